"""The real machines the simulation wires together, and what it checks inside them.

Imported lazily by the world, so the package imports before every machine exists.
"""

from __future__ import annotations

import importlib
from typing import Any

EPS = 1e-6


class _Lazy:
    def __init__(self, module: str) -> None:
        self._name = module
        self._mod = None

    def __getattr__(self, attr: str) -> Any:
        if self._mod is None:
            self._mod = importlib.import_module(self._name)
        return getattr(self._mod, attr)


sq = _Lazy("yrdask.runtime.submit_queue")
lq = _Lazy("yrdask.scheduler.leases")
gate = _Lazy("yrdask.worker.lease_gate")
lending = _Lazy("yrdask.worker.lending")


def available() -> dict[str, bool]:
    """Which machine modules import (the others are being written)."""
    out = {}
    for name in ("yrdask.runtime.submit_queue", "yrdask.scheduler.leases",
                 "yrdask.worker.lease_gate"):
        try:
            importlib.import_module(name)
            out[name] = True
        except ImportError:
            out[name] = False
    return out


def importable(name: str) -> bool:
    try:
        importlib.import_module(name)
        return True
    except ImportError:
        return False


def new_submit_queue(local_worker: str | None, **kwargs: Any) -> Any:
    return sq.SubmitQueue(local_worker, **kwargs)


def new_lease_queue() -> Any:
    return lq.LeaseQueue()


def new_gate() -> Any:
    return gate.LeaseGate()


#: the lend delays a seed draws from (virtual seconds; tasks compute 0.2 ms to 3 s): at once,
#: short, and longer than most waits (blocks that end untold)
LEND_DELAYS = (0.0, 0.002, 0.05, 0.5)
KEEP_REVOKED = (0.0, 0.05, 0.5, 5.0)  # SubmitQueue keep_revoked_s drawn per seed
#: how often a lease request's rpc is passed over when its turn comes (drawn per seed): a
#: slow rpc connection, so that the owner's later withdraw (on its stream) overtakes it
RPC_LAG = (0.0, 0.0, 0.0, 0.9)
#: how long after the scheduler's adapter knows a peer is gone (a job stream closed, Dask
#: removed a worker) its machines hear it (virtual seconds, drawn per departure)
GONE_DELAYS = (0.0, 0.001, 0.02, 0.2, 1.0)


def new_notices(delay_s: float) -> Any:
    return lending.LendNotices(delay_s)


def _ledger(queue: Any) -> Any:
    return queue.ledger


def check_ledger(queue: Any) -> None:
    """Each worker's ``held`` is the sum of its holdings (lent CPU excluded; what runs in a
    resource-group bundle counts in the bundle's reservation), and each holding sits on a
    known worker."""
    ledger = _ledger(queue)
    sums: dict[str, dict[str, float]] = {w: {} for w in ledger.workers}
    for hid, h in ledger.holdings.items():
        node = getattr(h, "node", "") or h.worker  # nodes are hosts (docs/nodes.md)
        assert node in ledger.workers, f"holding {hid} on unknown node {node}"
        assert hid in ledger.workers[node].holdings, f"holding {hid} not listed on {node}"
        if h.kind != "bundle" and hasattr(ledger, "processes"):
            assert h.worker in ledger.processes, f"holding {hid} in unknown process {h.worker}"
        s = sums[node] if not getattr(h, "bundle", "") else {}  # bundled: in its bundle
        for r, a in h.shape.items():
            if r == "CPU" and h.lent_cpu:
                continue
            s[r] = s.get(r, 0.0) + a
    for w, ws in ledger.workers.items():
        for r in set(ws.held) | set(sums[w]):
            assert abs(ws.held.get(r, 0.0) - sums[w].get(r, 0.0)) < EPS, \
                f"ledger of {w}: held {r}={ws.held.get(r, 0.0)} but holdings sum to {sums[w].get(r, 0.0)}"
        for hid in ws.holdings:
            assert hid in ledger.holdings, f"{w} lists holding {hid} the ledger forgot"


def _used(ledger: Any, ws: Any) -> dict[str, float]:
    """What the holdings on a worker use, summed from the holdings themselves (not from the
    ledger's own ``held``): a lease's CPU lent while its task is blocked is not counted; a
    holding inside a resource-group bundle counts against the bundle, not the worker."""
    used: dict[str, float] = {}
    for hid in ws.holdings:
        h = ledger.holdings.get(hid)
        if h is None or getattr(h, "bundle", ""):
            continue
        for r, a in h.shape.items():
            if r == "CPU" and h.lent_cpu:
                continue
            used[r] = used.get(r, 0.0) + a
    return used


def check_capacity(queue: Any, reclaimed: Any = (), shrunk: Any = ()) -> None:
    """Held <= offered on every node (a host's pool of worker processes) and resource.

    Two overdrafts are legitimate, and accounted explicitly: a lease whose task came back
    from ``yr.get`` takes its lent CPU back even over capacity (``LeaseUnblocked``), so the
    CPU of the leases in ``reclaimed`` (every lease ever unblocked) may exceed the offer; and
    when a process of a node leaves, the node's pool shrinks under what its other processes
    already hold, so the holdings in ``shrunk`` (those on a node when it lost a process) may
    exceed it.  Nothing else may."""
    ledger = _ledger(queue)
    for w, ws in ledger.workers.items():
        used = _used(ledger, ws)
        for r, a in used.items():
            cap = ws.capacity.get(r, 0.0)
            if a <= cap + EPS:
                continue
            allowance = 0.0
            for hid in ws.holdings:
                h = ledger.holdings.get(hid)
                if h is None or getattr(h, "bundle", ""):
                    continue
                if hid in shrunk and not (r == "CPU" and h.lent_cpu):
                    allowance += h.shape.get(r, 0.0)
                elif r == "CPU" and hid in reclaimed:
                    allowance += h.shape.get("CPU", 0.0)
            assert a <= cap + allowance + EPS, \
                f"capacity: {w} holds {r}={a:g} of {cap:g} offered (overdraft allowed for " \
                f"reclaimed CPU and a shrunk pool: {allowance:g}) in {sorted(ws.holdings)}"


def shrinking(queue: Any, worker: str) -> set[str]:
    """The holdings on ``worker``'s node that stay when ``worker`` leaves (call it before
    the lease queue hears of the loss): its pool shrinks under them."""
    ledger = _ledger(queue)
    node_of = getattr(ledger, "node_of", None)
    node = node_of(worker) if node_of is not None else worker
    ws = ledger.workers.get(node) if node is not None else None
    if ws is None:
        return set()
    return {hid for hid in ws.holdings
            if hid in ledger.holdings and ledger.holdings[hid].worker != worker}


def check_grant(queue: Any, holding_id: str) -> None:
    """A grant only takes what is free: right after it, every resource the holding asks
    for is within the worker's offer (blocked leases' lent CPU not counted)."""
    ledger = _ledger(queue)
    h = ledger.holdings.get(holding_id)
    if h is None or getattr(h, "bundle", ""):
        return
    ws = ledger.workers[getattr(h, "node", "") or h.worker]  # nodes are hosts
    used = _used(ledger, ws)
    for r, a in h.shape.items():
        if a > EPS:
            assert used.get(r, 0.0) <= ws.capacity.get(r, 0.0) + EPS, \
                f"capacity: granted {holding_id} {r}={a:g} on {h.worker}, which then holds " \
                f"{used.get(r, 0.0):g} of {ws.capacity.get(r, 0.0):g}"


def check_bundle_grant(sched: Any, holding_id: str, affinity: Any) -> None:
    """A grant runs where its request asked: inside a bundle of the group (and the bundle
    index) its affinity names, and outside every bundle otherwise."""
    from yrdask.protocol import bundle_target

    ledger = _ledger(sched.queue)
    h = ledger.holdings.get(holding_id)
    if h is None:
        return
    target = bundle_target(affinity) if affinity else None
    if target is None:
        assert not getattr(h, "bundle", ""), \
            f"groups: {holding_id} asked for no bundle but was granted in {h.bundle}"
        return
    group, index = target
    b = ledger.holdings.get(h.bundle) if h.bundle else None
    where = sched.rgm.by_holding.get(h.bundle) if sched.rgm is not None else None
    assert b is not None and b.kind == "bundle" and where is not None \
        and where[0] == group and index in (-1, where[1]), \
        f"groups: {holding_id} asked for bundle {index} of {group} but was granted in " \
        f"{h.bundle or 'no bundle'} ({where})"


def check_groups(rgm: Any, removed: Any = ()) -> None:
    """Resource groups against the ledger, from the holdings themselves:

    * what runs in a bundle sits on the bundle's node, inside a bundle the ledger holds, and
      all of it together stays within the bundle's reservation (lent CPU not counted);
    * every bundle holding belongs to a live group; a removed group (``removed``: the
      scheduler handled its removal) reserves nothing and nothing runs in it;
    * a group is ready (created) only when every bundle is reserved, as its strategy says.
    """
    from yrdask.protocol import RG_CREATED, RG_REMOVED

    ledger = rgm.ledger
    holdings = ledger.holdings
    used: dict[str, dict[str, float]] = {}
    for hid, h in holdings.items():
        if h.kind == "bundle":
            g = rgm.groups.get(h.label)
            assert g is not None and g.state != RG_REMOVED, \
                f"groups: bundle {hid} still reserved for removed group {h.label}"
            continue
        if not getattr(h, "bundle", ""):
            continue
        b = holdings.get(h.bundle)
        assert b is not None and b.kind == "bundle", \
            f"groups: {h.kind} {hid} runs in bundle {h.bundle}, which holds nothing"
        assert (getattr(h, "node", "") or h.worker) == (getattr(b, "node", "") or b.worker), \
            f"groups: {hid} runs on {h.worker}, its bundle {h.bundle} is on {b.worker}"
        u = used.setdefault(h.bundle, {})
        for r, a in h.shape.items():
            if r == "CPU" and h.lent_cpu:
                continue
            u[r] = u.get(r, 0.0) + a
    for bid, u in used.items():
        offer = holdings[bid].shape
        for r, a in u.items():
            assert a <= offer.get(r, 0.0) + EPS, \
                f"groups: bundle {bid} reserves {r}={offer.get(r, 0.0):g} but what runs in " \
                f"it holds {a:g}: {sorted(h for h, x in holdings.items() if x.bundle == bid)}"
    for name in removed:
        g = rgm.groups.get(name)
        assert g is None or g.state == RG_REMOVED, f"groups: {name} removed but {g.state}"
    for g in rgm.groups.values():
        if g.state != RG_CREATED:
            continue
        nodes = []
        for b in g.bundles:
            h = holdings.get(b.holding_id) if b.holding_id else None
            assert h is not None and h.kind == "bundle" and h.label == g.name, \
                f"groups: {g.name} is ready but bundle {b.index} is not reserved"
            nodes.append(getattr(h, "node", "") or h.worker)
        if g.strategy == "STRICT_SPREAD":
            assert len(set(nodes)) == len(nodes), f"groups: STRICT_SPREAD {g.name} on {nodes}"
        elif g.strategy == "STRICT_PACK":
            assert len(set(nodes)) <= 1, f"groups: STRICT_PACK {g.name} on {nodes}"


def ledger_summary(queue: Any) -> str:
    ledger = _ledger(queue)
    parts = []
    for w, ws in ledger.workers.items():
        held = ", ".join(f"{r}={a:g}" for r, a in sorted(ws.held.items()) if abs(a) > EPS)
        parts.append(f"{w} holds [{held}] in {sorted(ws.holdings)}")
    return "; ".join(parts) or "no workers"


def pending_requests(queue: Any) -> list:
    for attr in ("pending", "waiting", "requests"):
        value = getattr(queue, attr, None)
        if value is not None:
            return list(value)
    return []


def leftovers(world: Any) -> list[str]:
    """What is still held, pending or queued once everything is over."""
    out = []
    queue = world.sched.queue
    ledger = _ledger(queue)
    for hid, h in ledger.holdings.items():
        out.append(f"holding {hid} ({h.kind} of {h.owner} on {h.worker}) never released")
    for w, ws in ledger.workers.items():
        for r, a in ws.held.items():
            if abs(a) > EPS:
                out.append(f"{w} still holds {r}={a:g}")
    rgm = getattr(world.sched, "rgm", None)
    if rgm is not None:
        from yrdask.protocol import RG_REMOVED

        live = [g.name for g in rgm.groups.values() if g.state != RG_REMOVED]
        if live:
            out.append(f"resource groups {live} outlive their owner's job")
    pend = pending_requests(queue)
    if pend:
        out.append(f"scheduler requests still pending: {pend}")
    for node in world.live_workers():
        s = node.submit
        leases = getattr(s, "leases", None)
        if leases:
            out.append(f"{node.name}'s submit queue still has leases {sorted(leases)}")
        if node.gate.lease_of:
            out.append(f"{node.name}'s gate still has tasks {sorted(node.gate.lease_of)}")
        if node.runs:
            out.append(f"{node.name} still runs {sorted(node.runs)}")
        if node.task_side.tasks:
            out.append(f"{node.name}'s task side still has {sorted(node.task_side.tasks)}")
    return out


def stories(world: Any, keys: tuple) -> list[str]:
    """The machines' story entries about ``keys`` (each machine's own format)."""
    out = []
    for node in world.nodes.values():
        for machine_name in ("queue", "submit", "gate", "rgm"):
            m = getattr(node, machine_name, None)
            if m is None:
                continue
            story = getattr(m, "story", None)
            if story is None:
                continue
            entries = story.about(*keys) if hasattr(story, "about") else story(*keys)
            for sid, what in entries:
                out.append(f"{node.name}.{machine_name}: {sid:>20}  {' '.join(map(str, what))}")
    return out


def check_granted_in_time(queue: Any, since_of: dict, now: float, within: float) -> None:
    """Progress of a ``LeaseQueue``: a pending request (a task lease or an instance, no
    affinity) that fits the free capacity of a node with a process it does not avoid is
    granted within ``within`` virtual seconds (``since_of``: request id -> since when it has
    fit, the caller's record between calls)."""
    fit_now = set()
    for rid, w in queue.pending.items():
        if w.kind not in ("lease", "instance") or w.affinity:
            continue
        for n in queue.ledger.workers.values():
            if all(n.free(r) + EPS >= a for r, a in w.shape.items()) and any(
                    p not in w.avoid for p in (n.processes or (n.address,))):
                fit_now.add(rid)
                break
    for rid in [r for r in since_of if r not in fit_now]:
        del since_of[rid]
    for rid in fit_now:
        since = since_of.setdefault(rid, now)
        assert now - since <= within, (
            f"progress: {queue.pending[rid].describe()} ({queue.pending[rid]!r}) has fit the "
            f"free capacity since {since:.3f} s, yet is still pending at {now:.3f} s")


def check_answered_by_deadline(queue: Any, freeable_at: dict, now: float, slack: float) -> None:
    """Timers of a ``LeaseQueue``: a request (no affinity) that asked for ``timeout_ms``
    is answered by then, unless task leases hold resources on a node that could ever run it
    (tasks end: it may wait on, one more ``max(timeout, 1 s)`` after the last time that held).
    Judged from the request's own arrival time and timeout and the ledger's holdings, never
    from the deadline the queue worked out (``freeable_at``: request id -> the last time a
    lease stood in its way, the caller's record between calls)."""
    if not isinstance(queue.pending, dict) or getattr(queue, "scaling", None) is not None:
        return
    ledger = queue.ledger
    for rid in [r for r in freeable_at if r not in queue.pending]:
        del freeable_at[rid]
    for rid, w in queue.pending.items():
        if w.timeout_ms < 0 or w.affinity:
            continue
        timeout = w.timeout_ms / 1000
        for h in ledger.holdings.values():
            n = ledger.workers.get(h.node) if h.kind == "lease" else None
            if n is not None and all(n.capacity.get(r, 0.0) + EPS >= a
                                     for r, a in w.shape.items()):
                freeable_at[rid] = now
                break
        bound = w.since + timeout
        if rid in freeable_at:
            bound = max(bound, freeable_at[rid] + max(timeout, 1.0))
        assert now <= bound + slack, (
            f"timer: {w.describe()} ({w!r}) asked at {w.since:.3f} s to be answered within "
            f"{timeout:g} s, yet still waits at {now:.3f} s, and no task lease has stood in "
            f"its way since {freeable_at.get(rid, w.since):.3f} s")


def check_offers(queue: Any, offer_of: Any) -> None:
    """Capacity against the offers themselves: no node of the ledger counts more of a
    resource than the worker processes it lists there offer (``offer_of(process)``: what
    that process offered when it joined, the caller's own record), so a node that keeps a
    gone process's share is caught."""
    for node, ws in _ledger(queue).workers.items():
        if not ws.processes:
            continue
        offered: dict[str, float] = {}
        for p in ws.processes:
            for r, a in offer_of(p).items():
                offered[r] = offered.get(r, 0.0) + a
        for r, a in ws.capacity.items():
            assert a <= offered.get(r, 0.0) + EPS, (
                f"capacity: the ledger counts {r}={a:g} on node {node}, whose worker "
                f"processes {sorted(ws.processes)} offer {offered.get(r, 0.0):g}")
