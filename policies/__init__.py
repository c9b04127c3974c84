"""The catalogue of precision policies: one small module each, registered by name on import.

To add a policy, write a module here that calls `simdist.gradpath.policy.register` with
a `simdist.gradpath.policy.Policy` and import it below; nothing in ``simdist/`` changes.
"""

from simdist.policies import (  # noqa: F401 - imported for their registrations
    bf16_only,
    bf16_writeback,
    fp32_reference,
    fp32_staging,
    fsdp2_reduce_dtype,
    megatron_grad_reduce_fp32,
    stochastic_writeback,
)
