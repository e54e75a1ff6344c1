"""Resource accounting by worker and tag: capacities, what is held and by whom, and fit checks.

Pure logic (no Dask, no I/O), so it is unit-tested without a cluster.  Amounts are floats:
``CPU`` in millicores, ``Memory`` in MB, custom tags in the units the worker declared.

A *holding* is anything that keeps resources of one worker: a task lease or an instance.
Holdings of kind ``"lease"`` can be lent back while their task is blocked in ``yr.get``
(:meth:`Ledger.lend_cpu`); that is what lets nested work finish on a one-CPU cluster.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from yrdask.affinity import AffinityKind, Wire, describe, evaluate, parse_labels

EPS = 1e-9

#: How to make a request fit, appended to every "cannot be placed" explanation.
FIX_HINT = ("To place it: ask for less with InvokeOptions(cpu=..., memory=...) (cpu in "
            "millicores, 1000 = one core; memory in MB), end instances that hold what it "
            "needs, or add capacity: yr.init(Config(num_cpus=...)) for the embedded cluster, "
            "or more or larger workers.")

Shape = dict[str, float]


@dataclass
class Holding:
    """Resources one lease or instance holds on one worker."""

    holding_id: str
    kind: str  # "lease" | "instance"
    worker: str
    shape: Shape
    owner: str
    lent_cpu: bool = False
    queue: str = ""  # for leases: which of the owner's task queues it serves
    labels: tuple[str, ...] = ()  # for instances: their InvokeOptions.labels
    label: str = ""  # what it is for people: an instance's class name ("" if unknown)
    bundle: str = ""  # the resource-group bundle (its holding id) it runs in: its shape
    #                   counts against that bundle's reservation, not the worker's free capacity

    def describe(self) -> str:
        """``"Counter instance I1"`` / ``"task lease L3 of tcp://..."``: what holds it."""
        if self.kind == "lease":
            return f"task lease {self.holding_id} of {self.owner}"
        return f"{self.label} {self.kind} {self.holding_id}" if self.label \
            else f"{self.kind} {self.holding_id}"


@dataclass
class WorkerResources:
    """Capacity and current use of one worker process."""

    address: str
    capacity: Shape
    held: Shape = field(default_factory=dict)
    holdings: set[str] = field(default_factory=set)
    load: float = 0.0  # queued yr work the worker last reported (heartbeat)

    def free(self, resource: str) -> float:
        return self.capacity.get(resource, 0.0) - self.held.get(resource, 0.0)

    def could_ever_fit(self, shape: Shape) -> bool:
        return all(self.capacity.get(r, 0.0) + EPS >= amount for r, amount in shape.items())

    def fits_now(self, shape: Shape) -> bool:
        return all(self.free(r) + EPS >= amount for r, amount in shape.items())


class Ledger:
    """Every worker's capacity and every holding, with the placement choice among fits."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerResources] = {}
        self.holdings: dict[str, Holding] = {}
        # resource groups (scheduler/groups.py): bundle holding id -> what runs in it holds
        self.bundle_held: dict[str, Shape] = {}

    # -- workers ---------------------------------------------------------------------------

    def add_worker(self, address: str, capacity: Shape) -> None:
        self.workers[address] = WorkerResources(address, dict(capacity))

    def remove_worker(self, address: str) -> list[Holding]:
        """Forget a worker; returns the holdings that lived on it (now gone)."""
        ws = self.workers.pop(address, None)
        if ws is None:
            return []
        return [self.holdings.pop(h) for h in ws.holdings if h in self.holdings]

    # -- holdings --------------------------------------------------------------------------

    def hold(self, holding: Holding) -> None:
        ws = self.workers[holding.worker]
        held = self._held_for(holding, ws)
        for r, amount in holding.shape.items():
            held[r] = held.get(r, 0.0) + amount
        ws.holdings.add(holding.holding_id)
        self.holdings[holding.holding_id] = holding

    def release(self, holding_id: str) -> Holding | None:
        holding = self.holdings.pop(holding_id, None)
        if holding is None:
            return None
        ws = self.workers.get(holding.worker)
        if ws is not None:
            shape = dict(holding.shape)
            if holding.lent_cpu:
                shape.pop("CPU", None)
            held = self._held_for(holding, ws)
            for r, amount in shape.items():
                held[r] = held.get(r, 0.0) - amount
            ws.holdings.discard(holding_id)
        return holding

    def _held_for(self, holding: Holding, ws: WorkerResources) -> Shape:
        """Where ``holding``'s shape is counted: its bundle's use, or the worker's held (a
        removed bundle's leftovers count nowhere)."""
        if not holding.bundle:
            return ws.held
        return self.bundle_held.get(holding.bundle, {})

    def lend_cpu(self, holding_id: str, lent: bool) -> bool:
        """Lend a blocked lease's CPU back (``lent=True``) or take it again; True if changed."""
        holding = self.holdings.get(holding_id)
        if holding is None or holding.lent_cpu == lent:
            return False
        ws = self.workers.get(holding.worker)
        cpu = holding.shape.get("CPU", 0.0)
        if ws is not None:
            held = self._held_for(holding, ws)
            held["CPU"] = held.get("CPU", 0.0) + (-cpu if lent else cpu)
        holding.lent_cpu = lent
        return True

    # -- placement -------------------------------------------------------------------------

    def labels(self, ws: WorkerResources) -> dict[int, dict[str, set[str]]]:
        """A worker's labels by affinity kind (see :mod:`yrdask.affinity`)."""
        own = {"NODE_ID": {ws.address}, "NODE_IP": {_host(ws.address)}}
        own.update({r: {f"{a:g}"} for r, a in ws.capacity.items()})
        inst = parse_labels(label for h in ws.holdings if h in self.holdings
                            for label in self.holdings[h].labels)
        return {AffinityKind.RESOURCE: own, AffinityKind.INSTANCE: inst}

    def _allowed(self, ws: WorkerResources, affinity: Wire) -> tuple[bool, int]:
        return evaluate(affinity, self.labels(ws)) if affinity else (True, 0)

    def choose(self, shape: Shape, prefer: str | None = None, avoid: Collection[str] = (),
               affinity: Wire = ()) -> str | None:
        """The worker to place ``shape`` on now, or None if nothing fits at the moment.

        Hard affinities filter; then soft affinities rank.  Among the best, ``prefer`` (the
        submitter's own worker, or where its large arguments are) wins when it fits: nested
        work stays local.  Otherwise the worker with the largest free CPU fraction and the
        shortest reported queue, which spreads load.  ``avoid`` lists workers the requester
        just lost its channel to (dying, not yet gone).
        """
        best, best_key = None, None
        for ws in self.workers.values():
            if ws.address in avoid or not ws.fits_now(shape):
                continue
            allowed, preference = self._allowed(ws, affinity)
            if not allowed:
                continue
            cap = ws.capacity.get("CPU", 0.0) or 1.0
            key = (preference, ws.address == prefer, ws.free("CPU") / cap, -ws.load,
                   -len(ws.holdings))
            if best_key is None or key > best_key:
                best, best_key = ws.address, key
        return best

    def could_ever_fit(self, shape: Shape, affinity: Wire = ()) -> bool:
        return any(ws.could_ever_fit(shape) and self._allowed(ws, affinity)[0]
                   for ws in self.workers.values())

    def lease_holders_on_fitting_workers(self, shape: Shape, affinity: Wire = (),
                                         avoid: Collection[str] = ()) -> list[Holding]:
        """Leases on workers that could run ``shape`` (and are not in ``avoid``): returning
        them may make room."""
        return [
            self.holdings[h]
            for ws in self.workers.values()
            if ws.address not in avoid and ws.could_ever_fit(shape)
            and self._allowed(ws, affinity)[0]
            for h in sorted(ws.holdings)
            if self.holdings[h].kind == "lease"
        ]

    def explain_unfit(self, shape: Shape, affinity: Wire = ()) -> str:
        """Why ``shape`` cannot be placed: what it needs, what the cluster offers and holds."""
        need = format_shape(shape)
        if not self.workers:
            return f"request {need} cannot be scheduled: the cluster has no yr workers"
        if affinity and not any(self._allowed(ws, affinity)[0] for ws in self.workers.values()):
            return (f"request {need} cannot be scheduled: no worker satisfies its affinity "
                    f"{describe(affinity)}; workers: {', '.join(sorted(self.workers))}")
        if not self.could_ever_fit(shape):
            missing = sorted(
                r for r, a in shape.items()
                if not any(ws.capacity.get(r, 0.0) + EPS >= a for ws in self.workers.values())
            )
            offers = "; ".join(
                f"{ws.address}: {format_shape(ws.capacity)}" for ws in self.workers.values()
            )
            what = ", ".join(
                f"{r}={shape[r]:g} (largest offer: "
                f"{max(ws.capacity.get(r, 0.0) for ws in self.workers.values()):g})"
                for r in missing
            ) or need
            return (
                f"request {need} can never be scheduled: no worker offers {what}; "
                f"a request must fit on one worker process. Workers offer: {offers}. "
                f"{FIX_HINT}"
            )
        holders = "; ".join(
            f"{ws.address}: capacity {format_shape(ws.capacity)}, held by "
            + (", ".join(
                f"{self.holdings[h].describe()} {format_shape(self.holdings[h].shape)}"
                for h in sorted(ws.holdings)
            ) or "nothing")
            for ws in self.workers.values()
            if ws.could_ever_fit(shape)
        )
        return (f"request {need} did not fit in time: the workers that could run it are busy "
                f"({holders}). {FIX_HINT}")

    def explain_wait(self, shape: Shape, affinity: Wire = (),
                     avoid: Collection[str] = ()) -> list[str]:
        """Why ``shape`` waits, one line per worker: what each worker that could run it lacks
        now and what holds it (``"worker tcp://..: needs CPU 500, free 0 of 2000 millicores;
        held by Counter instance I1 {CPU: 500}, ..."``), then a line for the workers that
        can never run it.  Empty if it fits now."""
        lines, never = [], []
        for ws in self.workers.values():
            if ws.address in avoid:
                never.append(f"{ws.address} (unreachable to the requester)")
                continue
            if not ws.could_ever_fit(shape):
                never.append(f"{ws.address} (offers {format_shape(ws.capacity)})")
                continue
            if not self._allowed(ws, affinity)[0]:
                never.append(f"{ws.address} (affinity {describe(affinity)})")
                continue
            lacks = [f"needs {r} {a:g}, free {max(0.0, ws.free(r)):g} of "
                     f"{ws.capacity.get(r, 0.0):g}{unit_of(r)}"
                     for r, a in sorted(shape.items()) if ws.free(r) + EPS < a]
            if not lacks:
                continue
            held = self.holders_text(ws)
            lines.append(f"worker {ws.address}: {'; '.join(lacks)}; held by "
                         f"{held or 'nothing (it lent nothing back yet)'}")
        if not self.workers:
            lines.append("the cluster has no yr workers")
        elif never:
            lines.append(f"can never run it: {', '.join(never)}")
        return lines

    def holders_text(self, ws: WorkerResources) -> str:
        """What holds ``ws``'s resources, grouped: ``"3 Counter instances (I1, I2, I3), task
        lease L4 of tcp://..."``."""
        groups: dict[tuple[str, str, str], list[str]] = {}
        for hid in sorted(ws.holdings):
            h = self.holdings.get(hid)
            if h is not None:
                key = (h.kind, h.label, h.owner if h.kind == "lease" else "")
                groups.setdefault(key, []).append(hid)
        parts = []
        for (kind, label, owner), ids in groups.items():
            what = "task lease" if kind == "lease" else f"{label} {kind}".strip()
            tail = f" of {owner}" if owner else ""
            if len(ids) == 1:
                parts.append(f"{what} {ids[0]}{tail}")
            else:
                shown = ", ".join(ids[:8]) + (", ..." if len(ids) > 8 else "")
                parts.append(f"{len(ids)} {what}s ({shown}){tail}")
        return ", ".join(parts)

    def snapshot(self) -> dict[str, dict[str, Shape]]:
        return {
            a: {"capacity": dict(ws.capacity), "held": dict(ws.held)}
            for a, ws in self.workers.items()
        }


def _host(address: str) -> str:
    host = address.split("://", 1)[-1].rsplit(":", 1)[0]
    return host.strip("[]")


def unit_of(resource: str) -> str:
    """The unit suffix of a resource in messages (" millicores", " MB", or "")."""
    return {"CPU": " millicores", "Memory": " MB"}.get(resource, "")


def format_shape(shape: Shape) -> str:
    return "{" + ", ".join(f"{r}: {a:g}" for r, a in sorted(shape.items())) + "}"
