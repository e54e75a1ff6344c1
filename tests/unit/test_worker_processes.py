"""Worker processes (runtime/worker_processes.py): a WorkerLost of a dead process never touches
what belongs to the new process at the same address, whichever of the lease reply about the
new one and the WorkerLost of the old one comes first."""

from __future__ import annotations

import asyncio

import pytest

from yrdask import protocol as P
from yrdask.runtime import worker_processes as WP
from yrdask.runtime.objects import Entry
from tests.unit.harness import MachineHarness

X = "tcp://10.0.0.1:7000"


def kinds(out: list) -> list:
    return [type(i).__name__ for i in out]


def test_a_lease_for_the_new_process_overtaking_the_old_ones_worker_lost():
    """The overtaking order: the new process B is seen (lease reply) before WorkerLost(A)
    arrives.  A's death is carried out when B is seen; the late WorkerLost changes nothing,
    and B stays the process dealt with at the address."""
    h = MachineHarness(WP.WorkerProcesses())
    assert h(WP.Seen, X, "A") == []
    assert h(WP.Seen, X, "A") == []  # another grant on the same process
    out = h(WP.Seen, X, "B")
    assert out == [WP.Superseded("s3", X, "A", "B")]
    assert kinds(h(WP.Lost, X, "A")) == ["AlreadyGone"]
    assert h.m.live(X, "B") and not h.m.live(X, "A")
    assert h(WP.Seen, X, "A") == []  # a stale grant naming the dead one changes nothing
    assert h.m.live(X, "B")
    assert "Superseded" in h.m.story(X)


def test_the_usual_order_worker_lost_then_the_new_process():
    h = MachineHarness(WP.WorkerProcesses())
    h(WP.Seen, X, "A")
    assert h(WP.Lost, X, "A") == [WP.Gone("s2", X, "A")]
    assert h(WP.Seen, X, "B") == []  # nothing of A's is left to drop
    assert h.m.live(X, "B")
    assert h(WP.Lost, X, "B") == [WP.Gone("s4", X, "B")]
    assert not h.m.live(X, "B")


def test_a_process_never_dealt_with_dies_while_a_newer_one_is_current():
    """A died without this process ever dealing with it, and B was seen first: A's death is
    a stranger's; B's records stay.  A scheduler that names no process is obeyed."""
    h = MachineHarness(WP.WorkerProcesses())
    h(WP.Seen, X, "B")
    assert h(WP.Lost, X, "A") == [WP.Stranger("s2", X, "A", "B")]
    assert h.m.live(X, "B") and h.m.is_dead("A")
    assert h(WP.Lost, X, "") == [WP.Gone("s3", X, "B")]  # (no process named: as before)
    assert h(WP.Lost, X, "") == [WP.Gone("s4", X, "")]
    with pytest.raises(TypeError):
        h.m.handle(object())  # type: ignore[arg-type]


class _Chan:
    """A call channel as the runtime sees it (no socket)."""

    def __init__(self, expect: str) -> None:
        self.expect = expect
        self.closed = False
        self.aborted = False
        self.generation = 0
        self.sent_functions: set = set()

    def abort(self) -> None:
        self.aborted = True


def test_runtime_keeps_the_new_process_channel_and_records_when_the_old_ones_worker_lost_comes_late():
    """The adapter (Runtime): lease reply for B, then WorkerLost(A).  B's channel is not
    aborted nor dropped, the value B keeps is not lost, X is not marked dead or lost, and the
    removal is counted once (confirmed_gone of a channel to B stays false)."""
    from yrdask.runtime.runtime import Runtime

    loop = asyncio.new_event_loop()
    try:
        rt = Runtime(loop, "job-worker-processes")
        rt.worker_seen(X, "A")
        old = rt.channels[X] = _Chan("A")  # tasks ran on A: a value A keeps
        kept_by_a = rt.objects.entries["t-a.0"] = Entry()
        kept_by_a.set_result(P.LOCATION, X)
        rt.worker_seen(X, "B")  # the lease reply about B, before WorkerLost(A)
        assert old.aborted and X not in rt.channels  # A's channel went at once
        assert rt.confirmed_gone(X)  # a locate after it does not wait for B to go
        assert isinstance(kept_by_a.error, Exception)  # A's value is lost (no lineage here)
        assert X not in rt.objects.counter.dead and X not in rt.lost_workers
        new = rt.channels[X] = _Chan("B")  # Runtime.channel(X) now opens it expecting B
        kept_by_b = rt.objects.entries["t-b.0"] = Entry()
        kept_by_b.set_result(P.LOCATION, X)
        rt.worker_lost(X, "A")  # the late WorkerLost of A
        assert rt.channels.get(X) is new and not new.aborted
        assert kept_by_b.state == P.LOCATION and kept_by_b.location == X
        assert X not in rt.objects.counter.dead and X not in rt.lost_workers
        assert rt.removals[X] == 1
        rt.on_channel_lost(X, old)  # A's channel reporting its end late drops nothing
        assert rt.channels.get(X) is new
        rt.worker_exit(X, "was killed by signal 9 (SIGKILL)", "A")  # a late exit report
        assert X not in rt.exits  # not kept to describe B
        rt.worker_lost(X, "B")  # B dies in turn: its channel and records go
        assert new.aborted and X in rt.lost_workers and kept_by_b.state != P.LOCATION
    finally:
        loop.close()


def test_instance_locations_name_the_process_before_the_router_uses_the_address():
    """``CREATE_INSTANCE``/``LOCATE_INSTANCE`` replies carry the server id: the runtime
    learns it (a process it dealt with there before is dead: superseded) before the router
    sees the reply, in the form it always had."""
    from yrdask.runtime.runtime import Runtime

    class Scheduler:  # the scheduler rpc's answers, in order
        def __init__(self, *replies: list) -> None:
            self.replies = list(replies)

        async def request(self, msg: P.Message) -> list:
            return self.replies.pop(0)

    loop = asyncio.new_event_loop()
    try:
        rt = Runtime(loop, "job-worker-processes")
        answered: list = []
        rt.router.create_answered = lambda iid, reply: answered.append(("create", reply))
        rt.router.locate_answered = lambda iid, reply: answered.append(("locate", reply))
        rt.connector = Scheduler(["i-1", X, {}, "A"], [P.ALIVE, X, "", "i-1", "B"],
                                 [P.DEAD, None, "it ended", "i-1", ""])
        rt.router.specs["i-1"] = ({}, [])
        loop.run_until_complete(rt.router._create_rpc("i-1"))
        assert rt.worker_processes.live(X, "A")
        loop.run_until_complete(rt.router._locate_rpc("i-1", X))
        assert rt.worker_processes.live(X, "B") and rt.worker_processes.is_dead("A")
        loop.run_until_complete(rt.router._locate_rpc("i-1", None))
        assert answered == [("create", ["i-1", X, {}]), ("locate", [P.ALIVE, X, "", "i-1"]),
                            ("locate", [P.DEAD, None, "it ended", "i-1"])]
    finally:
        loop.close()


def test_a_new_process_named_after_the_old_ones_worker_lost_is_usable_at_once():
    """WorkerLost(A) was handled here, then a lease reply about B overtakes WorkerJoined(B)
    (the job stream): the address is usable at once (lease requests stop avoiding it, an
    owner there is not dead), not only once WorkerJoined comes; a stale grant naming A is
    not."""
    from yrdask.runtime.runtime import Runtime

    loop = asyncio.new_event_loop()
    try:
        rt = Runtime(loop, "job-worker-processes")
        rt.worker_seen(X, "A")
        rt.worker_lost(X, "A")
        rt.on_channel_lost(X)  # (A's channel reports its end)
        dead = rt.objects.counter.dead
        assert X in rt.lost_workers and X in dead and X in rt.submitter.machine.lost
        assert not rt.worker_seen(X, "A")  # a stale grant naming A: the address stays dead
        assert X in rt.lost_workers and X in dead and X in rt.submitter.machine.lost
        assert rt.worker_seen(X, "B")  # the lease reply about B, before WorkerJoined(B)
        assert X not in rt.lost_workers and X not in dead
        assert X not in rt.submitter.machine.lost
        assert not rt.worker_seen(X, "B")  # another grant on B: nothing more to do
        rt.worker_joined(X, "B")  # the WorkerJoined that comes later
        assert rt.worker_processes.live(X, "B") and X not in rt.lost_workers
    finally:
        loop.close()


def test_the_lost_channel_generations_kept_are_bounded():
    """``Runtime.lost_generation`` (confirmed_gone) keeps the newest EXITS_KEPT addresses,
    also for channels lost to addresses the scheduler never reported removed."""
    from yrdask.runtime.peers import EXITS_KEPT
    from yrdask.runtime.runtime import Runtime

    loop = asyncio.new_event_loop()
    try:
        rt = Runtime(loop, "job-worker-processes")
        for i in range(EXITS_KEPT + 5):
            address = f"tcp://10.0.1.{i // 250}:{7000 + i % 250}"
            chan = rt.channels[address] = _Chan("")
            rt.on_channel_lost(address, chan)
        assert len(rt.lost_generation) == EXITS_KEPT
        assert address in rt.lost_generation and "tcp://10.0.1.0:7000" not in rt.lost_generation
    finally:
        loop.close()
