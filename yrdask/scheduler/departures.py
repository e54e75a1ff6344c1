"""What the scheduler does when a peer goes, apart from Dask: who hears it, in which order.

A driver's job stream ends, or Dask removes a worker.  The lease queue hears it first (what
the peer held is released or lost, its waiting requests are refused), then the instance
lifecycle (the job's instances end, the worker's restart elsewhere or end), then the
resource groups (the groups its job or its worker's code created are removed); every other
process is told of a removed worker (:class:`~yrdask.protocol.WorkerLost`).  The extension
(``scheduler/extension.py``) runs this from ``connect_job``'s end and its ``remove_worker``
hook; the simulation's worlds (``tests/sim``) run it on their own edges, so they drive the
very order production uses.
"""

from __future__ import annotations

from typing import Any, Protocol

from yrdask import protocol as P
from yrdask.scheduler.lease_service import LeaseService


class DeparturesEdge(Protocol):
    """What :class:`Departures` needs of the world around it."""

    def broadcast(self, msg: P.Message, but: str) -> None:
        """Send ``msg`` to every driver and to every worker but ``but``."""


class Departures:
    """The decisions of a peer's departure (see module docstring).  ``instances``
    (:class:`~yrdask.scheduler.instance_service.InstanceService`) and ``groups``
    (:class:`~yrdask.scheduler.group_adapter.GroupService`) may be None where a world has
    none."""

    def __init__(self, edge: DeparturesEdge, leases: LeaseService, instances: Any = None,
                 groups: Any = None) -> None:
        self.edge = edge
        self.leases = leases
        self.instances = instances
        self.groups = groups

    def job_ended(self, job_id: str, owner: str) -> None:
        """The job stream of the driver at ``owner`` ended: its leases, requests,
        instances, handles and groups go."""
        self.leases.owner_gone(owner)
        if self.instances is not None:
            self.instances.owner_gone(job_id, owner)
        if self.groups is not None:
            self.groups.on_owner_gone(owner)

    def worker_removed(self, worker: str, server_id: str = "") -> None:
        """Dask removed ``worker`` (the process ``server_id``): what it held is lost, its
        submitter's leases and requests go, its instances restart or end, the groups its
        code created are removed, and every other process is told."""
        self.leases.worker_left(worker)
        if self.instances is not None:
            self.instances.worker_lost(worker)
        if self.groups is not None:
            self.groups.on_owner_gone(worker)
        self.edge.broadcast(P.WorkerLost(worker, server_id), but=worker)
