"""One share of each worker: yr tasks and Dask tasks together run no more than its threads.

yr's ledger counts the worker's CPU for yr leases, Dask's worker counts its threads for Dask
tasks; each believes it owns the worker.  :class:`WorkerShare` is the one count both obey
(docs/scheduling.md, "One share of each worker"):

* a Dask task takes a share (one thread) before its function runs, in Dask's own executor
  thread, and gives it back when it ends, when it secedes (``distributed.secede``,
  ``worker_client``) and while it waits in ``yr.get`` / ``yr.wait``;
* a yr task holds a share from the moment the lease gate starts it until it ends, except
  while it waits in ``yr.get`` (the gate's lent slot).  yr's count is the lease gate's own
  (running tasks not blocked), read only when a Dask task is running or waiting, so while
  none is, a yr task pays one attribute read (``share.dask``) and yr work runs exactly as
  before: yr never waits for yr here, its ledger does that.
* an instance's method call (and its ``__init__``) holds a share while it runs in a sync
  instance's thread, except while it waits in ``yr.get``.  yr's ledger counts an instance's
  CPU for its whole life, busy or idle; here a call counts while it runs.  Calls mark their
  thread in :attr:`WorkerShare.calls` (a dict write and delete, atomic under the GIL) and
  look at the lock only while Dask tasks run or wait.  Async instances' calls take none:
  their loop thread interleaves many, mostly waiting;
* Waiters of both kinds are admitted first come, first served, so neither starves the other.

Capacity is the CPU the worker offers to yr in threads (``nthreads``, or
``yrdask.worker.cpu`` / 1000).  Every yr task counts one thread, whatever its lease's CPU.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from concurrent.futures import Executor, Future
from typing import Any, Callable

RECHECK_S = 0.5  # a waiter looks again at least this often (a missed notice costs no hang)


class WorkerShare:
    """The worker's threads, shared by its yr and Dask tasks (see module docstring)."""

    def __init__(self, capacity: int, yr_running: Callable[[], int]) -> None:
        self.capacity = max(1, capacity)
        self.wired = False  # Dask's executor takes its threads from here (agent, config)
        self.yr_running = yr_running  # yr tasks started and not blocked in yr.get (the gate's)
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.dask = 0  # Dask tasks holding or waiting for a share: yr's hot path reads this
        self.held: set[int] = set()  # threads of Dask tasks holding a share
        self.lent: set[int] = set()  # threads of Dask tasks that gave theirs up in yr.get
        self.yr_waiting = 0  # yr tasks counted by the gate that wait here (use no thread)
        self.calls: dict[int, bool] = {}  # threads running an instance's method call now
        self.calls_lent: set[int] = set()  # of those, the ones waiting in yr.get
        self.queue: deque[int] = deque()  # tickets of waiters, both kinds, oldest first
        self._tickets = itertools.count()

    def busy(self) -> int:
        """Threads in use now: Dask tasks holding a share and yr tasks running (lock held)."""
        return len(self.held) + self.yr_running() - self.yr_waiting + len(self.calls)

    def _wait_turn(self, room: Callable[[], bool]) -> None:
        ticket = next(self._tickets)
        self.queue.append(ticket)
        try:
            while self.queue[0] != ticket or not room():
                self.changed.wait(RECHECK_S)
        finally:
            self.queue.remove(ticket)
            self.changed.notify_all()  # the next in line may fit as well

    # -- yr tasks (their threads; the gate already counts them) ----------------------------

    def yr_start(self) -> None:
        """A yr task the gate started (or that returns from ``yr.get``) is about to run:
        wait while Dask tasks use its thread.  Callers check ``self.dask`` first."""
        with self.lock:
            if not self.dask:
                return
            if not self.queue and self.busy() <= self.capacity:  # it counts itself
                return
            self.yr_waiting += 1
            try:
                self._wait_turn(lambda: self.busy() + 1 <= self.capacity)
            finally:
                self.yr_waiting -= 1

    def yr_freed(self) -> None:
        """A yr task ended or blocked in ``yr.get`` (the gate counted it out): wake waiters."""
        with self.lock:
            self.changed.notify_all()

    # -- instance method calls (their instance's thread) ----------------------------------

    def call_start(self) -> None:
        """A method call starts in this thread: it counts from now, and waits (uncounted)
        while Dask tasks use the worker's threads."""
        ident = threading.get_ident()
        self.calls[ident] = True  # before reading ``dask``: a Dask task taking a share sees it
        if not self.dask:
            return
        with self.lock:
            if not self.queue and self.busy() <= self.capacity:  # it counts itself
                return
            del self.calls[ident]
            self.changed.notify_all()  # a Dask task waiting may fit without it
            try:
                self._wait_turn(lambda: self.busy() + 1 <= self.capacity)
            finally:
                self.calls[ident] = True

    def call_end(self) -> None:
        """The method call of this thread ended: its share is free."""
        self.calls.pop(threading.get_ident(), None)
        if self.dask:
            with self.lock:
                self.changed.notify_all()

    def call_lend(self, blocked: bool) -> None:
        """The method call of this thread waits in ``yr.get`` (``blocked``) or runs again."""
        ident = threading.get_ident()
        if blocked:
            if self.calls.pop(ident, None) is None:
                return
            self.calls_lent.add(ident)
            if self.dask:
                with self.lock:
                    self.changed.notify_all()
        elif ident in self.calls_lent:
            self.calls_lent.discard(ident)
            self.call_start()

    # -- Dask tasks (their executor threads) -----------------------------------------------

    def dask_take(self) -> None:
        """Take a share for the Dask task of this thread; waits for one."""
        ident = threading.get_ident()
        with self.lock:
            self.dask += 1
            try:
                self._wait_turn(lambda: self.busy() + 1 <= self.capacity)
            except BaseException:
                self.dask -= 1
                raise
            self.held.add(ident)

    def dask_give(self, ident: int | None = None) -> None:
        """The Dask task of thread ``ident`` (this one) ended or seceded: free its share."""
        ident = threading.get_ident() if ident is None else ident
        with self.lock:
            self.lent.discard(ident)
            if ident in self.held:
                self.held.discard(ident)
                self.dask -= 1
                self.changed.notify_all()

    def dask_lend(self, blocked: bool) -> None:
        """The Dask task of this thread waits in ``yr.get`` (``blocked``) or runs again."""
        ident = threading.get_ident()
        if blocked:
            with self.lock:
                if ident not in self.held:
                    return
                self.held.discard(ident)
                self.lent.add(ident)
                self.dask -= 1
                self.changed.notify_all()
        else:
            with self.lock:
                if ident not in self.lent:
                    return
                self.lent.discard(ident)
            self.dask_take()


class SharedThreadPoolExecutor(Executor):
    """Dask's ``default`` executor, each task run under a share of :class:`WorkerShare`.

    Its class name holds ``ThreadPoolExecutor``: Dask's worker runs tasks of such executors
    with their context variables (``Worker.execute``).
    """

    def __init__(self, inner: Any, share: WorkerShare) -> None:
        self.inner = inner
        self.share = share

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> Future:
        return self.inner.submit(self._run, fn, args, kwargs)

    def _run(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        share = self.share
        share.dask_take()
        try:
            return fn(*args, **kwargs)
        finally:
            share.dask_give()

    def shutdown(self, wait: bool = True, **kwargs: Any) -> None:
        self.inner.shutdown(wait=wait, **kwargs)

    def __getattr__(self, name: str) -> Any:  # _max_workers, _work_queue, ... of Dask's pool
        return getattr(self.inner, name)
