"""Resource groups (yr's placement groups): where each bundle's reservation lives, as a pure machine.

A group reserves ``bundles`` ({resource: amount} each) on nodes (hosts: docs/nodes.md; the
"workers" below are nodes), all at once or not at all, under a strategy: ``STRICT_PACK``
(every bundle on one node), ``STRICT_SPREAD`` (each bundle on its own node) are hard; ``PACK`` / ``SPREAD`` (and ``None``) are preferences.  A group
that cannot be placed now waits and is tried again whenever the cluster changes.

The machine shares the lease queue's :class:`~yrdask.scheduler.resources.Ledger` and writes
only two things into it: holdings of kind ``"bundle"`` (a reservation takes the worker's free
capacity) and ``ledger.bundle_held`` (what runs inside each bundle holds).  The lease queue
asks :meth:`GroupMachine.fit` where a request that names a bundle (see
:func:`yrdask.protocol.bundle_wire`) fits: against the bundle's remaining reservation, not the
worker's free capacity.  Events in (:meth:`GroupMachine.handle`), instructions out; no I/O.

* A lost worker's bundles go back to pending and are placed again (Ray's behaviour), next to
  the group's other bundles as the strategy demands; what ran in them follows the usual
  fault rules.
* Removing a group (by the user, or because its owner's job ended, unless it is detached:
  Ray's ``lifetime="detached"``) releases its reservations and emits :class:`EndHolding`
  for each lease and instance inside it.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

from yrdask.protocol import RG_CREATED, RG_PENDING, RG_REMOVED, bundle_target
from yrdask.scheduler.resources import DEVICE_KINDS, EPS, Holding, Ledger, Shape, format_shape
from yrdask.statemachine import Event, Instruction, Story

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD", "None")
SEARCH_LIMIT = 5_000  # placement search steps per group and attempt
REMOVED_KEPT = 1000  # removed groups remembered (so wait() can say why they ended)


# -- events ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GroupRequested(Event):
    """Create group ``name`` of ``owner`` with ``bundles`` (validated shapes)."""

    name: str
    owner: str
    bundles: tuple
    strategy: str
    fate_sharing: bool = False
    detached: bool = False  # outlives its owner's job (Ray's lifetime="detached")


@dataclass(frozen=True, slots=True)
class GroupRemoved(Event):
    """Remove group ``name`` (the user asked) with ``reason``."""

    name: str
    reason: str


@dataclass(frozen=True, slots=True)
class OwnerEnded(Event):
    """``owner``'s job ended: its groups are removed."""

    owner: str


@dataclass(frozen=True, slots=True)
class ClusterChanged(Event):
    """Capacity changed (a worker joined or left, holdings were released): bundles whose
    holding vanished go back to pending, and pending groups are tried again."""


# -- instructions ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BundleReserved(Instruction):
    """Bundle ``index`` of ``group`` now holds ``holding_id`` on ``worker`` (already in the
    ledger): requests waiting for it may now be granted."""

    group: str
    index: int
    worker: str
    holding_id: str


@dataclass(frozen=True, slots=True)
class BundlesReleased(Instruction):
    """These bundle holdings left the ledger: what waits for room may now fit."""

    holding_ids: tuple


@dataclass(frozen=True, slots=True)
class GroupReady(Instruction):
    """Every bundle of ``group`` is placed: answer its waiters."""

    group: str


@dataclass(frozen=True, slots=True)
class GroupEnded(Instruction):
    """``group`` is removed because ``reason``: answer its waiters, refuse what waits for it."""

    group: str
    reason: str


@dataclass(frozen=True, slots=True)
class EndHolding(Instruction):
    """A lease or instance ran inside a removed group: end it (instances are killed,
    leases revoked; the lease was already released from the ledger)."""

    holding_id: str
    kind: str
    owner: str
    reason: str


# -- the machine -----------------------------------------------------------------------------


@dataclass
class Bundle:
    index: int
    shape: Shape
    worker: str | None = None  # the node it is reserved on, None while pending
    holding_id: str = ""


@dataclass
class Group:
    name: str
    owner: str
    strategy: str
    bundles: list[Bundle]
    state: str = RG_PENDING  # RG_PENDING | RG_CREATED | RG_REMOVED
    reason: str = ""  # why it waits (pending) or ended (removed)
    fate_sharing: bool = False  # a yr.Group with same_lifecycle: one member ends, all end
    detached: bool = False  # not removed when its owner's job ends
    tried_on: dict[str, Shape] | None = None  # free resources when placement last failed
    members: set[str] = field(default_factory=set)  # instance holdings seen inside it

    def describe(self) -> str:
        return f"resource group {self.name!r} ({self.strategy}, {len(self.bundles)} bundles)"


class GroupMachine:
    """Places, re-places and removes resource groups (see module docstring).

    ``groups`` by name (the last ``REMOVED_KEPT`` removed ones stay, so late waiters learn
    why); ``by_holding`` bundle holding id -> (group, index).
    """

    def __init__(self, ledger: Ledger, story_len: int = 20_000) -> None:
        self.ledger = ledger
        self.groups: dict[str, Group] = {}
        self.by_holding: dict[str, tuple[str, int]] = {}
        self._ids = itertools.count(1)
        self._story = Story(story_len)
        self._handlers: dict[type, Callable[[Any], list[Instruction]]] = {
            GroupRequested: self._requested, GroupRemoved: self._removed,
            OwnerEnded: self._owner_ended, ClusterChanged: self._changed,
        }

    # -- queries ---------------------------------------------------------------------------

    def story(self, *keys: str) -> list[tuple[str, tuple]]:
        return self._story.about(*keys)

    def live(self, name: str) -> Group | None:
        """The group of that name unless removed."""
        g = self.groups.get(name)
        return g if g is not None and g.state != RG_REMOVED else None

    def has_pending(self) -> bool:
        return any(g.state == RG_PENDING for g in self.groups.values())

    def targets(self, affinity: Any) -> bool:
        """True if a request's affinity wire names a bundle (the lease queue then asks
        :meth:`fit` instead of the worker ledger)."""
        return bool(affinity) and bundle_target(affinity) is not None

    def fit(self, affinity: Any, shape: Shape,
            avoid: Collection[str] = ()) -> tuple[str, str] | str | None:
        """Where a request for a bundle fits now: ``(worker process, bundle holding id)``; a reason
        string if it never can (no such group, index out of range, larger than the bundle);
        ``None`` to wait (the bundle is pending, or its reservation is in use)."""
        name, index = bundle_target(affinity)  # type: ignore[misc]
        g = self.groups.get(name)
        if g is None or g.state == RG_REMOVED:
            why = f" ({g.reason})" if g is not None else ""
            return f"resource group {name!r} does not exist{why}"
        if not -1 <= index < len(g.bundles):
            return (f"bundle_index {index} is out of range for {g.describe()}: use -1 (any "
                    f"bundle) or 0..{len(g.bundles) - 1}")
        bundles = g.bundles if index == -1 else [g.bundles[index]]
        if not any(_fits(b.shape, shape) for b in bundles):
            which = "any bundle" if index == -1 else f"bundle {index}"
            return (f"request {format_shape(shape)} can never fit {which} of {g.describe()}: "
                    f"bundles {', '.join(format_shape(b.shape) for b in bundles)}; ask for "
                    "less (InvokeOptions(cpu=..., memory=...)) or reserve more in the bundle")
        for b in bundles:
            if b.worker is None or not _fits(self.remaining(b), shape):
                continue
            node = self.ledger.workers.get(b.worker)
            if node is None:
                continue
            if not node.processes:  # a ledger of nodes without processes (unit tests)
                if b.worker not in avoid:
                    return b.worker, b.holding_id
                continue
            # The bundle reserves on its node; the work runs in its least-loaded process.
            where = node.process_for({r: a for r, a in shape.items()
                                      if r not in DEVICE_KINDS}, None, avoid)
            if where is not None:
                return where[0], b.holding_id
        return None

    def lease_holders(self, affinity: Any) -> list[Holding]:
        """Task leases running inside the bundle(s) a request names: returning them makes
        room for it (the lease queue revokes idle ones and keeps the request waiting)."""
        name, index = bundle_target(affinity)  # type: ignore[misc]
        g = self.live(name)
        if g is None:
            return []
        hids = {b.holding_id for b in (g.bundles if index == -1 else g.bundles[index:index + 1])
                if b.worker is not None}
        return [h for h in self.ledger.holdings.values()
                if h.kind == "lease" and h.bundle in hids]

    def remaining(self, b: Bundle) -> Shape:
        """What bundle ``b``'s reservation has left now."""
        used = self.ledger.bundle_held.get(b.holding_id, {})
        return {r: a - used.get(r, 0.0) for r, a in b.shape.items()}

    def explain(self, affinity: Any, shape: Shape) -> str:
        """Why a request for a bundle waits (the wait listings; its refusal at its deadline)."""
        found = self.fit(affinity, shape)
        if isinstance(found, str):
            return found
        name, index = bundle_target(affinity)  # type: ignore[misc]
        g = self.groups[name]
        if g.state == RG_PENDING:
            return (f"request {format_shape(shape)} waits for {g.describe()}, which is not "
                    f"placed yet: {g.reason}")
        bundles = g.bundles if index == -1 else [g.bundles[index]]
        parts = []
        for b in bundles:
            inside = ", ".join(h.describe() for h in self.ledger.holdings.values()
                               if h.bundle == b.holding_id)
            parts.append(f"bundle {b.index} on {b.worker} has {format_shape(self.remaining(b))} "
                         f"left, held by {inside or 'nothing'}")
        return (f"request {format_shape(shape)} does not fit into {g.describe()} now: "
                + "; ".join(parts))

    def snapshot(self) -> list[dict]:
        """The live groups (for ``cluster_info`` and the dashboard)."""
        return [{"name": g.name, "owner": g.owner, "strategy": g.strategy, "state": g.state,
                 "reason": g.reason,
                 "bundles": [{"shape": dict(b.shape), "worker": b.worker} for b in g.bundles]}
                for g in self.groups.values() if g.state != RG_REMOVED]

    # -- events ----------------------------------------------------------------------------

    def handle(self, event: Event) -> list[Instruction]:
        """Apply ``event``; returns what the adapter must do, in order."""
        return self._handlers[type(event)](event)

    def _requested(self, ev: GroupRequested) -> list[Instruction]:
        sid = ev.stimulus_id
        if self.live(ev.name) is not None:  # the adapter refuses it before it gets here
            self._story.log(sid, ("duplicate-ignored", ev.name), (ev.name,))
            return []
        g = Group(ev.name, ev.owner, ev.strategy,
                  [Bundle(i, dict(s)) for i, s in enumerate(ev.bundles)],
                  fate_sharing=ev.fate_sharing, detached=ev.detached)
        self.groups[ev.name] = g
        self._story.log(sid, ("requested", ev.name, ev.strategy,
                              tuple(format_shape(b.shape) for b in g.bundles)), (ev.name,))
        out: list[Instruction] = []
        self._try_place(g, sid, out)
        return out

    def _removed(self, ev: GroupRemoved) -> list[Instruction]:
        out: list[Instruction] = []
        g = self.live(ev.name)
        if g is not None:
            self._remove(g, ev.reason, ev.stimulus_id, out)
        return out

    def _owner_ended(self, ev: OwnerEnded) -> list[Instruction]:
        out: list[Instruction] = []
        for g in list(self.groups.values()):
            if g.owner == ev.owner and g.state != RG_REMOVED and not g.detached:
                self._remove(g, f"its job {ev.owner} ended", ev.stimulus_id, out)
        return out

    def _changed(self, ev: ClusterChanged) -> list[Instruction]:
        sid = ev.stimulus_id
        out: list[Instruction] = []
        self._share_fate(sid, out)
        for hid, (name, index) in list(self.by_holding.items()):
            if hid in self.ledger.holdings:
                continue
            # Its worker is gone (the ledger dropped the holding and what ran in it).
            del self.by_holding[hid]
            self.ledger.bundle_held.pop(hid, None)
            g = self.groups[name]
            b = g.bundles[index]
            self._story.log(sid, ("bundle-lost", name, index, b.worker), (name, hid))
            b.worker, b.holding_id = None, ""
            g.tried_on = None  # a new bundle to place: try again whatever is free
            if g.state == RG_CREATED:
                g.state, g.reason = RG_PENDING, "a worker holding its bundles was lost"
        for g in list(self.groups.values()):
            if g.state == RG_PENDING:
                self._try_place(g, sid, out)
        return out

    # -- helpers ---------------------------------------------------------------------------

    def _share_fate(self, sid: str, out: list[Instruction]) -> None:
        """A fate-sharing group whose member instance left the ledger (it ended, or its
        worker was lost) is removed: its other members are killed, naming the one that
        ended."""
        sharing = [g for g in self.groups.values() if g.fate_sharing and g.state != RG_REMOVED]
        if not sharing:
            return
        inside: dict[str, set[str]] = {}
        for h in self.ledger.holdings.values():
            if h.bundle and h.kind == "instance":
                inside.setdefault(self.by_holding.get(h.bundle, ("", 0))[0], set()).add(
                    h.holding_id)
        for g in sharing:
            now = inside.get(g.name, set())
            ended = sorted(g.members - now)
            g.members |= now
            if ended:
                self._remove(g, f"its member instance {', '.join(ended)} ended and the group "
                                "shares fate (same_lifecycle=True)", sid, out)

    def _try_place(self, g: Group, sid: str, out: list[Instruction]) -> None:
        todo = [b for b in g.bundles if b.worker is None]
        fixed = {b.index: b.worker for b in g.bundles if b.worker is not None}
        nodes = self.ledger.open_nodes()  # not the nodes being drained to retire
        free = {ws.address: {r: ws.free(r) for r in ws.capacity} for ws in nodes}
        if g.tried_on is not None and not _grew(g.tried_on, free):
            return  # nothing freed up since it last failed: it would fail again
        found = place(g.strategy, {b.index: b.shape for b in todo}, fixed, free)
        g.tried_on = free if found is None else None
        if found is None:
            g.reason = explain_unplaced(g.strategy, g.bundles, fixed, free,
                                        {ws.address: ws.capacity for ws in nodes})
            self._story.log(sid, ("wait", g.name, g.reason), (g.name,))
            return
        for b in todo:
            b.worker = found[b.index]
            b.holding_id = f"B{next(self._ids)}:{g.name}#{b.index}"
            self.ledger.hold(Holding(b.holding_id, "bundle", b.worker, dict(b.shape), g.owner,
                                     label=g.name, node=b.worker))
            self.ledger.bundle_held[b.holding_id] = {}
            self.by_holding[b.holding_id] = (g.name, b.index)
            self._story.log(sid, ("reserved", g.name, b.index, b.worker),
                            (g.name, b.holding_id, b.worker))
            out.append(BundleReserved(sid, g.name, b.index, b.worker, b.holding_id))
        g.state, g.reason = RG_CREATED, ""
        out.append(GroupReady(sid, g.name))

    def _remove(self, g: Group, reason: str, sid: str, out: list[Instruction]) -> None:
        released = []
        for b in g.bundles:
            if b.worker is None:
                continue
            for h in [h for h in self.ledger.holdings.values() if h.bundle == b.holding_id]:
                if h.kind == "lease":
                    self.ledger.release(h.holding_id)
                out.append(EndHolding(sid, h.holding_id, h.kind, h.owner,
                                      f"its {g.describe()} was removed: {reason}"))
            self.ledger.release(b.holding_id)
            self.ledger.bundle_held.pop(b.holding_id, None)
            self.by_holding.pop(b.holding_id, None)
            released.append(b.holding_id)
            b.worker, b.holding_id = None, ""
        g.state, g.reason = RG_REMOVED, f"removed: {reason}"
        self._story.log(sid, ("removed", g.name, reason), (g.name,))
        removed = [n for n, x in self.groups.items() if x.state == RG_REMOVED]
        for name in removed[:max(0, len(removed) - REMOVED_KEPT)]:
            del self.groups[name]  # the oldest removed groups: late waiters get "unknown"
        if released:
            out.append(BundlesReleased(sid, tuple(released)))
        out.append(GroupEnded(sid, g.name, g.reason))

    # -- invariants ------------------------------------------------------------------------

    def validate(self) -> None:
        """Check the machine's invariants against the ledger (tests call it after each step)."""
        ledger = self.ledger
        for g in self.groups.values():
            placed = [b for b in g.bundles if b.worker is not None]
            if g.state == RG_REMOVED:
                assert not placed, f"removed {g.name} still holds bundles"
                continue
            if g.state == RG_CREATED:
                assert len(placed) == len(g.bundles), f"{g.name} created with pending bundles"
            for b in placed:
                h = ledger.holdings.get(b.holding_id)
                assert h is not None and h.worker == b.worker and h.kind == "bundle", \
                    f"{g.name} bundle {b.index}: ledger holding {h}"
                assert self.by_holding[b.holding_id] == (g.name, b.index)
                for r, a in ledger.bundle_held.get(b.holding_id, {}).items():
                    assert a <= b.shape.get(r, 0.0) + 1e-6, \
                        f"{g.name} bundle {b.index} over-committed: {r} {a} > {b.shape}"
            workers = [b.worker for b in placed]
            if g.strategy == "STRICT_SPREAD":
                assert len(set(workers)) == len(workers), f"{g.name} bundles share a worker"
            if g.strategy == "STRICT_PACK":
                assert len(set(workers)) <= 1, f"{g.name} bundles on several workers"
        for ws in ledger.workers.values():
            for r, held in ws.held.items():
                assert held <= ws.capacity.get(r, 0.0) + 1e-6 or r == "CPU", \
                    f"{ws.address} over-committed: {r} held {held} > {ws.capacity.get(r, 0.0)}"


# -- placement (pure functions) --------------------------------------------------------------


def _grew(before: Mapping[str, Shape], now: Mapping[str, Shape]) -> bool:
    """True if some worker is new or has more of some resource free than ``before``."""
    for w, f in now.items():
        old = before.get(w)
        if old is None or any(a > old.get(r, 0.0) + EPS for r, a in f.items()):
            return True
    return False


def _fits(free: Mapping[str, float], shape: Mapping[str, float]) -> bool:
    return all(free.get(r, 0.0) + EPS >= a for r, a in shape.items())


def place(strategy: str, todo: Mapping[int, Shape], fixed: Mapping[int, str],
          free: Mapping[str, Shape]) -> dict[int, str] | None:
    """Workers for the bundles ``todo`` (index -> shape), given bundles already placed
    (``fixed``, index -> worker) and each worker's ``free`` capacity; all of them or ``None``.

    A bounded depth-first search: hard strategies restrict the candidates, soft ones order
    them (PACK: workers the group uses first; SPREAD: unused workers first).
    """
    # Cheap necessary conditions first: a hopeless group is retried after every lease-queue
    # step, so it must fail fast.
    if any(not any(_fits(f, shape) for f in free.values()) for shape in todo.values()):
        return None
    for r in {r for shape in todo.values() for r in shape}:
        if sum(shape.get(r, 0.0) for shape in todo.values()) > \
                sum(max(0.0, f.get(r, 0.0)) for f in free.values()) + EPS:
            return None
    if strategy == "STRICT_SPREAD" and len(todo) > len(set(free) - set(fixed.values())):
        return None
    left = {w: dict(f) for w, f in free.items()}
    order = sorted(todo, key=lambda i: (-sum(todo[i].values()), i))
    assigned: dict[int, str] = {}
    count: dict[str, int] = {}
    for w in fixed.values():
        count[w] = count.get(w, 0) + 1
    steps = [0]

    def candidates(shape: Shape) -> list[str]:
        ws = [w for w in left if _fits(left[w], shape)]
        if strategy == "STRICT_SPREAD":
            ws = [w for w in ws if not count.get(w)]
        elif strategy == "STRICT_PACK" and any(count.values()):
            ws = [w for w in ws if count.get(w)]
        spread = strategy in ("SPREAD", "STRICT_SPREAD")
        return sorted(ws, key=lambda w: (count.get(w, 0) if spread else -count.get(w, 0),
                                         -left[w].get("CPU", 0.0), w))

    def search(k: int) -> bool:
        if k == len(order):
            return True
        steps[0] += 1
        if steps[0] > SEARCH_LIMIT:
            return False
        i = order[k]
        shape = todo[i]
        tried: set[tuple] = set()
        for w in candidates(shape):
            # Workers with the same free resources and the same share of the group are
            # interchangeable for the rest of the search: try one of them only.
            same = (tuple(sorted(left[w].items())), count.get(w, 0))
            if same in tried:
                continue
            tried.add(same)
            for r, a in shape.items():
                left[w][r] = left[w].get(r, 0.0) - a
            count[w] = count.get(w, 0) + 1
            assigned[i] = w
            if search(k + 1):
                return True
            del assigned[i]
            count[w] -= 1
            for r, a in shape.items():
                left[w][r] += a
        return False

    return dict(assigned) if search(0) else None


def explain_unplaced(strategy: str, bundles: list[Bundle], fixed: Mapping[int, str],
                     free: Mapping[str, Shape], capacity: Mapping[str, Shape]) -> str:
    """Why a group's pending bundles cannot be placed now: which bundle, and why."""
    pending = [b for b in bundles if b.worker is None]
    if not capacity:
        return "the cluster has no yr workers"
    offers = "; ".join(f"{w}: capacity {format_shape(c)}, free {format_shape(free[w])}"
                       for w, c in sorted(capacity.items()))
    for b in pending:
        if not any(_fits(c, b.shape) for c in capacity.values()):
            return (f"bundle {b.index} {format_shape(b.shape)} can never be placed: no worker "
                    f"offers that much (a bundle must fit on one node). Workers: {offers}")
    if strategy == "STRICT_SPREAD":
        able = [w for w, c in capacity.items() if any(_fits(c, b.shape) for b in pending)]
        if len(bundles) > len(capacity) or len(pending) > len(set(able) - set(fixed.values())):
            return (f"STRICT_SPREAD needs {len(bundles)} distinct workers (one per bundle) but "
                    f"the cluster has {len(capacity)} that could take them; the group waits "
                    f"for more workers. Workers: {offers}")
    if strategy == "STRICT_PACK":
        total: Shape = {}
        for b in bundles:
            for r, a in b.shape.items():
                total[r] = total.get(r, 0.0) + a
        if not any(_fits(c, total) for c in capacity.values()):
            return (f"STRICT_PACK needs one worker offering all bundles together "
                    f"{format_shape(total)}, and none does. Workers: {offers}")
    need: Shape = {}
    for b in pending:
        for r, a in b.shape.items():
            need[r] = need.get(r, 0.0) + a
    short = sorted(r for r, a in need.items()
                   if sum(f.get(r, 0.0) for f in free.values()) + EPS < a)
    if short:
        have = {r: sum(max(0.0, f.get(r, 0.0)) for f in free.values()) for r in short}
        return (f"its {len(pending)} pending bundles need {format_shape(need)} in total but "
                f"the workers have only {format_shape(have)} free. Workers: {offers}")
    for b in pending:
        if not any(_fits(f, b.shape) for f in free.values()):
            return (f"bundle {b.index} {format_shape(b.shape)} does not fit the free "
                    f"resources of any worker now (others hold them). Workers: {offers}")
    return (f"the bundles fit one by one but not all together under {strategy} with what is "
            f"free now. Workers: {offers}")
