"""Where ranks live: the parallel layout (`spec`), group handles (`groups`), the rendezvous engine
(`engine`), SimWorld's `Comm` front end (`simworld`), the ``torch.distributed`` backend ``simdist``
(`backend`, in-process `inproc.spawn`, `process` mode, registered by `plugin`), real torch.distributed
process groups (`torch_comm`) and launchers: the one launcher `simdist.run` (`runner`, with the options every
launcher shares in `options`) over the thread launchers (`inproc`, `simworld`) and the process one (`launch`).

Importing this package registers the ``simdist`` backend with ``torch.distributed``.
"""

from simdist.world.plugin import register as _register

_register()
