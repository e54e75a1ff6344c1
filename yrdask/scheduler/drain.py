"""Scale-down that loses nothing (SPEC §9, docs/deploy.md "Scaling down").

Dask retires workers through two scheduler methods: ``workers_to_close`` proposes idle ones
(Adaptive, the HTTP API ``/api/v1/retire_workers``) and ``retire_workers`` retires them
(Adaptive, ``client.retire_workers``, the HTTP API).  Adaptive then *kills* what it proposed
(``cluster.scale_down``), whatever ``retire_workers`` did, so the decision to keep a worker
is made where workers are proposed, and ``retire_workers`` only drains.

* :func:`decide` (pure) says what one worker needs before it may go: kept (yr work runs
  there, an instance cannot move, no other worker could take what it hosts), or drained
  (its movable instances move with their state, the large values it keeps for their owners
  are taken over by another worker), or restarted elsewhere (instances without a checkpoint
  when ``yrdask.scheduling.drain-restart-unmovable`` is set).
* :class:`Drainer` is its Dask edge: Dask's ``valid_workers_downscaling`` plugin hook
  (which ``Scheduler.workers_to_close`` calls on every path) leaves out the workers to keep,
  and ``retire_workers`` (the method and the comm handler) drains each worker first and
  leaves out any whose drain failed, with the reason logged.  While it drains, the lease
  queue places nothing new on it (``WorkerDraining``), and the own processes of instances
  that restart elsewhere end before Dask removes it (``EndProcesses``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable

from yrdask import protocol as P
from yrdask.config import drain_settings

logger = logging.getLogger("yrdask.scheduler.drain")

# the parameters of Scheduler.retire_workers itself; the others go to workers_to_close
_RETIRE_KWARGS = ("close_workers", "remove", "stimulus_id")


@dataclass(frozen=True)
class Hosted:
    """What :func:`decide` needs of one instance on the worker (from the lifecycle)."""

    instance_id: str
    cls_name: str
    state: str
    has_checkpoint: bool
    can_restart: bool
    shape: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    """``keep``: why the worker must stay ("" if it may go); ``move``: instances that move
    with their state; ``restart``: instances left to restart elsewhere when it goes."""

    worker: str
    keep: str = ""
    move: tuple[str, ...] = ()
    restart: tuple[str, ...] = ()


def movable(h: Hosted) -> bool:
    """An instance moves with its state if it has a checkpoint (it called
    ``yr.save_state()``): its state pickles and it is built to resume from one."""
    return h.state == P.ALIVE and h.has_checkpoint


def decide(worker: str, hosted: Iterable[Hosted], leases: int, restart_unmovable: bool,
           room: Any = None, calls: int = 0, bundles: int = 0) -> Decision:
    """What ``worker`` needs before it may retire.

    ``leases``: yr task leases held there (running or about to run work: never idle).
    ``calls``: instance calls it runs or queues (its last heartbeat; counted when workers
    are proposed, not when a drain waits for them).  ``room(shape)``: whether another
    worker could take an instance of that shape now (``None``: not checked).  ``bundles``:
    resource-group bundles reserved on its node (a reservation keeps its node, as a
    placement group keeps a Ray node)."""
    if leases:
        return Decision(worker, keep=f"it runs yr work ({leases} task lease(s) held)")
    if bundles:
        return Decision(worker, keep=f"its node holds {bundles} resource-group bundle(s)")
    if calls:
        return Decision(worker, keep=f"it runs yr work ({calls} instance call(s))")
    move: list[str] = []
    restart: list[str] = []
    for h in hosted:
        what = f"instance {h.instance_id} ({h.cls_name})"
        if h.state != P.ALIVE:
            return Decision(worker, keep=f"{what} is {h.state}")
        if movable(h):
            if room is not None and not room(h.shape):
                return Decision(worker, keep=f"{what} has a checkpoint but no other worker "
                                             "has room for it")
            move.append(h.instance_id)
        elif restart_unmovable and h.can_restart:
            restart.append(h.instance_id)
        elif restart_unmovable:
            return Decision(worker, keep=f"{what} has no checkpoint and no restart left "
                                         "(recover_retry_times)")
        else:
            return Decision(worker, keep=(
                f"{what} has no checkpoint (yr.save_state) and cannot move; set "
                "yrdask.scheduling.drain-restart-unmovable to restart such instances "
                "elsewhere instead"))
    return Decision(worker, move=tuple(move), restart=tuple(restart))


def must_stay(proposed: Iterable[str], all_workers: Iterable[str],
              needs: dict[str, bool]) -> set[str]:
    """Of the ``proposed`` workers, those that must stay because what they hold needs
    another worker (``needs``: instances to move or values to hand over) and none would be
    left: when every worker is proposed, the ones with needs stay."""
    proposed = set(proposed)
    if set(all_workers) - proposed:
        return set()
    return {w for w in proposed if needs.get(w)}


class Drainer:
    """The Dask edge of :func:`decide` (see module docstring); one per extension."""

    def __init__(self, ext: Any) -> None:
        self.ext = ext
        self.scheduler = ext.scheduler
        self._retire = self.scheduler.retire_workers  # Dask's own (bound methods)
        self._to_close = self.scheduler.workers_to_close
        self.kept_log: dict[str, str] = {}  # worker -> why it was last kept (dashboards, tests)
        # retiring worker -> instances whose own processes its drain ended (restarted there
        # if the worker is kept after all)
        self.ended: dict[str, tuple[str, ...]] = {}

    def install(self) -> None:
        """``retire_workers`` (method and comm handler) drains first; ``workers_to_close``
        (method and comm handler) never proposes the last workers that hold something."""
        self.scheduler.retire_workers = self.retire_workers
        self.scheduler.handlers["retire_workers"] = self.retire_workers
        self.scheduler.workers_to_close = self.workers_to_close
        self.scheduler.handlers["workers_to_close"] = self.workers_to_close

    # -- what each worker needs ------------------------------------------------------------

    def hosted(self) -> dict[str, list[Hosted]]:
        """The live instances by the worker they are on (or moving from), in one pass."""
        by_worker: dict[str, list[Hosted]] = {}
        for r in self.ext.instances.lifecycle.instances.values():
            if r.state == P.DEAD:
                continue
            h = Hosted(r.instance_id, r.spec.get("cls_name") or "", r.state,
                       r.checkpoint is not None, r.can_restart, r.spec.get("shape") or {})
            for w in {r.worker, r.moving_from} - {None}:
                by_worker.setdefault(w, []).append(h)
        return by_worker

    def kept(self, workers: Iterable[str]) -> set[str]:
        """Of ``workers``, those a drain could not empty now (yr work running, instances
        that cannot move or have no room elsewhere): the floor of yr's adaptive target, so
        that workers whose instances can move are left for ``workers_to_close`` to propose."""
        hosted = self.hosted()
        restart_unmovable, _timeout = drain_settings()  # read once for all of them
        return {w for w in workers
                if self.decision(w, proposing=True, hosted=hosted.get(w, ()),
                                 restart_unmovable=restart_unmovable).keep}

    def decision(self, worker: str, avoid: Iterable[str] = (), proposing: bool = False,
                 hosted: Iterable[Hosted] | None = None,
                 restart_unmovable: bool | None = None) -> Decision:
        """:func:`decide` for ``worker`` now; ``proposing``: for ``workers_to_close`` (its
        running instance calls count too: a drain would wait for them); ``hosted``: its
        instances, when the caller has them (:meth:`hosted`)."""
        if hosted is None:
            hosted = self.hosted().get(worker, ())
        leases = sum(1 for h in self.ext.leases.holdings_on(worker) if h.kind == "lease")
        if restart_unmovable is None:
            restart_unmovable, _timeout = drain_settings()
        ledger = self.ext.ledger
        away = {worker, *avoid}

        def room(shape: dict) -> bool:
            from yrdask.scheduler.requests import shape_of

            return ledger.choose(shape_of(shape), avoid=away) is not None
        calls = 0
        if proposing:
            ws = self.scheduler.workers.get(worker)
            report = (ws.metrics or {}).get("yr") if ws is not None else None
            calls = sum(int(p) for _done, p in ((report or {}).get("instances") or {}).values())
        node = ledger.workers.get(ledger.node_of(worker) or "")
        bundles = 0 if node is None else sum(
            1 for h in node.holdings
            if h in ledger.holdings and ledger.holdings[h].kind == "bundle")
        return decide(worker, hosted, leases, restart_unmovable, room, calls, bundles)

    def _needs(self, worker: str) -> bool:
        """``worker`` hosts instances that would move, or keeps values for their owners
        (its last heartbeat's ``kept``)."""
        ws = self.scheduler.workers.get(worker)
        report = (ws.metrics or {}).get("yr") if ws is not None else None
        return bool((report or {}).get("kept")) or bool(self.decision(worker).move)

    def _keep(self, worker: str, why: str) -> None:
        if self.kept_log.get(worker) != why:
            logger.info("scale-down: keeping worker %s: %s", worker, why)
        self.kept_log[worker] = why

    def valid_workers_downscaling(self, workers: list) -> list:
        """Dask's plugin hook, from ``Scheduler.workers_to_close``: the workers that may go
        (Dask then picks among them)."""
        ok = []
        hosted = self.hosted()
        restart_unmovable, _timeout = drain_settings()
        for ws in workers:
            d = self.decision(ws.address, proposing=True, hosted=hosted.get(ws.address, ()),
                              restart_unmovable=restart_unmovable)
            if d.keep:
                self._keep(ws.address, d.keep)
            else:
                ok.append(ws)
        return ok

    def workers_to_close(self, *args: Any, **kwargs: Any) -> list:
        """Dask's ``workers_to_close`` (which calls the hook above), less the workers that
        must stay because nothing would be left to take what they hold."""
        out = self._to_close(*args, **kwargs)
        attribute = kwargs.get("attribute", "address")
        workers = self.scheduler.workers
        by_value = {getattr(ws, attribute): a for a, ws in workers.items()}
        addresses = [by_value.get(v, v) for v in out]
        stay = must_stay(addresses, workers, {a: self._needs(a) for a in addresses})
        for w in stay:
            self._keep(w, "what it holds (instances with a checkpoint, values kept for their "
                          "owners) needs another worker, and none would be left")
        return [v for v, a in zip(out, addresses) if a not in stay]

    # -- retire_workers --------------------------------------------------------------------

    async def retire_workers(self, workers: list[str] | None = None, *,
                             names: list | None = None, **kwargs: Any) -> dict:
        """Dask's ``retire_workers``, each worker drained first (nothing new is placed on
        it from now on); a worker whose drain failed is left out (kept, reason logged) and
        takes work again, as does one Dask did not retire."""
        retire_kw = {k: kwargs.pop(k) for k in _RETIRE_KWARGS if k in kwargs}
        if names is not None and workers is not None:
            raise TypeError("names and workers are mutually exclusive")
        if names is not None:
            wanted = {str(n) for n in names}
            addresses = [a for a, ws in self.scheduler.workers.items() if str(ws.name) in wanted]
        elif workers is not None:
            addresses = [a for a in workers if a in self.scheduler.workers]
        else:
            addresses = self.scheduler.workers_to_close(**kwargs)
        if not addresses:
            return {}
        retiring = set(addresses)
        lease_service = self.ext.lease_service
        for w in addresses:  # from now on nothing new is placed there
            lease_service.worker_draining(w, True)
        retired: dict = {}
        try:
            results = await asyncio.gather(*(self.drain(w, retiring) for w in addresses))
            go = [w for w, ok in zip(addresses, results) if ok]
            if go:
                retired = await self._retire(workers=go, **retire_kw)
        finally:
            for w in addresses:
                ended = self.ended.pop(w, ())
                if w in retired or w not in self.scheduler.workers:
                    continue
                # kept after all (its drain failed, or Dask did not retire it)
                lease_service.worker_draining(w, False)
                for iid in ended:  # their processes ended for nothing: restart them there
                    self.ext.instances.service.instance_state(
                        iid, P.RESTARTING, worker=w,
                        reason=f"its process ended for the retirement of worker {w}, "
                               "which was kept after all")
        return retired

    async def drain(self, worker: str, retiring: set[str]) -> bool:
        """Make ``worker`` safe to retire: move its instances, hand its values over.  False
        (with the reason logged) if it must stay."""
        others = [w for w in self.scheduler.workers if w not in retiring]
        d = self.decision(worker, retiring)
        if d.keep:
            self._keep(worker, d.keep)
            return False
        _restart, timeout = drain_settings()
        if d.move and not others:
            self._keep(worker, "no other worker is left to take its instances")
            return False
        for iid in d.move:
            why = await self.move_instance(worker, iid, retiring, timeout)
            if why:
                self._keep(worker, f"instance {iid} could not move: {why}")
                return False
        why = await self.hand_over_objects(worker, others)
        if why:
            self._keep(worker, why)
            return False
        again = self.decision(worker, retiring)  # work placed there while it drained
        if again.keep or again.move:
            self._keep(worker, again.keep or "instances were placed on it while it drained")
            return False
        if d.restart:
            logger.info("scale-down: worker %s retires; instances %s have no checkpoint and "
                        "restart elsewhere", worker, list(d.restart))
            why = await self.end_processes(worker, d.restart)
            if why:
                self._keep(worker, why)
                return False
        self.kept_log.pop(worker, None)
        return True

    async def end_processes(self, worker: str, instance_ids: Iterable[str]) -> str:
        """The instances that restart elsewhere once ``worker`` goes: their own processes
        end now, before Dask removes the worker, so none answers a call from its old state
        while the instance starts elsewhere (their callers lose their channels and locate
        them again; the restart waits for the worker's removal).  Returns "" or why not."""
        try:
            ended = await P.request(self.scheduler.rpc(worker),
                                    P.EndProcesses(list(instance_ids)))
        except Exception as e:  # noqa: BLE001 - the worker went meanwhile
            return f"it did not end its instances' processes ({e!r})"
        self.ended[worker] = tuple(ended or ())
        return ""

    async def move_instance(self, worker: str, iid: str, retiring: set[str],
                            timeout: float) -> str:
        """Drain ``iid`` on ``worker`` and start it elsewhere from its current state; its
        held calls then go to the new home.  Returns "" or why it did not move."""
        rpc = self.scheduler.rpc(worker)
        try:
            state = await P.request(rpc, P.DrainInstance(iid, timeout))
        except Exception as e:  # noqa: BLE001 - the worker went: nothing to drain
            return f"its worker did not answer ({e!r})"
        if state is None:
            await self._release(rpc, iid, "")
            return f"its calls did not finish within {timeout:g} s, or its state does not pickle"
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.ext.instances.service.move(
            iid, worker, state, tuple(retiring),
            lambda where, reason: fut.done() or fut.set_result((where, reason)))
        where, reason = await fut
        if where is None:
            await self._release(rpc, iid, "")  # ended (its held calls die) or not moved
            return reason
        logger.info("scale-down: instance %s moved from %s to %s", iid, worker, where)
        await self._release(rpc, iid, where)
        return ""

    async def _release(self, rpc: Any, iid: str, to: str) -> None:
        try:
            await P.request(rpc, P.InstanceMoved(iid, to))
        except Exception:  # noqa: BLE001 - the worker went meanwhile: its calls go with it
            logger.info("scale-down: telling the old worker of %s failed", iid, exc_info=True)

    async def hand_over_objects(self, worker: str, others: list[str]) -> str:
        """Another worker takes over the values ``worker`` keeps for their owners (same
        node: only recorded, the node's store keeps them; else copied once); owners and
        borrowers learn the new place (``ObjectsMoved``).  Returns "" or why not."""
        try:
            kept = list(await P.request(self.scheduler.rpc(worker), P.KeptObjects()))
        except Exception as e:  # noqa: BLE001
            return f"it did not say which values it keeps ({e!r})"
        if not kept:
            return ""
        if not others:
            return (f"it keeps the only copy of {len(kept)} value(s) and no other worker is "
                    "left to take them over")
        node = self.ext.ledger.node_of(worker)
        same = [w for w in others if self.ext.ledger.node_of(w) == node]
        to = (same or others)[0]
        try:
            adopted = list(await P.request(self.scheduler.rpc(to),
                                           P.AdoptObjects(worker, kept)))
        except Exception as e:  # noqa: BLE001
            return f"worker {to} could not take over its {len(kept)} value(s) ({e!r})"
        if adopted:
            self.ext._broadcast(P.ObjectsMoved(worker, to, adopted), but=worker)
            logger.info("scale-down: %d value(s) kept by %s are kept by %s now", len(adopted),
                        worker, to)
        return ""
