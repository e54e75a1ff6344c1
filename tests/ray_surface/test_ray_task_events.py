"""Ray's ``enable_task_events=False`` (``@ray.remote``, ``.options()``, ``@ray.method``): the
tasks, actor creations and actor calls it covers run as usual but leave no record, so
``ray.util.state.list_tasks`` and ``ray.timeline()`` (and Dask's Task Stream, built from the
same records) leave them out; a method's own setting wins over its actor's.

The records reach the scheduler in the workers' batches (a few a second): the test waits,
bounded, for the records of the calls that keep their events, made after the others, then
watches a while (4 batches) that no record of the others comes.
"""

from __future__ import annotations

import functools
import sys
import time

import cloudpickle
import pytest

import yrdask.ray as ray
from conftest import wait_until
from yrdask.ray.util import state
from yrdask.worker.dask_panels import FLUSH_MS

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(120)

list_tasks = functools.partial(state.list_tasks, raise_on_missing_output=False)


@ray.remote(enable_task_events=False)
def events_off_task(x):
    return x + 1


@ray.remote
def events_on_task(x):
    return x + 1


@ray.remote
class EventsProbe:
    @ray.method(enable_task_events=False)
    def quiet(self):
        return "quiet"

    def loud(self):
        return "loud"


@ray.remote(enable_task_events=False)
class EventsOffActor:
    def quiet(self):
        return "quiet"

    @ray.method(enable_task_events=True)
    def loud(self):
        return "loud"


def _names() -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in list_tasks(detail=True, limit=10_000):
        counts[t.name] = counts.get(t.name, 0) + 1
    return counts


def test_work_without_task_events_runs_and_leaves_no_record(ray_env):
    probe, off = EventsProbe.remote(), EventsOffActor.remote()
    # without events: the function's, a call's .options(), the method's, the actor's
    assert ray.get(events_off_task.remote(1)) == 2
    assert ray.get(events_on_task.options(enable_task_events=False).remote(2)) == 3
    assert ray.get(probe.quiet.remote()) == "quiet"
    assert ray.get(probe.loud.options(enable_task_events=False).remote()) == "loud"
    assert ray.get(off.quiet.remote()) == "quiet"
    # with events, after those: one call each
    assert ray.get(events_on_task.remote(3)) == 4
    assert ray.get(probe.loud.remote()) == "loud"
    assert ray.get(off.loud.remote()) == "loud"  # the method's True wins over the actor's
    recorded = {"events_on_task": 1, "EventsProbe.loud": 1, "EventsOffActor.loud": 1,
                "EventsProbe.__init__": 1}
    wait_until(lambda: all(_names().get(k, 0) >= n for k, n in recorded.items()), 30,
               lambda: f"the records of the calls with events: {_names()}")
    until = time.monotonic() + 4 * FLUSH_MS / 1000  # an absence: watched for 4 batches
    while True:
        names = _names()
        assert {k: names.get(k, 0) for k in recorded} == recorded
        for name in ("events_off_task", "EventsProbe.quiet", "EventsOffActor.quiet",
                     "EventsOffActor.__init__"):
            assert name not in names
        if time.monotonic() > until:
            break
        time.sleep(0.05)
    traced = {e["name"] for e in ray.timeline()}
    assert {"events_on_task", "EventsProbe.loud", "EventsOffActor.loud"} <= traced
    assert not traced & {"events_off_task", "EventsProbe.quiet", "EventsOffActor.quiet"}
    ray.kill(probe)
    ray.kill(off)


def test_task_events_take_a_bool_only(ray_env):
    with pytest.raises(TypeError, match="enable_task_events must be a bool"):
        events_on_task.options(enable_task_events="no").remote(1)
    with pytest.raises(TypeError, match="enable_task_events must be a bool"):
        ray.method(enable_task_events=1)
    probe = EventsProbe.remote()
    with pytest.raises(TypeError, match="enable_task_events must be a bool"):
        probe.loud.options(enable_task_events=None)
    ray.kill(probe)
