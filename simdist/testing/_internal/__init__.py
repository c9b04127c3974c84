"""simdist's own test references: not public API, may change without notice.

* `compact` -- the compact workload the gradient-path properties and ``bench/properties.py`` share;
* `case_batches` -- property (a)'s cases drawn several per Hypothesis example, run as one batch;
* `gloo_probe`, `gloo_fidelity` -- the corner cases and category probes that pin the `Gloo` reduction to real gloo
  (``tests/integration/test_gloo_corners.py``, ``experiments/gloo_corners.py``);
* `c10d_corners` -- one rank program recording how every c10d corner is answered (bytes, futures, exceptions),
  run on real gloo, threads and process mode (``tests/integration/test_c10d_corners.py``);
* `nccl_sim` -- a literal step-by-step simulation of NCCL's ring and tree kernels, the reference for `Nccl`.
"""
