"""Where ranks live: the parallel layout (`spec`), group handles and the `Comm` protocol (`groups`), the rendezvous
where rank threads meet (`rendezvous`, what a blocked rank waits on in `waits`, each rank's wake-up semaphore in
`baton`), a rank's side of a collective and its call site (`calls`), the observers every collective tells
(`observers`), the errors (`errors`), every collective's checks and completion written once (`reductions`,
`data_movement`; reduce ops and the sums through the reduction in `reduce_ops`; gloo's refusals and memory rules in
`gloo_rules`), and the two front ends over them: SimWorld's `Comm` (`simworld`) and the ``torch.distributed``
backend ``simdist`` (`backend`; registered by `plugin`; which group uses which reduction: `reduction_map`;
in-process `inproc.spawn_threads` with per-rank process-global state `isolation` and `rank_rngs`, scripts' own
``init_process_group`` in `attach`, gloo's name-based decisions `gloo_names`; `process` mode). Real
torch.distributed process groups as a `Comm` (`torch_comm`) and the launchers: the one launcher `simdist.run`
(`runner`, with the options every launcher shares in `options`: where, api, ``reduction=`` and its one default, the
deadline) over the thread launchers (`inproc`, `simworld`) and the process one (`process_launch`; each rank's body
in `rank_process`; waiting, failures and the deadline in `supervise`; a forkserver per preload set in `forkservers`,
each freezing its objects with `forkserver_freeze`); torchrun entry and scripts (`launch`, `script_launch`); the
frameworks refused on rank threads (`frameworks`).

Importing this package imports nothing and registers nothing: ``import simdist`` arranges the registration of the
``simdist`` backend (`simdist._autoregister`, the one place), and the first ``simdist`` group completes it.
"""
