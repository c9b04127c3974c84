"""Every collective's checks and completion, written once for both front ends (`SimComm` and the backend's
`SimProcessGroup` map their arguments onto these): the reductions (`reductions`), the data movement
(`data_movement`), the reduce ops and the sums through the reduction (`reduce_ops`), and gloo's refusals and memory
rules (`gloo_rules`). Each module is a namespace of functions: ``from simdist.world.collectives import reductions``.
"""

from simdist.world.collectives import data_movement, gloo_rules, reduce_ops, reductions

__all__ = ["data_movement", "gloo_rules", "reduce_ops", "reductions"]
