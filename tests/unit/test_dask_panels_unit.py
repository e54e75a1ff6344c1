"""The scheduler half of yr work in Dask's panels (scheduler/panels.py), on a real Dask
``Scheduler`` object that is built but never started (no I/O): records land in Dask's Task
Stream buffer in Dask's format, counts in Dask task prefixes, and done counts fade."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from distributed import Scheduler
from distributed.diagnostics.task_stream import TaskStreamPlugin, rectangles

from yrdask import protocol as P
from yrdask.scheduler.panels import FADE_S, DaskPanels


@pytest.fixture
def s():
    """A Dask Scheduler built but not started (its HTTP server, which Dask binds at once,
    on loopback and stopped afterwards)."""
    async def build() -> Scheduler:
        return Scheduler(dashboard=False, validate=True, host="127.0.0.1",
                         dashboard_address="127.0.0.1:0")
    sched = asyncio.run(build())
    yield sched
    sched.http_server.stop()


def test_records_counts_and_fading(s):
    panels = DaskPanels(s)
    w = "tcp://127.0.0.1:1"
    panels.add(w, [("train", "a1", 10.0, 10.5, 7, True), ("train", "a2", 10.5, 11.0, 7, False),
                   ("C.m", "b1", 11.0, 11.2, 8, True)], {"C.m": 1}, {"train": 3}, now=100.0)
    plugin = s.plugins[TaskStreamPlugin.name]
    assert plugin.index == 3
    first = plugin.buffer[0]
    assert first == {"key": "train-a1", "worker": w, "thread": 7, "status": "OK",
                     "startstops": [{"action": "compute", "start": 10.0, "stop": 10.5}]}
    assert [r["status"] for r in plugin.collect()] == ["OK", "error", "OK"]
    assert rectangles(plugin.collect())["name"] == ["train", "train", "C.m"]
    train, cm = s.task_prefixes["train"], s.task_prefixes["C.m"]
    assert (train.states["memory"], train.states["erred"], train.states["queued"]) == (1, 1, 3)
    assert (cm.states["memory"], cm.states["processing"]) == (1, 1)
    assert abs(train.all_durations["compute"] - 1.0) < 1e-6
    panels.add(w, [], {}, {}, now=101.0)  # nothing runs or waits any more
    assert (train.states["queued"], cm.states["processing"]) == (0, 0)
    lc = SimpleNamespace(instances={}, ended=[])
    panels.tick(lc, now=101.0 + FADE_S / 2)
    assert train.states["memory"] == 1  # still shown
    panels.tick(lc, now=101.0 + FADE_S * 2)
    assert (train.states["memory"], train.states["erred"], train.states["forgotten"]) == (0, 0, 2)


def test_instance_lifetimes_and_name_clash_and_worker_loss(s):
    from distributed.scheduler import TaskPrefix

    s.task_prefixes["Greeter"] = dask_own = TaskPrefix("Greeter")  # a Dask function's prefix
    panels = DaskPanels(s)
    rec = lambda state: SimpleNamespace(state=state, spec={"cls_name": "Greeter"})  # noqa: E731
    lc = SimpleNamespace(instances={"i1": rec(P.ALIVE), "i2": rec(P.PENDING)},
                         ended=[{"class": "Greeter", "ended_at": 99.0}])
    panels.tick(lc, now=100.0)
    ours = s.task_prefixes["Greeter (yr)"]
    assert (ours.states["processing"], ours.states["queued"], ours.states["memory"]) == (1, 1, 1)
    assert s.task_prefixes["Greeter"] is dask_own and dask_own.states["processing"] == 0
    panels.add("tcp://w:1", [], {"f": 2}, {}, now=100.0)
    assert s.task_prefixes["f"].states["processing"] == 2
    panels.worker_gone("tcp://w:1")
    assert s.task_prefixes["f"].states["processing"] == 0


def test_on_loop_from_the_loop_thread_queues_behind_earlier_calls():
    """A call made on the loop thread (a handle's ``__del__`` run there when Dask's profiler
    drops a sampled frame) does not overtake what other threads queued before it; with
    nothing queued it still runs at once."""
    import threading

    from yrdask.runtime.runtime import Runtime

    loop = asyncio.new_event_loop()
    rt = Runtime(loop, "job-test")
    done: list[str] = []
    started, queued, finished = threading.Event(), threading.Event(), threading.Event()

    def on_the_loop() -> None:
        rt.loop_thread = threading.get_ident()
        rt.on_loop(done.append, "at once")  # nothing queued: runs now
        assert done == ["at once"]
        started.set()
        queued.wait(10)  # another thread queues a call meanwhile
        rt.on_loop(done.append, "from the loop")  # like the decref in __del__
        loop.call_soon(finished.set)

    loop.call_soon(on_the_loop)
    thread = threading.Thread(target=loop.run_forever)
    thread.start()
    try:
        assert started.wait(10)
        rt.on_loop(done.append, "queued first")  # like the incref of the handle's thread
        queued.set()
        assert finished.wait(10)
        assert done == ["at once", "queued first", "from the loop"]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_state_view_of_tasks_from_a_wrapped_task_stream(s):
    """The scheduler's task records for Ray's state API (scheduler/state_view.py): what the
    Task Stream buffer still holds, how many fell out, instances behind method calls, and
    each worker's tasks now; Ray's truncation error once some fell out."""
    from collections import deque

    from yrdask.ray.util.state.api import check_complete
    from yrdask.ray.util.state.exception import RayStateApiException
    from yrdask.scheduler.state_view import state_records

    panels = DaskPanels(s)
    panels.task_stream().buffer = type(panels.task_stream().buffer)(deque(), 3)
    w = "tcp://127.0.0.1:1"
    panels.add(w, [("f", "t1", 1.0, 2.0, 7, True), ("f", "t2", 2.0, 3.0, 7, False),
                   ("C.__init__", "i_9", 3.0, 3.1, 8, True), ("C.m", "t3", 3.2, 3.3, 8, True),
                   ("g", "t4", 3.3, 3.4, 7, True)], {"g": 1}, {"g": 1}, now=100.0,
               tasks=[("g", "t5", True, "job-1"), ("g", "t6", False, "i-9")])
    alive = SimpleNamespace(instance_id="i-9", owner="job-1")
    life = SimpleNamespace(
        snapshot=lambda: [{"instance_id": "i-9", "class": "C", "worker": w}],
        ended_rows=lambda: [], job_of=lambda owner: "job-1" if owner in ("job-1", "i-9")
        else owner, instances={"i-9": alive})
    ledger = SimpleNamespace(workers={"127.0.0.1": SimpleNamespace(processes={w: None},
                                                                    host="127.0.0.1")})
    ext = SimpleNamespace(scheduler=s, panels=panels, jobs={}, ledger=ledger,
                          instances=SimpleNamespace(lifecycle=life))
    reply = state_records(ext, "tasks", 10)
    assert (reply["kept"], reply["total"]) == (3, 5)  # t1 and t2 fell out of the buffer
    assert [(r[1], r[7]) for r in reply["rows"]] == [("i_9", "i-9"), ("t3", "i-9"),
                                                    ("t4", "")]
    assert reply["now"] == [["g", "t5", True, "job-1", w], ["g", "t6", False, "job-1", w]]
    assert reply["processes"] == {w: {"node": "127.0.0.1", "host": "127.0.0.1", "pid": None}}
    assert [r[1] for r in state_records(ext, "tasks", 1)["rows"]] == ["t4"]
    with pytest.raises(RayStateApiException, match="Failed to retrieve all 5 tasks"):
        check_complete(reply)
    check_complete(dict(reply, total=3))
    with pytest.raises(RayStateApiException, match="only the newest 1 came back"):
        check_complete(state_records(ext, "tasks", 1))  # all kept, not all sent
    with pytest.raises(ValueError, match="unknown state record kind"):
        state_records(ext, "jobs", 10)
