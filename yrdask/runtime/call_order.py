"""The caller side of instance calls as a pure state machine: order, redelivery, handle counts.

One :class:`CallOrder` per process (driver or worker), driven by the adapter in
``runtime/instance_router.py`` (contract in ``docs/state-machines.md``, conventions in
``yrdask/statemachine.py``).  It sees ids, workers and outcomes only; the adapter keeps the
call payloads (pickled arguments, ref arguments, result entries) and does the rpcs.

Rules:

* Per instance there is one *route* holding this process's calls in submission order.  A
  call leaves (``SendCall``) only when every earlier call of the route has left and its own
  ref arguments are ready (the adapter says so with ``CallDepsReady``); a call whose
  argument failed fails in its turn, and the ones behind it go on.  An *unordered* call
  (the Ray surface's async and threaded actors) leaves as soon as its arguments are ready,
  past earlier calls still waiting for theirs, as on Ray.
* A route learns where its instance is from its creation (``CREATE_INSTANCE``: a worker, the
  real id when a named creation bound an existing instance, or a failure) or by asking
  (``LOCATE_INSTANCE``), which it does when it has calls and no worker.
* When the channel to a worker is lost, the calls sent there and not answered go back to the
  front of their route in the order they were sent, and the route locates its instance
  again (``lost=worker``): a restarted instance gets them again (at least once); a call that
  was answered is never sent again.  The oldest ``concurrency`` of them may have been
  running and are charged a crash (:func:`charge_crash`, the one rule); past their bound
  they fail once the route is located again: with ``CallCrashedError`` if the instance
  lives on (it restarted), with its end if it did not (Ray's ``ActorUnavailableError``
  and ``ActorDiedError``).  A *worker* here is whatever process the route's calls go to:
  a worker, or a process instance's own process (its endpoint, docs/isolation.md).
* When the instance moved (scale-down, ``scheduler/drain.py``), its old worker answers the
  calls it did not run with ``InstanceMovedError`` (:class:`CallMoved`): they and every
  call sent after them to that worker go back to the front of the route, uncharged, and
  the route locates the instance again.  None of them ran, so none runs twice.
* A dead route (creation failed, an argument of the creation failed, the instance ended)
  fails its queued and later calls with the cause.
* Ray's cancel of a call (:class:`CallCancelled`): one that has not left (queued: never
  sent, or back from a lost or moved host) is never sent (again) and fails at once with
  the cancel's error, unrun, and the calls behind it go on; one in flight stays there and
  its host is told (:class:`SendCancel`); its answer settles it, and if its host is lost
  or answers that the instance moved, it fails with the cancel's error instead of going
  again.  As Ray: an actor call cancelled before it is sent never runs.
* Handle counts: each live handle and each call not yet settled counts one for its
  instance; the scheduler hears of this process only when its count goes 0 -> 1 or 1 -> 0
  (the creator is named as the first holder in the spec, so its own 0 -> 1 is not sent).
  Deltas and the tokens of pickled handles (``transit``) and of unpickled ones
  (``arrived``) are batched: the first one asks for a ``FlushSoon``, and ``Flush`` turns
  the batch into one ``ReportHandles``.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any

from yrdask.errors import CallCrashedError, InstanceDiedError, ScheduleError
from yrdask.statemachine import Event, Instruction, Story, fast_init


def may_redeliver(crashes: int, bound: int) -> bool:
    """A call was running when its instance's process died, ``crashes`` times now: is it
    delivered again?  Not past ``bound`` (``-1``: no bound)."""
    return bound < 0 or crashes <= bound


def crash_window(unanswered: int, concurrency: int) -> int:
    """How many of the ``unanswered`` calls (oldest first, in the order their host received
    them) may have been running when the host process died: the oldest ``concurrency``.

    Why that bound holds: the host starts calls in arrival order, at most ``concurrency`` at
    a time (``worker/call_queue.py``), and an answered call has left the list, so the
    calls that were running are the oldest unanswered ones, never more than
    ``concurrency`` of them.  Async instances and the Ray surface's threaded and async
    actors are included: their concurrency (default 1000; with concurrency groups at least
    1000 and the groups' sum) bounds what runs at once, so practically all their
    unanswered calls count.  The one case it misses: an answer lost with the process (sent,
    never read) leaves a finished call in the list, charged in the place of a running one.
    ``concurrency < 1``: no bound (every unanswered call counts)."""
    return unanswered if concurrency < 1 else min(unanswered, concurrency)


def charge_crash(unanswered: list, concurrency: int, charge: Any, bound: Any
                 ) -> tuple[list, list]:
    """The one crash-charging rule (:class:`CallOrder`, each caller for its own calls): the
    host process of ``unanswered`` calls (a worker, or a process instance's own process;
    oldest first, in the order the host received them) died.  The oldest :func:`crash_window` of them may have
    been running: each is charged a crash (``charge(call)`` counts it and returns its count
    now) and is delivered again while :func:`may_redeliver` allows (``bound(call)``), else
    it fails; the others had not started and go again uncharged.

    Returns ``(calls to deliver again, in order; (call, crashes) to fail, in order)``.
    Pure: the callers keep the counts (per call, so a call charged on two deaths of the
    same host process chain counts both)."""
    n = crash_window(len(unanswered), concurrency)
    if n == 0:
        return list(unanswered), []
    resend: list = []
    failed: list = []
    for call in unanswered[:n]:
        crashes = charge(call)
        if may_redeliver(crashes, bound(call)):
            resend.append(call)
        else:
            failed.append((call, crashes))
    resend.extend(unanswered[n:])
    return resend, failed


# -- events ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CreateRequested(Event):
    """This process creates ``instance_id``; its calls queue until the creation answers."""

    instance_id: str


@dataclass(frozen=True, slots=True)
class CreateDepsReady(Event):
    """The creation's owned ref arguments are ready; ``error``: the first that failed."""

    instance_id: str
    error: Any = None


@dataclass(frozen=True, slots=True)
class Created(Event):
    """``CREATE_INSTANCE`` answered: placed on ``worker``; ``real_id`` differs from
    ``instance_id`` when a named creation bound an existing instance."""

    instance_id: str
    worker: str
    real_id: str


@dataclass(frozen=True, slots=True)
class CreateFailed(Event):
    """``CREATE_INSTANCE`` answered with no worker (or the rpc failed): ``reason``."""

    instance_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Located(Event):
    """``LOCATE_INSTANCE`` answered: ``worker`` (``None``: the instance is gone, ``reason``
    says why) and the real id the route's id stands for."""

    instance_id: str
    worker: str | None
    reason: str = ""
    real_id: str | None = None


@dataclass(frozen=True, slots=True)
class CallSubmitted(Event):
    """A method call; ``ready``: its owned ref arguments are ready (``error``: the first of
    them that failed)."""

    call_id: str
    instance_id: str
    ready: bool = True
    error: Any = None
    max_redeliveries: int | None = None  # its own bound (None: the machine's; -1: none)
    unordered: bool = False  # may leave before earlier calls whose arguments are not ready
    # how many calls of its instance run at once (its concurrency; 0: unknown, no bound):
    # which of them a lost worker charges (crash_window)
    concurrency: int = 1


@dataclass(frozen=True, slots=True)
class CallDepsReady(Event):
    """The owned ref arguments of a call submitted not ready are ready now."""

    call_id: str
    error: Any = None


@dataclass(frozen=True, slots=True)
class CallDone(Event):
    """``TASK_DONE`` for a call: ``error`` is the opaque error object, ``None`` on success."""

    call_id: str
    error: Any = None


@dataclass(frozen=True, slots=True)
class ChannelLost(Event):
    """The call channel to ``worker`` broke (or the scheduler said the worker is gone)."""

    worker: str


@dataclass(frozen=True, slots=True)
class CallRetried(Event):
    """Call ``call_id`` failed with an exception its method reruns after, and runs again
    (``CALL_RETRIED``): one try of its bound, which its crashes count against too."""

    call_id: str


@dataclass(frozen=True, slots=True)
class CallCancelled(Event):
    """Ray's cancel of call ``call_id``; ``error``: what it fails with if it has not left
    (or comes back unrun); ``recursive``: its host cancels the tasks it submitted too."""

    call_id: str
    error: Any
    recursive: bool = False


@dataclass(frozen=True, slots=True)
class CallMoved(Event):
    """Call ``call_id`` was answered unrun by the worker its instance left (scale-down moved
    the instance with its state, ``InstanceMovedError``)."""

    call_id: str


@dataclass(frozen=True, slots=True)
class HandleAdded(Event):
    """A handle to ``instance_id`` was made in this process."""

    instance_id: str


@dataclass(frozen=True, slots=True)
class HandleDropped(Event):
    """A handle to ``instance_id`` of this process was garbage collected."""

    instance_id: str


@dataclass(frozen=True, slots=True)
class HandleSent(Event):
    """A handle was pickled with ``token`` (it is in transit until someone unpickles it)."""

    instance_id: str
    token: str


@dataclass(frozen=True, slots=True)
class HandleArrived(Event):
    """A handle pickled elsewhere with ``token`` was unpickled here."""

    instance_id: str
    token: str


@dataclass(frozen=True, slots=True)
class Flush(Event):
    """Time to send the batched handle report (answer to ``FlushSoon``)."""


# -- instructions ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SendCreate(Instruction):
    """Send ``CREATE_INSTANCE`` with the spec of ``instance_id``; answer ``Created`` or
    ``CreateFailed``."""

    instance_id: str


@dataclass(frozen=True, slots=True)
class SendLocate(Instruction):
    """Send ``LOCATE_INSTANCE(instance_id, lost)``; answer ``Located``."""

    instance_id: str
    lost: str | None


@dataclass(frozen=True, slots=True)
class SendCall(Instruction):
    """Send ``CALL_METHOD`` of ``call_id`` to ``worker`` for ``instance_id`` (the real id);
    ``tries``: what its bound was charged before (crashes and reruns), for its method."""

    call_id: str
    instance_id: str
    worker: str
    tries: int = 0


@dataclass(frozen=True, slots=True)
class SendCancel(Instruction):
    """Send ``CANCEL_TASK`` of ``call_id`` to ``worker``, where it is in flight."""

    call_id: str
    worker: str
    recursive: bool = False


@dataclass(frozen=True, slots=True)
class CallSucceeded(Instruction):
    """Settle the call's refs with the results of its ``TASK_DONE``; the machine forgot it."""

    call_id: str


@dataclass(frozen=True, slots=True)
class CallFailed(Instruction):
    """Settle the call's refs with ``error``; the machine forgot it."""

    call_id: str
    error: Any


@dataclass(frozen=True, slots=True)
class FlushSoon(Instruction):
    """Send ``Flush`` soon (after the current burst, e.g. ``loop.call_soon``)."""


@dataclass(frozen=True, slots=True)
class ReportHandles(Instruction):
    """Send ``HANDLE_REFS`` to the scheduler."""

    deltas: dict
    transit: list
    arrived: list


# -- the machine -----------------------------------------------------------------------------

# What a route waits for, besides its calls' arguments.
CREATE_DEPS = "create-deps"  # the creation's ref arguments
CREATING = "creating"  # the CREATE_INSTANCE answer
LOCATING = "locating"  # the LOCATE_INSTANCE answer


class _Call:
    __slots__ = ("call_id", "instance_id", "seq", "ready", "error", "crashes", "retried",
                 "max_redeliveries", "unordered", "concurrency")

    def __init__(self, call_id: str, instance_id: str, seq: int, ready: bool,
                 error: Any, max_redeliveries: int | None = None,
                 unordered: bool = False, concurrency: int = 1) -> None:
        self.unordered = unordered
        self.concurrency = concurrency
        self.call_id = call_id
        self.instance_id = instance_id
        self.seq = seq  # submission order, for validate()
        self.ready = ready
        self.error = error  # a failed ref argument
        self.crashes = 0  # times it may have been running when its instance's process died
        self.retried = 0  # times its method ran it again after an exception (CallRetried)
        self.max_redeliveries = max_redeliveries


def _seq(call: _Call) -> int:
    return call.seq


def _concurrency_of(calls: list) -> int:
    """The concurrency of the instance these calls went to (0 if any caller did not know)."""
    conc = [c.concurrency for c in calls]
    return 0 if min(conc) < 1 else max(conc)


def _charge(call: _Call) -> int:
    """One more crash; returns the tries charged to its bound (crashes and reruns)."""
    call.crashes += 1
    return call.crashes + call.retried


class _Route:
    __slots__ = ("instance_id", "worker", "real_id", "dead", "queue", "inflight", "waiting",
                 "lost", "crashed")

    def __init__(self, instance_id: str, waiting: str | None = None) -> None:
        self.instance_id = instance_id
        self.worker: str | None = None
        self.real_id: str | None = None  # a named creation that bound an existing instance
        self.dead: Any = None  # the error every call fails with
        self.queue: deque[_Call] = deque()  # not sent (or sent to a lost worker), in order
        self.inflight: dict[str, _Call] = {}  # sent, not answered, in send order
        self.waiting: str | None = waiting  # CREATE_DEPS, CREATING, LOCATING or None
        self.lost: str | None = None  # the worker it was lost with, until located again
        # calls past their crash bound, with their CallCrashedError, until the route is
        # located again: they fail with it if the instance restarted, with its end if not
        self.crashed: list[tuple[_Call, Any]] = []


class CallOrder:
    """The instance calls and handle counts of one process (see module docstring)."""

    def __init__(self, story_len: int = 10_000, max_redeliveries: int = 1) -> None:
        self.max_redeliveries = max_redeliveries  # of the call running when a process died
        self.routes: dict[str, _Route] = {}
        self.calls: dict[str, _Call] = {}  # queued or in flight
        self.counts: dict[str, int] = {}  # handles + unsettled calls, per instance (> 0)
        # calls cancelled in flight -> the error they fail with if they come back unrun
        self.cancels: dict[str, Any] = {}
        self.registered: set[str] = set()  # instances the scheduler counts this process for
        self._deltas: dict[str, int] = {}
        self._transit: list[tuple[str, str]] = []
        self._arrived: list[tuple[str, str]] = []
        self._flush_asked = False
        self._seq = itertools.count()
        self.story = Story(story_len)
        self._entries = self.story.entries  # the hot path appends plain tuples itself
        self._handlers = {
            CallSubmitted: self._submitted, CallDepsReady: self._deps_ready,
            CallDone: self._done, ChannelLost: self._channel_lost, CallMoved: self._moved,
            CallRetried: self._retried, CallCancelled: self._cancelled,
            CreateRequested: self._create_requested, CreateDepsReady: self._create_deps_ready,
            Created: self._created, CreateFailed: self._create_failed, Located: self._located,
            HandleAdded: self._handle_added, HandleDropped: self._handle_dropped,
            HandleSent: self._handle_sent, HandleArrived: self._handle_arrived,
            Flush: self._flush,
        }

    # -- queries ---------------------------------------------------------------------------

    def pending(self, instance_id: str) -> int:
        """Calls of this process on ``instance_id`` not settled yet."""
        route = self.routes.get(instance_id)
        return 0 if route is None else len(route.queue) + len(route.inflight) + len(route.crashed)

    def story_of(self, *keys: str) -> list:
        """The story entries mentioning any call or instance id in ``keys``."""
        return self.story.about(*keys)

    # -- events ----------------------------------------------------------------------------

    def handle(self, event: Event) -> list[Instruction]:
        """Apply ``event``; returns what the adapter must do, in order."""
        handler = self._handlers.get(type(event))
        if handler is None:
            self.story.log(event.stimulus_id, ("unknown-event", type(event).__name__), ())
            return []
        out: list[Instruction] = []
        handler(event, out)
        return out

    # The hot path's events, by their fields: a call sent at once, a call answered.  These
    # are the implementation of those cases: handle(CallSubmitted) and handle(CallDone) try
    # them first (_submitted, _done), and CallRouter calls them directly (no event object
    # per call).  The stimulus id is the call id unless ``sid`` names another.

    def send_at_once(self, call_id: str, instance_id: str, max_redeliveries: int | None,
                     unordered: bool, concurrency: int, sid: str | None = None
                     ) -> SendCall | None:
        """``CallSubmitted`` of a ready call without a failed argument, when it leaves at
        once: its route knows its worker, queues nothing and is alive, and the instance is
        counted already.  Then it returns the one ``SendCall``; otherwise None, having
        changed nothing (:meth:`handle` takes the other cases)."""
        try:  # (no dict.get: the hot path counts its calls)
            route = self.routes[instance_id]
        except KeyError:
            return None
        if route.worker is None or route.queue or route.dead is not None:
            return None
        n = self.counts.get(instance_id)
        if not n or call_id in self.calls:
            return None
        call = _Call(call_id, instance_id, next(self._seq), True, None, max_redeliveries,
                     unordered, concurrency)
        self.calls[call_id] = call
        self.counts[instance_id] = n + 1
        route.inflight[call_id] = call
        worker, target = route.worker, route.real_id or instance_id
        if sid is None:
            sid = call_id
        self._entries.append((sid, "send", call_id, target, worker))  # as _pump's
        return SendCall(sid, call_id, target, worker)

    def succeeded_at_once(self, call_id: str, sid: str | None = None) -> bool:
        """``CallDone`` without an error, when the call is in flight and its instance stays
        counted after it (the usual answer): True, its ``CallSucceeded`` being the caller's
        to carry out; otherwise False, having changed nothing (:meth:`handle` takes the
        other cases)."""
        try:  # (no dict.get: the hot path counts its calls)
            call = self.calls[call_id]
        except KeyError:
            return False
        iid = call.instance_id
        route = self.routes.get(iid)
        n = self.counts.get(iid)
        if route is None or n is None or n < 2 or call_id not in route.inflight:
            return False
        del route.inflight[call_id]
        del self.calls[call_id]
        if self.cancels:  # (a cancelled call that ran on to its value)
            self.cancels.pop(call_id, None)
        self._entries.append((call_id if sid is None else sid, "succeeded", call_id, iid))
        self.counts[iid] = n - 1
        return True

    # calls

    def _submitted(self, ev: CallSubmitted, out: list) -> None:
        cid, iid = ev.call_id, ev.instance_id
        if ev.ready and ev.error is None:  # the usual: it leaves at once
            ins = self.send_at_once(cid, iid, ev.max_redeliveries, ev.unordered,
                                    ev.concurrency, ev.stimulus_id)
            if ins is not None:
                out.append(ins)
                return
        if cid in self.calls:
            self.story.log(ev.stimulus_id, ("duplicate-ignored", cid), (cid,))
            return
        route = self.routes.get(iid)
        if route is None:
            route = self.routes[iid] = _Route(iid)
        call = _Call(cid, iid, next(self._seq), ev.ready, ev.error, ev.max_redeliveries,
                     ev.unordered, ev.concurrency)
        self.calls[cid] = call
        if (route.worker is None or route.queue or not ev.ready or ev.error is not None
                or route.dead is not None):  # it waits (a call sent at once: "send" says it)
            self.story.log(ev.stimulus_id, ("call", cid, iid, ev.ready), (cid, iid))
        n = self.counts.get(iid)
        if n:  # a pending call counts as a handle (the instance is counted already)
            self.counts[iid] = n + 1
        else:
            self._incref(iid, ev.stimulus_id, out)
        route.queue.append(call)
        self._pump(route, ev.stimulus_id, out)

    def _deps_ready(self, ev: CallDepsReady, out: list) -> None:
        call = self.calls.get(ev.call_id)
        if call is None or call.ready:
            self.story.log(ev.stimulus_id, ("deps-ready-ignored", ev.call_id), (ev.call_id,))
            return
        call.ready, call.error = True, ev.error
        self.story.log(ev.stimulus_id, ("deps-ready", ev.call_id, ev.error is None),
                       (ev.call_id, call.instance_id))
        route = self.routes[call.instance_id]
        if route.queue and (route.queue[0] is call or call.unordered):
            self._pump(route, ev.stimulus_id, out)

    def _done(self, ev: CallDone, out: list) -> None:
        cid = ev.call_id
        if ev.error is None and self.succeeded_at_once(cid, ev.stimulus_id):  # the usual
            out.append(CallSucceeded(ev.stimulus_id, cid))
            return
        call = self.calls.get(cid)
        route = self.routes.get(call.instance_id) if call is not None else None
        if route is None or route.inflight.pop(cid, None) is None:
            self.story.log(ev.stimulus_id, ("done-ignored", cid), (cid,))
            return
        del self.calls[cid]
        if self.cancels:
            self.cancels.pop(cid, None)
        iid = call.instance_id
        if ev.error is None:
            self._entries.append((ev.stimulus_id, "succeeded", cid, iid))  # flat (Story)
            out.append(CallSucceeded(ev.stimulus_id, cid))
        else:
            self.story.log(ev.stimulus_id, ("failed", cid), (cid, iid))
            out.append(CallFailed(ev.stimulus_id, cid, ev.error))
        n = self.counts.get(iid)
        if n is not None and n > 1:  # other calls or handles still count the instance
            self.counts[iid] = n - 1
        else:
            self._decref(iid, ev.stimulus_id, out)

    def _retried(self, ev: CallRetried, out: list) -> None:
        call = self.calls.get(ev.call_id)
        if call is None:
            self.story.log(ev.stimulus_id, ("retried-ignored", ev.call_id), (ev.call_id,))
            return
        call.retried += 1
        self.story.log(ev.stimulus_id, ("retried", ev.call_id, call.retried),
                       (ev.call_id, call.instance_id))

    def _cancelled(self, ev: CallCancelled, out: list) -> None:
        cid = ev.call_id
        call = self.calls.get(cid)
        route = self.routes.get(call.instance_id) if call is not None else None
        if route is None or cid in self.cancels:
            self.story.log(ev.stimulus_id, ("cancel-ignored", cid), (cid,))
            return
        if cid in route.inflight:  # its host is told; its answer settles it
            self.cancels[cid] = ev.error
            self.story.log(ev.stimulus_id, ("cancel-sent", cid, route.worker),
                           (cid, call.instance_id))
            out.append(SendCancel(ev.stimulus_id, cid, route.worker, ev.recursive))
            return
        # not in flight (queued, or past its crash bound waiting for the route's locate):
        # it never leaves again; it fails unrun now, and the calls behind it may go
        if call in route.queue:
            route.queue.remove(call)
        else:
            route.crashed = [(c, e) for c, e in route.crashed if c is not call]
        self.story.log(ev.stimulus_id, ("cancelled-unsent", cid), (cid, call.instance_id))
        self._fail(call, ev.error, ev.stimulus_id, out)
        self._pump(route, ev.stimulus_id, out)
        self._drop_if_idle(route)

    def _unrun_cancels(self, calls: list, sid: str, out: list) -> list:
        """``calls`` come back unrun (or from a lost host): the cancelled ones fail with
        their cancel's error (they are never sent again); returns the others."""
        cancels = self.cancels
        if not cancels:
            return calls
        keep = []
        for call in calls:
            error = cancels.get(call.call_id)
            if error is None:
                keep.append(call)
            else:
                self._fail(call, error, sid, out)
        return keep

    def _channel_lost(self, ev: ChannelLost, out: list) -> None:
        for route in list(self.routes.values()):
            if route.worker != ev.worker:
                continue
            resend = list(route.inflight.values())
            route.inflight.clear()
            if resend:
                # The calls that were running are among the oldest unanswered ones (the
                # worker starts them in the order they arrived, up to the concurrency): they
                # are charged a crash, and fail past the bound (charge_crash: the one rule).
                # The ones behind had not started.
                resend, failed = charge_crash(resend, _concurrency_of(resend), _charge,
                                              self._bound_of)
                resend = self._unrun_cancels(resend, ev.stimulus_id, out)
                for call, _n in failed:
                    if call.call_id in self.cancels:
                        self._fail(call, self.cancels[call.call_id], ev.stimulus_id, out)
                        continue
                    bound = self._bound_of(call)
                    why = (f"yrdask.scheduling.max-call-redeliveries={bound}"
                           if call.max_redeliveries is None else f"its own bound: {bound}")
                    if call.retried:
                        why += (f", which its {call.retried} reruns after an exception "
                                "count against too")
                    # settled once located: the crash error if the instance lives on (it
                    # restarted), else the instance's end (Ray's ActorDiedError)
                    route.crashed.append((call, CallCrashedError(
                        f"call {call.call_id} on instance {call.instance_id} may have been "
                        f"running when the instance's process died, {call.crashes} times "
                        f"(last on "
                        f"{ev.worker}); it is not delivered again ({why}): "
                        "it may be what kills the process", ev.worker)))
            if resend:
                # back in submission order, as the queue always is: ordered calls were sent
                # in that order and are all older than the queued ones (they go back in
                # front); unordered ones may have passed queued calls still waiting for
                # their arguments (they go back among them)
                route.queue = deque(sorted((*resend, *route.queue), key=_seq))
            route.worker, route.lost = None, ev.worker
            self.story.log(ev.stimulus_id, ("lost", route.instance_id, ev.worker,
                                            [c.call_id for c in resend],
                                            [c.call_id for c, _e in route.crashed]),
                           (route.instance_id, *(c.call_id for c in resend)))
            self._pump(route, ev.stimulus_id, out)

    def _moved(self, ev: CallMoved, out: list) -> None:
        call = self.calls.get(ev.call_id)
        route = self.routes.get(call.instance_id) if call is not None else None
        if route is None or ev.call_id not in route.inflight:
            self.story.log(ev.stimulus_id, ("moved-ignored", ev.call_id), (ev.call_id,))
            return
        # The old host runs nothing once the instance left, and it answers in the order it
        # received: this call and every one sent after it to that worker did not run there.
        # All go back to the front of the route uncharged (nothing crashed) and the route
        # locates the instance again; their own "moved" answers are then ignored.
        resend = list(route.inflight.values())
        route.inflight.clear()
        resend = self._unrun_cancels(resend, ev.stimulus_id, out)
        route.queue = deque(sorted((*resend, *route.queue), key=_seq))
        old, route.worker, route.lost = route.worker, None, None
        self.story.log(ev.stimulus_id, ("moved", route.instance_id, old,
                                        [c.call_id for c in resend]),
                       (route.instance_id, *(c.call_id for c in resend)))
        self._pump(route, ev.stimulus_id, out)

    # creation and location

    def _create_requested(self, ev: CreateRequested, out: list) -> None:
        iid = ev.instance_id
        if iid in self.routes:
            self.story.log(ev.stimulus_id, ("create-ignored", iid), (iid,))
            return
        self.routes[iid] = _Route(iid, CREATE_DEPS)
        self.registered.add(iid)  # the spec names this process as the first holder
        self.story.log(ev.stimulus_id, ("create", iid), (iid,))

    def _create_deps_ready(self, ev: CreateDepsReady, out: list) -> None:
        route = self.routes.get(ev.instance_id)
        if route is None or route.waiting != CREATE_DEPS:
            self.story.log(ev.stimulus_id, ("create-deps-ignored", ev.instance_id),
                           (ev.instance_id,))
            return
        if ev.error is not None:
            self._kill(route, ev.error, ev.stimulus_id, out)
            return
        route.waiting = CREATING
        self.story.log(ev.stimulus_id, ("send-create", ev.instance_id), (ev.instance_id,))
        out.append(SendCreate(ev.stimulus_id, ev.instance_id))

    def _created(self, ev: Created, out: list) -> None:
        route = self.routes.get(ev.instance_id)
        if route is None or route.waiting != CREATING:
            self.story.log(ev.stimulus_id, ("created-ignored", ev.instance_id),
                           (ev.instance_id,))
            return
        route.waiting, route.worker = None, ev.worker
        if ev.real_id != route.instance_id:
            route.real_id = ev.real_id
        self.story.log(ev.stimulus_id, ("created", ev.instance_id, ev.worker, ev.real_id),
                       (ev.instance_id, ev.real_id))
        self._pump(route, ev.stimulus_id, out)
        self._drop_if_idle(route)

    def _create_failed(self, ev: CreateFailed, out: list) -> None:
        route = self.routes.get(ev.instance_id)
        if route is None or route.waiting != CREATING:
            self.story.log(ev.stimulus_id, ("create-failed-ignored", ev.instance_id),
                           (ev.instance_id,))
            return
        self._kill(route, ScheduleError(ev.reason), ev.stimulus_id, out)

    def _located(self, ev: Located, out: list) -> None:
        route = self.routes.get(ev.instance_id)
        if route is None or route.waiting != LOCATING:
            self.story.log(ev.stimulus_id, ("located-ignored", ev.instance_id),
                           (ev.instance_id,))
            return
        route.waiting, route.lost = None, None
        if ev.real_id is not None and ev.real_id != route.instance_id:
            route.real_id = ev.real_id
        if ev.worker is None:
            self._kill(route, InstanceDiedError(
                f"instance {route.instance_id} is not available: {ev.reason}"),
                ev.stimulus_id, out)
            return
        crashed, route.crashed = route.crashed, []
        for call, error in crashed:  # it lives on: they may have been what killed it
            self._fail(call, error, ev.stimulus_id, out)
        route.worker = ev.worker
        self.story.log(ev.stimulus_id, ("located", ev.instance_id, ev.worker),
                       (ev.instance_id,))
        self._pump(route, ev.stimulus_id, out)
        self._drop_if_idle(route)

    # handles

    def _handle_added(self, ev: HandleAdded, out: list) -> None:
        self._incref(ev.instance_id, ev.stimulus_id, out)

    def _handle_dropped(self, ev: HandleDropped, out: list) -> None:
        self._decref(ev.instance_id, ev.stimulus_id, out)

    def _handle_sent(self, ev: HandleSent, out: list) -> None:
        self._transit.append((ev.instance_id, ev.token))
        self.story.log(ev.stimulus_id, ("transit", ev.instance_id, ev.token),
                       (ev.instance_id, ev.token))
        self._ask_flush(ev.stimulus_id, out)

    def _handle_arrived(self, ev: HandleArrived, out: list) -> None:
        self._arrived.append((ev.instance_id, ev.token))
        self.story.log(ev.stimulus_id, ("arrived", ev.instance_id, ev.token),
                       (ev.instance_id, ev.token))
        self._ask_flush(ev.stimulus_id, out)

    def _flush(self, ev: Flush, out: list) -> None:
        self._flush_asked = False
        deltas = {k: v for k, v in self._deltas.items() if v}
        if deltas or self._transit or self._arrived:
            self.story.log(ev.stimulus_id, ("report", deltas, len(self._transit),
                                            len(self._arrived)), tuple(deltas))
            out.append(ReportHandles(ev.stimulus_id, deltas, self._transit, self._arrived))
        self._deltas, self._transit, self._arrived = {}, [], []

    # -- helpers ---------------------------------------------------------------------------

    def _pump(self, route: _Route, sid: str, out: list) -> None:
        """Send what may leave; fail everything on a dead route; locate if nobody knows."""
        queue = route.queue
        if route.dead is not None:
            if route.crashed:  # the instance ended: they fail with its end
                crashed, route.crashed = route.crashed, []
                for call, _error in crashed:
                    self._fail(call, route.dead, sid, out)
            while queue:
                self._fail(queue.popleft(), route.dead, sid, out)
            return
        worker = route.worker
        if worker is None:
            if (queue or route.crashed) and route.waiting is None:
                route.waiting = LOCATING
                self.story.log(sid, ("locate", route.instance_id, route.lost),
                               (route.instance_id,))
                out.append(SendLocate(sid, route.instance_id, route.lost))
            return
        target = route.real_id or route.instance_id
        passed: list[_Call] | None = None  # unordered calls still waiting for their arguments
        while queue:
            call = queue[0]
            if not call.ready:
                if not call.unordered:
                    break  # later calls wait behind it: calls leave in submission order
                if passed is None:
                    passed = []
                passed.append(queue.popleft())
                continue
            queue.popleft()
            if call.error is not None:
                self._fail(call, call.error, sid, out)
                continue
            cid = call.call_id
            route.inflight[cid] = call
            self._entries.append((sid, "send", cid, target, worker))  # flat (Story)
            out.append(SendCall(sid, cid, target, worker, call.crashes + call.retried))
        if passed:
            queue.extendleft(reversed(passed))  # they keep their places, in submission order

    def _bound_of(self, call: _Call) -> int:
        return self.max_redeliveries if call.max_redeliveries is None else call.max_redeliveries

    def _fail(self, call: _Call, error: Any, sid: str, out: list) -> None:
        del self.calls[call.call_id]
        if self.cancels:
            self.cancels.pop(call.call_id, None)
        self.story.log(sid, ("failed", call.call_id, repr(error)),
                       (call.call_id, call.instance_id))
        out.append(CallFailed(sid, call.call_id, error))
        self._decref(call.instance_id, sid, out)

    def _kill(self, route: _Route, error: Any, sid: str, out: list) -> None:
        route.dead, route.waiting = error, None
        self.story.log(sid, ("dead", route.instance_id, repr(error)), (route.instance_id,))
        self._pump(route, sid, out)
        self._drop_if_idle(route)

    def _drop_if_idle(self, route: _Route) -> None:
        """A route nobody holds, with nothing to send or wait for, is forgotten."""
        iid = route.instance_id
        if (iid not in self.counts and not route.queue and not route.inflight
                and not route.crashed and route.waiting is None
                and self.routes.get(iid) is route):
            del self.routes[iid]

    def _incref(self, iid: str, sid: str, out: list) -> None:
        n = self.counts.get(iid, 0) + 1
        self.counts[iid] = n
        if n == 1 and iid not in self.registered:
            self.registered.add(iid)
            self._delta(iid, +1, sid, out)

    def _decref(self, iid: str, sid: str, out: list) -> None:
        n = self.counts.get(iid)
        if n is None:
            self.story.log(sid, ("decref-ignored", iid), (iid,))
            return
        if n > 1:
            self.counts[iid] = n - 1
            return
        del self.counts[iid]
        if iid in self.registered:
            self.registered.discard(iid)
            self._delta(iid, -1, sid, out)
        route = self.routes.get(iid)
        if route is not None:
            self._drop_if_idle(route)

    def _delta(self, iid: str, d: int, sid: str, out: list) -> None:
        self._deltas[iid] = self._deltas.get(iid, 0) + d
        self.story.log(sid, ("holder", iid, d), (iid,))
        self._ask_flush(sid, out)

    def _ask_flush(self, sid: str, out: list) -> None:
        if not self._flush_asked:
            self._flush_asked = True
            out.append(FlushSoon(sid))

    # -- invariants ------------------------------------------------------------------------

    def validate(self) -> None:
        """Check the machine's invariants (tests and the simulation call it after each step)."""
        seen: set[str] = set()
        pending: dict[str, int] = {}
        for iid, route in self.routes.items():
            assert route.instance_id == iid, (iid, route.instance_id)
            sent = list(route.inflight.values())
            queued = list(route.queue)
            crashed = [c for c, _e in route.crashed]
            if crashed:
                assert route.worker is None and route.dead is None, \
                    f"route {iid} keeps crashed calls while located"
                assert route.waiting is not None, f"route {iid} has crashed calls, nobody asked"
            for call in sent + queued + crashed:
                assert call.call_id not in seen, f"call {call.call_id} queued and in flight"
                seen.add(call.call_id)
                assert self.calls.get(call.call_id) is call, f"call {call.call_id} unknown"
                assert call.instance_id == iid, (call.call_id, iid)
            ordered = [c for c in sent + queued if not c.unordered]
            seqs = [c.seq for c in ordered]
            assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), \
                f"route {iid} out of submission order: {[c.call_id for c in ordered]}"
            assert [c.seq for c in queued] == sorted(c.seq for c in queued), \
                f"route {iid} queue out of submission order"
            for call in sent:
                assert call.ready and call.error is None, f"{call.call_id} sent unready"
            if sent:
                assert route.worker is not None, f"route {iid} has calls in flight, no worker"
            if route.dead is not None:
                assert not queued and not sent and route.waiting is None, \
                    f"dead route {iid} keeps calls"
            elif queued and route.worker is None:
                assert route.waiting is not None, f"route {iid} has calls and nobody asked"
            elif queued:
                assert not queued[0].ready, f"route {iid}: a ready call waits at the head"
            if route.waiting is not None:
                assert route.worker is None, f"route {iid} waits with a worker"
            pending[iid] = len(sent) + len(queued) + len(crashed)
        assert seen == set(self.calls), "calls known but on no route"
        for cid in self.cancels:  # a cancelled call that has not left never leaves
            call = self.calls.get(cid)
            assert call is not None, f"cancel of {cid} kept after it was settled"
            assert cid in self.routes[call.instance_id].inflight, \
                f"cancelled call {cid} waits to be sent"
        for iid, n in self.counts.items():
            assert n > 0, f"count of {iid} is {n}"
            assert iid in self.registered, f"{iid} held here but not reported"
        for iid, n in pending.items():
            assert self.counts.get(iid, 0) >= n, f"{iid}: {n} calls but count {self.counts.get(iid)}"
        for iid, d in self._deltas.items():
            assert d in (-1, 0, 1), f"delta of {iid} is {d}"
        if self._deltas or self._transit or self._arrived:
            assert self._flush_asked, "handle report batched with no flush asked"

# built per task on the hot path: slots written directly (statemachine.fast_init)
fast_init(*[c for c in list(globals().values())
            if isinstance(c, type) and issubclass(c, (Event, Instruction))])
