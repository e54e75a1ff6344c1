"""yr demand in Dask's terms: how many more workers of the deployer's shape the waiting yr
work needs (docs/deploy.md, "Scaling up").

Pure (no Dask, no I/O, no clock): the scheduler's adapter (``scheduler/scale_up.py``) reads
the lease queue and the resource groups through :func:`pending_needs`, learns the shape of
one worker process with :func:`offer_shape`, and asks :func:`workers_needed` how many
workers of that shape the needs fill, bin-packed first fit, largest first.

What counts as demand: every waiting task lease request and instance creation, and the
pending bundles of resource groups (placement groups).  A request for a bundle is not
counted: its bundle is.  A worker the deployer adds is counted as a node of its own (a node
is a host, docs/nodes.md): a need must fit one worker, ``STRICT_PACK`` bundles go on one
worker together and ``STRICT_SPREAD`` bundles of one group on distinct workers.  GPUs count
as amounts (fractions of devices add up).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from yrdask.affinity import AffinityKind, Wire, evaluate
from yrdask.errors import YRValueError
from yrdask.protocol import RG_PENDING
from yrdask.scheduler.resources import DEVICE_KINDS, EPS, Shape, device_kind, format_shape

NEW_NODE = "<a new worker>"  # the NODE_ID / NODE_IP labels a worker not started yet has


@dataclass(frozen=True)
class Need:
    """One piece of waiting work: ``shape`` on one worker; ``apart``: needs with the same
    non-empty ``apart`` (one STRICT_SPREAD group's bundles) go on distinct workers."""

    shape: Shape
    apart: str = ""


def offer_shape(capacity: Shape, gpus: Iterable[str] = (), shared: Shape | None = None) -> Shape:
    """What one worker process offers, as one shape: its capacity, its devices counted by
    kind (``GPU``, ``NPU``) and its node-wide amounts (a lone worker's node has them)."""
    shape = {r: float(a) for r, a in capacity.items()}
    for r, a in (shared or {}).items():
        shape[r] = max(shape.get(r, 0.0), float(a))
    for g in gpus:
        kind = device_kind(g)
        shape[kind] = shape.get(kind, 0.0) + 1.0
    return shape


def fits(shape: Mapping[str, float], worker: Mapping[str, float]) -> bool:
    """True if one worker of shape ``worker`` could ever hold ``shape``."""
    return all(worker.get(r, 0.0) + EPS >= a for r, a in shape.items() if a > EPS)


def new_worker_allowed(affinity: Wire, worker: Shape) -> bool:
    """True if the hard affinities of a request admit a worker that is not there yet: it
    has the tags of ``worker`` and no instances, and no node id anyone could name."""
    if not affinity:
        return True
    own: dict[str, set[str]] = {"NODE_ID": {NEW_NODE}, "NODE_IP": {NEW_NODE}}
    own.update({r: {f"{a:g}"} for r, a in worker.items() if r not in DEVICE_KINDS})
    return evaluate(affinity, {AffinityKind.RESOURCE: own, AffinityKind.INSTANCE: {}})[0]


def unfit_reason(shape: Shape, affinity: Wire, worker: Shape) -> str:
    """Why no worker of shape ``worker`` could ever run ``shape`` (``""`` if one could)."""
    if not fits(shape, worker):
        short = ", ".join(f"{r}={a:g} (a worker offers {worker.get(r, 0.0):g})"
                          for r, a in sorted(shape.items()) if worker.get(r, 0.0) + EPS < a)
        return (f"no worker the deployer adds could ever run it: it needs {short}, and a "
                f"worker of the deployer's shape offers {format_shape(worker)}")
    if not new_worker_allowed(affinity, worker):
        return ("no worker the deployer adds could ever run it: its affinity names "
                "workers (or instances) a new worker does not have")
    return ""


def for_bundle(leases: Any, affinity: Wire) -> bool:
    """True if a request of the lease queue ``leases`` asks for a resource-group bundle
    (its bundle's pending reservation is the demand, not the request)."""
    return leases.bundles is not None and leases.bundles.targets(affinity)


def pending_needs(leases: Any, groups: Any = None) -> list[Need]:
    """The waiting work of the lease queue (``leases.pending``) and of the resource-group
    machine (its pending bundles), oldest first; requests for a bundle are left out."""
    needs = [Need(dict(w.shape)) for w in leases.pending.values()
             if not for_bundle(leases, w.affinity)]
    if groups is None:
        return needs
    for g in groups.groups.values():
        if g.state != RG_PENDING:
            continue
        todo = [b.shape for b in g.bundles if b.worker is None]
        if not todo:
            continue
        if g.strategy == "STRICT_PACK":
            total: Shape = {}
            for s in todo:
                for r, a in s.items():
                    total[r] = total.get(r, 0.0) + a
            needs.append(Need(total))
        else:
            apart = g.name if g.strategy == "STRICT_SPREAD" else ""
            needs.extend(Need(dict(s), apart) for s in todo)
    return needs


def workers_needed(needs: Iterable[Need], worker: Shape) -> tuple[int, list[Need]]:
    """``(n, unfit)``: how many workers of shape ``worker`` hold ``needs`` (first fit,
    largest share of a worker first), and the needs that no such worker could hold."""
    def share(n: Need) -> float:
        return max((a / worker[r] for r, a in n.shape.items() if worker.get(r, 0.0) > EPS),
                   default=0.0)

    bins: list[tuple[Shape, set[str]]] = []  # what is left of each worker, spread groups in it
    unfit: list[Need] = []
    for n in sorted(needs, key=share, reverse=True):
        if not fits(n.shape, worker):
            unfit.append(n)
            continue
        for left, apart in bins:
            if fits(n.shape, left) and not (n.apart and n.apart in apart):
                break
        else:
            left, apart = dict(worker), set()
            bins.append((left, apart))
        for r, a in n.shape.items():
            left[r] = left.get(r, 0.0) - a
        if n.apart:
            apart.add(n.apart)
    return len(bins), unfit


def configured_shape(value: Any, key: str) -> Shape | None:
    """The worker shape a config value gives (``None``: not configured), checked:
    ``{CPU: 4000, Memory: 16000, GPU: 1, tag: n}``, amounts in yr's units, not negative."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not value:
        raise YRValueError(f"{key}={value!r}: expected the resources of one worker process, "
                           "e.g. {CPU: 4000, Memory: 16000} (CPU in millicores, Memory in "
                           "MB, then GPU and custom tags), or null to learn it from the "
                           "workers seen")
    out: Shape = {}
    for r, a in value.items():
        try:
            amount = float(a)
        except (TypeError, ValueError):
            amount = -1.0
        if not isinstance(r, str) or amount < 0:
            raise YRValueError(f"{key}: {r!r}: {a!r} is not an amount >= 0 of a named "
                               "resource (e.g. CPU: 4000)")
        out[r] = amount
    return out
