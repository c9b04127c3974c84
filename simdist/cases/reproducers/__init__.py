"""Standalone reproducers of the DeepSpeed defects simdist found: each imports only torch and deepspeed, runs under
torchrun and exits 1 on DeepSpeed 0.19.8 as shipped. `simdist.cases.upstream.packages` exports three of them with
their fixes; `simdist.cases.deepspeed.gas_marker.write_reproducer` copies out the fourth."""
