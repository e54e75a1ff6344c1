"""The Dask-side adapter of resource groups: rpc handlers and extension hooks over GroupMachine.

Ops (:mod:`yrdask.protocol`, resource-group section): ``yr_create_resource_group``,
``yr_remove_resource_group``, ``yr_wait_resource_group``.  The decisions are
:class:`~yrdask.scheduler.groups.GroupMachine`'s; this class feeds it events (from those rpcs,
from every lease-queue step that may have changed capacity, from ended jobs) and carries out
its instructions: answer waiters, let the lease queue grant what a reservation or release
made possible, kill instances and revoke leases that ran in a removed group.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

from yrdask import protocol as P
from yrdask.scheduler import groups as G
from yrdask.scheduler.requests import shape_of

logger = logging.getLogger("yrdask.scheduler")

KILL_WAIT_S = 30.0  # how long a removal waits for the instances in the group to stop


class ResourceGroupService:
    """Resource groups on the scheduler (see module docstring); ``ext`` is the extension."""

    def __init__(self, ext: Any) -> None:
        self.ext = ext
        self.machine = G.GroupMachine(ext.leases.ledger)
        ext.leases.bundles = self.machine  # the lease queue fits bundle requests through it
        self._waiters: dict[str, list[asyncio.Future]] = {}  # group name -> wait() futures
        self._stimuli = itertools.count(1)
        self._busy = False  # re-entry guard: our own ticks feed the lease queue again
        self._tasks: set[asyncio.Task] = set()

    def _sid(self, what: str) -> str:
        return f"rg-{what}-{next(self._stimuli)}"

    # -- rpc handlers ----------------------------------------------------------------------

    def create_resource_group(self, owner: str, name: str, bundles: list,
                              strategy: str = "PACK", fate_sharing: bool = False) -> str:
        """Accept the group (placement goes on here); ``""`` or why it is refused."""
        if self.machine.live(name) is not None:
            return (f"resource group {name!r} already exists; remove it first "
                    "(yr.remove_resource_group) or choose another name")
        if strategy not in G.STRATEGIES:
            return f"invalid strategy {strategy!r}; expected one of {', '.join(G.STRATEGIES)}"
        self._do(self.machine.handle(G.GroupRequested(
            self._sid("create"), name, owner, tuple(shape_of(b) for b in bundles), strategy,
            bool(fate_sharing))))
        return ""

    async def remove_resource_group(self, name: str) -> bool:
        """Remove the group; True if it existed.  Replies once the instances that ran in it
        are stopped (at most ``KILL_WAIT_S``), so calls on them fail right after."""
        existed = self.machine.live(name) is not None
        kills = self._do(self.machine.handle(G.GroupRemoved(
            self._sid("remove"), name, "yr.remove_resource_group was called")))
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

    # -- hooks from the extension ----------------------------------------------------------

    def after_feed(self) -> None:
        """The lease queue handled an event: capacity may have changed (a worker came or went,
        holdings were released); lost bundles go pending and pending groups are tried."""
        if self._busy or not self.machine.by_holding and not self.machine.has_pending():
            return
        self._do(self.machine.handle(G.ClusterChanged(self._sid("changed"))))

    def on_owner_gone(self, owner: str) -> None:
        """``owner``'s job ended (or its worker left): its groups are removed."""
        if any(g.owner == owner for g in self.machine.groups.values()):
            self._do(self.machine.handle(G.OwnerEnded(self._sid("owner-gone"), owner)))

    # -- carrying out instructions ---------------------------------------------------------

    def _do(self, instructions: list) -> list[asyncio.Task]:
        """Carry out ``instructions``; returns the instance kills it started."""
        regrant = False
        kills: list[asyncio.Task] = []
        for ins in instructions:
            kind = type(ins)
            if kind is G.BundleReserved or kind is G.BundlesReleased:
                regrant = True
            elif kind is G.GroupReady or kind is G.GroupEnded:
                for future in self._waiters.pop(ins.group, []):
                    if not future.done():
                        future.set_result(None)
                # requests waiting for an ended group are refused by the re-grant pass
                regrant = regrant or kind is G.GroupEnded
            elif kind is G.EndHolding:
                kill = self._end_holding(ins)
                if kill is not None:
                    kills.append(kill)
        if regrant:
            self._busy = True
            try:
                # What waited for this bundle (or for the room a removal freed) may fit now;
                # requests for a removed group are refused by the same pass.
                self.ext._grant_pending()
            finally:
                self._busy = False
            # Changes made meanwhile were not seen (the guard): look again.  This ends, since
            # a step that places or releases nothing emits nothing to re-grant.
            self.after_feed()
        return kills

    def _end_holding(self, ins: G.EndHolding) -> asyncio.Task | None:
        if ins.kind == "instance":
            task = asyncio.get_running_loop().create_task(
                self.ext.instances.kill_instance(ins.holding_id, ins.reason))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return task
        if ins.kind == "lease":
            # Already released from the ledger; its owner returns it once idle and its
            # queued tasks ask again (and are refused: the group is gone).
            self.ext._send_to_owner(ins.owner, P.RevokeLeases([ins.holding_id]).to_msg())
        return None
