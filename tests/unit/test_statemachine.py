"""The shared machine plumbing: cheap stories and the generated ``__init__`` of events."""

from __future__ import annotations

import dataclasses
import gc

import pytest

from yrdask.runtime import submit_queue as M
from yrdask.statemachine import Event, Story, fast_init


@dataclasses.dataclass(frozen=True, slots=True)
class Ping(Event):
    """An event with a required field and a default."""

    task_id: str
    n: int = 3


fast_init(Ping)


def test_fast_init_keeps_the_dataclass_contract():
    ev = Ping("s", "t1")
    assert (ev.stimulus_id, ev.task_id, ev.n) == ("s", "t1", 3)
    assert Ping("s", task_id="t1", n=4).n == 4
    assert ev == Ping("s", "t1") and hash(ev) == hash(Ping("s", "t1"))
    assert repr(ev) == "Ping(stimulus_id='s', task_id='t1', n=3)"
    with pytest.raises(dataclasses.FrozenInstanceError):
        ev.n = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        Ping("s")  # the required field is still required


def test_fast_init_is_what_the_hot_machines_use():
    assert M.TaskQueued.__init__.__qualname__ == "TaskQueued.__init__"
    ev = M.TaskQueued("s", "t", "k", {}, 1, 1, (), 0, None, "f")
    assert ev.max_crashes is None and ev.name == "f"


def test_story_finds_tuple_entries_and_bare_objects_by_key():
    story = Story(10, keys_of=lambda obj: (obj.task_id,))
    story.log("a", ("wait", "t1", 0.5), ("t1", "L1"))
    story.entries.append(Ping("b", "t2"))  # bare: keys from keys_of when read
    story.entries.append(("c", Ping("c", "t1"), None))
    assert [sid for sid, _ in story.about("t1")] == ["a", "c"]
    assert story.about("t2") == [("b", (Ping("b", "t2"),))]
    assert story.about("L1")[0][1] == ("wait", "t1", 0.5)
    assert "Ping(stimulus_id='b'" in story.dump("t2")
    assert len(story.dump().splitlines()) == 3


def test_story_entries_of_plain_values_leave_the_collectors_lists():
    story = Story(10)
    task_id = "".join(["t", "1"])  # built here, as a machine builds its entries
    story.log("sid", ("start", task_id), (task_id, "L1"))
    gc.collect()
    gc.collect()  # a tuple is untracked once its items are: at most two collections
    assert not gc.is_tracked(story.entries[0])  # kept for free: no traversal per collection
