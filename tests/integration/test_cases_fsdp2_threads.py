"""Why fsdp2-reduce-dtype refuses ``--where threads`` (`SPY_IS_A_MODULE_GLOBAL`), checked by experiment: its rank
program on `simdist.run` threads gives FSDP2's gradients bitwise as in process mode (FSDP2 keeps no per-rank
module globals), but the divide-factor spy it installs in a module is shared by the threads, so each rank's
record is wrong. Slow: four processes plus four threads of real FSDP2."""

import pytest
import torch
import torch.distributed as dist

import simdist
from simdist.cases.fsdp2.reduce_dtype import Config, fsdp_rank
from simdist.cases.ranks import run_ranks
from simdist.numerics.floats import bits


class _ThreadComm:
    """What `fsdp_rank` asks of its comm: the rank and the layout."""

    def __init__(self, spec) -> None:
        self.spec = spec

    def get_rank(self) -> int:
        return dist.get_rank()


@pytest.mark.slow
def test_fsdp2_is_bitwise_the_same_on_threads_but_the_cases_spy_is_not():
    config = Config()
    threads = simdist.run(
        lambda rank: fsdp_rank(_ThreadComm(config.spec), config),
        config.spec.world_size,
        reduction="gloo",
        timeout_s=300,
    )
    processes = run_ranks(fsdp_rank, config.spec, config, where="processes")
    compared = 0
    for on_threads, in_processes in zip(threads, processes, strict=True):
        for name, run in on_threads.items():
            values = in_processes[name].trace.values
            assert run.trace.values.keys() == values.keys()
            for key, value in run.trace.values.items():
                assert torch.equal(bits(value), bits(values[key])), (name, key)
                compared += 1
    assert compared == 4 * 2 * 6 * config.gas * config.steps  # ranks x reduce dtypes x params x micro-steps
    per_rank = [{n: len(r.divide_factors) for n, r in ranks.items()} for ranks in processes]
    assert all(counts == per_rank[0] and all(counts.values()) for counts in per_rank)  # every rank records its own
    on_threads = [{n: len(r.divide_factors) for n, r in ranks.items()} for ranks in threads]
    assert on_threads != per_rank  # the spy is one module global: the records land in the wrong ranks
