"""The catalogue of precision policies: one small module each (with its variants: `bf16_writeback` also registers
``bf16_writeback_bf16_comm``), registered by name on import.

To add a policy, write a module here that calls `simdist.gradpath.policy.register` with
a `simdist.gradpath.policy.Policy` and import it below; no other module changes. (Policies of your
own need not live here: ``--policy-module`` and the ``simdist.policies`` entry-point group load them.)

These are real files inside the package (no symlink), so every checkout and every wheel has them.
"""

from simdist.policies import (  # noqa: F401 - imported for their registrations
    bf16_only,
    bf16_writeback,
    fp32_staging,
    fsdp2_reduce_dtype,
    megatron_grad_reduce_fp32,
    stochastic_writeback,
)
