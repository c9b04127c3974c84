"""torch's FSDP2 as ground truth: its mixed-precision gradient boundaries on DP4 (`reduce_dtype`, case
``fsdp2-reduce-dtype``) and on a 2-D TP x DP mesh (`tp_mesh`, case ``fsdp2-reduce-dtype-tp``).

Each module exposes ``CASE``; `simdist.cases` imports one only when its case is asked for.
"""
