"""A scheduler restart at the same address loses nothing that must last (docs/faults.md,
"Scheduler restart"): on real ``dask scheduler``/``dask worker`` processes, a detached named
instance with a checkpoint, a detached named placement group and a KV entry come back after
the scheduler is stopped (SIGTERM, then SIGKILL) and started again, and a driver connected
across the gap gets a typed error for its pending and later calls instead of hanging."""

from __future__ import annotations

import signal
import socket
import time

import pytest

import yrdask as yr
from conftest import CliCluster, wait_until
from yrdask.errors import SchedulerLostError
from yrdask.ray.util.placement_group import (get_placement_group, placement_group,
                                             remove_placement_group)
from yrdask.scheduler.durable import SqliteStore

pytestmark = pytest.mark.timeout(90)


@yr.instance
class Counter:
    def __init__(self) -> None:
        self.n = 0

    def incr(self) -> int:
        self.n += 1
        yr.save_state()
        return self.n

    def linger(self, seconds: float) -> int:
        """Runs across the scheduler's death (does not touch the state)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.05)
        return self.n


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _restart(cli: CliCluster, sig: int) -> None:
    """Stop the scheduler with ``sig``, start it again at the same address, and bring the
    workers back as their supervisor would (Dask's workers close when it goes)."""
    old = list(cli.workers)
    cli.restart_scheduler(sig)
    for w in old:
        cli._launch_worker(name=f"{w.name}r")
    cli._wait_for_workers(len(old))
    wait_until(lambda: all(w.proc.poll() is not None for w in old), 30,
               "the old workers closed after their scheduler went")
    for w in old:  # (until here cli.stop() would stop them)
        cli.workers.remove(w)


def _kept_groups(state) -> set[str]:
    """The group rows in the state file (read by a second connection, as SQLite allows)."""
    store = SqliteStore(str(state))
    try:
        return set(store.load().groups)
    finally:
        store.close()


def test_detached_instance_group_and_kv_survive_a_scheduler_restart(cluster, tmp_path):
    cluster.finalize()
    state = tmp_path / "yr-state.sqlite"
    cli = CliCluster.start([{}], tmp_path / "cli", port=_free_port(),
                           env={"DASK_YRDASK__STATE__PATH": str(state)})
    try:
        yr.init(yr.Config(server_address=cli.address))
        opts = yr.InvokeOptions(name="ctr", custom_extensions={"lifecycle": "detached"})
        ctr = Counter.options(opts).invoke()
        assert [yr.get(ctr.incr.invoke()) for _ in range(3)] == [1, 2, 3]
        yr.kv_write("restart-key", b"kept")
        pg = placement_group([{"CPU": 0.25}, {"CPU": 0.25}], "STRICT_PACK", name="kept-pg",
                             lifetime="detached")
        placement_group([{"CPU": 0.25}], name="job-pg")  # of this job: not kept
        assert pg.wait(30) and _kept_groups(state) == {"kept-pg"}
        pending = ctr.linger.invoke(3.0)
        settled: list[float] = []
        pending.on_complete(lambda _ref: settled.append(time.monotonic()))

        stopped_at = time.monotonic()
        _restart(cli, signal.SIGTERM)
        # The driver that was connected learns what happened, for pending and later calls.
        with pytest.raises(SchedulerLostError, match=cli.address):
            yr.get(pending, timeout=30)
        assert settled and settled[0] - stopped_at < 10  # failed soon, not after a time-out
        with pytest.raises(SchedulerLostError, match="restarted or lost"):
            ctr.incr.invoke()
        with pytest.raises(SchedulerLostError):  # a scheduler rpc
            yr.kv_read("restart-key", timeout=1)
        yr.finalize()

        yr.init(yr.Config(server_address=cli.address))
        again = yr.get_instance("ctr")
        assert yr.get(again.incr.invoke(), timeout=30) == 4  # from its checkpoint
        assert yr.kv_read("restart-key", timeout=5) == b"kept"
        found = get_placement_group("kept-pg")  # placed again on the worker that joined
        assert found.wait(30) and found.strategy == "STRICT_PACK"
        assert found.bundle_specs == [{"CPU": 0.25}, {"CPU": 0.25}]
        with pytest.raises(ValueError, match="job-pg"):
            get_placement_group("job-pg")
        yr.finalize()

        _restart(cli, signal.SIGKILL)
        yr.init(yr.Config(server_address=cli.address))
        again = yr.get_instance("ctr")
        assert yr.get(again.incr.invoke(), timeout=30) == 5  # the checkpoint saved after the first
        assert yr.kv_read("restart-key", timeout=5) == b"kept"
        found = get_placement_group("kept-pg")
        assert found.wait(30)
        remove_placement_group(found)  # its row goes with it
        assert _kept_groups(state) == set()
        again.terminate(is_sync=True)
        yr.kv_del("restart-key")
        yr.finalize()
    finally:
        cluster.finalize()
        cli.stop()
