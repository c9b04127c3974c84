"""Test support: Hypothesis strategies and the references simdist's own tests judge the product with.

Like ``hypothesis.extra`` or ``torch.testing``: nothing in the product imports this package (the top layer of
docs/ARCHITECTURE.md; ``tests/unit/test_import_graph.py`` checks it), and it may import every product layer.

* `strategies` -- Hypothesis strategies (public API, for property tests of your own distributed code too);
* `compact` -- the compact workload the gradient-path properties and ``bench/properties.py`` share;
* `case_batches` -- property (a)'s cases drawn several per Hypothesis example, run as one batch;
* `gloo_probe`, `gloo_fidelity` -- the corner cases and category probes that pin the `Gloo` model to real gloo
  (``tests/integration/test_gloo_corners.py``, ``experiments/gloo_corners.py``);
* `nccl_sim` -- a literal step-by-step simulation of NCCL's ring and tree kernels, the reference for `Nccl`.

Import the submodules themselves (``from simdist.testing.strategies import float_values``): this package imports
nothing, so ``import simdist.testing`` does not pull in Hypothesis.
"""
