"""Prints of yr tasks and methods, sent to their driver (``Config(log_to_driver=True)``).

One proxy per stream replaces ``sys.stdout`` and ``sys.stderr`` of a worker process, once.
A write asks which yr work the calling thread runs (:func:`current_execution` for a task, the
thread's instance for a method) and where that work's prints go (``log_to``: the driver's
owner address, carried by :class:`~yrdask.protocol.RunTask` and the instance spec, and
inherited by the work it submits).  Writes of such work are buffered and sent in batches, one
:class:`~yrdask.protocol.TaskOutput` per driver every :data:`FLUSH_INTERVAL_S` at most; every
other write (Dask's own, work of a job without ``log_to_driver``) goes to the real stream at
once.  A task that does not print pays nothing but one more ``None`` field in its push.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
from typing import Any, Iterator, TextIO

from yrdask import protocol as P
from yrdask.runtime import context
from yrdask.worker.execution import current_execution

logger = logging.getLogger("yrdask.output")

FLUSH_INTERVAL_S = 0.05  # a batch leaves this long after its first line
MAX_BUFFERED = 4 * 2**20  # characters kept per flush; beyond, lines are dropped and counted


class _Outbox:
    """The lines waiting to go to each driver, and the timer that sends them."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.loop: asyncio.AbstractEventLoop = agent.loop
        # The node (host) prints are prefixed with, as yr.get_node_id() names it there.
        self.node = getattr(agent, "node_id", None) or agent.worker.address
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.pending: dict[str, list[list[str]]] = {}  # driver -> [[source, stream, text]]
        self.size = 0
        self.dropped = 0
        self.armed = False
        self.send_lock: asyncio.Lock | None = None  # batches to a driver leave in order

    def add(self, driver: str, source: str, stream: str, text: str) -> None:
        with self.lock:
            if self.size + len(text) > MAX_BUFFERED:
                self.dropped += text.count("\n") or 1
                return
            self.size += len(text)
            records = self.pending.setdefault(driver, [])
            if records and records[-1][0] == source and records[-1][1] == stream:
                records[-1][2] += text
            else:
                records.append([source, stream, text])
            if self.armed:
                return
            self.armed = True
        try:
            self.loop.call_soon_threadsafe(self.loop.call_later, FLUSH_INTERVAL_S, self.flush)
        except RuntimeError:  # the worker's loop is closed: nobody will send it
            pass

    def flush(self) -> "asyncio.Task | None":
        """Send what is buffered (worker loop); returns the sending task, if any."""
        with self.lock:
            pending, self.pending = self.pending, {}
            dropped, self.dropped = self.dropped, 0
            self.size = 0
            self.armed = False
        if dropped:
            for records in pending.values():
                records.append([f"yrdask pid={self.pid}, node={self.node}", "stderr",
                                f"[{dropped} lines of output dropped: more than "
                                f"{MAX_BUFFERED} characters in {FLUSH_INTERVAL_S} s]\n"])
        if pending:
            return self.loop.create_task(self._send(pending))
        return None

    async def _send(self, pending: dict[str, list]) -> None:
        if self.send_lock is None:
            self.send_lock = asyncio.Lock()
        async with self.send_lock:
            for driver, records in pending.items():
                try:
                    await P.request(self.agent.worker.rpc(driver), P.TaskOutput(records))
                except Exception as e:  # the driver has gone: its job's prints have no reader
                    logger.debug("cannot send task output to %s: %r", driver, e)


class _Proxy:
    """``sys.stdout``/``sys.stderr`` of a worker: yr work's lines to its driver, others through."""

    def __init__(self, real: TextIO, stream: str) -> None:
        self._real = real
        self._stream = stream

    def write(self, text: str) -> int:
        target = _target()
        if target is None or not text:
            return self._real.write(text)
        outbox, driver, source = target
        outbox.add(driver, source, self._stream, text)
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._real.flush()

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, buffer, ...
        return getattr(self._real, name)


_outbox: _Outbox | None = None
_install_lock = threading.Lock()


_task_prints = threading.local()  # .target: (driver, name) of a task run outside an Execution


@contextlib.contextmanager
def task_prints_to(driver: str | None, name: str) -> Iterator[None]:
    """Prints of the calling thread go to ``driver`` as task ``name``'s while this holds (a
    task run by an isolated process, which has no :class:`Execution`)."""
    prev = getattr(_task_prints, "target", None)
    _task_prints.target = None if driver is None else (driver, name)
    try:
        yield
    finally:
        _task_prints.target = prev


def _target() -> tuple[_Outbox, str, str] | None:
    """``(outbox, driver, source)`` when the calling thread runs yr work whose prints go to a
    driver, else None."""
    outbox = _outbox
    if outbox is None:
        return None
    direct = getattr(_task_prints, "target", None)
    if direct is not None:
        return outbox, direct[0], f"{direct[1]} pid={outbox.pid}, node={outbox.node}"
    ex = current_execution()
    if ex is not None:  # a task's user code runs in this thread
        driver = ex.msg.get("log_to")
        if driver is None:
            return None
        return outbox, driver, f"{ex.msg['name']} pid={outbox.pid}, node={outbox.node}"
    lease = context.current_lease()
    if lease is None:
        return None
    inst = outbox.agent.instances.get(lease)  # a method (or __init__) of a hosted instance
    spec = getattr(inst, "spec", None)
    driver = spec.get("log_to") if spec is not None else None
    if driver is None:
        return None
    name = spec.get("cls_name", "instance")
    return outbox, driver, f"{name} pid={outbox.pid}, node={outbox.node}"


def current_target() -> str | None:
    """Where prints of work submitted by this thread go: those of the work it runs.

    Asked on every submission from a worker: :func:`_target`'s rules without building the
    source label (a task's own ``log_to`` answers at once).
    """
    if _outbox is None:
        return None
    if getattr(_task_prints, "target", None) is None:
        ex = current_execution()
        if ex is not None:  # a task's user code runs in this thread
            return ex.msg.get("log_to")
    target = _target()
    return None if target is None else target[1]


def install(agent: Any) -> None:
    """Route prints of ``agent``'s yr work to their drivers (once per process; idempotent)."""
    global _outbox
    with _install_lock:
        agent.runtime.output_target = current_target
        if _outbox is not None and _outbox.agent is not None and _outbox.agent is not agent \
                and not _outbox.agent.runtime.closed:
            return  # a second agent in this process (tests): the first one sends
        _outbox = _Outbox(agent)
        if not isinstance(sys.stdout, _Proxy):
            sys.stdout = _Proxy(sys.stdout, "stdout")  # type: ignore[assignment]
        if not isinstance(sys.stderr, _Proxy):
            sys.stderr = _Proxy(sys.stderr, "stderr")  # type: ignore[assignment]


async def uninstall(agent: Any) -> None:
    """``agent`` closes (its loop): send what is buffered; the streams go back to the real ones."""
    global _outbox
    with _install_lock:
        outbox = _outbox
        if outbox is None or outbox.agent is not agent:
            return
        _outbox = None
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            if isinstance(stream, _Proxy):
                setattr(sys, name, stream._real)
    sending = outbox.flush()
    if sending is not None:
        try:
            await asyncio.wait_for(asyncio.shield(sending), 2)
        except Exception:
            pass
