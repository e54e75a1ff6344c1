"""The scheduler's lease queue: who holds which worker's resources, and who waits for them.

A *holding* keeps resources of one worker: a task *lease* (a submitter pushes tasks of one
shape straight to that worker while it holds it) or an *instance* (for its whole life).
:class:`LeaseQueue` decides every holding, as a pure state machine
(``yrdask/statemachine.py``, contract in ``docs/state-machines.md``): no I/O, no clock, no
asyncio.  The Dask adapter (``scheduler/extension.py``) stamps events with its loop's clock,
answers each request's rpc with its ``Granted``/``Refused``, sends ``Revoke`` on the owner's
stream and turns ``WakeAt`` into ``loop.call_at``; the simulation in ``tests/sim`` drives the
same class through a simulated network.

The rules:

* a request is granted at once when a worker fits it (:meth:`Ledger.choose`: hard
  affinities filter, soft ones rank, the requester's ``local`` worker first, ``avoid`` never,
  nor a worker being drained to retire: ``WorkerDraining``);
* otherwise it waits, first come first served but without head-of-line blocking: whenever
  resources free up, every waiting request that fits now is granted, in arrival order,
  except that a task lease request whose queue already holds leases comes after those whose
  queues hold fewer, not counting leases whose CPU is lent (fair shares: freed room goes to
  the queue with the fewest running leases, not
  back to an older request of a queue that runs already, whose extra lease other waiters
  would then revoke after one task);
* a waiting request asks the owners of idle leases that stand in its way (leases on workers
  that could run it, except those serving the requester's own queue) to return them, each
  lease at most once per request; a lease request whose queue runs already asks with
  ``keep`` (a busy lease may run its backlog a while first), and asks again without it
  once its queue runs nothing;
* a lease whose task blocks in ``yr.get`` lends its CPU back (``LeaseBlocked``), and what
  waits may be granted on it: nested work cannot deadlock even on a one-CPU cluster;
* at its deadline a request keeps waiting (another ``timeout`` or at least 1 s) while leases
  hold what it needs on a worker that could run it, since tasks end; otherwise it is refused
  with :meth:`Ledger.explain_unfit`.  ``timeout_ms < 0`` waits forever;
* while Dask's deployer is attached (``scaling``, docs/deploy.md "Scaling up"), a request
  that a worker it adds could run waits past its deadline too (the cluster grows to it),
  and one that none could run, nor any node there ever could, is refused on arrival;
* a lease request withdrawn by its owner (its queue drained) leaves the queue, ``Refused``;
  a withdraw that overtakes its request (it names the owner's own id of a request not heard
  of yet) is remembered, boundedly, and the request is refused on arrival, never granted
  only to be returned;
* every request is answered exactly once (``Granted`` or ``Refused``).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Callable

from yrdask.affinity import Wire
from yrdask.protocol import mark_lease
from yrdask.scheduler.requests import freeze, shape_of
from yrdask.scheduler.resources import (DEVICE_KINDS, FIX_HINT, Holding, Ledger, Shape,
                                         device_kind, format_shape)
from yrdask.statemachine import Event, Instruction, Story, remember

EXTEND_MIN_MS = 1000  # a request that could be freed waits at least this long more
WITHDRAWN_UNSEEN = 1024  # withdraws of requests not heard of yet remembered (oldest forgotten)
TOLERANCE = 1e-6  # float slack of the ledger checks


# -- events ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerJoined(Event):
    """A yr worker process offers ``capacity`` ({resource: amount}) to its ``node`` (its
    own address if empty): ``gpus`` the device ids it can run work on, ``shared`` node-wide
    amounts that do not add up over the node's processes, ``labels`` the node's labels as
    ``((key, value), ...)`` (``docs/nodes.md``)."""

    worker: str
    capacity: Shape
    node: str = ""
    gpus: tuple = ()
    shared: Any = None
    labels: tuple = ()


@dataclass(frozen=True, slots=True)
class WorkerLeft(Event):
    """A worker is gone: what it held is lost, and (as an owner) its leases elsewhere are
    released and its waiting requests refused, as for ``OwnerGone(worker)``."""

    worker: str


@dataclass(frozen=True, slots=True)
class WorkerDraining(Event):
    """``worker`` is being drained to retire (``draining``; scheduler/drain.py), or was kept
    after all: while it drains nothing new is granted on it (leases, instances; a node all
    of whose processes drain takes no new bundle), and what it holds stays."""

    worker: str
    draining: bool


@dataclass(frozen=True, slots=True)
class HoldRequested(Event):
    """Hold ``shape`` on one worker for ``owner``: a task lease or an instance's holding.

    ``holding_id`` names the holding (instances hold under their own id; ``None``: the queue
    makes a lease id).  ``timeout_ms < 0`` waits forever.  ``local`` is the worker to prefer,
    ``queue`` the owner's task queue a lease serves (never revoked for that same queue),
    ``avoid`` workers never to grant on, ``affinity`` the wire form of
    :mod:`yrdask.affinity`, ``labels`` an instance's labels, ``label`` what it is for people
    (an instance's class name; named in wait explanations and refusals).
    """

    request_id: str
    owner: str
    kind: str
    shape: Shape
    timeout_ms: int
    local: str | None
    queue: str
    avoid: tuple
    affinity: Wire
    labels: tuple
    holding_id: str | None
    now: float
    label: str = ""
    own_id: str = ""  # the owner's own id of a lease request (what its withdraw names)


@dataclass(frozen=True, slots=True)
class HoldingsReleased(Event):
    """The holdings are given back (returned leases, ended instances)."""

    holding_ids: tuple


@dataclass(frozen=True, slots=True)
class LeaseBlocked(Event):
    """A task of the lease blocks in ``yr.get``: its CPU is lent back."""

    lease_id: str


@dataclass(frozen=True, slots=True)
class LeaseUnblocked(Event):
    """The blocked task runs again: its lease takes its CPU back."""

    lease_id: str


@dataclass(frozen=True, slots=True)
class OwnerGone(Event):
    """A driver's job (or a worker's submitter) ended: its leases are released and its
    waiting requests refused."""

    owner: str


@dataclass(frozen=True, slots=True)
class RequestCancelled(Event):
    """The requester no longer wants it (an instance ended while it waited)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class RequestWithdrawn(Event):
    """``owner`` withdraws its waiting lease request (its queue drained): it leaves the
    queue, answered ``Refused``; a request answered already, or another owner's, is left
    alone.  ``request_id`` empty: the request (the owner's ``own_id``) is not heard of yet
    (the withdraw overtook it, or it was answered already): remembered, so that it is
    refused on arrival."""

    request_id: str
    owner: str
    own_id: str = ""


@dataclass(frozen=True, slots=True)
class Tick(Event):
    """A timer asked for with ``WakeAt`` fired (or time simply passed)."""

    now: float


# -- instructions ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Granted(Instruction):
    """Answer the request: it holds ``holding_id`` on ``worker``."""

    request_id: str
    holding_id: str
    worker: str


@dataclass(frozen=True, slots=True)
class Refused(Instruction):
    """Answer the request: it cannot be had, because ``reason``."""

    request_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Revoke(Instruction):
    """Ask ``owner`` to return these leases once idle (``REVOKE_LEASES`` on its stream);
    ``keep``: the waiter's queue runs already, so a busy lease may run its backlog a while
    first."""

    owner: str
    lease_ids: tuple
    keep: bool = False


@dataclass(frozen=True, slots=True)
class WakeAt(Instruction):
    """Send ``Tick(now)`` at or after ``at``."""

    at: float


# -- the machine -----------------------------------------------------------------------------


class _Waiter:
    """A request waiting for room."""

    __slots__ = ("request_id", "owner", "kind", "shape", "timeout_ms", "local", "queue",
                 "avoid", "affinity", "labels", "holding_id", "deadline", "revoked", "label",
                 "since")

    def __init__(self, ev: HoldRequested) -> None:
        self.request_id = ev.request_id
        self.owner = ev.owner
        self.kind = ev.kind
        self.shape = shape_of(ev.shape)
        self.timeout_ms = ev.timeout_ms
        self.local = ev.local
        self.queue = ev.queue or ""
        self.avoid = tuple(ev.avoid or ())
        self.affinity = freeze(ev.affinity or ())
        self.labels = tuple(ev.labels or ())
        self.holding_id = ev.holding_id
        self.deadline: float | None = None if ev.timeout_ms < 0 else ev.now + ev.timeout_ms / 1000
        self.revoked: dict[str, bool] = {}  # leases already revoked for it -> with keep
        self.label = ev.label
        self.since = ev.now  # when it arrived (the adapter's clock)

    def describe(self) -> str:
        """``"Counter instance I5"`` / ``"task lease request R3 of tcp://..."``."""
        if self.kind == "lease":
            return f"task lease request {self.request_id} of {self.owner}"
        what = f"{self.label} {self.kind}" if self.label else self.kind
        return f"{what} {self.holding_id or self.request_id}"

    def fit_key(self) -> tuple:
        """Requests with equal keys fit exactly the same workers."""
        return (tuple(sorted(self.shape.items())), self.avoid, self.affinity)

    def __repr__(self) -> str:
        return (f"<{self.kind} request {self.request_id} of {self.owner} "
                f"{format_shape(self.shape)}>")


class LeaseQueue:
    """Grants leases and instance holdings, queues what does not fit (see module docstring).

    ``ledger`` is the resource :class:`Ledger` (read by the dashboard), ``pending`` the
    waiting requests by id in arrival order, ``counters`` the lease counters.
    """

    def __init__(self, story_len: int = 100_000) -> None:
        self.ledger = Ledger()
        self.pending: dict[str, _Waiter] = {}
        self.counters: dict[str, int] = {"leases_granted": 0, "leases_local": 0,
                                         "leases_forwarded": 0, "lease_timeouts": 0,
                                         "requests_withdrawn": 0}
        self.next_wake: float | None = None  # earliest WakeAt not yet answered by a Tick
        # (owner, own id) withdrawn before the request came (or after its answer): refused
        # on arrival; at most WITHDRAWN_UNSEEN, oldest forgotten first
        self.withdrawn_unseen: dict[tuple[str, str], None] = {}
        self._ids = 0
        self._story = Story(story_len)
        # Resource groups (scheduler/groups.py GroupMachine, set by the adapter): a request
        # whose affinity names a bundle is fitted into that bundle's reservation by it.
        self.bundles: Any = None
        # Dask's deployer (scheduler/scale_up.py ScaleUp, set by the adapter): while one is
        # attached, its verdict() says whether a worker it adds could run a request.
        self.scaling: Any = None
        self._handlers: dict[type, Callable[[Any], list[Instruction]]] = {
            HoldRequested: self._requested, HoldingsReleased: self._released,
            LeaseBlocked: self._blocked, LeaseUnblocked: self._unblocked,
            OwnerGone: self._owner_gone, RequestCancelled: self._cancelled,
            RequestWithdrawn: self._withdrawn, Tick: self._tick,
            WorkerJoined: self._worker_joined, WorkerLeft: self._worker_left,
            WorkerDraining: self._worker_draining,
        }

    # -- queries ---------------------------------------------------------------------------

    def story(self, *keys: str) -> list[tuple[str, tuple]]:
        """The story entries mentioning any request id, holding id, owner or worker in
        ``keys``."""
        return self._story.about(*keys)

    def story_text(self, *keys: str) -> str:
        """:meth:`story` (or everything) as text, one entry a line."""
        return self._story.dump(*keys)

    def waiting_longer_than(self, seconds: float, now: float) -> list[str]:
        """Ids of the requests that have waited at least ``seconds`` at ``now``, oldest
        first."""
        return [rid for rid, w in self.pending.items() if now - w.since >= seconds]

    def explain_wait(self, request_id: str, now: float | None = None) -> dict[str, Any] | None:
        """Why a waiting request waits, or None if it does not wait.

        ``{"request_id", "kind", "label", "what", "owner", "holding_id", "needs", "since",
        "waited_s", "reasons": [one line per worker], "fix", "text"}``: ``what`` names it for people
        (``"Counter instance I5"``), ``reasons`` come from :meth:`Ledger.explain_wait`
        (what each worker that could run it lacks, and which holdings hold it), ``text`` is
        all of it in one line.
        """
        w = self.pending.get(request_id)
        if w is None:
            return None
        reasons = ([self.bundles.explain(w.affinity, w.shape)] if self._in_bundle(w)
                   else self.ledger.explain_wait(w.shape, w.affinity, w.avoid))
        waited = None if now is None else max(0.0, now - w.since)
        head = f"{w.describe()} waits for {format_shape(w.shape)}"
        if waited is not None:
            head += f" ({waited:.0f} s so far)"
        return {"request_id": w.request_id, "kind": w.kind, "label": w.label,
                "what": w.describe(), "owner": w.owner, "holding_id": w.holding_id,
                "needs": dict(w.shape), "since": w.since, "waited_s": waited,
                "reasons": reasons, "fix": FIX_HINT,
                "text": f"{head}: {'; '.join(reasons)}. {FIX_HINT}"}

    def holdings_on(self, worker: str) -> list[Holding]:
        """What ``worker`` holds now (lost with it if it leaves)."""
        p = self.ledger.processes.get(worker)
        ws = p if p is not None else self.ledger.workers.get(worker)
        return [] if ws is None else [self.ledger.holdings[h] for h in sorted(ws.holdings)
                                      if h in self.ledger.holdings]

    # -- events ----------------------------------------------------------------------------

    def handle(self, event: Event) -> list[Instruction]:
        """Apply ``event``; returns what the adapter must do, in order."""
        handler = self._handlers.get(type(event))
        if handler is None:
            self._story.log(event.stimulus_id, ("unknown-event", type(event).__name__), ())
            return []
        return handler(event)

    def _requested(self, ev: HoldRequested) -> list[Instruction]:
        sid, rid = ev.stimulus_id, ev.request_id
        if rid in self.pending:
            self._story.log(sid, ("duplicate-request-ignored", rid), (rid, ev.owner))
            return []
        if ev.own_id and self.withdrawn_unseen and ev.kind == "lease" \
                and self.withdrawn_unseen.pop((ev.owner, ev.own_id), 0) is None:
            self.counters["requests_withdrawn"] += 1
            self._story.log(sid, ("withdrawn-before-arrival", rid, ev.owner, ev.own_id),
                            (rid, ev.owner))
            return [Refused(sid, rid, f"the lease request {rid} was withdrawn by its owner "
                                      f"{ev.owner} before it arrived (its queue drained)")]
        w = _Waiter(ev)
        self._story.log(sid, ("requested", rid, w.kind, w.owner, format_shape(w.shape),
                              w.timeout_ms), (rid, w.owner, w.holding_id))
        out: list[Instruction] = []
        if self._try_grant(w, sid, out):
            if w.labels and self.pending:  # its labels may admit a waiter's affinity
                self._grant_pending(sid, out)
            return out
        reason = self._never_by_scaling(w)
        if reason:
            self._story.log(sid, ("refused", rid, reason), (rid, w.owner))
            return [Refused(sid, rid, reason)]
        self.pending[rid] = w
        self._story.log(sid, ("wait", rid, w.deadline), (rid,))
        self._revoke_for(w, sid, out)
        if w.deadline is not None:
            out.extend(self._wake(sid, w.deadline))
        return out

    def _released(self, ev: HoldingsReleased) -> list[Instruction]:
        sid = ev.stimulus_id
        for hid in ev.holding_ids:
            h = self.ledger.release(hid)
            if h is None:
                self._story.log(sid, ("release-ignored", hid), (hid,))
            else:
                self._story.log(sid, ("released", hid, h.worker), (hid, h.owner, h.worker))
        out: list[Instruction] = []
        self._grant_pending(sid, out)
        return out

    def _blocked(self, ev: LeaseBlocked) -> list[Instruction]:
        if not self.ledger.lend_cpu(ev.lease_id, True):
            self._story.log(ev.stimulus_id, ("lend-ignored", ev.lease_id), (ev.lease_id,))
            return []
        self._story.log(ev.stimulus_id, ("lent", ev.lease_id), (ev.lease_id,))
        out: list[Instruction] = []
        self._grant_pending(ev.stimulus_id, out)
        return out

    def _unblocked(self, ev: LeaseUnblocked) -> list[Instruction]:
        changed = self.ledger.lend_cpu(ev.lease_id, False)
        self._story.log(ev.stimulus_id, ("unlent" if changed else "unlend-ignored",
                                         ev.lease_id), (ev.lease_id,))
        return []

    def _owner_gone(self, ev: OwnerGone) -> list[Instruction]:
        out: list[Instruction] = []
        self._drop_owner(ev.owner, ev.stimulus_id, out)
        self._grant_pending(ev.stimulus_id, out)
        return out

    def _cancelled(self, ev: RequestCancelled) -> list[Instruction]:
        w = self.pending.pop(ev.request_id, None)
        if w is None:
            self._story.log(ev.stimulus_id, ("cancel-ignored", ev.request_id), (ev.request_id,))
            return []
        self._story.log(ev.stimulus_id, ("cancelled", ev.request_id), (ev.request_id, w.owner))
        return [Refused(ev.stimulus_id, ev.request_id,
                        f"the {w.kind} request {ev.request_id} was cancelled")]

    def _withdrawn(self, ev: RequestWithdrawn) -> list[Instruction]:
        """The waiter goes, and with it the revokes asked for on its behalf (its record of
        them: leases already revoked stay so at their owners, and go back once idle)."""
        sid, rid = ev.stimulus_id, ev.request_id
        if not rid:
            if ev.own_id:
                remember(self.withdrawn_unseen, (ev.owner, ev.own_id), None, WITHDRAWN_UNSEEN)
                self._story.log(sid, ("withdrawn-unseen", ev.own_id, ev.owner), (ev.owner,))
            return []
        w = self.pending.get(rid)
        if w is None or w.owner != ev.owner or w.kind != "lease":
            self._story.log(sid, ("withdraw-ignored", rid, ev.owner), (rid, ev.owner))
            return []
        del self.pending[rid]
        self.counters["requests_withdrawn"] += 1
        self._story.log(sid, ("withdrawn", rid, w.owner, tuple(w.revoked)),
                        (rid, w.owner, *w.revoked))
        return [Refused(sid, rid, f"the lease request {rid} was withdrawn by its owner "
                                  f"{w.owner} (its queue drained)")]

    def _tick(self, ev: Tick) -> list[Instruction]:
        sid, now = ev.stimulus_id, ev.now
        self.next_wake = None  # the timer that brought this Tick is spent
        out: list[Instruction] = []
        self._grant_pending(sid, out)
        for rid, w in list(self.pending.items()):
            if w.deadline is None or w.deadline > now:
                continue
            if self._could_free(w) or self._may_grow(w):
                # Running tasks hold what it needs on a worker that could run it: they end;
                # or the deployer can add a worker that runs it.
                w.deadline = now + max(w.timeout_ms, EXTEND_MIN_MS) / 1000
                self._story.log(sid, ("extend", rid, w.deadline), (rid,))
                self._revoke_for(w, sid, out)
                continue
            del self.pending[rid]
            self.counters["lease_timeouts"] += 1
            reason = (self.bundles.explain(w.affinity, w.shape) if self._in_bundle(w)
                      else self.ledger.explain_unfit(w.shape, w.affinity))
            if w.kind != "lease":
                reason = f"{w.describe()}: {reason}"
            if w.avoid:
                reason += f" (it avoids {', '.join(w.avoid)}, unreachable to its requester)"
            self._story.log(sid, ("refused", rid, reason), (rid, w.owner))
            out.append(Refused(sid, rid, reason))
        earliest = min((w.deadline for w in self.pending.values() if w.deadline is not None),
                       default=None)
        if earliest is not None:
            out.extend(self._wake(sid, earliest))
        return out

    def _worker_joined(self, ev: WorkerJoined) -> list[Instruction]:
        sid, worker = ev.stimulus_id, ev.worker
        known = worker in self.ledger.processes  # registered again: it keeps what it holds
        self.ledger.add_worker(worker, shape_of(ev.capacity), ev.node or None, ev.gpus,
                               shape_of(ev.shared or {}), dict(ev.labels))
        node = self.ledger.node_of(worker)
        self._story.log(sid, ("worker-capacity" if known else "worker-joined", worker,
                              format_shape(ev.capacity), node), (worker, node))
        out: list[Instruction] = []
        self._grant_pending(sid, out)
        return out

    def _worker_draining(self, ev: WorkerDraining) -> list[Instruction]:
        sid, worker = ev.stimulus_id, ev.worker
        if not self.ledger.set_draining(worker, ev.draining):
            self._story.log(sid, ("draining-ignored", worker, ev.draining), (worker,))
            return []
        self._story.log(sid, ("draining" if ev.draining else "kept", worker), (worker,))
        out: list[Instruction] = []
        if not ev.draining:  # room again for what waits
            self._grant_pending(sid, out)
        return out

    def _worker_left(self, ev: WorkerLeft) -> list[Instruction]:
        sid, worker = ev.stimulus_id, ev.worker
        lost = self.ledger.remove_worker(worker)
        self._story.log(sid, ("worker-left", worker, tuple(sorted(h.holding_id for h in lost))),
                        (worker,))
        for h in lost:
            self._story.log(sid, ("lost", h.holding_id, h.kind, worker),
                            (h.holding_id, h.owner))
        out: list[Instruction] = []
        # A submitter on that worker owned leases elsewhere, and may have requests waiting.
        self._drop_owner(worker, sid, out)
        self._grant_pending(sid, out)
        return out

    # -- helpers ---------------------------------------------------------------------------

    def _new_id(self) -> str:
        while True:
            self._ids += 1
            hid = f"L{self._ids}"
            if hid not in self.ledger.holdings:
                return hid

    def _in_bundle(self, w: _Waiter) -> bool:
        """True if ``w`` asks for a resource-group bundle (fitted by ``self.bundles``)."""
        return self.bundles is not None and self.bundles.targets(w.affinity)

    def _try_grant(self, w: _Waiter, sid: str, out: list[Instruction]) -> bool:
        """Grant ``w`` if a worker fits it now; True if ``w`` was answered."""
        ledger = self.ledger
        bundle = ""
        if self._in_bundle(w):
            found = self.bundles.fit(w.affinity, w.shape, w.avoid)
            if isinstance(found, str):  # it never can: no such group, bundle too small
                self._story.log(sid, ("refused", w.request_id, found), (w.request_id,))
                out.append(Refused(sid, w.request_id, found))
                return True
            worker, bundle = found if found is not None else (None, "")
        else:
            worker = ledger.choose(w.shape, prefer=w.local, avoid=w.avoid, affinity=w.affinity)
        if worker is None:
            return False
        hid = w.holding_id or self._new_id()
        gpus = ledger.plan_gpus(w.shape, worker, bundle)
        if not w.holding_id:
            # The lease id carries its devices and whole CPUs to the worker
            # (protocol.lease_devices, protocol.lease_cpus).
            hid = mark_lease(hid, [g for g, _ in gpus], w.shape.get("CPU", 0.0) / 1000)
        if hid in ledger.holdings:  # the same instance placed twice: never count it twice
            reason = f"holding {hid} already holds resources on {ledger.holdings[hid].worker}"
            self._story.log(sid, ("refused", w.request_id, reason), (w.request_id, hid))
            out.append(Refused(sid, w.request_id, reason))
            return True
        ledger.hold(Holding(hid, w.kind, worker, w.shape, w.owner, queue=w.queue,
                            labels=w.labels, label=w.label, bundle=bundle, gpus=gpus))
        if w.kind == "lease":
            counters = self.counters
            counters["leases_granted"] += 1
            counters["leases_local" if worker == w.local else "leases_forwarded"] += 1
        self._story.log(sid, ("granted", w.request_id, hid, worker),
                        (w.request_id, hid, w.owner, worker))
        out.append(Granted(sid, w.request_id, hid, worker))
        return True

    def _grant_pending(self, sid: str, out: list[Instruction]) -> None:
        """Grant every waiting request that fits now, oldest first but the poorer queues'
        lease requests before richer ones (:meth:`_fair_order`; no head-of-line blocking).

        Resources only shrink during a pass, so a request shape that did not fit is not tried
        again in it; an instance granted with labels may admit an earlier request's
        affinity, so that starts another pass.  A lease granted while others still wait
        stands in their way as the ones they revoked on arrival did: they revoke it too, so
        it comes back once idle instead of after its owner's idle time.
        """
        pending = self.pending
        granted = False
        while pending:
            unfit: set[tuple] = set()
            relabelled = False
            for w in self._fair_order():
                rid = w.request_id
                key = w.fit_key()
                if key in unfit:
                    continue
                if self._try_grant(w, sid, out):
                    del pending[rid]
                    granted = True
                    relabelled = relabelled or bool(w.labels)
                else:
                    unfit.add(key)
            if not relabelled:
                break
        if granted:
            running = self._running_queues()  # once for the pass: revokes change no holding
            for w in list(pending.values()):
                self._revoke_for(w, sid, out, running)

    def _fair_order(self):
        """The waiters in the order :meth:`_grant_pending` tries them: arrival order, but a
        lease request after the requests whose queues hold fewer leases (counted as grants
        happen during the pass).  A lease whose task waits in ``yr.get`` (its CPU lent) is
        not counted: the parents of nested work stay in arrival order with their children.
        A generator: it sees the grants made while it runs."""
        pending = self.pending
        queues = {(w.owner, w.queue) for w in pending.values() if w.kind == "lease"}
        if len(queues) < 2:  # one queue (or none) waits: arrival order is fair
            yield from list(pending.values())
            return
        held: dict[tuple, int] = dict.fromkeys(queues, 0)
        for h in self.ledger.holdings.values():
            key = (h.owner, h.queue)
            if h.kind == "lease" and key in held and not h.lent_cpu:
                held[key] += 1
        heap = []
        for seq, w in enumerate(pending.values()):
            n = held[(w.owner, w.queue)] if w.kind == "lease" else 0
            heap.append((n, seq, w))
        heapq.heapify(heap)
        while heap:
            n, seq, w = heapq.heappop(heap)
            if w.kind == "lease":
                now = held[(w.owner, w.queue)]
                if now != n:  # its queue was granted a lease since: behind the poorer ones
                    heapq.heappush(heap, (now, seq, w))
                    continue
            yield w
            if w.kind == "lease" and w.request_id not in pending:  # granted
                held[(w.owner, w.queue)] += 1

    def _holders_for(self, w: _Waiter) -> list[Holding]:
        if self._in_bundle(w):  # only leases inside its bundle(s) can make room for it
            return self.bundles.lease_holders(w.affinity)
        return self.ledger.lease_holders_on_fitting_workers(w.shape, w.affinity, w.avoid)

    def _could_free(self, w: _Waiter) -> bool:
        """True if leases (tasks, which end) hold resources on a worker that could run ``w``."""
        return bool(self._holders_for(w))

    def _may_grow(self, w: _Waiter) -> bool:
        """True if a deployer is attached and a worker it adds could run ``w``."""
        return (self.scaling is not None and not self._in_bundle(w)
                and self.scaling.verdict(w.shape, w.affinity) == "")

    def _never_by_scaling(self, w: _Waiter) -> str:
        """Why ``w`` can never run, when a deployer is attached, none of its workers could
        run it and no node there ever could; else ``""`` (it waits)."""
        if self.scaling is None or self._in_bundle(w):
            return ""
        why = self.scaling.verdict(w.shape, w.affinity)
        if not why or self.ledger.could_ever_fit(w.shape, w.affinity):
            return ""
        what = "" if w.kind == "lease" else f"{w.describe()}: "
        return (f"{what}request {format_shape(w.shape)} can never be scheduled: {why}. "
                f"{FIX_HINT}")

    def _running_queues(self) -> set[tuple]:
        """The (owner, queue) of every lease whose CPU is not lent: the queues that run."""
        return {(h.owner, h.queue) for h in self.ledger.holdings.values()
                if h.kind == "lease" and not h.lent_cpu}

    def _revoke_for(self, w: _Waiter, sid: str, out: list[Instruction],
                    running: set[tuple] | None = None) -> None:
        """Ask the owners of leases that stand in ``w``'s way to return the idle ones.

        A lease request whose own queue runs already (holds a lease whose CPU is not lent)
        revokes with ``keep``: busy leases may run their backlog a while first, so that
        queues that all run and all want more do not trade their leases after every task.
        Once its queue runs nothing, it asks again without ``keep``. A request for a
        resource-group bundle always revokes firmly: what its queue runs outside the bundle
        says nothing about room inside it."""
        holders = self._holders_for(w)
        if not holders:
            return
        if running is None:
            running = self._running_queues()
        keep = (w.kind == "lease" and not self._in_bundle(w)
                and (w.owner, w.queue) in running)
        by_owner: dict[str, list[str]] = {}
        revoked = w.revoked
        for h in holders:
            hid = h.holding_id
            if h.owner == w.owner and h.queue == w.queue:
                continue  # it serves this very queue
            asked = revoked.get(hid)
            if asked is not None and (asked <= keep):
                continue  # asked for already (as firmly)
            revoked[hid] = keep
            by_owner.setdefault(h.owner, []).append(hid)
        for owner, lease_ids in by_owner.items():
            self._story.log(sid, ("revoke", w.request_id, owner, tuple(lease_ids), keep),
                            (w.request_id, owner, *lease_ids))
            out.append(Revoke(sid, owner, tuple(lease_ids), keep))

    def _drop_owner(self, owner: str, sid: str, out: list[Instruction]) -> None:
        """Release ``owner``'s leases, refuse its waiting requests and forget its withdraws
        (a process started later at the same address counts its ids from the start again)."""
        ledger = self.ledger
        if self.withdrawn_unseen:
            for key in [k for k in self.withdrawn_unseen if k[0] == owner]:
                del self.withdrawn_unseen[key]
        for h in [h for h in ledger.holdings.values() if h.owner == owner and h.kind == "lease"]:
            ledger.release(h.holding_id)
            self._story.log(sid, ("released-owner-gone", h.holding_id, h.worker),
                            (h.holding_id, owner, h.worker))
        for rid, w in list(self.pending.items()):
            if w.owner == owner:
                del self.pending[rid]
                reason = f"the requester {owner} of {w.kind} request {rid} is gone"
                self._story.log(sid, ("refused", rid, reason), (rid, owner))
                out.append(Refused(sid, rid, reason))

    def _wake(self, sid: str, at: float) -> list[Instruction]:
        if self.next_wake is not None and self.next_wake <= at:
            return []
        self.next_wake = at
        return [WakeAt(sid, at)]

    # -- invariants ------------------------------------------------------------------------

    def validate(self) -> None:
        """Check the queue's invariants (the simulation calls this after every step)."""
        ledger = self.ledger
        sums: dict[str, dict[str, float]] = {w: {} for w in ledger.workers}
        gpus: dict[str, dict[str, float]] = {w: {} for w in ledger.workers}
        for hid, h in ledger.holdings.items():
            assert h.holding_id == hid, f"holding {hid} filed as {h.holding_id}"
            assert h.node in ledger.workers, f"holding {hid} on unknown node {h.node}"
            assert hid in ledger.workers[h.node].holdings, f"{h.node} does not list {hid}"
            if h.kind != "bundle":
                assert h.worker in ledger.processes or h.worker in ledger.workers, \
                    f"holding {hid} runs in unknown worker process {h.worker}"
            for kind in DEVICE_KINDS:
                assert abs(sum(a for g, a in h.gpus if device_kind(g) == kind)
                           - h.shape.get(kind, 0.0)) < TOLERANCE \
                    or not ledger.workers[h.node].gpu_used, \
                    f"{hid} holds devices {h.gpus} for {h.shape}"
            if not h.bundle:
                for g, a in h.gpus:
                    gpus[h.node][g] = gpus[h.node].get(g, 0.0) + a
            s = sums[h.node] if not h.bundle else {}  # bundled: counted in its bundle
            for r, a in h.shape.items():
                if not (r == "CPU" and h.lent_cpu):
                    s[r] = s.get(r, 0.0) + a
        for address, ws in ledger.workers.items():
            for hid in ws.holdings:
                assert hid in ledger.holdings, f"{address} lists holding {hid} the ledger forgot"
            for r in set(ws.held) | set(sums[address]):
                held, due = ws.held.get(r, 0.0), sums[address].get(r, 0.0)
                assert abs(held - due) < TOLERANCE, \
                    f"{address} holds {r}={held:g} but its holdings sum to {due:g}"
                assert held > -TOLERANCE, f"{address} holds a negative {r}={held:g}"
            for g, used in ws.gpu_used.items():
                due = gpus[address].get(g, 0.0)
                assert abs(used - due) < TOLERANCE, \
                    f"{address} GPU {g} used {used:g} but its holdings sum to {due:g}"
                assert used < 1.0 + TOLERANCE, f"{address} GPU {g} over-committed: {used:g}"
        assert len(self.withdrawn_unseen) <= WITHDRAWN_UNSEEN, "unbounded withdraw memory"
        deadlines = []
        for rid, w in self.pending.items():
            assert w.request_id == rid, f"request {rid} filed as {w.request_id}"
            assert (w.deadline is None) == (w.timeout_ms < 0), f"request {rid}: deadline {w.deadline}"
            worker = (self.bundles.fit(w.affinity, w.shape, w.avoid) if self._in_bundle(w)
                      else ledger.choose(w.shape, avoid=w.avoid, affinity=w.affinity))
            assert worker is None, f"request {rid} waits though {worker} has room for it"
            if w.deadline is not None:
                deadlines.append(w.deadline)
        if deadlines:
            assert self.next_wake is not None and self.next_wake <= min(deadlines), \
                f"requests wait for deadlines {min(deadlines)} without a timer ({self.next_wake})"
