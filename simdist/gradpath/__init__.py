"""The BF16 gradient path: parameter families (`families`), precision policies as data (`policy`), the stage logic
written once (`kernel`) with its two adapters, per rank on a `Comm` (`path`: `train_rank`) and every rank at once
(`batched`), and captures (`probes`); the independent FP32/FP64 oracle that judges it (the package `oracle`: its
rules `oracle.rules`, its group sums and step `oracle.step`, several steps `oracle.runs`; no gradient-path code),
and the oracle's precision
as a policy the gradient path runs (`matched_policy`, for gradient-path tests). The catalogue of registered
policies is `simdist.policies.catalogue`."""
