"""One pushed task on a worker, from its arrival to its end: what cancelling it may do.

``yr.cancel`` of a running task raises :class:`~yrdask.errors.CancelledError` in the thread
that runs it (``PyThreadState_SetAsyncExc``).  That is only safe if the exception cannot
land anywhere else, so each task has an :class:`Execution` record with a lock:

* the task thread *arms* the record (under the lock) right before the user function and
  *disarms* it right after; a cancel raises the exception only while the record is armed,
  at most once (``shot``);
* disarming clears an exception still pending for the thread (``SetAsyncExc(ident, NULL)``),
  so it can never hit the next task that thread runs; one delivered between the user code
  and the disarm is caught by the agent, and the task reports a cancel;
* a task cancelled before it is armed is never armed (``arm`` returns False): it never runs.

The record lives in the agent's table from ``RUN_TASK`` until the task ends or is bounced,
so a cancel for a task that is not there (ended, bounced) is simply dropped.

While the user code calls back into yr's own bookkeeping that must not be torn halfway (the
lease gate, when the task blocks in ``yr.get`` and lends its slot), the record is *shielded*:
no exception is raised meanwhile, one already raised is withdrawn, and the cancel is raised
synchronously when the shield is lifted.

A thread blocked in C never sees the asynchronous exception.  So a task's thread that
blocks in ``yr.get``/``yr.wait`` waits shielded, in slices (the runtime's ``wait_hook``,
:func:`_cancellable_wait`): a cancel ends that wait at once, and a forced cancel of a task
waiting on a value never has to end the worker process.
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any

from yrdask.errors import CancelledError
from yrdask.runtime import context as _rtctx

_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
_current = threading.local()  # .ex: the Execution armed in this thread, if any


def current_execution() -> "Execution | None":
    """The task record whose user code this thread runs now, if any."""
    return getattr(_current, "ex", None)


def _current_cancelled() -> bool:
    ex = getattr(_current, "ex", None)
    return ex is not None and ex.cancelled


_rtctx.cancel_probe = _current_cancelled  # ray's RuntimeContext.is_canceled() asks it

#: a task's thread blocked in ``yr.get``/``yr.wait`` looks at its cancel this often
WAIT_CHECK_S = 0.1


def _cancellable_wait(wait: Any, timeout: float | None) -> bool:
    """A task's thread blocks in ``yr.get``/``yr.wait``: ``wait(timeout)`` shielded (the
    exception a cancel raises in a thread lands only when it runs Python again, maybe inside
    ``threading``'s own code, and never while it is blocked in C), in slices of
    :data:`WAIT_CHECK_S`; a cancel meanwhile ends the wait with ``CancelledError``, raised
    here, so a task blocked on a value stops at once (and a forced cancel leaves its worker
    process alone).  Other threads just wait."""
    ex = getattr(_current, "ex", None)
    if ex is None or not ex.armed:
        return wait(timeout)
    ex.shield()
    try:
        end = None if timeout is None else time.monotonic() + timeout
        while not ex.cancelled:
            step = WAIT_CHECK_S if end is None else min(WAIT_CHECK_S,
                                                        max(0.0, end - time.monotonic()))
            if wait(step):
                return True
            if end is not None and time.monotonic() >= end:
                return False
        return False
    finally:
        ex.unshield()  # raises the CancelledError of a cancel that came meanwhile


_rtctx.wait_hook = _cancellable_wait


#: Set by ``worker/hosting.py``: notes a child of the method call this thread runs.
call_child_note: Any = None


def _note_child(task_id: str) -> None:
    """The task (or method call) this thread runs submitted ``task_id`` (a recursive cancel
    cancels it)."""
    ex = getattr(_current, "ex", None)
    if ex is not None:
        if ex.children is None:
            ex.children = [task_id]
        else:
            ex.children.append(task_id)
    elif call_child_note is not None:
        call_child_note(task_id)


_rtctx.child_note = _note_child  # the runtime's submit_task tells it


class Execution:
    """The cancel state of one task on this worker (see module docstring)."""

    __slots__ = ("task_id", "peer", "msg", "lock", "cancelled", "armed", "shot", "ident",
                 "shielded", "saved", "children")

    def __init__(self, task_id: str, peer: Any, msg: dict) -> None:
        self.task_id = task_id
        self.peer = peer
        self.msg = msg
        self.lock = threading.Lock()
        self.cancelled = False
        self.armed = False
        self.shot = False  # the async exception was raised (once at most)
        self.ident = 0
        self.shielded = False
        self.saved: tuple | None = None  # the thread's task context before arm, if it set one
        self.children: list | None = None  # ids of the tasks its user code submitted

    def cancel(self) -> bool:
        """Mark cancelled; interrupt the user code if it runs now.  True if interrupted."""
        with self.lock:
            self.cancelled = True
            if not self.armed or self.shot:
                return False
            self.shot = True
            _set_async_exc(ctypes.c_ulong(self.ident), ctypes.py_object(CancelledError))
            return True

    def arm(self, lease_id: str | None = None, owner: str | None = None) -> bool:
        """The calling thread is about to run the user code; False if it must not (cancelled).

        With a ``lease_id``, the thread also runs in the task's context (its lease and
        lifetime ``owner``, as :class:`yrdask.runtime.context.task_context` sets) until
        :meth:`disarm`: one step less on the hot path than a separate ``with``.
        """
        with self.lock:
            if self.cancelled:
                return False
            self.ident = threading.get_ident()
            self.armed = True
            _current.ex = self
            if lease_id is not None:
                ctx = _rtctx._ctx
                self.saved = (getattr(ctx, "lease_id", None), getattr(ctx, "owner", None))
                ctx.lease_id, ctx.owner = lease_id, owner
            return True

    def disarm(self) -> None:
        """The user code is over: no cancel may reach this thread any more, and the thread
        leaves the task's context.

        May itself raise the pending ``CancelledError`` (delivered on entering the call):
        callers loop ``try: disarm() except CancelledError: retry`` in their own frame.
        Idempotent.
        """
        with self.lock:
            self.shielded = False
            _current.ex = None
            if self.saved is not None:
                _rtctx._ctx.lease_id, _rtctx._ctx.owner = self.saved
                self.saved = None
            if self.armed:
                self.armed = False
                if self.shot:  # raised but maybe not delivered yet: drop it
                    _set_async_exc(ctypes.c_ulong(self.ident), None)

    def shield(self) -> None:
        """yr bookkeeping runs in the task's thread now: no cancel may land inside it."""
        with self.lock:
            if self.armed:
                self.armed = False
                self.shielded = True
                if self.shot:  # withdrawn now, raised again by unshield
                    _set_async_exc(ctypes.c_ulong(self.ident), None)

    def unshield(self) -> None:
        """Back to user code: cancels may interrupt again; one that came meanwhile is raised."""
        with self.lock:
            if not self.shielded:
                return
            self.shielded = False
            self.armed = True
            cancelled = self.cancelled
            self.shot = self.shot or cancelled
        if cancelled:
            raise CancelledError(f"task {self.task_id} cancelled")

