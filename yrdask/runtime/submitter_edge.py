"""The submitter's I/O edge in a process: the runtime's event loop, call channels, scheduler
connector and object table carry out what :class:`~yrdask.runtime.submitter.Submitter`
decides (it names the :class:`~yrdask.runtime.submitter.SubmitterEdge` it needs)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from yrdask import protocol as P
from yrdask.errors import TaskCrashedError
from yrdask.runtime import submit_queue as M
from yrdask.runtime.objects import Entry, failing_entries
from yrdask.runtime.store import node_store

logger = logging.getLogger("yrdask.submitter")


class RuntimeEdge:
    """The submitter's I/O edge in a process: the runtime's event loop, channels, connector
    and object table."""

    __slots__ = ("rt",)
    now = staticmethod(time.monotonic)

    def __init__(self, runtime: Any) -> None:
        self.rt = runtime

    def call_soon(self, fn: Callable[[Any], None], arg: Any) -> None:
        self.rt.loop.call_soon(fn, arg)

    def call_at(self, at: float, fn: Callable[[], None]) -> asyncio.TimerHandle:
        return self.rt.loop.call_later(max(0.0, at - time.monotonic()), fn)

    def request_lease(self, ins: M.RequestLease, near: str | None,
                      answer: Callable[[str, str | None, str], None]) -> None:
        self.rt.loop.create_task(self._request_lease(ins, near, answer))

    async def _request_lease(self, ins: M.RequestLease, near: str | None,
                             answer: Callable[[str, str | None, str], None]) -> None:
        try:
            lease_id, where = await self.rt.connector.request_lease(
                ins.shape, ins.timeout_ms, ins.queue, list(ins.avoid), ins.affinity, near,
                ins.request_id)
        except Exception as e:  # scheduler unreachable
            lease_id, where = None, f"lease request failed: {e!r}"
        answer(ins.request_id, lease_id, where)

    def push(self, task: Any, lease_id: str, worker: str, slots: int) -> None:
        """``RUN_TASK`` of ``task`` (a :class:`~yrdask.runtime.submitter.Task`) on its lease."""
        rt = self.rt
        chan = rt.channels.get(worker) or rt.channel(worker)
        fn = None
        if task.fn_id not in chan.sent_functions:  # the function goes once per channel
            chan.sent_functions.add(task.fn_id)
            fn = task.fn_payload
        chan.send(P.RunTask.wire(task.task_id, lease_id, task.fn_id, fn, task.args, task.deps,
                                 task.nret, task.owner, task.name, slots, task.log_to,
                                 task.events))

    def send_cancel(self, worker: str, task_id: str, force: bool, recursive: bool) -> None:
        self.rt.channel(worker).send(P.CancelTask(task_id, force, recursive))

    def return_leases(self, lease_ids: list[str]) -> None:
        self.rt.connector.return_leases(lease_ids)

    def withdraw_requests(self, request_ids: list[str]) -> None:
        self.rt.connector.withdraw_lease_requests(request_ids)

    def crashed(self, error: TaskCrashedError, entries: list[Entry]) -> None:
        self.rt.with_exit_reason(error, failing_entries(entries))

    def when_exit_known(self, worker: str, then: Any, wait_s: float) -> None:
        self.rt.when_exit_known(worker, then, wait_s)

    def kept_result(self, oid: str, entry: Entry, worker: str) -> bool:
        if entry.refs <= 0 and self.rt.objects.entries.get(oid) is not entry:
            self.rt.free_remote(worker, [oid])  # dropped while it ran, and not lent
            return False
        return True

    def keeps_copy(self, oid: str) -> bool:
        return node_store().contains(oid)

    def entry_of(self, oid: str) -> Entry | None:
        return self.rt.objects.entries.get(oid)

    def ensure_fetch(self, ref: Any) -> None:
        self.rt._ensure_fetch(ref)

    def address(self) -> str:
        return self.rt.address

    def local_worker(self) -> str | None:
        return self.rt.local_worker

    def prefers_local(self) -> bool:
        agent = self.rt.agent
        return agent is not None and agent.prefers_local()

    def cannot(self, ins: Any, error: BaseException) -> None:
        logger.error("submitter: cannot carry out %r", ins, exc_info=error)
