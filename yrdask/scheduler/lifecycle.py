"""The instance lifecycle manager's state: owner tree, names, handle holders, states.

Pure logic, no Dask and no I/O: the extension feeds it events and carries out what it
returns (stop these instances on their workers, release their resources).  The rules
(SPEC §4, docs/lifetimes.md):

* Every instance has an owner: a job id, or the id of the instance that created it (work
  created inside a stateless task belongs to that task's owner).  Owners form a tree.
* When an owner ends, its non-detached descendants end too.
* Unnamed, non-detached instances end when no process holds a handle and no handle is in
  transit (pickled but not yet unpickled).  Callers count pending calls as handles.
* Named instances live until terminated or their owner ends; detached ones until terminated.
* When the process hosting an instance dies, the instance restarts (``RESTARTING``, then
  ``ALIVE`` again on another worker) while it has ``recover_retry_times`` left (-1: no
  limit); otherwise it ends.  Its non-detached children end either way: the process that
  owned them is gone.  Terminate, reference release and an owner's end never restart.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from yrdask import protocol as P


@dataclass(eq=False)
class InstanceRecord:
    """What the manager knows of one instance."""

    instance_id: str
    spec: dict[str, Any]
    owner: str
    name_key: tuple[str, str] | None
    detached: bool
    state: str = P.PENDING
    worker: str | None = None
    reason: str = ""
    holders: set[str] = field(default_factory=set)
    transit: set[str] = field(default_factory=set)
    created_at: float = field(default_factory=time.time)
    restarts: int = 0
    checkpoint: bytes | None = None  # the last yr.save_state() of the instance

    @property
    def can_restart(self) -> bool:
        limit = self.spec.get("recover_retry_times") or 0
        return limit == -1 or self.restarts < limit

    @property
    def refcounted(self) -> bool:
        return self.name_key is None and not self.detached

    @property
    def unheld(self) -> bool:
        return not self.holders and not self.transit


class Lifecycle:
    """All instances of the cluster and the rules above; returns what must end."""

    def __init__(self) -> None:
        self.instances: dict[str, InstanceRecord] = {}
        self.names: dict[tuple[str, str], str] = {}
        self.children: dict[str, set[str]] = {}  # owner id -> instance ids
        self.released_tokens: set[str] = set()  # arrived before their registration
        self.aliases: dict[str, str] = {}  # id of a named creation that bound an existing one
        self.story: list[tuple] = []  # (time, instance_id, event, detail) for debugging
        self.graveyard: dict[str, str] = {}  # forgotten instance -> why it ended (bounded)

    def _log(self, iid: str, event: str, detail: str = "") -> None:
        self.story.append((time.time(), iid, event, detail))
        if len(self.story) > 10_000:
            del self.story[:5_000]

    # -- creation --------------------------------------------------------------------------

    def named(self, namespace: str, name: str) -> InstanceRecord | None:
        iid = self.names.get((namespace, name))
        rec = self.instances.get(iid) if iid else None
        return rec if rec is not None and rec.state != P.DEAD else None

    def add(self, spec: dict[str, Any]) -> InstanceRecord:
        name_key = (spec.get("namespace") or "", spec["name"]) if spec.get("name") else None
        rec = InstanceRecord(spec["instance_id"], spec, spec["owner"], name_key,
                             bool(spec.get("detached")))
        if spec.get("holder"):
            rec.holders.add(spec["holder"])
        self.instances[rec.instance_id] = rec
        self.children.setdefault(rec.owner, set()).add(rec.instance_id)
        if name_key is not None:
            self.names[name_key] = rec.instance_id
        self._log(rec.instance_id, "created", f"owner={rec.owner}")
        return rec

    def placed(self, iid: str, worker: str) -> None:
        rec = self.instances[iid]
        rec.worker = worker
        self._log(iid, "placed", worker)

    def set_state(self, iid: str, state: str, reason: str = "") -> InstanceRecord | None:
        rec = self.instances.get(iid)
        if rec is None or rec.state == P.DEAD:
            return None
        rec.state = state
        if reason:
            rec.reason = reason
        self._log(iid, state, reason)
        return rec

    # -- ending ----------------------------------------------------------------------------

    def end(self, iid: str, reason: str) -> list[InstanceRecord]:
        """End an instance and its non-detached descendants; returns them, deepest first."""
        rec = self.instances.get(iid)
        if rec is None or rec.state == P.DEAD:
            return []
        ended: list[InstanceRecord] = []
        for child in list(self.children.get(iid, ())):
            crec = self.instances.get(child)
            if crec is not None and not crec.detached:
                ended += self.end(child, f"its owner {iid} ended ({reason})")
        rec.state = P.DEAD
        rec.reason = reason
        if rec.name_key is not None and self.names.get(rec.name_key) == iid:
            del self.names[rec.name_key]
        self.children.get(rec.owner, set()).discard(iid)
        self.children.pop(iid, None)
        self._log(iid, "ended", reason)
        ended.append(rec)
        return ended

    def forget(self, iid: str) -> None:
        """Drop a dead record (after its worker confirmed the stop)."""
        rec = self.instances.get(iid)
        if rec is not None and rec.state == P.DEAD:
            del self.instances[iid]
            self.graveyard[iid] = rec.reason
            if len(self.graveyard) > 10_000:
                for old in list(self.graveyard)[:5_000]:
                    del self.graveyard[old]
            if self.aliases:
                for alias in [a for a, real in self.aliases.items() if real == iid]:
                    del self.aliases[alias]

    def end_owner(self, owner: str, reason: str) -> list[InstanceRecord]:
        """An owner (job) is gone: end its non-detached instances and their trees."""
        ended: list[InstanceRecord] = []
        for iid in list(self.children.get(owner, ())):
            rec = self.instances.get(iid)
            if rec is not None and not rec.detached:
                ended += self.end(iid, reason)
        if not self.children.get(owner):
            self.children.pop(owner, None)
        return ended

    def on_worker_lost(self, worker: str) -> tuple[list[InstanceRecord], list[InstanceRecord]]:
        """The instances of a dead worker: ``(restarting, ended)``."""
        restarting: list[InstanceRecord] = []
        ended: list[InstanceRecord] = []
        for rec in [r for r in self.instances.values() if r.worker == worker]:
            if rec.state == P.DEAD:  # ended above, as a child of another one
                continue
            cause = f"its worker {worker} was lost"
            if not rec.can_restart:
                limit = rec.spec.get("recover_retry_times") or 0
                if limit:
                    cause += f" and it had used all its {limit} restarts"
                ended += self.end(rec.instance_id, cause)
                continue
            rec.restarts += 1
            rec.state, rec.worker, rec.reason = P.RESTARTING, None, cause
            self._log(rec.instance_id, P.RESTARTING, f"{cause} (restart {rec.restarts})")
            for child in list(self.children.get(rec.instance_id, ())):
                crec = self.instances.get(child)
                if crec is not None and not crec.detached:
                    ended += self.end(child, f"its owner {rec.instance_id} was restarted ({cause})")
            restarting.append(rec)
        return [r for r in restarting if r.state != P.DEAD], ended

    # -- handle reference counting ---------------------------------------------------------

    def handle_refs(self, holder: str, deltas: dict[str, int], transit: list,
                    arrived: list) -> list[str]:
        """Apply a holder's report; returns ids that may now be unheld."""
        touched: list[str] = []
        for iid, token in transit:
            rec = self.instances.get(iid)
            if token in self.released_tokens:
                self.released_tokens.discard(token)
            elif rec is not None:
                rec.transit.add(token)
        for iid, delta in deltas.items():
            rec = self.instances.get(iid)
            if rec is None:
                continue
            if delta > 0:
                rec.holders.add(holder)
            else:
                rec.holders.discard(holder)
                touched.append(iid)
        for iid, token in arrived:
            rec = self.instances.get(iid)
            if rec is not None and token in rec.transit:
                rec.transit.discard(token)
                touched.append(iid)
            else:
                self.released_tokens.add(token)
        return touched

    def holder_lost(self, holder: str) -> list[str]:
        touched = []
        for rec in self.instances.values():
            if holder in rec.holders:
                rec.holders.discard(holder)
                touched.append(rec.instance_id)
        return touched

    def releasable(self, iid: str) -> bool:
        rec = self.instances.get(iid)
        return rec is not None and rec.state != P.DEAD and rec.refcounted and rec.unheld

    def snapshot(self) -> list[dict[str, Any]]:
        return [
            {"instance_id": r.instance_id, "class": r.spec.get("cls_name"), "state": r.state,
             "worker": r.worker, "owner": r.owner,
             "name": r.name_key[1] if r.name_key else "",
             "namespace": r.name_key[0] if r.name_key else "", "detached": r.detached,
             "restarts": r.restarts, "resources": r.spec.get("shape"), "reason": r.reason,
             "created_at": r.created_at}
            for r in self.instances.values()
        ]
