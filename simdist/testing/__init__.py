"""Test support: Hypothesis strategies (public) and, in `simdist.testing._internal`, the references simdist's own
tests judge the product with (not public API).

Like ``hypothesis.extra`` or ``torch.testing``: nothing in the product imports this package (the top layer of
docs/ARCHITECTURE.md; ``tests/unit/meta/test_import_graph.py`` checks it), and it may import every product layer.

* `strategies` -- Hypothesis strategies (public API, for property tests of your own distributed code too);
* `_internal` -- the compact workload, property batches, the gloo probes and the NCCL kernel simulation that
  simdist's own tests and benchmarks use (may change without notice).

Import the submodules themselves (``from simdist.testing.strategies import float_values``): this package imports
nothing, so ``import simdist.testing`` does not pull in Hypothesis.
"""
