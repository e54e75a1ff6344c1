"""``python -m benchmarks.owner_path_cpu``: CPU of the owner's own steps per task, no I/O.

The driver loop's part of a task burst that is not the socket: :class:`Submitter` and its
:class:`SubmitQueue` (the real ones), the runtime's ``TASK_DONE`` handling and
``RUN_TASK`` encoding, with a stand-in for the channel (it keeps the wire dicts) and
answers built the way a worker builds them.  20 000 tasks on ``LEASES`` pipelined leases
(one per worker process): each round submits them all, then answers them in reads of
``--per-read`` answers (as the driver's channel reader delivers them), refilling as the
runtime does.  Reports the best of 5 rounds in µs per task, with the collector off
(``--gc``: on).
Measures what the driver's loop spends per task beyond Dask's comm reads and writes
(docs/changelog/performance-history.md, "2026-11-27: The driver's loop per task").
"""

from __future__ import annotations

import gc
import json
import sys
import time

from yrdask import protocol as P
from yrdask.runtime import submit_queue as M
from yrdask.runtime.objects import Entry
from yrdask.config import PIPELINE_DEPTH, PIPELINE_REFILL
from yrdask.runtime.submitter import Submitter, Task
from yrdask.runtime.submitter_edge import RuntimeEdge
from yrdask.runtime.instance_router import InstanceRouter


class _Chan:
    """A call channel that keeps what is sent."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sent_functions: set[str] = set()
        self.out: list = []

    def send(self, msg: dict) -> None:
        self.out.append(msg)


class _Objects:
    entries: dict = {}

    def on_done_refs(self, refs: list) -> None:
        pass


class _Connector:
    """The scheduler stream's one-way messages, dropped."""

    def return_leases(self, lease_ids: list) -> None:
        pass

    def withdraw_lease_requests(self, request_ids: list) -> None:
        pass


class _Runtime:
    """The parts of a driver's runtime the owner path reads."""

    def __init__(self, workers: list[str]) -> None:
        self.channels = {w: _Chan(w) for w in workers}
        self.objects = _Objects()
        self.address = "tcp://driver"
        self.local_worker = None
        self.agent = None
        self.connector = _Connector()

    def channel(self, worker: str) -> _Chan:
        return self.channels[worker]


class _Edge(RuntimeEdge):
    """The runtime's edge, with lease requests kept to be granted by hand and no timers."""

    __slots__ = ("granted",)

    def __init__(self, rt: _Runtime, granted: list) -> None:
        super().__init__(rt)
        self.granted = granted

    def request_lease(self, ins, near, answer) -> None:
        self.granted.append((ins.request_id, answer))

    def call_at(self, at, fn) -> None:
        return None

    def call_soon(self, fn, arg) -> None:
        fn(arg)


def one_round(n_tasks: int, leases: int, per_read: int) -> float:
    from yrdask.runtime.runtime import Runtime

    workers = [f"tcp://w{i}" for i in range(leases)]
    rt = _Runtime(workers)
    granted: list = []
    edge = _Edge(rt, granted)
    sub = Submitter(edge, M.SubmitQueue(None, lease_idle_s=1.0, max_crash_retries=3,
                                        pipeline_depth=PIPELINE_DEPTH,
                                        pipeline_refill=PIPELINE_REFILL))
    rt.submitter = sub
    rt.router = object.__new__(InstanceRouter)
    rt.router.calls = {}
    on_message = Runtime.on_channel_message.__get__(rt)
    shape = {"CPU": 1000.0}
    key = (tuple(shape.items()), 30000, 1, ())
    tasks = [Task(f"t{i}", "fn", b"fn", "empty", b"args", (), [Entry()], [f"t{i}.0"], 1,
                  shape, key, 30000, 0, "job") for i in range(n_tasks)]
    perf = time.perf_counter
    t0 = perf()
    for task in tasks:
        sub.submit(task)
    n_leases = 0
    while granted and n_leases < leases:  # grant up to one lease per worker
        request_id, answer = granted.pop(0)
        answer(request_id, f"l{n_leases}", workers[n_leases])
        n_leases += 1
    took = perf() - t0
    result = [[P.VALUE, b"\x80\x04K\x00."]]
    done = 0
    while done < n_tasks:
        for chan in rt.channels.values():
            out, chan.out = chan.out, []
            for at in range(0, len(out), per_read):
                # the worker's answers (not timed)
                replies = [P.TaskDone.wire(m["task_id"], results=result, took=1e-5)
                           for m in out[at:at + per_read]]
                t0 = perf()
                for reply in replies:
                    on_message(reply)
                took += perf() - t0
                done += len(replies)
    assert not sub.tasks, f"{len(sub.tasks)} tasks not settled"
    return took


def main(n_tasks: int = 20000, leases: int = 16, per_read: int = 2, rounds: int = 5,
         collect: bool = False) -> dict:
    if not collect:
        gc.disable()
    try:
        best = min(one_round(n_tasks, leases, per_read) for _ in range(rounds))
    finally:
        gc.enable()
    return {"tasks": n_tasks, "leases": leases, "per_read": per_read, "gc": collect,
            "us_per_task": round(best * 1e6 / n_tasks, 2)}


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:] if not a.startswith("--")]
    per_read = 2
    for a in sys.argv[1:]:
        if a.startswith("--per-read="):
            per_read = int(a.split("=", 1)[1])
    print(json.dumps(main(*(args[:1] or [20000]), *(args[1:2] or [16]), per_read=per_read,
                          collect="--gc" in sys.argv)))
