"""Resource accounting by node and tag: capacities, what is held and by whom, and fit checks.

A *node* is a host (docs/nodes.md): the offers of all its worker processes form one pool.
A request takes what it asks from one node's pool and runs in one process there; GPUs and
NPUs are tracked by device id, whole or shared by fractions (:func:`assign_devices`).  A GPU's
id is its ``CUDA_VISIBLE_DEVICES`` entry (``"0"``); an NPU's is its
``ASCEND_RT_VISIBLE_DEVICES`` entry with the kind in front (``"NPU:0"``), so both kinds share
one table of devices per node and per process.

Pure logic (no Dask, no I/O), so it is unit-tested without a cluster.  Amounts are floats:
``CPU`` in millicores, ``Memory`` in MB, ``GPU`` in devices, custom tags in the units the
worker declared.

A *holding* is anything that keeps resources of one node: a task lease or an instance
(both run in one worker process of it) or a resource-group bundle (a reservation).
Holdings of kind ``"lease"`` can be lent back while their task is blocked in ``yr.get``
(:meth:`Ledger.lend_cpu`); that is what lets nested work finish on a one-CPU cluster.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from yrdask.affinity import AffinityKind, Wire, describe, evaluate, parse_labels
# how to make a request fit, appended to every "cannot be placed" explanation (yr's words;
# a Ray job reads them in Ray's: yrdask/words.py)
from yrdask.words import FIX_HINT

EPS = 1e-9

Shape = dict[str, float]

#: The accelerators leased by device id: resource name -> the prefix of its ids here.
DEVICE_KINDS = {"GPU": "", "NPU": "NPU:"}


def device_kind(device_id: str) -> str:
    """``"GPU"`` for ``"0"``, ``"NPU"`` for ``"NPU:0"``."""
    return "NPU" if device_id.startswith("NPU:") else "GPU"


def wants_devices(shape: Shape) -> bool:
    """Whether a request asks for GPUs or NPUs."""
    return any(shape.get(kind, 0.0) > EPS for kind in DEVICE_KINDS)


@dataclass
class Holding:
    """Resources one lease, instance or bundle holds on one node.

    ``worker`` is the worker process it runs in (leases and instances; a bundle reserves on
    the node only, so its ``worker`` is the node id).  ``node`` is filled in by
    :meth:`Ledger.hold`; ``gpus`` too: the device ids it holds and how much of each
    (``(("0", 1.0),)``, ``(("1", 0.5),)``).
    """

    holding_id: str
    kind: str  # "lease" | "instance" | "bundle"
    worker: str
    shape: Shape
    owner: str
    lent_cpu: bool = False
    queue: str = ""  # for leases: which of the owner's task queues it serves
    labels: tuple[str, ...] = ()  # for instances: their InvokeOptions.labels
    label: str = ""  # what it is for people: an instance's class name ("" if unknown)
    bundle: str = ""  # the resource-group bundle (its holding id) it runs in: its shape
    #                   counts against that bundle's reservation, not the node's free capacity
    node: str = ""  # the node (host) it holds on; set by Ledger.hold
    gpus: tuple = ()  # ((device id, amount), ...) it holds; set by Ledger.hold

    def describe(self) -> str:
        """``"Counter instance I1"`` / ``"task lease L3 of tcp://..."``: what holds it."""
        if self.kind == "lease":
            return f"task lease {self.holding_id} of {self.owner}"
        return f"{self.label} {self.kind} {self.holding_id}" if self.label \
            else f"{self.kind} {self.holding_id}"

    @property
    def gpu_ids(self) -> list[str]:
        """The device ids it holds, in order (``CUDA_VISIBLE_DEVICES`` of its work)."""
        return [g for g, _ in self.gpus]


@dataclass
class ProcessOffer:
    """One worker process: what it adds to its node, and where its work may run.

    ``capacity`` adds up over the node's processes (CPU, Memory, ``--resources`` tags);
    ``gpus`` are the device ids (GPUs and NPUs) it can run work on (a node's are the union:
    processes that see the same devices share them); ``shared`` are node-wide amounts that
    do not add up (``accelerator_type:<model>``, resources declared for the whole node): the
    node offers the largest any of its processes reports; ``labels`` the node's labels its
    process declares (Ray's node labels: the node has those of all its processes).
    """

    address: str
    node: str
    capacity: Shape
    gpus: tuple[str, ...] = ()
    shared: Shape = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    load: float = 0.0  # queued yr work the process last reported (heartbeat)
    holdings: set[str] = field(default_factory=set)
    cpu_held: float = 0.0  # CPU of the work running in it (lent CPU not counted)
    # it is being drained to retire (scheduler/drain.py): nothing new is placed in it, and
    # a node all of whose processes drain takes no new bundle
    draining: bool = False

    def cpu_free(self) -> float:
        """What is left of its own CPU share: work beyond it would share its cores (and its
        GIL) with the work already there."""
        return self.capacity.get("CPU", 0.0) - self.cpu_held


@dataclass
class NodeResources:
    """Capacity and current use of one node (a host): the pool of its worker processes."""

    address: str  # the node id
    capacity: Shape
    held: Shape = field(default_factory=dict)
    holdings: set[str] = field(default_factory=set)
    processes: dict[str, ProcessOffer] = field(default_factory=dict)
    gpu_used: dict[str, float] = field(default_factory=dict)  # device id -> amount held
    host: str = ""
    labels: dict[str, str] = field(default_factory=dict)  # its processes' labels together

    @property
    def node_id(self) -> str:
        return self.address

    @property
    def load(self) -> float:
        return sum(p.load for p in self.processes.values())

    @load.setter
    def load(self, value: float) -> None:  # a node that is one process (unit tests)
        procs = list(self.processes.values())
        if procs:
            procs[0].load = value

    def free(self, resource: str) -> float:
        return self.capacity.get(resource, 0.0) - self.held.get(resource, 0.0)

    def could_ever_fit(self, shape: Shape) -> bool:
        if not all(self.capacity.get(r, 0.0) + EPS >= amount for r, amount in shape.items()):
            return False
        if not wants_devices(shape) or not self.gpu_used:
            return True
        return any(assign_devices({g: 1.0 for g in p.gpus}, shape) is not None
                   for p in self.processes.values())

    def fits_now(self, shape: Shape) -> bool:
        if not all(self.free(r) + EPS >= amount for r, amount in shape.items()):
            return False
        return self.process_for(shape) is not None or not self.processes

    def gpu_free(self, ids: Collection[str]) -> dict[str, float]:
        """What is free of each of ``ids`` now (1.0 = the whole device)."""
        return {g: 1.0 - self.gpu_used.get(g, 0.0) for g in ids}

    def process_for(self, shape: Shape, prefer: str | None = None,
                    avoid: Collection[str] = ()) -> tuple[str, tuple] | None:
        """The process to run ``shape`` in, and the device ids it would take, or None.

        ``prefer`` first if it can, then the least-loaded process (fewest holdings, then the
        shortest reported queue).  A GPU or NPU request needs a process that sees free
        devices.
        """
        devices = wants_devices(shape)
        cpu = shape.get("CPU", 0.0)
        # A process whose own CPU share still has room first (CPU-bound work in one process
        # shares one GIL), the requester's own among them; then the most own CPU left, the
        # fewest holdings, the shortest queue.
        order = sorted(self.processes.values(),
                       key=lambda p: (p.cpu_free() + EPS < cpu, p.address != prefer,
                                      -p.cpu_free(), len(p.holdings), p.load, p.address))
        for p in order:
            if p.draining or p.address in avoid:
                continue
            if not devices or not self.gpu_used:
                return p.address, ()
            got = assign_devices(self.gpu_free(p.gpus), shape)
            if got is not None:
                return p.address, got
        return None


#: Before nodes were hosts, a node was one worker process: the old name of the node record.
WorkerResources = NodeResources


def assign_gpus(free: dict[str, float], amount: float) -> tuple | None:
    """Which device ids ``amount`` GPUs take from ``free`` ({id: free share}), or None.

    Whole GPUs (``amount >= 1``) take that many wholly free devices, in id order; a fraction
    takes a share of one device, the fullest one it still fits on (so fractions pack and
    whole devices stay free), as Ray does.
    """
    if amount <= EPS:
        return ()
    if amount >= 1.0 - EPS:
        whole = int(amount + 1.0 - EPS) if abs(amount - round(amount)) > EPS else round(amount)
        ids = [g for g, f in free.items() if f >= 1.0 - EPS][:whole]
        if len(ids) < whole:
            return None
        left = amount
        out = []
        for g in ids:
            take = min(1.0, left)
            out.append((g, take))
            left -= take
        return tuple(out)
    fitting = [(f, i, g) for i, (g, f) in enumerate(free.items()) if f + EPS >= amount]
    if not fitting:
        return None
    _, _, g = min(fitting)
    return ((g, amount),)


def assign_devices(free: dict[str, float], shape: Shape) -> tuple | None:
    """The device ids (with shares) ``shape``'s GPUs and NPUs take from ``free`` ({id: free
    share}, both kinds), or None; each kind by :func:`assign_gpus`."""
    out: tuple = ()
    for kind in DEVICE_KINDS:
        amount = shape.get(kind, 0.0)
        if amount <= EPS:
            continue
        got = assign_gpus({g: f for g, f in free.items() if device_kind(g) == kind}, amount)
        if got is None:
            return None
        out += got
    return out


class Ledger:
    """Every node's pooled capacity and every holding, with the placement choice among fits.

    ``workers`` (also ``nodes``) maps node id -> :class:`NodeResources`; ``processes`` maps
    a worker process's address -> its :class:`ProcessOffer`.  A process that names no node
    is a node of its own (its address is the node id), as in the unit tests.
    """

    def __init__(self) -> None:
        self.workers: dict[str, NodeResources] = {}
        self.nodes = self.workers  # the same table, by its proper name
        self.processes: dict[str, ProcessOffer] = {}
        self.holdings: dict[str, Holding] = {}
        # resource groups (scheduler/groups.py): bundle holding id -> what runs in it holds
        self.bundle_held: dict[str, Shape] = {}

    # -- workers ---------------------------------------------------------------------------

    def add_worker(self, address: str, capacity: Shape, node: str | None = None,
                   gpus: Collection[str] = (), shared: Shape | None = None,
                   labels: dict[str, str] | None = None) -> None:
        """A worker process joins (or offers again): its node's pool grows by its offer."""
        known = self.processes.get(address)
        node = node or (known.node if known is not None else address)
        if known is not None and known.node != node:
            self._drop_process(address)
            known = None
        ns = self.workers.get(node)
        if ns is None:
            ns = self.workers[node] = NodeResources(node, {}, host=_host(address))
        offer = ProcessOffer(address, node,
                             {r: float(a) for r, a in capacity.items() if r not in DEVICE_KINDS},
                             tuple(str(g) for g in gpus), dict(shared or {}), dict(labels or {}))
        for kind, prefix in DEVICE_KINDS.items():  # a count without ids: ids 0..n-1
            if kind in capacity and not any(device_kind(g) == kind for g in offer.gpus):
                offer.gpus += tuple(f"{prefix}{i}" for i in range(int(capacity[kind] + EPS)))
        if known is not None:  # registered again: it keeps what it holds
            offer.holdings, offer.load = known.holdings, known.load
            offer.cpu_held, offer.draining = known.cpu_held, known.draining
        self.processes[address] = ns.processes[address] = offer
        self._sum(ns)

    def _sum(self, ns: NodeResources) -> None:
        """A node's capacity from its processes' offers (after one joined or left)."""
        cap: Shape = {}
        ids: dict[str, None] = {}
        labels: dict[str, str] = {}
        for p in ns.processes.values():
            labels.update(p.labels)
            for r, a in p.capacity.items():
                cap[r] = cap.get(r, 0.0) + a
            for r, a in p.shared.items():
                cap[r] = max(cap.get(r, 0.0), a)
            ids.update(dict.fromkeys(p.gpus))
        for kind in DEVICE_KINDS:
            n = sum(device_kind(g) == kind for g in ids)
            if n:
                cap[kind] = float(n)
        ns.capacity, ns.labels = cap, labels
        ns.gpu_used = {g: ns.gpu_used.get(g, 0.0) for g in ids}

    def _drop_process(self, address: str) -> list[Holding]:
        p = self.processes.pop(address, None)
        if p is None:
            return []
        ns = self.workers[p.node]
        ns.processes.pop(address, None)
        lost = [self.holdings[h] for h in sorted(p.holdings) if h in self.holdings]
        for h in lost:
            self.release(h.holding_id)
        if not ns.processes:  # the node is gone, with its bundles
            lost += [self.holdings.pop(h) for h in sorted(ns.holdings) if h in self.holdings]
            del self.workers[p.node]
        else:
            self._sum(ns)
        return lost

    def remove_worker(self, address: str) -> list[Holding]:
        """Forget a worker process; returns the holdings that lived on it (now gone): its
        leases and instances, and its node's bundles if it was the node's last process."""
        return self._drop_process(address)

    def set_draining(self, address: str, draining: bool) -> bool:
        """Mark a worker process as drained to retire (``True``) or kept after all; True if
        that changed anything.  A draining process takes no new lease, instance or bundle
        (:meth:`NodeResources.process_for`, :meth:`open_nodes`); what it holds stays."""
        p = self.processes.get(address)
        if p is None or p.draining == draining:
            return False
        p.draining = draining
        return True

    def open_nodes(self) -> list[NodeResources]:
        """The nodes new bundles may go to: all but those whose every process drains."""
        return [ws for ws in self.workers.values() if not _retiring(ws)]

    def node_of(self, address: str) -> str | None:
        """The node id of a worker process (None if it is unknown)."""
        p = self.processes.get(address)
        return p.node if p is not None else (address if address in self.workers else None)

    # -- holdings --------------------------------------------------------------------------

    def hold(self, holding: Holding) -> None:
        proc = self.processes.get(holding.worker)
        node = holding.node or (proc.node if proc is not None else holding.worker)
        holding.node = node
        ns = self.workers[node]
        if wants_devices(holding.shape) and not holding.gpus:
            holding.gpus = self._take_gpus(holding.shape, ns, proc, holding.bundle) or ()
        held = self._held_for(holding, ns)
        for r, amount in holding.shape.items():
            held[r] = held.get(r, 0.0) + amount
        for g, a in holding.gpus:
            used = self._gpu_used_for(holding, ns)
            used[g] = used.get(g, 0.0) + a
        ns.holdings.add(holding.holding_id)
        if proc is not None and holding.kind != "bundle":
            proc.holdings.add(holding.holding_id)
            proc.cpu_held += holding.shape.get("CPU", 0.0)
        self.holdings[holding.holding_id] = holding

    def plan_gpus(self, shape: Shape, worker: str, bundle: str = "") -> tuple:
        """The device ids (with shares) a request of ``shape`` placed on process ``worker``
        (inside ``bundle``, if any) would take now; ``()`` if it asks for no GPU or NPU."""
        if not wants_devices(shape):
            return ()
        proc = self.processes.get(worker)
        ns = self.workers.get(proc.node if proc is not None else worker)
        if ns is None:
            return ()
        return self._take_gpus(shape, ns, proc, bundle) or ()

    def _take_gpus(self, shape: Shape, ns: NodeResources, proc: ProcessOffer | None,
                   bundle: str) -> tuple | None:
        if bundle:  # from the devices its bundle reserved
            b = self.holdings.get(bundle)
            if b is None:
                return ()
            used = self.bundle_gpus.get(bundle, {})
            free = {g: a - used.get(g, 0.0) for g, a in b.gpus}
            if proc is not None and proc.gpus:
                free = {g: f for g, f in free.items() if g in proc.gpus}
            return assign_devices(free, shape)
        ids = proc.gpus if proc is not None and proc.node == ns.address else tuple(ns.gpu_used)
        return assign_devices(ns.gpu_free(ids), shape)

    @property
    def bundle_gpus(self) -> dict[str, dict[str, float]]:
        """Bundle holding id -> device id -> share held by what runs inside it."""
        d = self.__dict__.get("_bundle_gpus")
        if d is None:
            d = self.__dict__["_bundle_gpus"] = {}
        return d

    def _gpu_used_for(self, holding: Holding, ns: NodeResources) -> dict[str, float]:
        if not holding.bundle:
            return ns.gpu_used
        return self.bundle_gpus.setdefault(holding.bundle, {})

    def release(self, holding_id: str) -> Holding | None:
        holding = self.holdings.pop(holding_id, None)
        if holding is None:
            return None
        ns = self.workers.get(holding.node)
        if ns is not None:
            shape = dict(holding.shape)
            if holding.lent_cpu:
                shape.pop("CPU", None)
            held = self._held_for(holding, ns)
            for r, amount in shape.items():
                held[r] = held.get(r, 0.0) - amount
            used = self._gpu_used_for(holding, ns)
            for g, a in holding.gpus:
                if g in used:
                    used[g] = max(0.0, used[g] - a)
            ns.holdings.discard(holding_id)
        if holding.kind == "bundle":
            self.bundle_gpus.pop(holding_id, None)
        proc = self.processes.get(holding.worker)
        if proc is not None and holding_id in proc.holdings:
            proc.holdings.discard(holding_id)
            if not holding.lent_cpu:
                proc.cpu_held -= holding.shape.get("CPU", 0.0)
        return holding

    def _held_for(self, holding: Holding, ws: NodeResources) -> Shape:
        """Where ``holding``'s shape is counted: its bundle's use, or the node's held (a
        removed bundle's leftovers count nowhere)."""
        if not holding.bundle:
            return ws.held
        return self.bundle_held.get(holding.bundle, {})

    def lend_cpu(self, holding_id: str, lent: bool) -> bool:
        """Lend a blocked lease's CPU back (``lent=True``) or take it again; True if changed."""
        holding = self.holdings.get(holding_id)
        if holding is None or holding.lent_cpu == lent:
            return False
        ws = self.workers.get(holding.node)
        cpu = holding.shape.get("CPU", 0.0)
        if ws is not None:
            held = self._held_for(holding, ws)
            held["CPU"] = held.get("CPU", 0.0) + (-cpu if lent else cpu)
        proc = self.processes.get(holding.worker)
        if proc is not None and holding_id in proc.holdings:
            proc.cpu_held += -cpu if lent else cpu
        holding.lent_cpu = lent
        return True

    # -- placement -------------------------------------------------------------------------

    def labels(self, ws: NodeResources) -> dict[int, dict[str, set[str]]]:
        """A node's labels by affinity kind (see :mod:`yrdask.affinity`)."""
        own = {"NODE_ID": {ws.address}, "NODE_IP": {ws.host or _host(ws.address)}}
        own.update({r: {f"{a:g}"} for r, a in ws.capacity.items()})
        own.update({k: {v} for k, v in ws.labels.items()})
        inst = parse_labels(label for h in ws.holdings if h in self.holdings
                            for label in self.holdings[h].labels)
        return {AffinityKind.RESOURCE: own, AffinityKind.INSTANCE: inst}

    def _allowed(self, ws: NodeResources, affinity: Wire) -> tuple[bool, int]:
        return evaluate(affinity, self.labels(ws)) if affinity else (True, 0)

    def choose(self, shape: Shape, prefer: str | None = None, avoid: Collection[str] = (),
               affinity: Wire = ()) -> str | None:
        """The worker process to place ``shape`` on now, or None if nothing fits now.

        Nodes are ranked: hard affinities filter; then soft affinities rank.  Among the
        best, the node of ``prefer`` (the submitter's own worker, or where its large
        arguments are) wins when it fits: nested work stays local.  Otherwise the node with
        the largest free CPU fraction and the shortest reported queue, which spreads load.
        Inside the node, ``prefer`` runs it if it can, else the least-loaded process
        (:meth:`NodeResources.process_for`).  ``avoid`` lists worker processes the
        requester just lost its channel to (dying, not yet gone).
        """
        found = self.choose_with_gpus(shape, prefer, avoid, affinity)
        return found[0] if found is not None else None

    def choose_with_gpus(self, shape: Shape, prefer: str | None = None,
                         avoid: Collection[str] = (),
                         affinity: Wire = ()) -> tuple[str, tuple] | None:
        """:meth:`choose`, with the GPU ids the process would take."""
        best, best_key = None, None
        prefer_node = self.node_of(prefer) if prefer else None
        for ws in self.workers.values():
            if not ws.fits_now(shape):
                continue
            allowed, preference = self._allowed(ws, affinity)
            if not allowed:
                continue
            where = ws.process_for(shape, prefer, avoid)
            if where is None:
                continue
            cap = ws.capacity.get("CPU", 0.0) or 1.0
            key = (preference, ws.address == prefer_node, ws.free("CPU") / cap, -ws.load,
                   -len(ws.holdings))
            if best_key is None or key > best_key:
                best, best_key = where, key
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
            if _reachable(ws, avoid) and not _retiring(ws) and ws.could_ever_fit(shape)
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
                f"a request must fit on one node (one host's worker processes together). "
                f"Nodes offer: {offers}. "
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
            if not _reachable(ws, avoid):
                never.append(f"{ws.address} (unreachable to the requester)")
                continue
            if _retiring(ws):
                never.append(f"{ws.address} (retiring: it is being drained)")
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

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Each node's capacity, what is held, its worker processes and its GPUs in use."""
        return {
            a: {"capacity": dict(ws.capacity), "held": dict(ws.held),
                "processes": sorted(ws.processes), "host": ws.host,
                "gpus": dict(ws.gpu_used), "labels": dict(ws.labels)}
            for a, ws in self.workers.items()
        }


def _reachable(ws: NodeResources, avoid: Collection[str]) -> bool:
    """True if some process of the node is not in ``avoid`` (a node of no processes, as
    in tests of the ledger alone, counts by its own id)."""
    if not avoid:
        return True
    if not ws.processes:
        return ws.address not in avoid
    return any(p not in avoid for p in ws.processes)


def _retiring(ws: NodeResources) -> bool:
    """True if every worker process of the node is being drained to retire."""
    return bool(ws.processes) and all(p.draining for p in ws.processes.values())


def _host(address: str) -> str:
    host = address.split("://", 1)[-1].rsplit(":", 1)[0]
    return host.strip("[]")


def unit_of(resource: str) -> str:
    """The unit suffix of a resource in messages (" millicores", " MB", or "")."""
    return {"CPU": " millicores", "Memory": " MB"}.get(resource, "")


def format_shape(shape: Shape) -> str:
    return "{" + ", ".join(f"{r}: {a:g}" for r, a in sorted(shape.items())) + "}"
