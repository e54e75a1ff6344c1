"""The instance router's decisions, apart from its I/O: what a process does with
:class:`~yrdask.runtime.call_order.CallOrder`'s instructions and its answers.

``CallOrder`` decides where and when calls go; this class turns the runtime's happenings
(a creation asked for and its arguments ready, a call submitted and its arguments ready, an
answer, a broken channel, handles made, dropped, sent, unpickled, rpc answers) into events,
reads the rpc answers (a creation that bound nothing or raised fails, a locate that says
``DEAD`` or raised names no worker) and hands each instruction to a small
:class:`CallRouterEdge`.  The runtime's adapter (``runtime/instance_router.py``) holds one and
is its edge (payloads, channels, rpcs on the loop); the simulation (``tests/sim/calls.py``) plugs in its
links, so it drives this very code.
"""

from __future__ import annotations

from typing import Any, Protocol

from yrdask import protocol as P
from yrdask.errors import InstanceDiedError, InstanceMovedError, RemoteError, call_cancelled
from yrdask.runtime import call_order as C


def cancelled_answer(call_id: str, error: Any) -> Any:
    """What a cancelled call's answer (``error``: the loaded error, None on success)
    settles it with: the answer itself (as Ray, ``ray.get`` returns once the worker is
    done: a value, the method's error, ``CancelledError``), except that its instance's end
    under it settles it as cancelled."""
    cause = error.to_exception() if isinstance(error, RemoteError) else error
    if isinstance(cause, InstanceDiedError):
        return call_cancelled(call_id)
    return error


class CallRouterEdge(Protocol):
    """What :class:`CallRouter` needs of the world around it."""

    def send_call(self, ins: C.SendCall) -> None:
        """``CALL_METHOD`` of ``ins.call_id`` to ``ins.worker`` on its call channel."""

    def send_cancel(self, worker: str, msg: P.CancelTask) -> None:
        """``msg`` to ``worker`` on its call channel (behind the call it cancels)."""

    def call_succeeded(self, call_id: str) -> None:
        """Settle the call with the results of its ``TASK_DONE``."""

    def call_failed(self, call_id: str, error: Any) -> None:
        """Settle the call with ``error``."""

    def flush_soon(self) -> None:
        """Call :meth:`CallRouter.flush` after the current burst (a later loop turn)."""

    def report_handles(self, ins: C.ReportHandles) -> None:
        """``HANDLE_REFS`` on the job (or worker) stream."""

    def send_create(self, instance_id: str) -> None:
        """``CREATE_INSTANCE`` rpc; its answer (or exception) goes to
        :meth:`CallRouter.create_answered`."""

    def send_locate(self, instance_id: str, lost: str | None) -> None:
        """``LOCATE_INSTANCE`` rpc; its answer (or exception) goes to
        :meth:`CallRouter.locate_answered`."""


class CallRouter:
    """Feeds :class:`CallOrder` and carries out its instructions through a
    :class:`CallRouterEdge`."""

    def __init__(self, edge: CallRouterEdge, order: C.CallOrder) -> None:
        self.edge = edge
        self.order = order

    # -- happenings -> events --------------------------------------------------------------

    def create_requested(self, iid: str) -> None:
        self._do(self.order.handle(C.CreateRequested(iid, iid)))

    def create_deps_ready(self, iid: str, error: Any = None) -> None:
        self._do(self.order.handle(C.CreateDepsReady(iid, iid, error)))

    def submit(self, call_id: str, instance_id: str, ready: bool, error: Any = None,
               max_redeliveries: int | None = None, unordered: bool = False,
               concurrency: int = 1) -> None:
        if ready and error is None:  # the usual: it leaves at once
            ins = self.order.send_at_once(call_id, instance_id, max_redeliveries, unordered,
                                          concurrency)
            if ins is not None:
                self.edge.send_call(ins)
                return
        out = self.order.handle(C.CallSubmitted(call_id, call_id, instance_id, ready, error,
                                                max_redeliveries, unordered, concurrency))
        if len(out) == 1 and type(out[0]) is C.SendCall:  # the usual: sent at once
            self.edge.send_call(out[0])
        else:
            self._do(out)

    def deps_ready(self, call_id: str, error: Any = None) -> None:
        self._do(self.order.handle(C.CallDepsReady(call_id, call_id, error)))

    def done(self, call_id: str, error: Any = None) -> None:
        """The call's ``TASK_DONE`` (``error``: the loaded error object, None on success)."""
        if error is None and self.order.succeeded_at_once(call_id):  # the usual answer
            self.edge.call_succeeded(call_id)
            return
        if type(error) is InstanceMovedError:  # unrun where its instance was: send it again
            self._do(self.order.handle(C.CallMoved(f"moved-{call_id}", call_id)))
            return
        out = self.order.handle(C.CallDone(call_id, call_id, error))
        if len(out) == 1 and type(out[0]) is C.CallSucceeded:  # the usual answer
            self.edge.call_succeeded(call_id)
        else:
            self._do(out)

    def cancel(self, call_id: str, recursive: bool = False) -> None:
        """Ray's cancel of a method call not cancelled yet.  Not sent yet: it never is; it
        fails with :func:`~yrdask.errors.call_cancelled` at once, unrun (as Ray: an actor
        call cancelled before it is sent never runs).  Sent: its worker gets ``CANCEL_TASK``
        (a call not started never runs) and its answer settles it (:func:`cancelled_answer`);
        back unrun from a lost or moved host, it fails as cancelled instead of going again."""
        self._do(self.order.handle(C.CallCancelled(f"cancel-{call_id}", call_id,
                                                   call_cancelled(call_id), recursive)))

    def retried(self, call_id: str) -> None:
        """The call's ``CALL_RETRIED``: its method runs it again after an exception."""
        self._do(self.order.handle(C.CallRetried(f"retried-{call_id}", call_id)))

    def channel_lost(self, worker: str) -> None:
        """Calls not answered go back to their routes, which locate their instance again."""
        self._do(self.order.handle(C.ChannelLost(f"lost-{worker}", worker)))

    def incref(self, iid: str) -> None:
        self._do(self.order.handle(C.HandleAdded("handle", iid)))

    def decref(self, iid: str) -> None:
        self._do(self.order.handle(C.HandleDropped("handle", iid)))

    def transit(self, iid: str, token: str) -> None:
        self._do(self.order.handle(C.HandleSent(token, iid, token)))

    def arrived(self, iid: str, token: str) -> None:
        self._do(self.order.handle(C.HandleArrived(token, iid, token)))

    def flush(self) -> None:
        self._do(self.order.handle(C.Flush("flush")))

    def create_answered(self, iid: str, reply: list | BaseException) -> None:
        """``CREATE_INSTANCE``'s reply ``[real_id, worker, meta]`` or ``[None, reason,
        None]``, or the exception the rpc raised."""
        if isinstance(reply, BaseException):
            real_id, where = None, f"instance creation failed: {reply!r}"
        else:
            real_id, where = reply[0], reply[1]
        if real_id is None:
            event: Any = C.CreateFailed(f"create-{iid}", iid, where)
        else:
            event = C.Created(f"create-{iid}", iid, where, real_id)
        self._do(self.order.handle(event))

    def locate_answered(self, iid: str, reply: list | BaseException) -> None:
        """``LOCATE_INSTANCE``'s reply ``[state, worker, reason, real_id]``, or the exception
        the rpc raised."""
        if isinstance(reply, BaseException):
            state, where, reason, real_id = (P.DEAD, None,
                                             f"cannot reach the scheduler: {reply!r}", None)
        else:
            state, where, reason, real_id = reply
        if state == P.DEAD:
            where = None
        self._do(self.order.handle(C.Located(f"locate-{iid}", iid, where, reason, real_id)))

    # -- instructions ----------------------------------------------------------------------

    def _do(self, instructions: list) -> None:
        edge = self.edge
        for ins in instructions:
            kind = type(ins)
            if kind is C.SendCall:
                edge.send_call(ins)
            elif kind is C.CallSucceeded:
                edge.call_succeeded(ins.call_id)
            elif kind is C.CallFailed:
                edge.call_failed(ins.call_id, ins.error)
            elif kind is C.FlushSoon:
                edge.flush_soon()
            elif kind is C.ReportHandles:
                edge.report_handles(ins)
            elif kind is C.SendCreate:
                edge.send_create(ins.instance_id)
            elif kind is C.SendLocate:
                edge.send_locate(ins.instance_id, ins.lost)
            elif kind is C.SendCancel:
                edge.send_cancel(ins.worker, P.CancelTask(ins.call_id, recursive=ins.recursive))
            else:  # pragma: no cover - a new instruction nobody taught the adapter
                raise AssertionError(f"unknown instruction {ins!r}")
