"""``ray.cancel(ref, recursive=...)``: Ray's default (``recursive=True``) cancels the tasks
the cancelled task submitted too, and theirs; ``recursive=False`` leaves them running.

The tasks leave files as they start, finish normally or end (``finally``), so the test
waits on files, never on sleeps.
"""

from __future__ import annotations

import os
import sys
import time

import cloudpickle
import pytest

import yrdask as yr
import yrdask.ray as ray
from conftest import wait_until

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(120)


def _touch(folder, name):
    open(os.path.join(folder, name), "w").close()


@ray.remote(num_cpus=0)
def grandchild(folder):
    _touch(folder, "grandchild-started")
    try:
        while not os.path.exists(os.path.join(folder, "release")):
            time.sleep(0.02)
        _touch(folder, "grandchild-finished")
    finally:
        _touch(folder, "grandchild-ended")


@ray.remote(num_cpus=0)
def child(folder):
    ref = grandchild.remote(folder)
    _touch(folder, "child-started")
    try:
        return ray.get(ref)
    finally:
        _touch(folder, "child-ended")


@ray.remote(num_cpus=0)
def parent(folder):
    return ray.get(child.remote(folder))


def _started(folder):
    return all(os.path.exists(os.path.join(folder, f))
               for f in ("child-started", "grandchild-started"))


def test_a_recursive_cancel_cancels_the_tasks_children_and_theirs(ray_env, tmp_path):
    folder = str(tmp_path)
    ref = parent.remote(folder)
    wait_until(lambda: _started(folder), 60, "the child and grandchild to start")
    ray.cancel(ref)  # recursive=True: Ray's default
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(ref, timeout=30)
    wait_until(lambda: os.path.exists(os.path.join(folder, "grandchild-ended")), 60,
               "the grandchild to be cancelled")
    assert os.path.exists(os.path.join(folder, "child-ended"))
    _touch(folder, "release")
    assert not os.path.exists(os.path.join(folder, "grandchild-finished"))


def test_a_cancel_that_is_not_recursive_leaves_the_children_running(ray_env, tmp_path):
    folder = str(tmp_path)
    ref = parent.remote(folder)
    wait_until(lambda: _started(folder), 60, "the child and grandchild to start")
    ray.cancel(ref, recursive=False)
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(ref, timeout=30)
    _touch(folder, "release")  # the grandchild, still running, finishes normally
    wait_until(lambda: os.path.exists(os.path.join(folder, "grandchild-finished")), 60,
               "the grandchild to finish")


@yr.invoke(invoke_options=yr.InvokeOptions(cpu=0, memory=0))
def yr_child(folder):
    _touch(folder, "yr-child-started")
    try:
        while True:
            time.sleep(0.02)
    finally:
        _touch(folder, "yr-child-ended")


@yr.invoke(invoke_options=yr.InvokeOptions(cpu=0, memory=0))
def yr_parent(folder):
    return yr.get(yr_child.invoke(folder))


def test_yr_cancel_with_allow_recursive_cancels_the_children(ray_env, tmp_path):
    folder = str(tmp_path)
    ref = yr_parent.invoke(folder)
    wait_until(lambda: os.path.exists(os.path.join(folder, "yr-child-started")), 60,
               "the child to start")
    yr.cancel(ref, allow_recursive=True)
    wait_until(lambda: os.path.exists(os.path.join(folder, "yr-child-ended")), 60,
               "the child to be cancelled")
