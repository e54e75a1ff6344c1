"""What a worker needs before scale-down may retire it (``scheduler/drain.py``, pure)."""
from __future__ import annotations

import dask
import pytest

from yrdask import protocol as P
from yrdask.config import drain_settings
from yrdask.errors import YRValueError
from yrdask.scheduler.drain import Hosted, decide, must_stay

pytestmark = pytest.mark.timeout(10)

W = "tcp://w1:1"


def inst(iid, state=P.ALIVE, checkpoint=False, restarts=False, shape=None):
    return Hosted(iid, "Counter", state, checkpoint, restarts, shape or {"CPU": 1000.0})


def test_a_worker_with_yr_leases_is_never_idle():
    d = decide(W, [], leases=2, restart_unmovable=True)
    assert "2 task lease(s)" in d.keep


def test_an_empty_idle_worker_may_go_with_nothing_to_do():
    assert decide(W, [], 0, False) == decide(W, [], 0, True) == type(decide(W, [], 0, False))(W)


def test_checkpointed_instances_move_and_unmovable_ones_keep_the_worker():
    d = decide(W, [inst("a", checkpoint=True), inst("b", checkpoint=True)], 0, False)
    assert (d.keep, d.move, d.restart) == ("", ("a", "b"), ())
    d = decide(W, [inst("a", checkpoint=True), inst("b")], 0, False)
    assert "instance b (Counter) has no checkpoint" in d.keep
    assert "yrdask.scheduling.drain-restart-unmovable" in d.keep


def test_the_config_key_restarts_unmovable_instances_within_their_budget():
    d = decide(W, [inst("a", checkpoint=True), inst("b", restarts=True)], 0, True)
    assert (d.keep, d.move, d.restart) == ("", ("a",), ("b",))
    d = decide(W, [inst("b", restarts=False)], 0, True)
    assert "no restart left" in d.keep


def test_instances_starting_or_restarting_keep_the_worker():
    for state in (P.PENDING, P.RESTARTING):
        assert state in decide(W, [inst("a", state=state, checkpoint=True)], 0, True).keep


def test_a_move_needs_room_on_another_worker():
    d = decide(W, [inst("a", checkpoint=True, shape={"CPU": 4000.0})], 0, False,
               room=lambda shape: shape["CPU"] <= 1000.0)
    assert "no other worker has room" in d.keep


def test_the_last_workers_holding_something_are_not_all_proposed():
    everyone = ["a", "b", "c"]
    assert must_stay(["a", "b"], everyone, {"a": True}) == set()  # c is left to take it
    assert must_stay(everyone, everyone, {"a": True, "b": False}) == {"a"}


def test_drain_settings_are_checked_with_the_key_named():
    assert drain_settings() == (False, 30.0)
    with dask.config.set({"yrdask.scheduling.drain-restart-unmovable": "yes"}):
        with pytest.raises(YRValueError, match="drain-restart-unmovable='yes'"):
            drain_settings()
    with dask.config.set({"yrdask.scheduling.drain-timeout": "-1s"}):
        with pytest.raises(YRValueError, match="drain-timeout"):
            drain_settings()
    with dask.config.set({"yrdask.scheduling.drain-timeout": "2s"}):
        assert drain_settings()[1] == 2.0


def test_instance_calls_running_there_make_a_worker_busy():
    d = decide(W, [inst("a", checkpoint=True)], 0, False, calls=3)
    assert "3 instance call(s)" in d.keep


def test_a_bundle_reserved_on_its_node_keeps_the_worker_even_with_movable_instances():
    d = decide(W, [inst("a", checkpoint=True)], 0, True, bundles=1)
    assert "bundle" in d.keep and not d.move
    assert decide(W, [inst("a", checkpoint=True)], 0, False, bundles=0).move == ("a",)
