"""Ray's own words for Ray programs: the error types and the moments Ray raises them.

Options are checked when a function or class is decorated (or given ``.options()``), a
refused ``ray.init(address=...)`` is a quick ``ConnectionError``, work no node can ever run
raises Ray's ``TaskUnschedulableError`` / ``ActorUnschedulableError`` (``RayError``s), and
a queue's ``actor_options`` are checked as ``.options(**actor_options)``.  (A call its
actor's crash cut short: test_ray_actors.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import cloudpickle
import pytest

import yrdask as yr
import yrdask.ray as ray
from yrdask.ray.util.queue import Queue

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(120)


def plain():
    return 1


class Plain:
    pass


@pytest.mark.parametrize("bad, match", [
    ({"num_cpus": -1}, "'num_cpus' only accepts"),
    ({"num_gpus": -0.5}, "'num_gpus' only accepts"),
    ({"memory": "1GB"}, "'memory' only accepts"),
    ({"resources": {"CPU": 1}}, "instead of 'CPU'"),
])
def test_bad_resource_options_are_refused_at_decoration_and_options(bad, match):
    # Ray validates options in @ray.remote and .options(), before any .remote()
    with pytest.raises(ValueError, match=match):
        ray.remote(**bad)(plain)
    with pytest.raises(ValueError, match=match):
        ray.remote(**bad)(Plain)
    with pytest.raises(ValueError, match=match):
        ray.remote(plain).options(**bad)
    with pytest.raises(ValueError, match=match):
        ray.remote(Plain).options(**bad)
    with pytest.raises(ValueError, match="'num_returns' only accepts"):
        ray.remote(num_returns=-2)(plain)


def test_a_refused_address_is_a_quick_connection_error():
    # Ray: ray.init(address=...) where nothing listens raises ConnectionError (no 30 s wait)
    code = ("import yrdask.ray as ray\n"
            "try:\n    ray.init(address='tcp://127.0.0.1:1')\n"
            "except ConnectionError as e:\n    print('ConnectionError', e)\n")
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, YR_SERVER_ADDRESS="", RAY_ADDRESS=""))
    assert out.stdout.startswith("ConnectionError Could not connect to the cluster at "
                                 "tcp://127.0.0.1:1"), out.stdout + out.stderr[-2000:]
    assert time.monotonic() - start < 20  # not Dask's 30 s connect timeout


def test_schedule_errors_are_rays_unschedulable_errors():
    # what ray.get raises for yr's ScheduleError (work no node can ever run): Ray's types,
    # RayErrors, still yr's ScheduleError for code that catches that
    from yrdask.ray.exceptions import from_yr_error

    task = from_yr_error(yr.ScheduleError("request {CPU: 1000, x: 1} can never be scheduled"))
    actor = from_yr_error(yr.ScheduleError(
        "Unschedulable instance i-94591332e21: request {x: 1} can never be scheduled"))
    assert type(task) is ray.exceptions.TaskUnschedulableError
    # in Ray's words (yrdask/words.py): Ray's resource dict, cores
    assert str(task).startswith("The task is not schedulable: request {'CPU': 1.0, 'x': 1.0}")
    assert type(actor) is ray.exceptions.ActorUnschedulableError
    assert str(actor).startswith("The actor is not schedulable: Unschedulable actor")
    for err in (task, actor):
        assert isinstance(err, ray.exceptions.RayError) and isinstance(err, yr.ScheduleError)


@pytest.mark.parametrize("bad", ["num_cpus=1", [("num_cpus", 1)]])
def test_queue_actor_options_that_are_not_a_dict_are_a_type_error(ray_env, bad):
    # Ray hands them to .options(**actor_options): a non-mapping is a TypeError
    with pytest.raises(TypeError, match="actor_options must be a dict"):
        Queue(actor_options=bad)


def test_queue_actor_options_are_checked_as_actor_options(ray_env):
    with pytest.raises(ValueError, match="Invalid option keyword bogus for actors"):
        Queue(actor_options={"bogus": 1})
    q = Queue(actor_options={"num_cpus": 0, "resources": {}})
    q.put(1)
    assert q.get(timeout=30) == 1
    q.shutdown()


def test_an_intended_exit_reads_as_a_sentence_after_because():
    """yr's reason of an intended exit ("exited by …") follows Ray's "The actor is dead
    because" as "it exited by …"; other reasons are kept as they are."""
    from yrdask.ray.exceptions import actor_died

    left = actor_died("instance i-1 is not available: exited by __ray_terminate__()")
    assert str(left).startswith("The actor is dead because it exited by __ray_terminate__().")
    lost = actor_died("instance i-1 is not available: its worker tcp://w:1 was lost")
    assert str(lost).startswith("The actor is dead because its worker tcp://w:1 was lost.")
