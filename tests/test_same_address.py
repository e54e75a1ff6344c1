"""A worker process that comes back at its dead predecessor's address (docs/faults.md).

``dask worker --worker-port P`` restarts a crashed worker process on port P again, and a
nanny's worker on port 0 may be handed the dead one's port by the kernel.  Dask then lists
the same address for a new process.  yrdask must treat it as a new worker: usable at once
(tasks, instances, objects it owns), while what lived on the dead process stays lost
(restarted or reported dead, computed again or a typed error), never read from the new one.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

import yrdask as yr
from yrdask import protocol as P
from conftest import CliCluster, WorkerProc, wait_until
from yrdask.errors import OwnerDiedError

pytestmark = pytest.mark.timeout(120)

T = 20  # seconds any one yr.get may take here (each is far quicker when it works)
BIG = 600 * 1024  # over the inline limit: the value stays in the worker that computed it


@yr.invoke
def where() -> tuple[int, str]:
    from yrdask.runtime.context import current_runtime

    return os.getpid(), current_runtime().address


@yr.invoke
def big(seed: int) -> bytes:
    return bytes([seed]) * BIG


@yr.invoke
def put_here(size: int = 0) -> list:
    """A ref this worker process owns, nested in the result (the driver borrows it)."""
    return [yr.put(f"owned by {os.getpid()}".ljust(size))]


@yr.instance
class Keeper:
    def pid(self) -> int:
        return os.getpid()


def _free_port() -> int:
    """A free port below the kernel's ephemeral range when there is room: between this probe
    and the worker's bind, no ``bind(0)`` and no outgoing connection of another process can be
    handed it (a port from ``bind(0)`` could be)."""
    import random

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    ports = random.sample(range(20000, low), min(50, low - 20000)) if low > 21000 else []
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dask_pids(address: str) -> dict[str, int]:
    """Worker address -> pid, as the scheduler lists them."""
    return {a: pid for a, (pid, _) in _dask_workers(address).items()}


def _dask_workers(address: str) -> dict[str, tuple[int, str]]:
    """Worker address -> (pid, Dask's server_id), as the scheduler lists them."""
    from distributed import Client

    with Client(address, timeout=10, set_as_default=False) as client:
        return client.run_on_scheduler(
            lambda dask_scheduler: {a: (ws.pid, ws.server_id)
                                    for a, ws in dask_scheduler.workers.items()})


class _FixedPort(CliCluster):
    """The suite's cli cluster whose workers listen on a fixed port (``--worker-port``)."""

    port = 0

    def _launch_worker(self, resources: str = "", nthreads: int = 1, name: str | None = None,
                       node: str | None = None, env: dict[str, str] | None = None) -> WorkerProc:
        log = self.workdir / "worker.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "distributed.cli.dask_worker", self.address,
                 "--preload", "yrdask", "--nthreads", str(nthreads), "--nanny",
                 "--worker-port", str(self.port), "--host", "127.0.0.1", "--no-dashboard"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                cwd=self.workdir,
                env={**os.environ, **(env or {}), "YRDASK_NODE_ID": "node-fixed"})
        worker = WorkerProc("fixed", resources, proc, log)
        self.workers.append(worker)
        return worker


@pytest.fixture
def fixed_port_cluster(cluster, tmp_path):
    """A scheduler and one ``dask worker --nanny --worker-port P`` (2 threads, a node of its
    own), both with ``--preload yrdask``; the driver joined with ``server_address``."""
    cluster.finalize()
    _FixedPort.port = _free_port()
    cli = _FixedPort.start([{"nthreads": 2}], tmp_path)
    try:
        yr.init(yr.Config(server_address=cli.address))
        yield cli, f"tcp://127.0.0.1:{_FixedPort.port}"
    finally:
        try:
            if yr.is_initialized():
                yr.finalize()
        finally:
            cli.stop()


def test_a_worker_restarted_at_its_address_is_a_new_worker(fixed_port_cluster):
    cli, address = fixed_port_cluster
    pid, at = yr.get(where.invoke(), timeout=T)
    assert at == address
    old_id = _dask_workers(cli.address)[address][1]
    kept = big.invoke(7)
    yr.wait(kept, timeout=T)  # computed: its value lives in that worker process only
    # owned by that process, too large to travel inline with the result: only it has it
    (owned,) = yr.get(put_here.invoke(BIG), timeout=T)
    # light instances (pinned): the test reads the worker's pid through them
    gone = Keeper.options(recover_retry_times=0, light=True).invoke()
    back = Keeper.options(recover_retry_times=1, light=True).invoke()
    assert yr.get([gone.pid.invoke(), back.pid.invoke()], timeout=T) == [pid, pid]

    os.kill(pid, signal.SIGKILL)  # the worker process, not its nanny
    wait_until(lambda: _dask_pids(cli.address).get(address) not in (None, pid), 30,
               lambda: f"the nanny to restart the worker at {address}: "
                       f"{_dask_pids(cli.address)}")
    new_pid = _dask_pids(cli.address)[address]

    t0 = time.monotonic()
    # new tasks run on the new process (the only worker: no request may avoid it)
    assert yr.get(where.invoke(), timeout=T) == (new_pid, address)
    # a ref the new process owns is readable (its owner is alive, though at a dead one's
    # address)
    (fresh,) = yr.get(put_here.invoke(BIG), timeout=T)
    assert yr.get(fresh, timeout=T).strip() == f"owned by {new_pid}"
    # a new instance is created there
    assert yr.get(Keeper.options(light=True).invoke().pid.invoke(), timeout=T) == new_pid
    # the old instances: one restarted on the new process, one reported dead
    assert yr.get(back.pid.invoke(), timeout=T) == new_pid
    with pytest.raises(yr.InstanceDiedError, match="was lost"):
        yr.get(gone.pid.invoke(), timeout=T)
    # what lived on the dead process: a task result is computed again, a ref the dead
    # process owned is an OwnerDiedError, never a value asked of the new process
    assert yr.get(kept, timeout=T) == bytes([7]) * BIG
    with pytest.raises(OwnerDiedError, match=address):
        yr.get(owned, timeout=T)
    took = time.monotonic() - t0
    assert took < 10, f"the restarted worker took {took:.1f} s to serve all that"

    # The driver deals with the new process (its lease replies named it), and a WorkerLost
    # of the old one arriving now (as when a lease reply overtook it) leaves the new
    # process's channel and the value it keeps alone (docs/faults.md)
    from yrdask.runtime.context import current_runtime

    new_id = _dask_workers(cli.address)[address][1]
    # the scheduler ties a nanny's exit report to the process by its pid (a late one names
    # the old process, not the new one at its address)
    from distributed import Client

    with Client(cli.address, timeout=10, set_as_default=False) as client:
        tied = client.run_on_scheduler(
            lambda dask_scheduler: list(dask_scheduler.extensions["yr"].process_of_pid.items()))
    assert [tuple(v) for (_, p), v in tied if p == pid] == [(address, old_id)], tied
    rt = current_runtime()
    assert new_id != old_id and rt.worker_processes.live(address, new_id)
    # a caller that lost its channel to the old process and asks only now where the
    # instance is (naming the process it lost) is answered at once: the new process there
    # is another one, not waited for as the lost one
    t1 = time.monotonic()
    reply = rt.run_sync(_locate(rt, back.instance_id, address, old_id), timeout=T)
    assert reply[0] == P.ALIVE and reply[1] == address and reply[4] == new_id, reply
    assert time.monotonic() - t1 < 5, f"the locate waited {time.monotonic() - t1:.1f} s"
    kept_new = big.invoke(8)
    yr.wait(kept_new, timeout=T)
    chan = rt.channels[address]
    rt.run_sync(_late_worker_lost(rt, address, old_id), timeout=T)
    assert rt.channels.get(address) is chan and not chan.closed
    entry = rt.objects.entries[kept_new.id]
    assert entry.location == address, f"the new process's value was dropped: {entry.state}"
    assert yr.get(where.invoke(), timeout=T) == (new_pid, address)
    assert yr.get(kept_new, timeout=T) == bytes([8]) * BIG


async def _locate(rt, iid: str, lost: str, lost_server_id: str) -> list:
    return await rt.connector.request(P.LocateInstance(iid, lost=lost,
                                                       lost_server_id=lost_server_id))


async def _late_worker_lost(rt, address: str, server_id: str) -> None:
    rt.worker_lost(address, server_id)  # on the loop, as the job stream's reader calls it
