"""The worker agent's instance side and a hosted instance's call rules
(``worker/instance_side.py``), on recording edges: what the agent and hosting would start,
run and answer is kept for the test to read."""
from __future__ import annotations

import pytest

from yrdask.worker.instance_side import HostedCalls, InstanceSide

pytestmark = pytest.mark.timeout(10)


class _Hosted(HostedCalls):
    """A hosted instance whose executors only record what they are handed."""

    def __init__(self, concurrency: int = 1) -> None:
        super().__init__(concurrency)
        self.started: list[str] = []  # started by the queue
        self.side: list[str] = []  # started on the off-loop executor
        self.answers: list[tuple[str, str]] = []  # (call id, what)
        self.interrupted: list[str] = []

    def _start(self, item) -> None:
        self.started.append(item[1]["task_id"])

    def _start_side(self, item) -> None:
        self.side.append(item[1]["task_id"])

    def _answer_died(self, peer, call_id) -> None:
        self.answers.append((call_id, "died"))

    def _answer_init_error(self, call_id) -> None:
        if self.answered(call_id) is not None:
            self.answers.append((call_id, "init-error"))

    def _answer_cancelled(self, call_id) -> None:
        if self.answered(call_id) is not None:
            self.answers.append((call_id, "cancelled"))

    def _interrupt(self, call_id) -> None:
        self.interrupted.append(call_id)

    def run(self, call_id: str) -> bool:
        """An executor runs ``call_id``: it answers ``ok`` unless hosting says it must not."""
        if not self.runs(call_id):
            return False
        if self.answered(call_id) is not None:
            self.answers.append((call_id, "ok"))
        return True


class _Edge:
    def __init__(self) -> None:
        self.hosted: dict[str, _Hosted] = {}
        self.dead: list[tuple[str, str]] = []
        self.ignored: list[str] = []

    def host(self, spec, running):
        inst = self.hosted[spec["instance_id"]] = _Hosted(spec.get("concurrency", 1))
        return inst

    def died(self, peer, msg, why) -> None:
        self.dead.append((msg["task_id"], why))

    def ignored_start(self, instance_id) -> None:
        self.ignored.append(instance_id)

    def moved_away(self, peer, msg, to) -> None:
        self.dead.append((msg["task_id"], f"moved to {to}"))


def _call(cid: str, iid: str = "i1", method: str = "m") -> dict:
    return {"task_id": cid, "instance_id": iid, "method": method}


def test_calls_that_beat_their_start_go_to_the_instance_in_order():
    edge = _Edge()
    side = InstanceSide(edge)
    side.call_method("p", _call("c1"))
    side.call_method("p", _call("c2"))
    assert side.early["i1"] and not edge.hosted
    inst = side.start({"instance_id": "i1"})
    assert list(inst.pending) == ["c1", "c2"] and "i1" not in side.early
    assert inst.started == []  # __init__ first
    inst.constructed()
    assert inst.started == ["c1"]
    assert inst.run("c1") and inst.finished()[1]["task_id"] == "c2"


def test_a_start_that_its_stop_overtook_is_ignored_and_its_early_calls_die():
    edge = _Edge()
    side = InstanceSide(edge)
    side.call_method("p", _call("c1"))
    assert side.stop("i1", "terminated") is None
    assert edge.dead == [("c1", "terminated")]
    assert side.start({"instance_id": "i1"}) is None
    assert edge.ignored == ["i1"] and "i1" not in side.instances
    side.call_method("p", _call("c2"))  # a late call answers died at once
    assert edge.dead[-1] == ("c2", "terminated")


def test_a_cancel_that_beats_the_start_holds_the_call_never_runs():
    edge = _Edge()
    side = InstanceSide(edge)
    side.call_method("p", _call("c1"))
    side.call_method("p", _call("c2"))
    assert side.cancel("c1") is True
    assert side.cancel("c9") is False  # no call of this worker
    inst = side.start({"instance_id": "i1"})
    inst.constructed()
    assert inst.run("c1") is False
    assert inst.answers == [("c1", "cancelled")]
    nxt = inst.finished()
    assert nxt[1]["task_id"] == "c2" and inst.run("c2")
    assert inst.answers[-1] == ("c2", "ok") and not side.early_cancels


def test_cancel_of_a_running_call_interrupts_it_and_its_answer_counts_once():
    inst = _Hosted(2)
    inst.constructed()
    inst.call("p", _call("c1"))
    assert inst.started == ["c1"] and inst.run("c1") is True
    assert inst.cancel_call("c1") is False  # answered already: not this instance's
    inst.call("p", _call("c2"))
    assert inst.cancel_call("c2") is True and inst.interrupted == ["c2"]


def test_off_loop_calls_start_outside_the_queue_but_never_before_init():
    inst = _Hosted(1)
    inst.call("p", _call("c1", method="side"))
    inst.call("p", _call("c2"))
    assert inst.side == [] and inst.started == []  # __init__ has not finished
    inst.constructed(frozenset({"side"}))
    assert inst.side == ["c1"] and inst.started == ["c2"]
    inst.call("p", _call("c3", method="side"))  # the queue is full: it starts all the same
    inst.call("p", _call("c4"))
    assert inst.side == ["c1", "c3"] and inst.started == ["c2"]
    inst.queue.validate()


def test_stop_answers_every_call_once_and_nothing_starts_after_it():
    inst = _Hosted(1)
    inst.constructed()
    for cid in ("c1", "c2", "c3"):
        inst.call("p", _call(cid))
    assert inst.stop("terminated") is True and inst.stop("again") is False
    assert sorted(inst.answers) == [("c1", "died"), ("c2", "died"), ("c3", "died")]
    assert inst.run("c1") is False and inst.finished() is None  # the running one returns
    inst.call("p", _call("c4"))
    assert inst.answers[-1] == ("c4", "died") and not inst.pending


def test_calls_answer_the_error_of_a_failed_init():
    inst = _Hosted(1)
    inst.call("p", _call("c1"))
    inst.init_error = b"boom"
    inst.constructed()
    assert inst.run("c1") is False and inst.answers == [("c1", "init-error")]


def test_a_moving_instance_holds_new_calls_then_answers_them_moved_unrun():
    """Scale-down: the calls it had go on, the ones after the hold wait unrun; once it
    left they and later ones answer "moved" (the caller sends them to the new home)."""
    edge = _Edge()
    side = InstanceSide(edge)
    inst = side.start({"instance_id": "i1"})
    inst.constructed()
    side.call_method("p", _call("c1"))
    assert side.hold("i1") is inst
    side.call_method("p", _call("c2"))
    side.call_method("p", _call("c3"))
    assert inst.started == ["c1"] and list(inst.pending) == ["c1"]  # c2, c3 held
    inst.run("c1")
    assert side.release("i1", "tcp://w2:1") is inst  # the edge ends it
    side.call_method("p", _call("c4"))
    assert edge.dead == [("c2", "moved to tcp://w2:1"), ("c3", "moved to tcp://w2:1"),
                         ("c4", "moved to tcp://w2:1")]
    assert inst.answers == [("c1", "ok")] and "i1" not in side.instances
    side.start({"instance_id": "i1"})  # it moves back here later: calls go to it again
    side.call_method("p", _call("c5"))
    assert list(edge.hosted["i1"].pending) == ["c5"]


def test_a_move_given_up_lets_the_held_calls_through_in_order():
    edge = _Edge()
    side = InstanceSide(edge)
    inst = side.start({"instance_id": "i1"})
    inst.constructed()
    side.hold("i1")
    side.call_method("p", _call("c1"))
    side.call_method("p", _call("c2"))
    assert inst.started == []
    assert side.release("i1", "") is None
    assert inst.started == ["c1"] and list(inst.pending) == ["c1", "c2"]
    assert side.hold("nope") is None


def test_a_stop_while_moving_answers_the_held_calls_died():
    edge = _Edge()
    side = InstanceSide(edge)
    side.start({"instance_id": "i1"}).constructed()
    side.hold("i1")
    side.call_method("p", _call("c1"))
    side.stop("i1", "terminated")
    assert edge.dead == [("c1", "terminated")] and not side.held


def test_a_crashed_light_instance_answers_its_calls_died_and_the_next_wait_for_its_restart():
    """``CRASH_INSTANCE`` (Ray's ``ray.kill(no_restart=False)``): the object goes, its calls
    not answered die, and the instance is not ended here: calls after the crash wait for the
    restart's ``START`` and run on the new object (or die with a ``STOP``)."""
    edge = _Edge()
    side = InstanceSide(edge)
    old = side.start({"instance_id": "i1"})
    old.constructed()
    side.call_method("p", _call("c1"))  # running
    side.call_method("p", _call("c2"))  # queued behind it
    assert side.crash("i1", "killed by ray.kill(no_restart=False)") is old
    assert old.answers == [("c1", "died"), ("c2", "died")] and old.stopped
    assert not old.run("c1")  # its answer was given: the late run answers nothing more
    side.call_method("p", _call("c3"))
    assert side.early["i1"] and not edge.dead  # waits for the restart
    new = side.start({"instance_id": "i1", "incarnation": 1})
    assert new is not old and list(new.pending) == ["c3"] and edge.ignored == []
    assert side.crash("gone", "x") is None
    side.crash("i1", "again")
    side.call_method("p", _call("c4"))
    side.stop("i1", "no restarts left")  # the restart was refused: the waiting call dies
    assert edge.dead == [("c4", "no restarts left")]
