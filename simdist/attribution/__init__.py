"""Where does my program lose precision? Per-call-site error of unmodified code, and counterfactual promotion.

    report = simdist.blame(train, 4, promote_top=3)   # train(rank): plain torch.distributed
    print(report.format())
    report.figure()

`blame` runs the rank function on `simdist.run` threads (``simdist blame script.py`` runs a script that
calls `simdist.run` itself) and measures, in the same run, every reducing collective against the FP64
sum of the same members' inputs (`simdist.attribution.collectives`) and every narrowing cast against its wide
input (an `simdist.audit.Audit` with a cast hook), grouped by call site (`simdist.attribution.measure` defines
the figures). Promotion reruns the program with chosen sites exact and reports how far the final
parameters, optimizer state and loss move: which boundary matters for the end result
(`simdist.attribution.api.blame_target`).

``simdist blame --nproc N --processes script.py`` runs a torchrun-style script on N simdist rank processes
(DeepSpeed, Megatron: module-global groups) and merges the ranks' sites (`simdist.attribution.processes`).

What it does not see: what the audit cannot see (`simdist.audit`), collectives on real process groups (gloo,
NCCL), and the rounding inside a collective of ops other than SUM/AVG.
"""

from simdist.attribution.api import blame, blame_target
from simdist.attribution.measure import Errors, SiteErrors
from simdist.attribution.report import BlameReport, Movement, Promotion

__all__ = ["BlameReport", "Errors", "Movement", "Promotion", "SiteErrors", "blame", "blame_target"]
