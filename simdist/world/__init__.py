"""Where ranks live: the parallel layout (`spec`), group handles and the `Comm` protocol (`groups`), the
rendezvous with its observer list (`rendezvous`) and its errors (`errors`), every collective's checks and
completion written once (`collectives`), and the two front ends over them: SimWorld's `Comm` (`simworld`) and
the ``torch.distributed`` backend ``simdist`` (`backend`; registered by `plugin`; which group uses which
reduction model: `modelmap`; in-process `inproc.spawn` with per-rank process-global state `isolation` and
gloo's name-based decisions `gloo_names`; `process` mode). Real torch.distributed process groups as a `Comm`
(`torch_comm`) and the launchers: the one launcher `simdist.run` (`runner`, with the options every launcher
shares in `options`: where, api, ``reduction=`` and its one default, the deadline) over the thread launchers
(`inproc`, `simworld`) and the process one (`launch`, its forkserver in `forkserver_freeze`).

Importing this package registers the ``simdist`` backend with ``torch.distributed``.
"""

from simdist.world.plugin import register as _register

_register()
