"""The BF16 gradient path: parameter families (`families`), precision policies as data (`policy`,
`catalogue`), the stage logic written once (`kernel`) with its two adapters, per rank on a `Comm` (`path`:
`train_rank`) and every rank at once (`batched`), the independent FP32/FP64 oracle that judges it (`reference`:
no engine code), the oracle's precision as an engine policy (`oracle`) and captures (`probes`)."""
