"""The live handler tables of the scheduler and workers match the ops listed in protocol.py."""

import pytest
from distributed import Client

from yrdask import protocol as P

pytestmark = pytest.mark.timeout(120)


def _yr_ops(table) -> set[str]:
    return {op for op in table if op.startswith("yr_")}


def test_handler_tables_match_protocol(yr_cluster):
    with Client(yr_cluster.address, set_as_default=False, timeout=30) as client:
        sched = client.run_on_scheduler(
            lambda dask_scheduler: (_yr_ops(dask_scheduler.handlers),
                                    _yr_ops(dask_scheduler.stream_handlers)))
        workers = client.run(
            lambda dask_worker: (_yr_ops(dask_worker.handlers),
                                 _yr_ops(dask_worker.stream_handlers)))
    assert sched[0] == set(P.SCHEDULER_RPC)
    assert sched[1] == set(P.SCHEDULER_STREAM)
    assert workers, "no workers answered"
    for addr, (rpc, stream) in workers.items():
        assert rpc == set(P.WORKER_RPC), addr
        assert stream == set(P.WORKER_STREAM), addr


def test_every_op_is_named_yr_and_documented():
    ops = (P.SCHEDULER_RPC + P.SCHEDULER_STREAM + P.WORKER_RPC + P.WORKER_STREAM
           + P.CHANNEL_TO_WORKER + P.CHANNEL_TO_CALLER + (P.JOB_WELCOME,))
    source = open(P.__file__).read()
    for op in ops:
        assert op.startswith("yr_") and "-" not in op, op
        name = next(k for k, v in vars(P).items() if v == op and k.isupper())
        assert f'{name} = "{op}"\n"""' in source, f"{name} has no docstring in protocol.py"
