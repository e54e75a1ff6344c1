"""Where this process's instance calls go: the asyncio adapter of :class:`CallOrder`.

Every rule (per-caller order, creation and locating, redelivery after a lost channel, dead
routes, handle counts) lives in :mod:`yrdask.runtime.call_order`, and what is done with its
instructions and the rpc answers in :mod:`yrdask.runtime.call_router` (which the simulation
drives too); this adapter holds that router and is its edge: it keeps what the machine
does not see (the creation specs, the pickled arguments, the ref arguments and the result
entries of each call), turns the runtime's callbacks into the router's calls and carries out
the instructions: rpcs to the scheduler, ``CALL_METHOD`` on the call channels, settling result
entries, and the batched ``HANDLE_REFS`` report.  All methods run on the loop thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import dask

from yrdask import config as _config  # noqa: F401 - registers the yrdask.* defaults
from yrdask import protocol as P
from yrdask.errors import CallCrashedError
from yrdask.runtime import call_order as C
from yrdask.runtime.call_router import CallRouter, cancelled_answer
from yrdask.runtime.objects import dep_of, failed_dep, failing_entries, pending_owned, when_ready


@dataclass(eq=False, slots=True)
class Call:
    """The payload of one method call, kept here until the machine settles it."""

    call_id: str
    instance_id: str
    method: str
    args: bytes
    dep_refs: Sequence
    entries: Sequence
    nret: int
    deps: Sequence | None = None  # as first sent, kept for a redelivery
    results: list | None = None  # of its TASK_DONE, until CallSucceeded
    max_redeliveries: int | None = None  # its own bound after crashes (None: the default)
    unordered: bool = False  # may pass earlier calls still waiting for their arguments
    concurrency: int = 1  # its instance's (0: unknown): bounds a lost worker's crash charge
    held: Sequence | None = None  # its ref arguments, alive until it is answered (borrowing)
    cancelled: bool = False  # Ray's cancel of an actor task (CallRouter.cancel)
    events: bool = True  # False: the call leaves no record (P.CallMethod)


class InstanceRouter:
    """See module docstring; ``order`` is the machine (one per process).  What it does with
    the machine's instructions is decided by its :class:`CallRouter` (``decisions``, which
    the simulation drives too, on an edge of its own); this class is that router's edge
    (:class:`~yrdask.runtime.call_router.CallRouterEdge`)."""

    def __init__(self, runtime: Any, order: C.CallOrder | None = None) -> None:
        self.rt = runtime
        if order is None:
            order = C.CallOrder(max_redeliveries=int(
                dask.config.get("yrdask.scheduling.max-call-redeliveries", 1)))
        self.order = order
        self.decisions = decisions = CallRouter(self, order)
        # what the API and the rpc answers tell the decisions directly (bound once: no call
        # of this class in between): handles made, dropped, sent and unpickled, rpc replies
        self.incref = decisions.incref
        self.decref = decisions.decref
        self.transit = decisions.transit
        self.arrived = decisions.arrived
        self.create_answered = decisions.create_answered
        self.locate_answered = decisions.locate_answered
        self.retried = decisions.retried  # a call's CALL_RETRIED (runtime/answers.py)
        self.calls: dict[str, Call] = {}
        self.specs: dict[str, tuple[dict, list]] = {}  # creations not answered yet

    # -- runtime callbacks (loop thread) -------------------------------------------------

    def create(self, spec: dict, dep_refs: list) -> None:
        iid = spec["instance_id"]
        self.specs[iid] = (spec, dep_refs)
        self.decisions.create_requested(iid)
        when_ready(dep_refs, lambda: self._create_ready(iid))

    def _create_ready(self, iid: str) -> None:
        spec, dep_refs = self.specs[iid]
        error = failed_dep(dep_refs)
        if error is None:
            spec["deps"] = [dep_of(ref) for ref in dep_refs]
            for ref in dep_refs:  # a restart reads them again, whenever: keep them
                if ref._entry.stored or ref._entry.state == P.LOCATION:
                    self.rt.objects.pin({ref._id: ref._entry.owner or self.rt.address})
        else:
            del self.specs[iid]
        self.decisions.create_deps_ready(iid, error)

    def call(self, call: Call) -> None:
        cid = call.call_id
        self.calls[cid] = call
        refs = call.dep_refs
        if refs and pending_owned(refs):
            self.decisions.submit(cid, call.instance_id, False, None,
                                  call.max_redeliveries, call.unordered, call.concurrency)
            when_ready(refs, lambda: self.decisions.deps_ready(cid, failed_dep(refs)))
        elif not refs:  # the usual: no ref argument (sent at once: CallRouter.submit)
            self.decisions.submit(cid, call.instance_id, True, None,
                                  call.max_redeliveries, call.unordered, call.concurrency)
        else:
            error = failed_dep(refs)
            self.decisions.submit(cid, call.instance_id, True, error,
                                  call.max_redeliveries, call.unordered, call.concurrency)

    def cancel(self, cid: str, recursive: bool = False) -> bool:
        """Ray's ``cancel`` of an actor task; False if ``cid`` is no call waiting for its
        answer.  Not sent yet: it never is, and its refs fail with ``CancelledError`` at
        once (``CallRouter.cancel``).  Sent: the worker is told (a call not started never
        runs, a running ``async def`` one is cancelled, a sync one runs on), and its answer
        settles it (as Ray: ``ray.get`` returns once the worker is done): a sync call's is
        ``CancelledError``; an ``async def`` one's is what the method did with the
        ``asyncio.CancelledError`` (re-raised: ``CancelledError``; caught: its value or
        error)."""
        call = self.calls.get(cid)
        if call is None:
            return False
        if not call.cancelled:
            call.cancelled = True
            self.decisions.cancel(cid, recursive)
        return True

    def on_result(self, cid: str, results: list | None) -> bool:
        """A plain answer (``TaskDone`` with results only: no error, no refs report) to
        method call ``cid`` (the hot path, read off its wire dict); False if it is no call
        waiting here or one answered after a cancel (then :meth:`on_done` has the rule)."""
        try:
            call = self.calls[cid]
        except KeyError:
            return False
        if call.cancelled or results is None:
            return False
        call.results = results
        self.decisions.done(cid)  # (the usual answer settles through call_succeeded)
        return True

    def on_done(self, msg: P.TaskDone) -> bool:
        """Settle a method call's refs; False if ``msg`` is not for a method call."""
        cid = msg.task_id
        call = self.calls.get(cid)
        if call is None:
            return False
        error = msg.error
        if error is None:
            call.results = msg.results
        else:
            from yrdask.serialization import loads

            error = loads(error)
        if call.cancelled:  # (a success too: on_result leaves a cancelled call's to this)
            error = cancelled_answer(cid, error)
        self.decisions.done(cid, error)
        return True

    def on_channel_lost(self, worker: str) -> None:
        """Calls not answered go back to their routes, which locate their instance again."""
        self.decisions.channel_lost(worker)

    # -- the edge (CallRouterEdge) -----------------------------------------------------------

    def send_call(self, ins: C.SendCall) -> None:
        call = self.calls[ins.call_id]
        if call.deps is None:
            if call.dep_refs:
                call.deps = [dep_of(r) for r in call.dep_refs]
                # refs to values in the store stay held until the call is done (by reference)
                call.dep_refs = [r for r in call.dep_refs if r._entry.stored]
            else:
                call.deps = ()
        chan = self.rt.channels.get(ins.worker) or self.rt.channel(ins.worker)
        chan.send(P.CallMethod.wire(
            call.call_id, ins.instance_id, call.method, call.args, call.deps, call.nret,
            call.events, ins.tries))

    def send_cancel(self, worker: str, msg: P.CancelTask) -> None:
        self.rt.channel(worker).send(msg)

    def call_succeeded(self, call_id: str) -> None:
        calls = self.calls
        call = calls[call_id]
        del calls[call_id]  # (not pop: no call on the hot path)
        for entry, (k, payload) in zip(call.entries, call.results):
            entry.set_result(k, payload)

    def call_failed(self, call_id: str, error: Any) -> None:
        call = self.calls.pop(call_id)
        if type(error) is CallCrashedError:  # the machine knows ids, not methods
            error = CallCrashedError(f"method {call.method!r}: {error}", error.worker)
            self.rt.with_exit_reason(error, failing_entries(call.entries))
            return
        for entry in call.entries:
            entry.set_error(error)

    def flush_soon(self) -> None:
        self.rt.loop.call_soon(self.decisions.flush)

    def report_handles(self, ins: C.ReportHandles) -> None:
        self.rt.connector.stream_send(P.HandleRefs(
            ins.deltas, transit=[list(t) for t in ins.transit],
            arrived=[list(t) for t in ins.arrived]))

    def send_create(self, instance_id: str) -> None:
        self.rt.loop.create_task(self._create_rpc(instance_id))

    def send_locate(self, instance_id: str, lost: str | None) -> None:
        if lost is not None and self.rt.confirmed_gone(lost):
            # the scheduler removed the process lost here already: the one at that address
            # now (a worker restarted at a fixed port) is another, where the instance may
            # run again; the scheduler must not wait for *it* to go (LocateInstance.lost)
            lost = None
        # which process it lost there (if this process was told): a request that reaches the
        # scheduler after a new process took that address is answered at once
        server_id = self.rt.worker_processes.current.get(lost, "") if lost else ""
        self.rt.loop.create_task(self._locate_rpc(instance_id, lost, server_id))

    async def _create_rpc(self, iid: str) -> None:
        spec, _refs = self.specs.pop(iid)
        try:
            reply: Any = await self.rt.connector.request(P.CreateInstance(spec))
        except Exception as e:
            reply = e
        else:
            if reply[0] is not None and len(reply) > 3:  # which process it is on, first
                self.rt.worker_seen(reply[1], reply[3])
                reply = reply[:3]
        self.create_answered(iid, reply)

    async def _locate_rpc(self, iid: str, lost: str | None, lost_server_id: str = "") -> None:
        try:
            reply: Any = await self.rt.connector.request(
                P.LocateInstance(iid, lost=lost, lost_server_id=lost_server_id))
        except Exception as e:
            reply = e
        else:
            if len(reply) > 4:  # which process it is on, first (runtime/worker_processes.py)
                if reply[1] and reply[0] != P.DEAD:
                    self.rt.worker_seen(reply[1], reply[4])
                reply = reply[:4]
        self.locate_answered(iid, reply)
