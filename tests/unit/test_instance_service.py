"""The scheduler's instance adapter decisions (``scheduler/instance_service.py``) on a
recording edge: creations refused after their job ended, acquires skipped when cancelled
before they ran, grants on a removed worker, kills answered once their stops returned,
locates that wait for a lost worker.  The simulation drives the same class (tests/sim)."""
from __future__ import annotations

import pytest

from yrdask import protocol as P
from yrdask.scheduler import lifecycle as L
from yrdask.scheduler.instance_service import LOST_WORKER_WAIT_S, InstanceService

pytestmark = pytest.mark.timeout(30)

W1, W2 = "tcp://w1:1", "tcp://w2:1"


class Edge:
    def __init__(self) -> None:
        self.t = 100.0
        self.workers = {W1, W2}
        self.soon_fns: list = []
        self.acquires: list = []  # (req, timeout_ms, answer)
        self.cancelled: list = []
        self.released: list = []
        self.started: list = []  # (worker, spec)
        self.stops: list = []  # (worker, iid, reason)
        self.gone: list = []  # (worker, timeout, then, server id)
        self.timers: list = []
        self.broadcasts: list = []
        self.crashes: list = []  # (worker, iid, incarnation)

    def now(self): return self.t
    def call_at(self, at, fn): self.timers.append((at, fn))
    def soon(self, fn): self.soon_fns.append(fn)
    def is_worker(self, w): return w in self.workers
    def acquire(self, req, timeout_ms, answer): self.acquires.append((req, timeout_ms, answer))
    def cancel_acquire(self, req): self.cancelled.append(req)
    def release(self, ids): self.released.extend(ids)
    def start_instance(self, worker, spec): self.started.append((worker, spec))
    def stop_instance(self, worker, iid, reason, force=False):
        self.stops.append((worker, iid, reason))
    def worker_gone(self, worker, timeout, then, server_id=""):
        self.gone.append((worker, timeout, then, server_id))
    def broadcast(self, msg): self.broadcasts.append(msg)
    def crash_instance(self, worker, iid, reason, inc): self.crashes.append((worker, iid, inc))
    def after_feed(self): pass

    def run_soon(self):
        fns, self.soon_fns = self.soon_fns, []
        for fn in fns:
            fn()


def spec(iid="i1", owner="job-1", **kw):
    return {"instance_id": iid, "owner": owner, "cls_name": "C", "holder": "d1",
            "shape": {"CPU": 1000.0}, "timeout_ms": 5000, "meta": {"m": 1}, **kw}


def created(svc, iid="i1", worker=W1, **kw):
    """Create ``iid`` and place it on ``worker``; returns the create rpc's replies."""
    edge = svc.edge
    replies: list = []
    svc.create(spec(iid, **kw), replies.append)
    edge.run_soon()
    req, _timeout, answer = edge.acquires[-1]
    answer([iid, worker])
    return replies


@pytest.fixture
def svc():
    return InstanceService(Edge(), L.Lifecycle())


def test_a_creation_is_answered_once_placed_and_started_there(svc):
    replies = created(svc)
    assert replies == [["i1", W1, {"m": 1}]]
    assert [w for w, _s in svc.edge.started] == [W1]
    assert not svc.requests  # the acquire is answered


def test_a_creation_after_its_job_ended_is_refused_without_asking(svc):
    svc.owner_gone("job-1", "d1")
    replies: list = []
    svc.create(spec(), replies.append)
    assert replies and replies[0][0] is None and "has ended" in replies[0][1]
    assert not svc.edge.soon_fns and "i1" not in svc.lifecycle.instances


def test_an_acquire_cancelled_before_it_ran_never_asks(svc):
    svc.create(spec(), lambda r: None)
    svc.kill("i1", "terminated", lambda: None)  # CancelAcquire before the task ran
    svc.edge.run_soon()
    assert svc.edge.acquires == [] and svc.edge.cancelled == []


def test_a_waiting_acquire_is_withdrawn_when_its_instance_ends(svc):
    replies: list = []
    svc.create(spec(), replies.append)
    svc.edge.run_soon()
    req = svc.edge.acquires[0][0]
    svc.kill("i1", "terminated", lambda: None)
    assert svc.edge.cancelled == [req]
    assert replies and replies[0][0] is None


def test_a_grant_on_a_worker_already_removed_is_a_loss(svc):
    svc.create(spec(recover_retry_times=0), lambda r: None)
    svc.edge.run_soon()
    _req, _t, answer = svc.edge.acquires[0]
    svc.edge.workers.discard(W2)
    answer(["i1", W2])
    assert not svc.lifecycle.is_live("i1")
    # (its START went to no stream, and its holding went with the worker: nothing to release)


def test_kill_answers_once_the_stop_returned(svc):
    created(svc)
    done: list = []
    svc.kill("i1", "terminated", lambda: done.append(1))
    assert svc.edge.stops == [(W1, "i1", "terminated")] and done == []
    svc.stopped("i1")
    assert done == [1]


def test_kill_on_a_removed_worker_answers_at_once(svc):
    created(svc)
    svc.edge.workers.discard(W1)
    done: list = []
    svc.kill("i1", "terminated", lambda: done.append(1))
    assert svc.edge.stops == [] and done == [1]


def test_a_locate_from_a_caller_that_lost_the_worker_waits_for_its_removal(svc):
    created(svc, recover_retry_times=1)
    svc.instance_state("i1", "ALIVE", worker=W1)
    replies: list = []
    svc.locate("i1", W1, replies.append, "s-old")
    # the edge waits for that process's removal (at once if another one is at W1 now)
    assert replies == [] and svc.edge.gone[0][:2] == (W1, LOST_WORKER_WAIT_S)
    assert svc.edge.gone[0][3] == "s-old"
    svc.edge.workers.discard(W1)
    svc.worker_lost(W1)  # restarts: a new acquire
    svc.edge.gone[0][2]()
    assert replies == []
    svc.edge.run_soon()
    svc.edge.acquires[-1][2](["i1", W2])
    assert replies and replies[0][1] == W2 and replies[0][0] in (P.RESTARTING, P.ALIVE,
                                                                  P.PENDING)


def test_a_locate_that_overtook_the_creation_waits_for_it(svc):
    replies: list = []
    svc.locate("i1", None, replies.append)
    assert replies == []
    created(svc)
    assert replies and replies[0][1] == W1 and replies[0][3] == "i1"


def test_a_restart_tells_the_worker_its_count_and_checkpoint(svc):
    created(svc, recover_retry_times=1)
    svc.instance_state("i1", "ALIVE", worker=W1)
    svc.save_state("i1", b"ck")
    svc.edge.workers.discard(W1)
    svc.worker_lost(W1)
    svc.edge.run_soon()
    svc.edge.acquires[-1][2](["i1", W2])
    worker, started = svc.edge.started[-1]
    assert worker == W2 and started["incarnation"] == 1 and started["checkpoint"] == b"ck"


def test_save_state_of_an_ended_instance_raises(svc):
    created(svc)
    svc.kill("i1", "terminated", lambda: None)
    with pytest.raises(RuntimeError, match="has ended"):
        svc.save_state("i1", b"x")


def test_the_instance_ops_are_its_own_handlers(svc):
    """The extension's tables take these ops from the service (``P.handlers``): an rpc's
    answer callback comes first, a stream's sender as ``worker=`` or ``holder=``."""
    from yrdask.scheduler.instance_service import OPS, RPC_OPS

    rpc = P.handlers(RPC_OPS, svc)
    ops = P.handlers(OPS, svc)
    replies: list = []
    P.dispatch(rpc, P.CreateInstance(spec()).to_msg(), replies.append)
    svc.edge.run_soon()
    svc.edge.acquires[-1][2](["i1", W1])
    assert replies == [["i1", W1, {"m": 1}]]
    P.dispatch(ops, {**P.InstanceState("i1", P.ALIVE).to_msg(), "worker": W1})
    P.dispatch(ops, {**P.HandleRefs({"i1": 1}).to_msg(), "holder": "d2"})
    assert "d2" in svc.lifecycle.instances["i1"].holders
    P.dispatch(rpc, P.LocateInstance("i1").to_msg(), replies.append)
    assert replies[-1] == [P.ALIVE, W1, "", "i1"]
    P.dispatch(ops, P.SaveState("i1", b"ck").to_msg())
    assert svc.lifecycle.checkpoint_of("i1") == b"ck"
    P.dispatch(rpc, P.KillInstance("i1").to_msg(), replies.append)
    assert svc.edge.stops == [(W1, "i1", "terminated")] and len(replies) == 2
    svc.stopped("i1")
    assert replies[-1] is None


def test_kill_with_restart_crashes_it_and_answers_at_once(svc):
    created(svc, recover_retry_times=1)
    svc.instance_state("i1", P.ALIVE, worker=W1)
    replies: list = []
    svc.kill_instance(replies.append, "i1", "killed by hand", restart=True)
    assert replies == [None] and svc.lifecycle.is_live("i1") and not svc.edge.stops
    assert svc.edge.crashes == [(W1, "i1", 0)]


def test_a_process_instance_that_ended_is_told_to_everyone(svc):
    """An ``INSTANCE_STATE`` other than ALIVE with a process instance's endpoint and a reason
    is broadcast as ``WorkerExit`` (its callers' errors say how it ended); an ALIVE one, or
    one with no reason, is not."""
    created(svc, recover_retry_times=1)
    svc.instance_state("i1", P.ALIVE, worker=W1, address="tcp://p:1")
    svc.instance_state("i1", P.RESTARTING, worker=W1, reason="killed by signal 9",
                       incarnation=0, address="tcp://p:1")
    assert svc.edge.broadcasts == [P.WorkerExit("tcp://p:1", "killed by signal 9")]
