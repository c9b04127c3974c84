"""Where ranks live. At the top: the parallel layout (`spec`), group handles and the `Comm` protocol (`groups`), the
options every launcher shares (`options`: where, api, ``reduction=`` with its one parser and default, the deadline),
the errors (`errors`), SimWorld's `Comm` (`simworld`), real torch.distributed process groups as a `Comm`
(`torch_comm`), the one launcher `simdist.run` (`runner`) and torchrun entry (`launch`). Five wings:

* `rendezvous` -- where rank threads meet, a rank's side of a collective, what a blocked rank waits on, the
  observers every collective tells;
* `collectives` -- every collective's checks and completion, written once for both front ends;
* `backend` -- the ``torch.distributed`` backend ``simdist`` (its process group, which reduction each group uses,
  scripts' own ``init_process_group``, gloo's name-based decisions, the registration);
* `threads` -- unmodified ``torch.distributed`` code on one thread per rank, with per-rank process-global state;
* `processes` -- process mode: the transport, the launcher, each rank's body, supervision, forkservers, scripts.

Importing this package (or any of its modules but the backend's) registers nothing and imports no
``torch.distributed``: ``import simdist`` arranges the registration (`simdist._autoregister`), and the backend
itself is imported when the first ``simdist`` group is made.
"""
