"""Where this process's instance calls go: creation, locating, ordered sends, handle counts.

All methods run on the runtime's loop thread.  Per instance there is one :class:`Route`
holding the calls of this process in submission order; a call leaves only when every call
before it has left and its own ref arguments are ready, so calls from one caller reach the
instance in order over the (ordered) call channel.  Handle counts are reported to the
scheduler only when this process's count for an instance goes 0 -> 1 or 1 -> 0 (pending
calls count as handles), batched per loop iteration.

When the channel to an instance's worker is lost, the calls sent there and not answered go
back to the front of their route, in the order they were sent, and the route asks the
scheduler where the instance is now: a restarted instance gets them again (at least once),
an ended one fails them with the cause.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from yrdask import protocol as P
from yrdask.runtime.objects import dep_of, failed_dep, pending_owned, when_ready
from yrdask.errors import InstanceDiedError, ScheduleError


@dataclass(eq=False)
class Call:
    call_id: str
    instance_id: str
    method: str
    args: bytes
    dep_refs: list
    entries: list
    nret: int
    deps: list | None = None  # as sent, kept for a redelivery


@dataclass(eq=False)
class Route:
    instance_id: str
    worker: str | None = None
    real_id: str | None = None  # a named creation that bound an existing instance
    dead: Any = None  # the error (exception or RemoteError) every call fails with
    queue: deque = field(default_factory=deque)
    locating: bool = False
    lost: str | None = None  # the worker it was lost with, until located again


class InstanceRouter:
    """See module docstring."""

    def __init__(self, runtime: Any) -> None:
        self.rt = runtime
        self.routes: dict[str, Route] = {}
        self.inflight: dict[str, tuple[Call, Route]] = {}
        self.counts: dict[str, int] = {}
        self.registered: set[str] = set()
        self._deltas: dict[str, int] = {}
        self._transit: list = []
        self._arrived: list = []
        self._flush_armed = False

    # -- creation and location -------------------------------------------------------------

    def create(self, spec: dict, dep_refs: list) -> None:
        iid = spec["instance_id"]
        route = self.routes.setdefault(iid, Route(iid, locating=True))
        self.registered.add(iid)  # the spec names us as the first holder
        when_ready(dep_refs, lambda: self._send_create(spec, dep_refs, route))

    def _send_create(self, spec: dict, dep_refs: list, route: Route) -> None:
        error = failed_dep(dep_refs)
        if error is not None:
            self._kill_route(route, error)
            return
        spec["deps"] = [dep_of(ref) for ref in dep_refs]

        async def create() -> None:
            try:
                iid, where, _meta = await self.rt.connector.scheduler_rpc(
                    P.CREATE_INSTANCE, spec=spec)
            except Exception as e:
                iid, where = None, f"instance creation failed: {e!r}"
            route.locating = False
            if iid is None:
                self._kill_route(route, ScheduleError(where))
            else:
                route.worker = where
                if iid != route.instance_id:
                    route.real_id = iid
                self._pump(route)

        self.rt.loop.create_task(create())

    def _locate(self, route: Route) -> None:
        route.locating = True

        async def locate() -> None:
            try:
                state, where, reason, real_id = await self.rt.connector.scheduler_rpc(
                    P.LOCATE_INSTANCE, instance_id=route.instance_id, lost=route.lost)
            except Exception as e:
                state, where, reason = P.DEAD, None, f"cannot reach the scheduler: {e!r}"
                real_id = route.instance_id
            route.locating = False
            route.lost = None
            if real_id != route.instance_id:
                route.real_id = real_id
            if state == P.DEAD or where is None:
                self._kill_route(route, InstanceDiedError(
                    f"instance {route.instance_id} is not available: {reason}"))
            else:
                route.worker = where
                self._pump(route)

        self.rt.loop.create_task(locate())

    # -- calls -----------------------------------------------------------------------------

    def call(self, call: Call) -> None:
        route = self.routes.get(call.instance_id)
        if route is None:
            route = self.routes[call.instance_id] = Route(call.instance_id)
        self.incref(call.instance_id)
        route.queue.append(call)
        self._pump(route)

    def _pump(self, route: Route) -> None:
        if route.dead is not None:
            while route.queue:
                self._fail(route.queue.popleft(), route.dead)
            return
        if route.worker is None:
            if not route.locating and route.queue:
                self._locate(route)
            return
        while route.queue:
            call = route.queue[0]
            if pending_owned(call.dep_refs):
                # Later calls wait behind this one: calls leave in submission order.
                when_ready(call.dep_refs, lambda: self._pump(route))
                return
            route.queue.popleft()
            if call.deps is None:
                error = failed_dep(call.dep_refs)
                if error is not None:
                    self._fail(call, error)
                    continue
                call.deps = [dep_of(r) for r in call.dep_refs]
                call.dep_refs = []
            self.inflight[call.call_id] = (call, route)
            self.rt.channel(route.worker).send({
                "op": P.CALL_METHOD, "task_id": call.call_id,
                "instance_id": route.real_id or call.instance_id, "method": call.method,
                "args": call.args, "deps": call.deps, "nret": call.nret,
            })

    def on_done(self, msg: dict) -> bool:
        """Settle a method call's refs; False if ``msg`` is not for a method call."""
        item = self.inflight.pop(msg["task_id"], None)
        if item is None:
            return False
        call, _route = item
        error = msg.get("error")
        if error is not None:
            from yrdask.serialization import loads

            self._fail(call, loads(error))
        else:
            for entry, (kind, payload) in zip(call.entries, msg["results"]):
                entry.set_result(kind, payload)
            self.decref(call.instance_id)
        return True

    def on_channel_lost(self, worker: str) -> None:
        """Calls not answered go back to their routes, which locate their instance again."""
        resend: dict[str, list[Call]] = {}
        for call_id, (call, route) in list(self.inflight.items()):
            if route.worker == worker:
                del self.inflight[call_id]
                resend.setdefault(route.instance_id, []).append(call)
        for route in list(self.routes.values()):
            if route.worker != worker:
                continue
            route.worker, route.lost = None, worker
            route.queue.extendleft(reversed(resend.get(route.instance_id, ())))
            self._pump(route)

    def _fail(self, call: Call, error: Any) -> None:
        for entry in call.entries:
            entry.set_error(error)
        self.decref(call.instance_id)

    def _kill_route(self, route: Route, error: BaseException) -> None:
        route.dead = error
        route.locating = False
        self._pump(route)


    # -- handle counting -------------------------------------------------------------------

    def incref(self, iid: str) -> None:
        n = self.counts.get(iid, 0) + 1
        self.counts[iid] = n
        if n == 1 and iid not in self.registered:
            self.registered.add(iid)
            self._delta(iid, +1)

    def decref(self, iid: str) -> None:
        n = self.counts.get(iid, 0) - 1
        if n > 0:
            self.counts[iid] = n
            return
        self.counts.pop(iid, None)
        if iid in self.registered:
            self.registered.discard(iid)
            self._delta(iid, -1)
        route = self.routes.get(iid)
        if route is not None and not route.queue and not route.locating:
            del self.routes[iid]

    def transit(self, iid: str, token: str) -> None:
        self._transit.append([iid, token])
        self._arm()

    def arrived(self, iid: str, token: str) -> None:
        self._arrived.append([iid, token])
        self._arm()

    def _delta(self, iid: str, d: int) -> None:
        self._deltas[iid] = self._deltas.get(iid, 0) + d
        self._arm()

    def _arm(self) -> None:
        if not self._flush_armed:
            self._flush_armed = True
            self.rt.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_armed = False
        deltas = {k: v for k, v in self._deltas.items() if v}
        if deltas or self._transit or self._arrived:
            self.rt.connector.stream_send({"op": P.HANDLE_REFS, "deltas": deltas,
                                           "transit": self._transit, "arrived": self._arrived})
        self._deltas, self._transit, self._arrived = {}, [], []
