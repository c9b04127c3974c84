"""Case ``deepspeed-wrappers``: the #8913 audit on the real DeepSpeed engine, every optimizer wrapper, end to end.

`case` holds ``CASE`` and the run; `checks` the checks of each wrapper's result; `oracle` the FP32 oracle it is
judged against. `simdist.cases` imports `case` only when the case is asked for, so this package imports nothing
by itself.
"""
