"""The Dask-side adapter of resource groups: rpc handlers and extension hooks over GroupMachine.

Ops (:mod:`yrdask.protocol`, resource-group section): ``yr_create_resource_group``,
``yr_remove_resource_group``, ``yr_wait_resource_group``, ``yr_get_resource_group``. The
decisions are :class:`~yrdask.scheduler.groups.GroupMachine`'s; :class:`GroupService` feeds it
events (from those rpcs, from every lease-queue step that may have changed capacity, from
ended jobs) and carries out its instructions through a small :class:`GroupServiceEdge` (let the lease
queue grant what a reservation or release made possible, kill instances and revoke leases that
ran in a removed group, answer waiters), as ``scheduler/lease_service.py`` does with
``LeaseServiceEdge``.
:class:`ResourceGroupService` plugs in the scheduler's loop and streams; the simulation
(``tests/sim/world.py``) plugs in its links, so it drives this very code.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any, Protocol

from yrdask import protocol as P
from yrdask.scheduler import groups as G
from yrdask.scheduler.requests import shape_of

logger = logging.getLogger("yrdask.scheduler")

KILL_WAIT_S = 30.0  # how long a removal waits for the instances in the group to stop


class GroupServiceEdge(Protocol):
    """What :class:`GroupService` needs of the world around it."""

    def grant_pending(self) -> None:
        """Let the lease queue grant what fits now (a bundle was reserved or room freed)."""

    def kill_instance(self, instance_id: str, reason: str) -> Any:
        """Stop an instance that ran in a removed group; returns a handle the removal may
        wait for (or None)."""

    def send_to_owner(self, owner: str, msg: dict) -> None:
        """Send ``msg`` on ``owner``'s job or worker stream; drop it if there is none."""

    def group_settled(self, group: str) -> None:
        """``group`` is placed or removed: answer the callers waiting for it."""

    def requester_gone(self, owner: str) -> str | None:
        """Why ``owner`` can own nothing new (its job ended, its worker left), or None: the
        lease service's :meth:`~yrdask.scheduler.lease_service.LeaseService.requester_gone`."""


class GroupService:
    """Feeds the group machine and carries out its instructions through a
    :class:`GroupServiceEdge`; ``leases`` is the lease queue whose ledger the groups reserve in."""

    def __init__(self, edge: GroupServiceEdge, leases: Any) -> None:
        self.edge = edge
        self.machine = G.GroupMachine(leases.ledger)
        leases.bundles = self.machine  # the lease queue fits bundle requests through it
        self._stimuli = itertools.count(1)
        self._busy = False  # re-entry guard: our own ticks feed the lease queue again
        # Where detached groups are recorded for a restarted scheduler
        # (scheduler/durable.py: DurableControl, or None).
        self.durable: Any = None

    def _sid(self, what: str) -> str:
        return f"rg-{what}-{next(self._stimuli)}"

    def create(self, owner: str, name: str, bundles: list, strategy: str = "PACK",
               fate_sharing: bool = False, detached: bool = False) -> str:
        """Accept the group (placement goes on here); ``""`` or why it is refused.

        The create is an rpc on a pooled connection, not on the owner's job stream, so it can
        arrive after the owner ended (its groups were removed then): a group made now would
        never be removed, so it is refused, as a lease request is.
        """
        gone = self.edge.requester_gone(owner)
        if gone is not None:
            return (f"resource group {name!r} was not created: {gone} (its job ended or its "
                    "worker left before the request arrived)")
        if self.machine.live(name) is not None:
            return (f"resource group {name!r} already exists; remove it first "
                    "(yr.remove_resource_group) or choose another name")
        if strategy not in G.STRATEGIES:
            return f"invalid strategy {strategy!r}; expected one of {', '.join(G.STRATEGIES)}"
        self.do(self.machine.handle(G.GroupRequested(
            self._sid("create"), name, owner, tuple(shape_of(b) for b in bundles), strategy,
            bool(fate_sharing), bool(detached))))
        if detached and self.durable is not None:
            self.durable.group_created(self.machine.groups[name])
        return ""

    def remove(self, name: str, reason: str = "yr.remove_resource_group was called"
               ) -> tuple[bool, list]:
        """Remove the group: whether it existed, and the instance kills started."""
        existed = self.machine.live(name) is not None
        kills = self.do(self.machine.handle(G.GroupRemoved(self._sid("remove"), name, reason)))
        return existed, kills

    def after_feed(self) -> None:
        """The lease queue handled an event: capacity may have changed (a worker came or went,
        holdings were released); lost bundles go pending and pending groups are tried."""
        if self._busy or not self.machine.by_holding and not self.machine.has_pending():
            return
        self.do(self.machine.handle(G.ClusterChanged(self._sid("changed"))))

    def on_owner_gone(self, owner: str) -> None:
        """``owner``'s job ended (or its worker left): its groups are removed."""
        if any(g.owner == owner for g in self.machine.groups.values()):
            self.do(self.machine.handle(G.OwnerEnded(self._sid("owner-gone"), owner)))

    def do(self, instructions: list) -> list:
        """Carry out ``instructions``; returns the instance kills it started."""
        regrant = False
        kills: list = []
        edge = self.edge
        for ins in instructions:
            kind = type(ins)
            if kind is G.BundleReserved or kind is G.BundlesReleased:
                regrant = True
            elif kind is G.GroupReady or kind is G.GroupEnded:
                edge.group_settled(ins.group)
                if kind is G.GroupEnded and self.durable is not None:
                    self.durable.group_removed(ins.group)
                # requests waiting for an ended group are refused by the re-grant pass
                regrant = regrant or kind is G.GroupEnded
            elif kind is G.EndHolding:
                if ins.kind == "instance":
                    kill = edge.kill_instance(ins.holding_id, ins.reason)
                    if kill is not None:
                        kills.append(kill)
                elif ins.kind == "lease":
                    # Already released from the ledger; its owner returns it once idle and
                    # its queued tasks ask again (and are refused: the group is gone).
                    edge.send_to_owner(ins.owner, P.RevokeLeases([ins.holding_id]).to_msg())
            else:  # pragma: no cover - a new instruction nobody taught the adapter
                raise AssertionError(f"unknown group machine instruction {ins!r}")
        if regrant:
            self._busy = True
            try:
                # What waited for this bundle (or for the room a removal freed) may fit now;
                # requests for a removed group are refused by the same pass.
                edge.grant_pending()
            finally:
                self._busy = False
            # Changes made meanwhile were not seen (the guard): look again.  This ends, since
            # a step that places or releases nothing emits nothing to re-grant.
            self.after_feed()
        return kills


class ResourceGroupService:
    """Resource groups on the scheduler (see module docstring); ``ext`` is the extension."""

    def __init__(self, ext: Any) -> None:
        self.ext = ext
        self.service = GroupService(_LoopGroupEdge(self), ext.leases)
        self.machine = self.service.machine
        self._waiters: dict[str, list[asyncio.Future]] = {}  # group name -> wait() futures
        self._tasks: set[asyncio.Task] = set()

    # -- rpc handlers ----------------------------------------------------------------------

    def create_resource_group(self, owner: str, name: str, bundles: list,
                              strategy: str = "PACK", fate_sharing: bool = False,
                              detached: bool = False) -> str:
        """Accept the group (placement goes on here); ``""`` or why it is refused."""
        return self.service.create(owner, name, bundles, strategy, fate_sharing, detached)

    async def remove_resource_group(self, name: str) -> bool:
        """Remove the group; True if it existed.  Replies once the instances that ran in it
        are stopped (at most ``KILL_WAIT_S``), so calls on them fail right after."""
        existed, kills = self.service.remove(name)
        if kills:
            await asyncio.wait(kills, timeout=KILL_WAIT_S)
        return existed

    async def wait_resource_group(self, name: str, timeout: float = -1) -> list:
        """``[state, reason, bundle_count]`` once every bundle is placed, the group is
        removed, or ``timeout`` s passed (``< 0``: forever; ``0``: look only)."""
        g = self.machine.groups.get(name)
        if g is None:
            return [P.RG_UNKNOWN, f"no resource group named {name!r} exists", 0]
        if g.state == P.RG_PENDING and timeout != 0:
            future = asyncio.get_running_loop().create_future()
            self._waiters.setdefault(name, []).append(future)
            try:
                await asyncio.wait_for(asyncio.shield(future),
                                       None if timeout < 0 else timeout)
            except asyncio.TimeoutError:
                pass
            finally:
                waiting = self._waiters.get(name, [])
                if future in waiting:
                    waiting.remove(future)
                if not waiting:
                    self._waiters.pop(name, None)
            g = self.machine.groups.get(name, g)
        return [g.state, g.reason, len(g.bundles)]

    def get_resource_group(self, name: str) -> list | None:
        """``[strategy, bundles]`` of the live group ``name``, or None."""
        g = self.machine.live(name)
        if g is None:
            return None
        return [g.strategy, [dict(b.shape) for b in g.bundles]]

    # -- hooks from the extension ----------------------------------------------------------

    def after_feed(self) -> None:
        """The lease queue handled an event (see :meth:`GroupService.after_feed`)."""
        self.service.after_feed()


class _LoopGroupEdge:
    """The group service's I/O edge in the scheduler: the extension's lease service, instance
    manager and streams, and the ``wait_resource_group`` futures."""

    def __init__(self, rg: ResourceGroupService) -> None:
        self.rg = rg

    def grant_pending(self) -> None:
        self.rg.ext._grant_pending()

    def kill_instance(self, instance_id: str, reason: str) -> asyncio.Task:
        tasks = self.rg._tasks
        task = asyncio.get_running_loop().create_task(
            self.rg.ext.instances.kill_instance(instance_id, reason))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    def send_to_owner(self, owner: str, msg: dict) -> None:
        self.rg.ext._send_to_owner(owner, msg)

    def group_settled(self, group: str) -> None:
        for future in self.rg._waiters.pop(group, []):
            if not future.done():
                future.set_result(None)

    def requester_gone(self, owner: str) -> str | None:
        return self.rg.ext.lease_service.requester_gone(owner)
