"""Find the hidden rounding boundaries of real training code: a precision audit on torch's dispatcher.

    with audit() as a:
        train_one_step()
    print(a.report().format())

`Audit` (``simdist.audit.mode``) is a ``TorchDispatchMode``: while it is active it sees every aten op
the current thread dispatches and records

* ``cast`` -- a floating conversion that narrows precision: ``_to_copy``
  (``.to()``, ``.float()``, ``.bfloat16()``...), ``copy_`` into a narrower
  tensor, ``prims.convert_element_type``, autocast's reduced-precision casts;
* ``accumulate`` -- a sum, reduction or accumulation (``add``, ``sub``,
  ``sum``, ``mean``, ``mm``, ``addcmul``, ``index_add``, ``cumsum``...) whose
  result is stored in a dtype narrower than one of its inputs:
  ``bf16.add_(fp32)``, ``torch.add(a, b, out=bf16)``, ``x.sum(dtype=bf16)``;
* ``store`` -- any other op computed wide and stored narrow (``bf16.mul_(fp32)``,
  ``bf16.index_put_(..., fp32)``, ``bf16 * fp32_0dim``);
* ``collective`` -- every collective with its dtype: c10d ops
  (``c10d.allreduce_`` ...) as real process groups dispatch them, and the
  collectives of a simdist communicator wrapped by `AuditedComm` / `audited`
  (``comm.all_reduce`` ...), recorded with the dtype of the tensor they
  reduce (a SimWorld `Reduction` may add up wider: see the group's reduction);
  without a wrapper, the collectives of SimWorld's own `SimComm`
  (``comm.all_reduce``) and of the ``simdist`` torch.distributed backend
  (``dist.all_reduce`` in `simdist.run` ranks: its Python process groups
  never reach the dispatcher) are recorded too (`simdist.audit.world_hooks`).

"Narrower" means the output dtype cannot hold every value of the input dtype:
fewer mantissa bits or a smaller exponent range, so fp32 -> fp16, fp16 -> bf16
and bf16 -> fp16 all count. Each record carries the op's aten name, the input
and output dtypes, the shape, the rank (if any), and the user's call site by the
one rule of `simdist.callsite` (``file:line``, function): the first source
location outside torch, simdist's world layer, this package and blame. simdist's
other modules count as user code; ``skip=("simdist.sources.synthetic", "/path/prefix")``
skips more frames (modules, packages or path prefixes), attributing the record
to the next frame outward. Sites are cached by code object and line.

`AuditReport` groups the records by site (site, op, kind, dtypes, context) with
counts and, with ``errors=True`` (the default), the largest relative rounding
error the site introduced: ``max |narrow - wide| / |wide|`` in fp64 over the
nonzero finite wide elements (``inf`` where the narrow dtype overflowed). For a
cast the wide value is the input; for an accumulation or store it is the same
op re-run with every floating input upcast to the widest input dtype (never for
random ops; always on copies, so the audited program computes the same bits).
Only narrowing ops pay for this; other ops take a fast path that checks the
dtypes of their tensor arguments.

Cost: every aten op goes through Python (``__torch_dispatch__``), which is
the price of any dispatch mode: 2-6 us per op on a CPU core, against 1-4 us for
the op itself on small tensors. ``bench/audit.py`` times one gradient-path
step (4 SimWorld ranks, tiny tensors, the worst case): about 2.2x plain for an
empty mode, 2.6x for the audit without errors, 3x with errors (about 10 us per
narrowing event, computed with numpy on the CPU). ``errors=False`` skips them.

Threads, autograd, ranks
------------------------
Dispatch modes live on a per-thread stack: an audit sees the ops of the thread
that entered it and nothing else.

* Autograd: the backward of a CPU graph runs in the thread that calls
  ``backward()``, so an audit active *when ``backward()`` is called* sees the
  backward formulas, gradient accumulation and tensor/grad hooks; one active
  only during the forward does not (tested). Ops run by hooks are attributed
  to the hook's line; ops of C++ backward formulas have no Python frame of
  their own and are attributed to the ``backward()`` call, with the autograd
  node in ``context`` (``backward:ToCopyBackward0``). For CUDA graphs torch's
  engine runs the backward on a device thread and restores the caller's
  thread-local state there, dispatch modes included, so the same audit
  records them (from that thread: formula ops then have no Python frame at all
  and show as ``<no Python frame>``); this path is not exercised by the
  CPU-only tests. SimWorld turns those device threads off anyway.
* SimWorld rank threads: enter the audit inside the rank program, or wrap it
  with ``audited(fn)``: each rank thread then records into its own report,
  tagged with its rank, and ``fn`` receives an `AuditedComm` that records each
  collective (op, dtype, group kind) and pauses the audit while the collective
  runs. That pause matters: SimWorld's reductions run on whichever rank
  thread arrives last, so without it that rank would be charged with the other
  ranks' (modelled) reduction arithmetic. ``world.run(audited(fn), ...)``
  returns ``(result, report)`` per rank; `AuditReport.merge` combines them.
  ``audit(threads=True)`` (what ``simdist audit`` uses) instead follows every
  thread *started* while it is active: each gets its own mode, recording into
  the same report, tagged with the rank parsed from SimWorld's thread names
  (``simdist-rank-N``); SimWorld's and the simdist backend's collectives are
  recorded by `simdist.audit.world_hooks`, which pauses the rank's audit while
  the collective runs, so the reduction's arithmetic is not charged to the
  completing rank either. A followed thread that outlives the audit keeps a
  mode that only passes ops through; one that ends pops its mode first, and
  the audit waits (Linux) until its finished threads are gone from the OS, so
  that their C++ thread-local state is released before the interpreter can
  finalize (otherwise the process may abort at exit with status 134).
* torch.distributed: c10d collectives reach the dispatcher, so they are
  recorded with their dtype (``c10d.allreduce_``, bf16). With `audited` the
  same rank program reports ``comm.all_reduce`` in SimWorld and on gloo/NCCL.
  Reports are plain data: ``report.to_dict()`` pickles across processes.

What the audit cannot see
-------------------------
* Arithmetic that never reaches the dispatcher: Python float math
  (``1.0 / dense_dp``), numpy, and Python scalars converted inside an op
  (``bf16 * 0.1`` rounds 0.1 in C++), tensors built from Python numbers.
* Casts inside one kernel: bf16 ops compute in fp32 "opmath" and round once
  on store, fused kernels (FusedAdam, flash attention, cuBLAS with a
  reduced-precision accumulator, matmul with TF32) narrow internally; only the
  op's input/output dtypes are visible. Collective internals are likewise
  opaque: a bf16 all-reduce is recorded as one bf16 ``collective``.
* Code compiled with ``torch.compile`` (fused Triton/C++ kernels); custom ops
  and subclasses below the mode; integer <-> float conversions and complex
  dtypes; ops in threads that did not enter an audit (see above), and in
  other processes (``simdist.run(where="gloo")`` children need their own audit).
* The audit pushes and pops its mode on the thread-local stack without touching
  ``TorchDispatchMode``'s process-global flags (interleaved rank threads would
  corrupt them); those flags only steer ``torch.compile``.
"""

from simdist.audit.mode import Audit, audit
from simdist.audit.ranks import AuditedComm, audited
from simdist.audit.report import AuditReport, Record, SiteSummary, dtype_name, narrows

__all__ = [
    "Audit",
    "AuditReport",
    "AuditedComm",
    "Record",
    "SiteSummary",
    "audit",
    "audited",
    "dtype_name",
    "narrows",
]
