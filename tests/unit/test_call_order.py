"""Unit tests of yrdask.runtime.call_order.CallOrder, the caller side of instance calls.

No cluster: events in, instructions out, ``validate()`` after every step.  Order under
interleaved argument readiness, creation (named bind, failure, failed argument), redelivery
after a lost channel with some calls answered, dead routes, handle counting edge cases, and
a seeded random run.
"""

from __future__ import annotations

import random

import pytest

from .harness import MachineHarness

from yrdask.errors import CallCrashedError, InstanceDiedError, ScheduleError
from yrdask.runtime import call_order as C

pytestmark = pytest.mark.timeout(30)

W1, W2 = "tcp://w1:1", "tcp://w2:1"


class Harness(MachineHarness):
    """A CallOrder with a step counter and helpers that validate after each event."""

    def __init__(self) -> None:
        super().__init__(C.CallOrder())

    def created(self, iid: str, worker: str = W1, real_id: str | None = None) -> list:
        """Create ``iid`` and hold one handle to it, as ``create_instance`` does."""
        self(C.CreateRequested, iid)
        self(C.HandleAdded, iid)
        out = self(C.CreateDepsReady, iid)
        assert of(out, C.SendCreate) == [C.SendCreate(f"s{self.n}", iid)]
        return self(C.Created, iid, worker, real_id or iid)


def of(out: list, kind: type) -> list:
    return [i for i in out if type(i) is kind]


def sent(out: list) -> list[str]:
    return [i.call_id for i in of(out, C.SendCall)]


@pytest.fixture
def h() -> Harness:
    return Harness()


# --------------------------------------------------------------------------- order


def test_calls_wait_for_creation_then_leave_in_order(h):
    h(C.CreateRequested, "i")
    assert sent(h(C.CallSubmitted, "c1", "i")) == []
    assert sent(h(C.CallSubmitted, "c2", "i")) == []
    assert h(C.CreateDepsReady, "i") == [C.SendCreate(f"s{h.n}", "i")]
    out = h(C.Created, "i", W1, "i")
    assert of(out, C.SendCall) == [C.SendCall(f"s{h.n}", "c1", "i", W1),
                                   C.SendCall(f"s{h.n}", "c2", "i", W1)]
    assert sent(h(C.CallSubmitted, "c3", "i")) == ["c3"]


def test_a_call_waits_for_its_arguments_and_holds_later_calls_back(h):
    h.created("i")
    assert sent(h(C.CallSubmitted, "c1", "i", False)) == []
    assert sent(h(C.CallSubmitted, "c2", "i")) == []  # ready, but behind c1
    assert sent(h(C.CallSubmitted, "c3", "i", False)) == []
    assert sent(h(C.CallDepsReady, "c3")) == []  # c3 ready first: still behind c1
    assert sent(h(C.CallDepsReady, "c1")) == ["c1", "c2", "c3"]


def test_unordered_calls_leave_as_their_arguments_are_ready(h):
    # Ray's async and threaded actors: a later call whose arguments are ready runs first
    h.created("i")
    assert sent(h(C.CallSubmitted, "c1", "i", False, None, None, True)) == []
    assert sent(h(C.CallSubmitted, "c2", "i", True, None, None, True)) == ["c2"]
    assert sent(h(C.CallSubmitted, "c3", "i", False, None, None, True)) == []
    assert sent(h(C.CallDepsReady, "c3")) == ["c3"]
    assert sent(h(C.CallDepsReady, "c1")) == ["c1"]


def test_unordered_calls_lost_with_a_worker_go_back_in_submission_order(h):
    # found by the instance world with async instances: the sent calls went back in front
    # of an older call still waiting for its arguments (the queue out of submission order)
    h.created("i")
    h(C.CallSubmitted, "c1", "i", False, None, None, True)
    assert sent(h(C.CallSubmitted, "c2", "i", True, None, None, True)) == ["c2"]
    h(C.ChannelLost, W1)  # validate() after the step: the queue is in submission order
    out = h(C.Located, "i", W2, "", "i")
    assert sent(out) == ["c2"]
    assert sent(h(C.CallDepsReady, "c1")) == ["c1"]


def test_interleaved_readiness_keeps_submission_order(h):
    h.created("i")
    for k in range(6):
        h(C.CallSubmitted, f"c{k}", "i", k % 2 == 1)  # even ones wait for arguments
    order: list[str] = []
    for k in (4, 2, 0):
        order += sent(h(C.CallDepsReady, f"c{k}"))
    assert order == [f"c{k}" for k in range(6)]


def test_a_call_with_a_failed_argument_fails_in_its_turn_and_the_rest_go_on(h):
    h.created("i")
    boom = ValueError("arg failed")
    h(C.CallSubmitted, "c1", "i", False)
    out = h(C.CallSubmitted, "c2", "i", True, boom)  # failed argument, behind c1
    assert out == []
    h(C.CallSubmitted, "c3", "i")
    out = h(C.CallDepsReady, "c1")
    assert [type(i) for i in out] == [C.SendCall, C.CallFailed, C.SendCall]
    assert of(out, C.CallFailed)[0].error is boom and sent(out) == ["c1", "c3"]


def test_named_bind_sends_to_the_real_id(h):
    out = h.created("alias", W2, real_id="real")
    assert out == []
    assert of(h(C.CallSubmitted, "c1", "alias"), C.SendCall) == [
        C.SendCall(f"s{h.n}", "c1", "real", W2)]


# --------------------------------------------------------------------------- answers


def test_answers_settle_once_and_stale_answers_are_ignored(h):
    h.created("i")
    h(C.CallSubmitted, "c1", "i")
    h(C.CallSubmitted, "c2", "i")
    assert h(C.CallDone, "c1") == [C.CallSucceeded(f"s{h.n}", "c1")]
    err = RuntimeError("method raised")
    assert h(C.CallDone, "c2", err) == [C.CallFailed(f"s{h.n}", "c2", err)]
    assert h(C.CallDone, "c1") == []  # a duplicate
    assert h(C.CallDone, "nope") == []
    assert "c1" not in h.m.calls and h.m.pending("i") == 0


def test_an_answer_for_a_queued_call_is_ignored(h):
    h(C.CreateRequested, "i")
    h(C.CallSubmitted, "c1", "i")
    assert h(C.CallDone, "c1") == []
    assert h.m.pending("i") == 1


# --------------------------------------------------------------------------- lost channels


def test_lost_channel_redelivers_unanswered_calls_in_send_order(h):
    h.created("i")
    for k in range(5):
        h(C.CallSubmitted, f"c{k}", "i")
    h(C.CallSubmitted, "late", "i", False)  # not sent: waits for its argument
    h(C.CallDone, "c1")
    h(C.CallDone, "c3")
    out = h(C.ChannelLost, W1)
    assert out == [C.SendLocate(f"s{h.n}", "i", W1)]
    assert sent(h(C.CallSubmitted, "c5", "i")) == []  # queued behind the locate
    out = h(C.Located, "i", W2, "", "i")
    assert sent(out) == ["c0", "c2", "c4"]  # c1 and c3 were answered: never resent
    assert {i.worker for i in of(out, C.SendCall)} == {W2}
    assert sent(h(C.CallDepsReady, "late")) == ["late", "c5"]


def test_lost_channel_of_another_worker_changes_nothing(h):
    h.created("i")
    h(C.CallSubmitted, "c1", "i")
    assert h(C.ChannelLost, W2) == []
    assert h(C.CallDone, "c1") == [C.CallSucceeded(f"s{h.n}", "c1")]


def test_idle_route_locates_with_the_lost_worker_on_its_next_call(h):
    h.created("i")
    assert h(C.ChannelLost, W1) == []
    assert h(C.CallSubmitted, "c1", "i") == [C.SendLocate(f"s{h.n}", "i", W1)]


def test_lost_twice_redelivers_again_while_the_bound_allows(h):
    h.m = C.CallOrder(max_redeliveries=2)
    h.created("i")
    h(C.CallSubmitted, "c1", "i")
    h(C.ChannelLost, W1)
    assert sent(h(C.Located, "i", W2, "", "i")) == ["c1"]
    h(C.ChannelLost, W2)
    assert sent(h(C.Located, "i", W1, "", "i")) == ["c1"]
    assert h(C.CallDone, "c1") == [C.CallSucceeded(f"s{h.n}", "c1")]


def test_the_running_call_fails_past_the_bound_and_the_calls_behind_it_go_on(h):
    # Default bound 1: the oldest unanswered call was running when the process died; it is
    # delivered once more, and fails at the second death.  c2 waited behind it: not charged.
    h.created("i")
    h(C.CallSubmitted, "c1", "i")
    h(C.CallSubmitted, "c2", "i")
    h(C.ChannelLost, W1)
    assert sent(h(C.Located, "i", W2, "", "i")) == ["c1", "c2"]
    assert of(h(C.ChannelLost, W2), C.CallFailed) == []  # once it is known to live on
    out = h(C.Located, "i", W1, "", "i")
    failed = of(out, C.CallFailed)
    assert [f.call_id for f in failed] == ["c1"]
    assert isinstance(failed[0].error, CallCrashedError)
    assert "2 times" in str(failed[0].error) and W2 in str(failed[0].error)
    assert sent(out) == ["c2"]
    h(C.ChannelLost, W1)  # c2's first death as the running call: one more try
    assert sent(h(C.Located, "i", W2, "", "i")) == ["c2"]
    assert h(C.CallDone, "c2") == [C.CallSucceeded(f"s{h.n}", "c2")]


def test_a_call_with_its_own_bound_zero_fails_at_the_first_death(h):
    # Ray's max_task_retries=0 (its default): the running call fails when the actor dies;
    # c2 behind it (machine default bound) is delivered to the restarted instance.
    h.created("i")
    h(C.CallSubmitted, "c1", "i", True, None, 0)
    h(C.CallSubmitted, "c2", "i")
    assert of(h(C.ChannelLost, W1), C.CallFailed) == []
    out = h(C.Located, "i", W2, "", "i")
    failed = of(out, C.CallFailed)
    assert [f.call_id for f in failed] == ["c1"]
    assert "its own bound: 0" in str(failed[0].error)
    assert sent(out) == ["c2"]


def test_a_call_past_its_bound_fails_with_the_instances_end_if_it_did_not_restart(h):
    # Ray: the call cut short by a death that is not restarted gets ActorDiedError (the
    # end), not ActorUnavailableError (the crash); the call behind it fails the same way.
    h.created("i")
    h(C.CallSubmitted, "c1", "i", True, None, 0)
    h(C.CallSubmitted, "c2", "i")
    assert of(h(C.ChannelLost, W1), C.CallFailed) == []
    failed = of(h(C.Located, "i", None, "it used all its restarts", "i"), C.CallFailed)
    assert [f.call_id for f in failed] == ["c1", "c2"]
    assert all(type(f.error) is InstanceDiedError and "all its restarts" in str(f.error)
               for f in failed)


def test_reruns_after_an_exception_and_crashes_share_the_calls_bound(h):
    # Ray's max_task_retries is one budget: c1 (bound 2) was rerun once after an exception,
    # then its process died; it goes again with both tries charged (its method then has no
    # rerun left), and a second death fails it.  c2, rerun twice before a death, fails then.
    h.created("i")
    h(C.CallSubmitted, "c1", "i", True, None, 2)
    assert h(C.CallRetried, "c1") == []
    h(C.ChannelLost, W1)
    out = h(C.Located, "i", W2, "", "i")
    assert of(out, C.SendCall) == [C.SendCall(f"s{h.n}", "c1", "i", W2, 2)]
    h(C.ChannelLost, W2)
    failed = of(h(C.Located, "i", W1, "", "i"), C.CallFailed)
    assert [f.call_id for f in failed] == ["c1"]
    assert "2 times" in str(failed[0].error) and "1 reruns" in str(failed[0].error)
    h(C.CallSubmitted, "c2", "i", True, None, 2)
    h(C.CallRetried, "c2")
    h(C.CallRetried, "c2")
    h(C.ChannelLost, W1)
    failed = of(h(C.Located, "i", W2, "", "i"), C.CallFailed)
    assert [f.call_id for f in failed] == ["c2"] and "1 times" in str(failed[0].error)
    assert h(C.CallRetried, "c2") == []  # answered: ignored


def test_a_call_without_a_bound_is_delivered_after_every_death(h):
    h.created("i")
    h(C.CallSubmitted, "c1", "i", True, None, -1)
    workers = [W1, W2] * 5
    for lost, now in zip(workers, workers[1:]):
        assert of(h(C.ChannelLost, lost), C.CallFailed) == []
        assert sent(h(C.Located, "i", now, "", "i")) == ["c1"]
    assert h(C.CallDone, "c1") == [C.CallSucceeded(f"s{h.n}", "c1")]


def test_stale_locate_answer_is_ignored(h):
    h.created("i")
    assert h(C.Located, "i", W2, "", "i") == []
    assert sent(h(C.CallSubmitted, "c1", "i")) == ["c1"]
    assert h(C.CallSubmitted, "c1", "i") == []  # duplicate id


def test_call_on_an_unknown_instance_locates_it(h):
    h(C.HandleArrived, "i", "t1")  # a handle unpickled here
    h(C.HandleAdded, "i")
    out = h(C.CallSubmitted, "c1", "i")
    assert of(out, C.SendLocate) == [C.SendLocate(f"s{h.n}", "i", None)]
    assert of(out, C.FlushSoon) == []  # the first HandleAdded asked for it already
    assert sent(h(C.Located, "i", W1, "", "i")) == ["c1"]
    assert report(h).deltas == {"i": 1}


def test_locate_of_a_bound_alias_learns_the_real_id(h):
    h(C.CallSubmitted, "c1", "alias")
    out = h(C.Located, "alias", W1, "", "real")
    assert of(out, C.SendCall) == [C.SendCall(f"s{h.n}", "c1", "real", W1)]


# --------------------------------------------------------------------------- dead routes


def test_dead_instance_fails_queued_and_later_calls_with_the_cause(h):
    h.created("i")
    h(C.CallSubmitted, "c1", "i")
    h(C.CallSubmitted, "c2", "i", False)
    h(C.ChannelLost, W1)
    out = h(C.Located, "i", None, "its worker w1 was lost", "i")
    failed = of(out, C.CallFailed)
    assert [f.call_id for f in failed] == ["c1", "c2"]
    assert isinstance(failed[0].error, InstanceDiedError)
    assert "i is not available: its worker w1 was lost" in str(failed[0].error)
    later = of(h(C.CallSubmitted, "c3", "i"), C.CallFailed)
    assert [f.call_id for f in later] == ["c3"] and later[0].error is failed[0].error
    assert h(C.CallDepsReady, "c2") == []  # already failed


def test_creation_failure_fails_every_call(h):
    h(C.CreateRequested, "i")
    h(C.HandleAdded, "i")
    h(C.CallSubmitted, "c1", "i")
    h(C.CreateDepsReady, "i")
    out = h(C.CreateFailed, "i", "no worker has CPU=99000")
    assert [f.call_id for f in of(out, C.CallFailed)] == ["c1"]
    err = of(out, C.CallFailed)[0].error
    assert isinstance(err, ScheduleError) and "CPU=99000" in str(err)
    assert h(C.Created, "i", W1, "i") == []  # too late: ignored


def test_failed_creation_argument_kills_the_route_with_that_error(h):
    h(C.CreateRequested, "i")
    h(C.HandleAdded, "i")
    h(C.CallSubmitted, "c1", "i")
    boom = RuntimeError("arg task failed")
    out = h(C.CreateDepsReady, "i", boom)
    assert of(out, C.SendCreate) == []
    assert of(out, C.CallFailed) == [C.CallFailed(f"s{h.n}", "c1", boom)]


# --------------------------------------------------------------------------- handle counts


def report(h: Harness) -> C.ReportHandles | None:
    out = h(C.Flush)
    return out[0] if out else None


def test_creator_is_registered_by_the_spec_and_reports_only_the_drop(h):
    h(C.CreateRequested, "i")
    assert h(C.HandleAdded, "i") == []  # 0 -> 1, but the spec named this process
    assert h(C.HandleAdded, "i") == []
    assert h(C.HandleDropped, "i") == []
    assert h(C.HandleDropped, "i") == [C.FlushSoon(f"s{h.n}")]
    assert report(h).deltas == {"i": -1}
    assert report(h) is None  # nothing new


def test_pending_calls_count_as_handles(h):
    h.created("i")
    h(C.CallSubmitted, "c1", "i")
    assert h(C.HandleDropped, "i") == []  # the call still holds it
    out = h(C.CallDone, "c1")
    assert of(out, C.FlushSoon) and report(h).deltas == {"i": -1}
    assert "i" not in h.m.routes  # nobody holds it, nothing pending: forgotten


def test_borrowed_handle_reports_up_and_down_once_per_batch(h):
    out = h(C.HandleAdded, "x")
    assert out == [C.FlushSoon(f"s{h.n}")]
    assert h(C.HandleAdded, "x") == []  # 1 -> 2: nothing to report, flush already asked
    r = report(h)
    assert r.deltas == {"x": 1}
    h(C.HandleDropped, "x")
    h(C.HandleDropped, "x")
    h(C.HandleAdded, "x")  # down and up again within one batch: nets to nothing
    assert report(h) is None


def test_tokens_travel_in_the_report(h):
    h(C.HandleAdded, "x")
    h(C.HandleSent, "x", "t1")
    h(C.HandleArrived, "y", "t2")
    r = report(h)
    assert r.deltas == {"x": 1} and r.transit == [("x", "t1")] and r.arrived == [("y", "t2")]


def test_a_drop_without_a_handle_is_ignored(h):
    assert h(C.HandleDropped, "x") == []
    assert h.m.counts == {}


def test_handle_dropped_while_creating_keeps_the_route_until_answered(h):
    h(C.CreateRequested, "i")
    h(C.HandleAdded, "i")
    h(C.CreateDepsReady, "i")
    h(C.HandleDropped, "i")
    assert "i" in h.m.routes  # still waiting for CREATE_INSTANCE
    h(C.Created, "i", W1, "i")
    assert "i" not in h.m.routes


def test_unknown_event_is_logged_not_raised(h):
    assert h.m.handle(C.SendCall("x", "c", "i", W1)) == []
    assert any(w[0] == "unknown-event" for _, w, _ in h.m.story.entries)


def test_story_tells_what_happened_to_a_call(h):
    h.created("i")
    h(C.CallSubmitted, "c1", "i")  # sent at once: its "send" entry tells it
    h(C.CallSubmitted, "c2", "i", False)
    h(C.ChannelLost, W1)
    h(C.Located, "i", W2, "", "i")
    h(C.CallDone, "c1")
    kinds = [what[0] for _, what in h.m.story_of("c1")]
    assert kinds == ["send", "lost", "send", "succeeded"]
    assert [what[0] for _, what in h.m.story_of("c2")] == ["call"]


# --------------------------------------------------------------------------- random


def _state(m: C.CallOrder) -> tuple:
    """Everything a CallOrder keeps, comparable (its story included)."""
    calls = {cid: (c.instance_id, c.seq, c.ready, repr(c.error), c.crashes, c.max_redeliveries,
                   c.unordered, c.concurrency) for cid, c in m.calls.items()}
    routes = {iid: (r.worker, r.real_id, repr(r.dead), [c.call_id for c in r.queue],
                    list(r.inflight), r.waiting, r.lost) for iid, r in m.routes.items()}
    return (calls, routes, dict(m.counts), set(m.registered), dict(m._deltas),
            list(m._transit), list(m._arrived), m.story.dump())


@pytest.mark.parametrize("seed", range(40))
def test_random_events_keep_the_invariants_and_settle_every_call_once(seed):
    """Random interleavings of calls, readiness, answers, losses and handles.

    Checks: every call settles exactly once; the calls that reach an instance incarnation
    (between two losses) arrive in submission order; a call answered is never sent again.
    (tests/unit/test_hot_paths.py drives the same through the router's shortcuts.)
    """
    drive_random_calls(Harness(), seed)


def drive_random_calls(h: Harness, seed: int) -> None:
    """Feed ``h`` 400 random events (see the test above) and check its outcome."""
    rng = random.Random(seed)
    instances = ["a", "b", "c"]
    workers = [W1, W2, "tcp://w3:1"]
    where: dict[str, str] = {}
    settled: dict[str, int] = {}
    answered: set[str] = set()
    submitted: list[str] = []
    sends_to: dict[tuple, list[str]] = {}  # (instance, worker, epoch) -> call ids
    epoch = {w: 0 for w in workers}
    inflight: dict[str, tuple[str, str]] = {}  # call -> (instance, worker) as sent
    unready: list[str] = []
    handles: dict[str, int] = {i: 0 for i in instances}
    locating: set[str] = set()
    creating: dict[str, str] = {}
    n = 0
    for iid in instances:
        h(C.CreateRequested, iid)
        creating[iid] = "deps"

    def apply(out: list) -> None:
        for ins in out:
            t = type(ins)
            if t is C.SendCall:
                assert ins.call_id not in answered, f"{ins.call_id} resent after its answer"
                inflight[ins.call_id] = (ins.instance_id, ins.worker)
                key = (ins.instance_id, ins.worker, epoch[ins.worker])
                sends_to.setdefault(key, []).append(ins.call_id)
            elif t in (C.CallSucceeded, C.CallFailed):
                settled[ins.call_id] = settled.get(ins.call_id, 0) + 1
                inflight.pop(ins.call_id, None)
            elif t is C.SendLocate:
                locating.add(ins.instance_id)
            elif t is C.SendCreate:
                creating[ins.instance_id] = "sent"

    for _ in range(400):
        r = rng.random()
        if r < 0.3:
            n += 1
            cid = f"c{n}"
            iid = rng.choice(instances)
            ready = rng.random() < 0.7
            submitted.append(cid)
            if not ready:
                unready.append(cid)
            apply(h(C.CallSubmitted, cid, iid, ready))
        elif r < 0.4 and unready:
            cid = unready.pop(rng.randrange(len(unready)))
            err = ValueError("dep") if rng.random() < 0.1 else None
            apply(h(C.CallDepsReady, cid, err))
        elif r < 0.6 and inflight:
            cid = rng.choice(sorted(inflight))
            _iid, worker = inflight[cid]
            if where.get(_iid) == worker:
                answered.add(cid)
                apply(h(C.CallDone, cid, None if rng.random() < 0.9 else RuntimeError("m")))
        elif r < 0.68:
            worker = rng.choice(workers)
            for iid, w in list(where.items()):
                if w == worker:
                    del where[iid]
            epoch[worker] += 1
            apply(h(C.ChannelLost, worker))
        elif r < 0.78 and locating:
            iid = rng.choice(sorted(locating))
            locating.discard(iid)
            if rng.random() < 0.1:
                apply(h(C.Located, iid, None, "gone", iid))
            else:
                where[iid] = rng.choice(workers)
                apply(h(C.Located, iid, where[iid], "", iid))
        elif r < 0.85 and creating:
            iid = rng.choice(sorted(creating))
            if creating[iid] == "deps":
                apply(h(C.CreateDepsReady, iid))
            else:
                del creating[iid]
                if rng.random() < 0.1:
                    apply(h(C.CreateFailed, iid, "no room"))
                else:
                    where[iid] = rng.choice(workers)
                    apply(h(C.Created, iid, where[iid], iid))
        elif r < 0.92:
            iid = rng.choice(instances)
            if handles[iid] and rng.random() < 0.5:
                handles[iid] -= 1
                apply(h(C.HandleDropped, iid))
            else:
                handles[iid] += 1
                apply(h(C.HandleAdded, iid))
        else:
            apply(h(C.Flush))
    for cid, count in settled.items():
        assert count == 1, f"{cid} settled {count} times"
    # On each channel incarnation (a worker between two losses), an instance receives calls
    # in submission order and never one twice.
    rank = {cid: k for k, cid in enumerate(submitted)}
    for key, cids in sends_to.items():
        ranks = [rank[c] for c in cids]
        assert ranks == sorted(set(ranks)), (key, cids)
    unsettled = set(submitted) - set(settled)
    assert unsettled == set(h.m.calls), "a call was lost without an answer"


# --------------------------------------------------------------------------- scale-down moves


def test_calls_the_old_host_did_not_run_go_to_the_new_home_once_in_order(h):
    """The instance moved from W1 to W2 (scale-down): W1 answered c0 and c1 before the move
    and answers c2 "moved".  c2 and the later c3 (sent to W1, answered "moved" after) go
    back uncharged, in order, before anything newer; their late "moved" answers and the
    answers of c0/c1 change nothing, and each call is settled exactly once."""
    h.m = C.CallOrder(max_redeliveries=0)  # a crash charge would fail them: none is made
    h.created("i")
    for k in range(4):
        h(C.CallSubmitted, f"c{k}", "i")
    assert h(C.CallDone, "c0") == [C.CallSucceeded(f"s{h.n}", "c0")]
    h(C.CallDone, "c1")
    out = h(C.CallMoved, "c2")
    assert out == [C.SendLocate(f"s{h.n}", "i", None)]  # not lost: the old host lives
    assert sent(h(C.CallSubmitted, "c4", "i")) == []  # behind the locate
    assert h(C.CallMoved, "c3") == []  # its own "moved" answer: back in the queue already
    out = h(C.Located, "i", W2, "", "i")
    assert sent(out) == ["c2", "c3", "c4"]
    assert {i.worker for i in of(out, C.SendCall)} == {W2}
    for k in (2, 3, 4):
        assert h(C.CallDone, f"c{k}") == [C.CallSucceeded(f"s{h.n}", f"c{k}")]
    assert h(C.CallDone, "c2") == []  # answered once
    assert h.m.pending("i") == 0


def test_a_moved_answer_for_a_call_not_in_flight_is_ignored(h):
    h.created("i")
    h(C.CallSubmitted, "c1", "i")
    h(C.CallDone, "c1")
    assert h(C.CallMoved, "c1") == []
    assert h(C.CallMoved, "nope") == []
