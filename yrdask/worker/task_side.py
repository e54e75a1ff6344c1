"""The worker agent's task side: what it decides about pushed tasks, apart from its I/O.

The :class:`~yrdask.worker.lease_gate.LeaseGate` decides which pushed task of a lease runs,
waits or goes back; this class decides what the agent does around it: a task pushed twice is
ignored (the first answers), a task the gate starts runs only if it is still here, a bounced
one is answered ``requeue`` and forgotten, a task that ended is forgotten before it answers
(its retry may come back at once), a cancel of an unknown task is dropped (it ended or went
back), any cancel interrupts the task, and a forced one of a task still running after a grace
ends the process.
It does no I/O itself: a small :class:`TaskSideEdge` runs tasks, answers callers and arms
timers.  It also lends: a thread of a lease or instance that waits in ``yr.get`` frees the
lease's gate slot at once and its CPU at the scheduler if the wait lasts
(``worker/lending.py``'s :class:`~yrdask.worker.lending.LendNotices`).
The agent (``worker/agent.py``) plugs in its executor, peers and loop; the
simulation (``tests/sim/world.py``) its virtual clock, links and simulated tasks, so it
drives this very code (as ``runtime/submitter.py`` and ``scheduler/lease_service.py``).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Protocol

from yrdask import protocol as P
from yrdask.worker import lease_gate as G
from yrdask.worker import lending as L

#: cancel(force=True): how long a running task has to stop at the interrupt before its
#: worker process is ended (a task blocked in C never sees the interrupt)
FORCE_CANCEL_GRACE_S = 0.5


class TaskSideEdge(Protocol):
    """What :class:`TaskSide` needs of the world around it."""

    def now(self) -> float:
        """The clock of the gate's times (the loop's)."""

    def start(self, ex: Any) -> None:
        """Run task ``ex`` (on a task thread); it ends with :meth:`TaskSide.finished`."""

    def reply(self, ex: Any, msg: dict) -> None:
        """Answer ``ex``'s caller with ``msg`` (a ``TASK_DONE``)."""

    def call_at(self, at: float, fn: Callable[[], None]) -> None:
        """Call ``fn`` on the loop at (or after) ``at`` (from any thread)."""

    def exit_process(self, ex: Any) -> None:
        """``cancel(force=True)`` of running task ``ex``: end this worker process."""

    def notify(self, holding_id: str, blocked: bool) -> None:
        """Send ``LeaseBlocked`` (``blocked``) or ``LeaseUnblocked`` to the scheduler, after
        every notice asked for before (called under :attr:`TaskSide.lock`)."""


class TaskSide:
    """The tasks pushed to one worker (see module docstring).  ``record(task_id, peer,
    msg)`` makes a task's record (``worker/execution.py``'s ``Execution``): it has
    ``task_id`` and ``cancel()``."""

    def __init__(self, edge: TaskSideEdge, record: Callable[[str, Any, dict], Any],
                 gate: G.LeaseGate | None = None,
                 notices: L.LendNotices | None = None) -> None:
        self.edge = edge
        self.record = record
        self.gate = gate if gate is not None else G.LeaseGate()
        self.notices = notices if notices is not None else L.LendNotices()
        self.lock = threading.Lock()  # task threads end tasks and lend slots
        self.tasks: dict[str, Any] = {}  # pushed here and not ended (or bounced) yet
        self.running: dict[str, Any] = {}  # those whose function runs now (the edge's)

    def run_task(self, peer: Any, msg: dict) -> bool:
        """A task pushed on a lease (loop thread): the gate starts it, holds it or bounces
        it.  False if it is here already (pushed twice: the first one answers)."""
        task_id = msg["task_id"]
        tasks = self.tasks
        if task_id in tasks:
            return False
        ex = tasks[task_id] = self.record(task_id, peer, msg)
        edge = self.edge
        now = edge.now()
        with self.lock:  # feed(TaskArrived(...)), with no event object (the hot path)
            instructions = self.gate.arrived("run", task_id, msg["lease_id"],
                                             msg.get("slots", 1), now)
        if instructions:
            if len(instructions) == 1 and type(instructions[0]) is G.StartTask:
                edge.start(ex)  # _carry's one StartTask of this very task, inline
            else:
                self._carry(instructions)
        return True

    def finished(self, ex: Any) -> None:
        """Task ``ex`` ended (its thread): forgotten before any answer that may be retried
        (an error, a cancel), since a retry of it (same id, same lease) may come back at once
        and must find the slot free; a plain answer may have gone already (never retried)."""
        task_id = ex.task_id
        self.running.pop(task_id, None)
        tasks = self.tasks
        if tasks.get(task_id) is ex:
            del tasks[task_id]
        with self.lock:  # feed(TaskEnded(...)), with no event object (the hot path)
            instructions = self.gate.ended("end", task_id)
        if instructions:
            self._carry(instructions)

    def next_waits(self, task_id: str) -> bool:
        """Whether a task of ``task_id``'s lease waits in the gate (its end would admit it).

        A peek without the lock (task thread, on ending ``task_id``): a task that arrives
        just after it answers False is admitted by :meth:`finished` all the same."""
        return self.gate.waits_after(task_id)

    def cancel(self, task_id: str, force: bool = False) -> list | None:
        """``CANCEL_TASK`` (loop thread): a task not started yet never runs; a running one is
        interrupted (``force``: its process ends).  Unknown ids (ended, bounced) are dropped:
        a cancel always follows its task's ``RUN_TASK`` on the same channel.  Returns the
        ids of the tasks it submitted (for a recursive cancel), if any."""
        ex = self.tasks.get(task_id)
        if ex is None:
            return None
        ex.cancel()
        if force and self.running.get(task_id) is ex:
            # the task may be blocked in C, where the interrupt never reaches it; this
            # process also hosts other tasks and actors (a Ray worker runs only the one
            # task), so the interrupt gets a moment first and only then the process ends
            self.edge.call_at(self.edge.now() + FORCE_CANCEL_GRACE_S,
                              lambda: self._force_end(ex))
        return ex.children

    def _force_end(self, ex: Any) -> None:
        """The grace of a forced cancel ran out: still running, ``ex`` ends its process."""
        if self.running.get(ex.task_id) is ex:
            self.edge.exit_process(ex)

    def load(self) -> int:
        """Tasks pushed here and not ended (running, blocked in ``yr.get`` or waiting)."""
        return len(self.tasks)

    def lend(self, holding_id: str, blocked: bool) -> None:
        """A thread of ``holding_id`` (a lease or an instance) waits in ``yr.get``
        (``blocked``) or runs again (any thread): the gate may start the lease's next task
        now, and the scheduler hears of the wait if it lasts (``worker/lending.py``)."""
        now = self.edge.now() if blocked else 0.0
        with self.lock:  # SlotLent and Blocked, with no event objects (the hot path)
            instructions = self.gate.lent("lend", holding_id, blocked)
            notices = self.notices.blocked("lend", holding_id, blocked, now)
            if notices:  # under the lock: the scheduler hears them in the order decided
                self._notify(notices)
        if instructions:
            self._carry(instructions)

    def asking(self, asking: bool) -> None:
        """This worker's submitter sends a lease request (``asking``) or has its answer:
        while it waits, blocks are told at once (what it asks for may need their CPU)."""
        with self.lock:
            notices = self.notices.handle(L.Asking("asking", asking))
            if notices:
                self._notify(notices)

    def lend_tick(self) -> None:
        """The notices' timer fired: tell the scheduler of the blocks that lasted."""
        with self.lock:
            notices = self.notices.handle(L.Tick("lend-tick", self.edge.now()))
            if notices:
                self._notify(notices)

    def _notify(self, notices: list) -> None:
        for ins in notices:
            if type(ins) is L.Notify:
                self.edge.notify(ins.holding_id, ins.blocked)
            elif type(ins) is L.WakeAt:
                self.edge.call_at(ins.at, self.lend_tick)
            else:  # pragma: no cover - a new instruction nobody taught the adapter
                raise AssertionError(f"unknown lending instruction {ins!r}")

    def feed(self, event: G.Event) -> None:
        """Feed the lease gate (any thread) and carry out what it says."""
        with self.lock:
            instructions = self.gate.handle(event)
        self._carry(instructions)

    def _carry(self, instructions: list) -> None:
        for ins in instructions:
            kind = type(ins)
            if kind is G.StartTask:
                ex = self.tasks.get(ins.task_id)
                if ex is not None:
                    self.edge.start(ex)
                continue
            elif kind is G.BounceTask:  # waited too long behind its lease's running tasks
                ex = self.tasks.pop(ins.task_id, None)
                if ex is not None:
                    self.edge.reply(ex, P.TaskDone(ins.task_id, requeue=True).to_msg())
            elif kind is G.WakeAt:
                self.edge.call_at(ins.at, self.tick)
            else:  # pragma: no cover - a new instruction nobody taught the adapter
                raise AssertionError(f"unknown lease gate instruction {ins!r}")

    def tick(self) -> None:
        self.feed(G.Tick("tick", self.edge.now()))
