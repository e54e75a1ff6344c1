"""yrdask.ray behaviours that real Ray programs and Ray's own tests rely on (issue 20):
per-call method options, ``cancel(force=True)``, runtime context names, Ray's error types,
async-actor ordering, concurrency groups, ActorPool, dynamic generators.

Each test states the Ray behaviour it checks (learned from Ray's source and tests); waits
are rendezvous (events, files, refs), never sleeps.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
import uuid

import cloudpickle
import pytest

import yrdask.ray as ray
from conftest import wait_for_file

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def ray_env(cluster):
    cluster()  # embedded, two 1-CPU workers
    ray.init(namespace=f"round2-{uuid.uuid4().hex[:6]}")
    yield ray
    ray.shutdown()


# -- per-call method options ------------------------------------------------------------------


@ray.remote
class Flaky:
    def __init__(self):
        self.tries = {}

    def fail_until(self, key, n):
        """Raises ValueError the first ``n`` times it is called with ``key``."""
        self.tries[key] = self.tries.get(key, 0) + 1
        if self.tries[key] <= n:
            raise ValueError(f"try {self.tries[key]}")
        return self.tries[key]



@ray.remote(concurrency_groups={"io": 1})
class Grouped:
    def thread(self):
        return threading.current_thread().name


def test_per_call_retry_options_override_the_methods(ray_env):
    f = Flaky.remote()
    # Ray: actor.method.options(max_task_retries=, retry_exceptions=) holds for that call
    retried = f.fail_until.options(max_task_retries=2, retry_exceptions=[ValueError])
    assert ray.get(retried.remote("a", 2)) == 3
    with pytest.raises(ValueError, match="try 1"):  # the method itself does not retry
        ray.get(f.fail_until.remote("b", 1))
    with pytest.raises(ValueError, match="try 2"):  # one retry is not enough for two failures
        ray.get(f.fail_until.options(max_task_retries=1, retry_exceptions=True).remote("c", 2))
    with pytest.raises(ValueError, match="try 1"):  # only the listed exception types retry
        ray.get(f.fail_until.options(max_task_retries=3,
                                     retry_exceptions=[KeyError]).remote("d", 1))
    with pytest.raises(TypeError):  # the signature is still checked at the call
        retried.remote("e")


def test_per_call_concurrency_group(ray_env):
    g = Grouped.remote()
    assert ray.get(g.thread.options(concurrency_group="io").remote())
    with pytest.raises(ValueError, match="no such concurrency group"):
        ray.get(g.thread.options(concurrency_group="nope").remote())


# -- cancel(force=True) -------------------------------------------------------------------------


@ray.remote
def blocked_in_c(path):
    with open(path, "a") as f:
        f.write("x")
    time.sleep(600)  # in C: no Python bytecode runs, so no exception can reach it


@ray.remote
def quick():
    return "ran"


def test_force_cancel_ends_the_worker_process_of_a_task_blocked_in_c(ray_env, tmp_path):
    marks = [tmp_path / "a", tmp_path / "b"]
    refs = [blocked_in_c.remote(str(m)) for m in marks]  # both CPUs of the cluster
    for m in marks:
        wait_for_file(str(m))
    for ref in refs:
        ray.cancel(ref, force=True)
    for ref in refs:
        with pytest.raises(ray.exceptions.TaskCancelledError):
            ray.get(ref, timeout=10)  # at once, not after the sleep
    # the CPUs are free: a new task runs now (it would wait 600 s behind the sleepers)
    assert ray.get(quick.remote(), timeout=60) == "ran"
    # a forced cancel is not a crash of the task: it is not run again on the new process
    assert [m.read_text() for m in marks] == ["x", "x"]
