"""DeepSpeed 0.19.8's real code as ground truth (the ``deepspeed`` extra): the #8913 case on ``BF16_Optimizer``
(`issue_8913`), a checkpoint round trip (`checkpoint`), the GAS boundary marker (`gas_marker`), the real engine
driven on a process group (`engine`, with the spies that record what it computes: `spy`), and the FP32-staging
fix as a patched update (`harness`).

Each case module exposes ``CASE``; `simdist.cases` imports one only when its case is asked for, so this package
imports none of them (and no DeepSpeed) by itself.
"""
