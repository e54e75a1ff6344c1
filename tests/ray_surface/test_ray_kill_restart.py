"""``ray.kill(actor, no_restart=False)``: the actor's process is killed as if it crashed
(docs/migrating-from-ray.md): it restarts while it has ``max_restarts`` left (a fresh
``__init__``, ``was_current_actor_reconstructed``), the call it cut short fails unless
``max_task_retries`` lets it run again, and with no restart left the actor is dead.  For a
process actor (``yrdask_light=False``) its process is SIGKILLed; for a light actor its
object in the worker is dropped and built again there."""

from __future__ import annotations

import os
import sys
import time

import cloudpickle
import pytest

import yrdask.ray as ray
from conftest import wait_until

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(120)

T = 60


@ray.remote(num_cpus=0.1, max_restarts=1)
class Tally:
    def __init__(self):
        self.n = 0

    def incr(self):
        self.n += 1
        return self.n

    def state(self):
        return (self.n, os.getpid(),
                ray.get_runtime_context().was_current_actor_reconstructed)

    def hold(self, marker, seconds):
        """Says it runs (the marker file), then runs ``seconds``."""
        open(marker, "a").close()
        time.sleep(seconds)
        return self.n


def _running(ref, marker) -> None:
    wait_until(lambda: os.path.exists(marker), T, "the call to start")
    os.remove(marker)


@pytest.mark.parametrize("light", [True, False], ids=["light", "process"])
def test_kill_with_restart_restarts_the_actor_until_its_restarts_are_used(ray_env, tmp_path,
                                                                          light):
    a = Tally.options(yrdask_light=light).remote()
    assert [ray.get(a.incr.remote(), timeout=T) for _ in range(2)] == [1, 2]
    n, pid, again = ray.get(a.state.remote(), timeout=T)
    assert (n, again) == (2, False)
    marker = str(tmp_path / "running")
    cut = a.hold.remote(marker, 10)
    _running(cut, marker)
    ray.kill(a, no_restart=False)
    # max_task_retries=0: not run again; a light actor's calls end with its object
    cut_short = (ray.exceptions.ActorDiedError if light
                 else ray.exceptions.ActorUnavailableError)
    with pytest.raises(cut_short):
        ray.get(cut, timeout=T)
    n, new_pid, again = ray.get(a.state.remote(), timeout=T)
    assert (n, again) == (0, True)  # a fresh __init__: a restart, not the old object
    assert (new_pid == pid) is light  # a process actor got a new process
    assert ray.get(a.incr.remote(), timeout=T) == 1

    ray.kill(a, no_restart=False)  # its one restart is used: now it dies

    def dead() -> bool:  # a call sent before the kill reached the actor may still answer
        try:
            ray.get(a.incr.remote(), timeout=T)
        except ray.exceptions.ActorDiedError:
            return True
        return False

    wait_until(dead, T, "the actor to end at its second kill, its restart used")


def test_kill_with_restart_runs_the_cut_call_again_within_max_task_retries(ray_env,
                                                                           tmp_path):
    a = Tally.options(yrdask_light=False, max_task_retries=1).remote()
    assert ray.get(a.incr.remote(), timeout=T) == 1
    marker = str(tmp_path / "running")
    cut = a.hold.remote(marker, 1)
    _running(cut, marker)
    ray.kill(a, no_restart=False)
    assert ray.get(cut, timeout=T) == 0  # delivered again, to the restarted actor
    assert ray.get(a.state.remote(), timeout=T)[2] is True
    ray.kill(a)  # no_restart=True (the default): dead, whatever restarts are left
    with pytest.raises(ray.exceptions.ActorDiedError):
        ray.get(a.incr.remote(), timeout=T)
