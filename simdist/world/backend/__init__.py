"""The ``torch.distributed`` backend ``simdist``: c10d's methods mapped onto the collectives (`process_group`:
`SimProcessGroup`), which reduction each group uses (`reduction_map`), scripts' own ``init_process_group``
attached to the rank's group (`attach`), where torch decides by the backend's name that a group is gloo
(`gloo_names`), and the registration with ``torch.distributed`` (`registration`, run by `simdist._autoregister` when
c10d makes the first ``simdist`` group; importing this package registers nothing).
"""

from simdist.world.backend.process_group import BACKEND_NAME, DoneWork, SimProcessGroup, Transport
from simdist.world.backend.reduction_map import Chooser
from simdist.world.options import as_reduction

__all__ = ["BACKEND_NAME", "Chooser", "DoneWork", "SimProcessGroup", "Transport", "as_reduction"]
