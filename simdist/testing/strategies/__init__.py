"""Hypothesis strategies for numerics properties of distributed reductions: public API.

Composable building blocks for property tests of your own distributed code (with the ``simdist_world``
fixture of `simdist.pytest_plugin`; README, "Property-test your own distributed code") and of simdist's:

* `parallel_specs` -- valid `ParallelSpec` layouts (optionally with fixed sizes);
* `float_values` -- exact values of one dtype, with the adversarial corners a
  reduction meets: subnormals, the largest finite values, signed zeros and,
  when allowed, NaN and infinities;
* `tensors` -- a tensor of such values;
* `bit_patterns`, `pattern_tensor` -- raw bit patterns of one dtype (NaN payloads, signed zeros, infinities,
  the largest finite values) and the tensor they make;
* `rank_tensors` -- the per-rank tensors of one group, including structured
  cases that plain independent draws almost never hit: exact cancellation
  between ranks and sums that land on a rounding tie;
* `bf16_values`, `bf16_gradients`, `peer_gradients` -- BF16 local gradients
  and how TP peers' gradients relate (independent, identical, cancelling,
  on ties, at BF16 midpoints);
* `gradient_streams` -- a whole ``(step, micro, rank, param) -> gradient``
  stream for a spec, value by value;
* `gradient_batches` -- the same, cheap to draw: bytes read as BF16 bits
  (`VALUE_MODES`) with the peer layouts applied by tensor operations, held
  rank-batched (`GradientBatch`) for `simdist.gradpath.batched.BatchedPath` (`batches.decode_batch` decodes
  the two draws, many at once in `simdist.testing._internal.case_batches`);
* `policies` -- registered precision policies;
* `oracle_cases` -- property (a)'s cases: a layout, GAS, steps and a gradient batch for the compact workload
  of `simdist.testing._internal.compact`.

All values are built from sign, exponent and significand integers, or from raw bit patterns, so every
drawn value is exactly representable in the requested dtype and shrinks
towards small, simple numbers.

The strategies live in one module per thing they draw (`layouts`, `values`, `gradients`, `batches`, `cases`);
import them from here.
"""

from simdist.testing.strategies.batches import VALUE_MODES, GradientBatch, gradient_batches
from simdist.testing.strategies.cases import oracle_cases, policies
from simdist.testing.strategies.gradients import (
    BF16_SAFE_EXPONENT,
    PEER_LAYOUTS,
    GradientStream,
    bf16_gradients,
    bf16_values,
    gradient_streams,
    peer_gradients,
)
from simdist.testing.strategies.layouts import parallel_specs
from simdist.testing.strategies.values import bit_patterns, float_values, pattern_tensor, rank_tensors, tensors

__all__ = [
    "BF16_SAFE_EXPONENT",
    "PEER_LAYOUTS",
    "VALUE_MODES",
    "GradientBatch",
    "GradientStream",
    "bf16_gradients",
    "bf16_values",
    "bit_patterns",
    "float_values",
    "gradient_batches",
    "gradient_streams",
    "oracle_cases",
    "parallel_specs",
    "pattern_tensor",
    "peer_gradients",
    "policies",
    "rank_tensors",
    "tensors",
]
