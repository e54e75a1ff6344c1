"""``python benchmarks/task_path_cpu.py``: CPU of a worker's own steps per pushed task.

A :class:`~yrdask.worker.agent.WorkerAgent` without a Dask worker, loop or threads: its
task side, lease gate, ``Execution`` records and Dask-panels recorder are the real ones, the
executor runs each task at once in this thread and the caller's peer keeps the replies.  It
pushes 20 000 trivial tasks (``RUN_TASK`` wire dicts, one lease) through ``run_task`` and
reports the best of 7 rounds in µs per task, with the collector off (``--gc``: on), and one
``yr.get`` inside a task's lending steps (``lend_slot`` blocked, then unblocked).  What it
leaves out (the loop hop, the thread hand-off, the socket) is the same in every tree; what it
measures is what a tree adds per task on the worker (docs/changelog/performance-history.md,
"2026-11-26: Latency: the worker's steps per task").
"""

from __future__ import annotations

import gc
import sys
import time
import timeit

from yrdask import protocol as P
from yrdask.serialization import pack_plain_args
from yrdask.worker.agent import WorkerAgent, _AgentEdge, _Ending
from yrdask.worker.dask_panels import Recorder
from yrdask.worker.execution import Execution
from yrdask.worker.lending import LendNotices
from yrdask.worker.task_side import TaskSide


class _Bag:
    pass


def agent() -> WorkerAgent:
    """The agent's task path with stand-ins for its Dask worker, loop and threads."""
    a = object.__new__(WorkerAgent)
    a.loop = _Bag()
    a.loop.time = time.monotonic
    a.worker = _Bag()
    a.worker.address, a.worker.active_threads = "tcp://worker", {}
    a.functions, a.fn_payloads, a.instances = {"fn": lambda i: i}, {}, {}
    a.share = _Bag()
    a.share.dask = 0
    a.executor = _Bag()
    a.executor.submit = lambda fn, ex: fn(ex)
    a._ending, a._held = _Ending(), []  # the hand-over slot; no answer is ever held here
    a.task_side = TaskSide(_AgentEdge(a), Execution, notices=LendNotices())
    a.tasks, a.running, a.gate = a.task_side.tasks, a.task_side.running, a.task_side.gate
    a.gate_lock = a.task_side.lock
    a.runtime = _Bag()
    a.runtime.objects = None
    a.inline_limit, a.tasks_done, a.pool = 512 * 1024, 0, None
    a.recorder = Recorder(a, True)
    return a


def task_path(n: int = 20_000, rounds: int = 7) -> float:
    a = agent()
    peer = _Bag()
    peer.caller, replies = "tcp://driver", []
    peer.reply = replies.append
    args = pack_plain_args((1,), {})
    best = float("inf")
    for r in range(rounds):
        msgs = [P.RunTask.wire(f"t{r}-{i}", "lease-1", "fn", None, args, [], 1, "job", "fn")
                for i in range(n)]
        replies.clear()
        a.recorder.records.clear()
        t0 = time.process_time()
        for msg in msgs:
            a.run_task(peer, msg)
        best = min(best, (time.process_time() - t0) / n * 1e6)
    assert len(replies) == n and "results" in replies[-1], replies[-1]
    return best


class _NoTimerEdge(_AgentEdge):
    """The agent's edge without the lending notices' timer (nothing runs a loop here)."""

    __slots__ = ()

    def call_at(self, at: float, fn) -> None:
        return None


def lend_cycle(n: int = 100_000) -> float:
    a = agent()
    a.task_side.edge.__class__ = _NoTimerEdge  # this edge only: _AgentEdge stays as it is
    with a.task_side.lock:
        a.gate.arrived("run", "t", "lease-1", 1, 0.0)
    Execution("t", None, {}).arm("lease-1", "job")

    def cycle() -> None:
        a.lend_slot("lease-1", True)
        a.lend_slot("lease-1", False)

    return min(timeit.repeat(cycle, number=n, repeat=5)) / n * 1e6


if __name__ == "__main__":
    if "--gc" not in sys.argv:
        gc.disable()
    print(f"task path {task_path():.2f} us per task; yr.get lending {lend_cycle():.2f} us "
          f"per block and unblock ({'collector on' if gc.isenabled() else 'collector off'})")
