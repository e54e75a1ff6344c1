"""``ray.util.state`` and ``ray.timeline()`` on the embedded cluster, as a Ray program uses
them: what each list and summary holds after known work (names, states, ids, counts), Ray's
filter rules on real rows, and the trace of calls whose durations the test sets.

The suite's cluster is shared, so every function and class here has a name of its own and
every check filters by it; task lists and summaries are read with
``raise_on_missing_output=False``, as earlier tests on the same cluster may have run more
calls than the history keeps (Ray's truncation error is tested in
``tests/unit/test_dask_panels_unit.py``).  The scheduler hears of ended calls a few times a second (the
workers' Task Stream batches): the checks poll, bounded, until the records are there.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import cloudpickle
import pytest

from conftest import dask_worker_pids, spin, wait_until
from yrdask.ray.util.placement_group import placement_group, remove_placement_group
from yrdask.ray.util import state
from yrdask.ray.util.state import (RayStateApiException, get_actor, list_actors, list_nodes,
                                   list_objects, list_placement_groups, list_workers,
                                   summarize_actors, summarize_objects)

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(120)

list_tasks = functools.partial(state.list_tasks, raise_on_missing_output=False)
summarize_tasks = functools.partial(state.summarize_tasks, raise_on_missing_output=False)


def _tasks(name: str, n: int) -> list:
    """The records of the calls named ``name`` that ended, once there are ``n`` of them."""
    ended = [("name", "=", name), ("state", "!=", "RUNNING"),
             ("state", "!=", "SUBMITTED_TO_WORKER")]
    return wait_until(lambda: (lambda got: got if len(got) >= n else None)(
        list_tasks(filters=ended, detail=True)), 20,
        lambda: f"{n} ended calls named {name}: {list_tasks(filters=[('name', '=', name)])}")


def test_lists_filters_and_summaries_of_known_work(ray_env):
    ray = ray_env

    @ray.remote
    def state_probe_square(x):
        return x * x

    @ray.remote
    def state_probe_fails():
        raise KeyError("on purpose")

    @ray.remote
    class StateProbeCounter:
        def __init__(self):
            self.n = 0

        def bump(self):
            self.n += 1
            return self.n

    assert ray.get([state_probe_square.remote(i) for i in range(3)]) == [0, 1, 4]
    with pytest.raises(KeyError):
        ray.get(state_probe_fails.remote())
    kept = StateProbeCounter.options(name="state-probe-kept").remote()
    gone = StateProbeCounter.remote()
    assert ray.get([kept.bump.remote(), kept.bump.remote(), gone.bump.remote()]) == [1, 2, 1]
    # ray.kill is a force kill: an actor's process sends its call records every 250 ms, so
    # the kill waits for them (the records of its last 250 ms die with it, docs/monitoring.md)
    _tasks("StateProbeCounter.bump", 3)
    ray.kill(gone)
    kept_id, gone_id = kept._actor_id.hex(), gone._actor_id.hex()
    workers = set(dask_worker_pids().values())
    pids = set(dask_worker_pids())

    # tasks: names match case-insensitively, as Ray's string filters do
    squares = _tasks("state_probe_square", 3)
    assert len(list_tasks(filters=[("name", "=", "STATE_PROBE_SQUARE")])) == 3
    assert {t.state for t in squares} == {"FINISHED"}
    assert {t.type for t in squares} == {"NORMAL_TASK"}
    assert {t.worker_id for t in squares} <= workers and {t.worker_pid for t in squares} <= pids
    assert all(t.start_time_ms <= t.end_time_ms for t in squares)
    assert len({t.task_id for t in squares}) == 3
    failed, = _tasks("state_probe_fails", 1)
    assert (failed.state, failed.error_type) == ("FAILED", "TASK_EXECUTION_EXCEPTION")
    assert [t.task_id for t in list_tasks(filters=[("state", "=", "failed"),
                                                   ("name", "=", "state_probe_fails")])] \
        == [failed.task_id]
    bumps = _tasks("StateProbeCounter.bump", 3)
    if len({t.worker_id for t in bumps}) == 1:  # both actors on one worker: a call's record
        # names its class, not which of them (docs/monitoring.md), so no actor id is given
        assert [t.actor_id for t in bumps] == [None, None, None]
    else:
        assert sorted(t.actor_id for t in bumps) == sorted([kept_id, kept_id, gone_id])
    assert {t.type for t in bumps} == {"ACTOR_TASK"}
    inits = _tasks("StateProbeCounter.__init__", 2)
    assert {(t.type, t.actor_id) for t in inits} == {("ACTOR_CREATION_TASK", kept_id),
                                                    ("ACTOR_CREATION_TASK", gone_id)}
    one = list_tasks(filters=[("name", "=", "state_probe_square")], limit=1)
    assert len(one) == 1 and one[0].start_time_ms is None  # detail columns only with detail
    assert one[0]["name"] == one[0].get("name") == "state_probe_square"  # Ray's dict access

    # actors: live and ended, by class and state; != keeps the others
    mine = [("class_name", "=", "StateProbeCounter")]
    wait_until(lambda: [a.actor_id for a in list_actors(filters=mine + [("state", "=", "DEAD")])]
               == [gone_id], 20, "the killed actor listed DEAD")
    alive, = list_actors(filters=mine + [("state", "=", "alive")])
    assert (alive.actor_id, alive.name, alive.state) == (kept_id, "state-probe-kept", "ALIVE")
    assert alive.ray_namespace == ray.get_runtime_context().namespace
    assert alive.pid in pids and alive.node_id in {n.node_id for n in list_nodes()}
    assert [a.actor_id for a in list_actors(filters=mine + [("state", "!=", "ALIVE")])] \
        == [gone_id]
    detail = get_actor(kept_id)
    assert (detail.num_restarts, detail.is_detached, detail.death_cause) == (0, False, None)
    dead = get_actor(gone_id)
    assert dead.state == "DEAD" and "actor_died_error_context" in dead.death_cause
    assert get_actor("i-no-such-actor") is None
    summary = summarize_actors()["cluster"]["summary"]["StateProbeCounter"]
    assert summary == {"class_name": "StateProbeCounter",
                       "state_counts": {"ALIVE": 1, "DEAD": 1}}

    # summary of tasks: counts per name and type
    tasks = summarize_tasks()["cluster"]
    assert tasks["summary"]["state_probe_square"] == {
        "func_or_class_name": "state_probe_square", "type": "NORMAL_TASK",
        "state_counts": {"FINISHED": 3}}
    assert tasks["summary"]["StateProbeCounter.bump"]["state_counts"] == {"FINISHED": 3}
    assert tasks["summary"]["StateProbeCounter.bump"]["type"] == "ACTOR_TASK"
    assert tasks["summary_by"] == "func_name" and tasks["total_actor_tasks"] >= 3

    # placement groups, objects, nodes, workers
    pg = placement_group([{"CPU": 0.1}], name="state-probe-pg")
    try:
        assert pg.wait(30)
        group, = list_placement_groups(filters=[("name", "=", "state-probe-pg")], detail=True)
        assert (group.placement_group_id, group.state) == (pg.id, "CREATED")
        assert group.creator_job_id == ray.get_runtime_context().get_job_id()
        assert group.bundles[0]["unit_resources"] == {"CPU": 0.1}
    finally:
        remove_placement_group(pg)
    big = ray.put(b"x" * 300_000)
    obj, = list_objects(filters=[("object_id", "=", big.hex())])
    assert (obj.task_status, obj.type, obj.pid, obj.reference_type) == (
        "FINISHED", "DRIVER", os.getpid(), "LOCAL_REFERENCE")
    assert obj.object_size > 300_000
    assert summarize_objects()["cluster"]["total_objects"] >= 1
    assert {w.worker_id for w in list_workers(filters=[("worker_type", "=", "WORKER")])} \
        == workers
    assert {w.pid for w in list_workers(filters=[("pid", "=", str(next(iter(pids))))])} \
        == {next(iter(pids))}  # a string value of an int column compares as an int
    node, = list_nodes()
    assert node.state == "ALIVE" and node.is_head_node and node.resources_total["CPU"] == 2


def test_bad_filters_get_rays_errors(ray_env):
    with pytest.raises(RayStateApiException, match="filter column nope is not supported"):
        list_actors(filters=[("nope", "=", "x")])
    with pytest.raises(ValueError, match="Unsupported filter predicate > is given"):
        list_tasks(filters=[("state", ">", "x")])
    with pytest.raises(ValueError, match="Provide \\(key, predicate, value\\) tuples"):
        list_actors(filters=[("state", "=")])
    with pytest.raises(RayStateApiException, match="exceeds the supported limit 10000"):
        list_actors(limit=10_001)
    with pytest.raises(RayStateApiException, match="Failed to convert a value abc"):
        list_actors(filters=[("pid", "=", "abc")])
    with pytest.warns(UserWarning, match="multiple '=' filters with the same key 'state'"):
        assert list_actors(filters=[("state", "=", "ALIVE"), ("state", "=", "DEAD")]) == []
    with pytest.raises(ValueError, match="is not the cluster this session is on"):
        list_nodes(address="tcp://127.0.0.1:1")
    own = ray_env.init(ignore_reinit_error=True).address_info["address"]
    assert list_nodes(address=own) == list_nodes()  # the session's own address is fine


def test_timeline_has_one_event_per_call(ray_env, tmp_path):
    ray = ray_env

    @ray.remote
    def state_probe_spin(ms):
        spin(ms)
        return ms

    assert ray.get([state_probe_spin.remote(ms) for ms in (30, 60)]) == [30, 60]
    _tasks("state_probe_spin", 2)
    started = time.time()
    events = [e for e in ray.timeline() if e["name"] == "state_probe_spin"]
    assert len(events) == 2
    workers = set(dask_worker_pids().values())
    for e in events:
        assert e["ph"] == "X" and e["cat"] == "task::state_probe_spin"
        assert e["tid"].split(" ")[0].removeprefix("worker:") in workers
        assert e["pid"] == list_nodes()[0].node_ip
        assert e["ts"] <= started * 1e6
    short, long = sorted(e["dur"] / 1000 for e in events)  # microseconds -> ms
    assert short >= 30 and long >= 60
    ids = {t.task_id for t in list_tasks(filters=[("name", "=", "state_probe_spin")])}
    assert {e["args"]["task_id"] for e in events} == ids
    path = tmp_path / "trace.json"
    assert ray.timeline(filename=str(path)) is None
    written = [e for e in json.loads(path.read_text()) if e["name"] == "state_probe_spin"]
    assert written == events


def test_a_running_task_is_listed_by_id_until_it_ends(ray_env, tmp_path):
    ray = ray_env
    go = tmp_path / "go"

    @ray.remote
    def state_probe_waits(path):
        deadline = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)
        return "done"

    ref = state_probe_waits.remote(str(go))
    mine = [("name", "=", "state_probe_waits")]
    running, = wait_until(lambda: list_tasks(filters=mine + [("state", "=", "RUNNING")]), 20,
                          "the waiting task listed RUNNING")
    assert running.task_id == ref.task_id
    assert running.job_id == ray.get_runtime_context().get_job_id()
    assert running.worker_pid in dask_worker_pids()
    counts = summarize_tasks()["cluster"]["summary"]["state_probe_waits"]["state_counts"]
    assert counts == {"RUNNING": 1}
    go.touch()
    assert ray.get(ref) == "done"
    ended, = _tasks("state_probe_waits", 1)
    assert (ended.task_id, ended.state) == (ref.task_id, "FINISHED")
    wait_until(lambda: [t.state for t in list_tasks(filters=mine)] == ["FINISHED"], 20,
               "the task listed FINISHED only, once it ended")


def test_a_method_calls_task_id_is_its_listed_id(ray_env):
    """Inside a method call (sync, ``async def``, in a concurrency group; in a process actor
    and in a light one),
    ``get_task_id()`` is the id ``list_tasks`` lists the call under, and its ref's
    ``task_id``, as on Ray."""
    ray = ray_env

    @ray.remote(concurrency_groups={"io": 2})
    class StateProbeIds:
        def sync_id(self):
            return ray.get_runtime_context().get_task_id()

        async def async_id(self):
            return ray.get_runtime_context().get_task_id()

        @ray.method(concurrency_group="io")
        async def group_id(self):  # run on the group's own event loop thread
            return ray.get_runtime_context().get_task_id()

    actors = [StateProbeIds.remote(), StateProbeIds.options(yrdask_light=True).remote()]
    for method in ("sync_id", "async_id", "group_id"):
        refs = [getattr(a, method).remote() for a in actors for _ in range(2)]
        ids = ray.get(refs)
        assert ids == [ref.task_id for ref in refs] and len(set(ids)) == 4, (method, ids)
        listed = {t.task_id for t in _tasks(f"StateProbeIds.{method}", 4)}
        assert listed == set(ids), (method, ids, listed)
