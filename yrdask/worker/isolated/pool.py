"""Pooled isolated processes for stateless tasks (:class:`ProcessPool`): one task at a time
each, kept per ``(env, cwd)`` and reused, reaped when idle unless a nested call made them
owners; ``max_calls`` recycles them (Ray's rule).  A death under a task is
:class:`ProcessDied`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import subprocess
import threading
import time
from typing import Any

from yrdask.worker.isolated.zygote import (child_info, describe_exit_of, kill_child,
                                            start_child)

logger = logging.getLogger("yrdask.worker")

POOL_IDLE_S = 10.0  # a pooled task process unused this long is reaped
CANCEL_POLL_S = 0.1  # a cancel of a running isolated task kills its process within this


class ProcessDied(Exception):
    """The pooled process running a task died (``args[0]``: :func:`describe_exit_of`'s text)."""


class _PooledProcess:
    __slots__ = ("proc", "address", "comm", "idle_since", "calls", "owner")

    def __init__(self, proc: subprocess.Popen, address: str, comm: Any) -> None:
        self.proc = proc
        self.address = address
        self.comm = comm  # the agent's, connected when it began to listen
        self.idle_since = 0.0
        self.calls = 0  # tasks it ran, for ``max_calls``
        # a nested call started a runtime there: it may own objects that others hold
        # (Ray's rule: they live as long as their owner), so it is not reaped when idle
        self.owner = False

    async def request(self, msg: dict) -> dict:
        from distributed.comm.core import CommClosedError

        try:
            await self.comm.write(msg)
            return await self.comm.read()
        except (CommClosedError, OSError):
            loop = asyncio.get_running_loop()
            code = await loop.run_in_executor(None, self.proc.wait)
            raise ProcessDied(describe_exit_of(self.proc.pid, code)) from None


class ProcessPool:
    """Child processes for stateless tasks with env_vars/working_dir, one task at a time
    each, kept per ``(env, cwd)`` and reused, reaped after ``POOL_IDLE_S`` unused."""

    def __init__(self, agent: Any, idle_s: float = POOL_IDLE_S) -> None:
        self.agent = agent
        self.idle_s = idle_s
        self.lock = threading.Lock()
        self.idle: dict[str, list[_PooledProcess]] = {}
        self.every: set[_PooledProcess] = set()
        self.closed = False
        self._reaping = False

    def __len__(self) -> int:
        return len(self.every)

    def run(self, isolation: dict, request: dict) -> dict:
        """Run one task (blocking, in the task's thread); its ``TASK_DONE`` wire dict.

        Raises :class:`ProcessDied` if the process died under it.  Any other exception
        here (a cancel of the task) kills the process: it may still be running the code.
        """
        key = json.dumps(isolation, sort_keys=True)
        with self.lock:
            free = self.idle.get(key)
            child = free.pop() if free else None
        if child is None:
            started = asyncio.run_coroutine_threadsafe(start_child(
                isolation, child_info(self.agent), self.agent.runtime.connection_args),
                self.agent.loop)
            child = _PooledProcess(*started.result())
            with self.lock:
                if self.closed:
                    self.agent.loop.call_soon_threadsafe(child.comm.abort)
                    kill_child(child.proc)
                    raise ProcessDied("its worker is closing")
                self.every.add(child)
        loop = self.agent.loop
        fut = asyncio.run_coroutine_threadsafe(child.request(request), loop)
        try:
            while not fut.done():  # short waits: a cancel (an exception raised in this
                concurrent.futures.wait((fut,), CANCEL_POLL_S)  # thread) lands in between
            answer = fut.result()
        except BaseException:
            fut.cancel()
            self._drop(child)
            raise
        # ``[done, owner]``; a dict: the child's endpoint reports a failure of its own
        reply, owner = (answer, False) if isinstance(answer, dict) else answer
        child.owner = child.owner or bool(owner)
        child.calls += 1
        max_calls = isolation.get("max_calls") or 0
        with self.lock:
            # closing, or it ran its max_calls (Ray's recycling): it ends, outside the lock
            done = self.closed or bool(max_calls and child.calls >= max_calls)
            if not done:
                child.idle_since = time.monotonic()
                self.idle.setdefault(key, []).append(child)
                if not self._reaping:
                    self._reaping = True
                    loop.call_soon_threadsafe(loop.call_later, self.idle_s, self._reap)
        if done:
            self._drop(child)  # takes the lock itself
        return reply

    def _drop(self, child: _PooledProcess) -> None:
        with self.lock:
            self.every.discard(child)
        self.agent.loop.call_soon_threadsafe(child.comm.abort)
        kill_child(child.proc)
        threading.Thread(target=child.proc.wait, daemon=True).start()  # reap the zombie

    def _reap(self) -> None:
        """Loop thread: processes idle for ``idle_s`` go; check again while any is left."""
        now = time.monotonic()
        doomed = []
        with self.lock:
            for key, free in list(self.idle.items()):
                keep = []
                for c in free:
                    (keep if c.owner or now - c.idle_since < self.idle_s else doomed).append(c)
                if keep:
                    self.idle[key] = keep
                else:
                    del self.idle[key]
            # owners are kept: no tick for them alone (the next release arms it again)
            self._reaping = not self.closed and any(
                not c.owner for free in self.idle.values() for c in free)
        for child in doomed:
            self._drop(child)
        if self._reaping:
            self.agent.loop.call_later(self.idle_s / 2, self._reap)

    def close(self) -> None:
        """The worker closes: every pooled process goes, and is reaped."""
        with self.lock:
            self.closed = True
            every, self.every, self.idle = list(self.every), set(), {}
        for child in every:
            child.comm.abort()
            kill_child(child.proc)
            try:
                child.proc.wait(5)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL did not land
                logger.error("isolated process %s did not exit", child.proc.pid)
