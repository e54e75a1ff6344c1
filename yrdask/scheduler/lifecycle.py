"""The instance lifecycle as a pure state machine: owner tree, names, handle holders, restarts.

No Dask, no I/O, no clock (conventions in ``yrdask/statemachine.py``, contract in
``docs/state-machines.md``): the scheduler's adapter (``instance_manager.py``) turns rpcs,
stream messages and Dask's worker removals into events and carries out the instructions
(acquire or release an instance's resources, start or stop it on a worker, wake rpcs that
wait for a placement).  The rules (SPEC §4-5, docs/lifetimes.md):

* Every instance has an owner: a job id, or the id of the instance that created it (work
  created inside a stateless task belongs to that task's owner).  Owners form a tree.
  An instance created by an owner instance that has ended ends at once.
* When an owner ends, its non-detached descendants end too.
* Unnamed, non-detached instances end when no process holds a handle and no handle is in
  transit (pickled but not yet unpickled), after a grace period (``release_grace_s``) that
  absorbs reordering between the holders' separate streams.  Callers count pending calls as
  handles.
* Named instances live until terminated or their owner ends; detached ones until terminated.
  A named creation while the name is taken binds the existing instance (an *alias*).
* When the process hosting an instance dies, the instance restarts (``RESTARTING``, then
  placed and ``ALIVE`` again, from its last ``yr.save_state()`` checkpoint if any) while it
  has ``recover_retry_times`` left (-1: no limit); otherwise it ends.  That process is its
  worker (``WorkerLost``: placed anew) or, for an isolated instance, its own child process
  (``ProcessDied``: started again on the same worker, which keeps its resources); both
  count against one budget per instance, whatever worker it is on.  Its non-detached
  children end either way: the process that owned them is gone.  Terminate, reference
  release and an owner's end never restart.
* A crash on request (``Crash``: Ray's ``ray.kill(actor, no_restart=False)``) kills an
  alive instance's process on its worker (``CrashInstance``; a light instance's "process"
  is its object in the worker) and nothing more: the worker reports that death as
  ``ProcessDied``, so it restarts or ends by the rules above, and its calls are charged as
  after any crash.  An instance not alive on a worker (pending, restarting) is left as it is.
* Scale-down moves an instance (``Move``, driven by ``scheduler/drain.py``): its worker
  retires, the instance was drained there (new calls held, none running) and its current
  state taken.  It stays ``ALIVE``; its resources there go back, it is placed anew (never
  on a retiring worker) and started from that state (the checkpoint).  Not a restart: its
  budget is untouched.  If no worker takes it, it ends, and its held copy is stopped.
* An ended instance is ``DEAD`` until its worker confirmed the stop (``Stopped``), then it
  is forgotten; the *graveyard* keeps why it ended (bounded) for later lookups, and the
  *tombstones* (``ended``, the newest ``ended_kept``) what it was: class, name, owner and
  job, worker, why and when it ended (the dashboard's and ``yrdask status``'s "Ended").
  Times are the latest ``now`` an event carried, or that the adapter set in :attr:`now`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from yrdask import protocol as P
from yrdask.statemachine import Event, Instruction, Story

RELEASE_GRACE_S = 0.5
RESTART_TIMEOUT_MS = 60_000  # at least this long to find room for a restarting instance
GRAVEYARD_MAX = 10_000
ENDED_KEPT = 1000  # tombstones kept (Dask config yrdask.scheduling.ended-instances-kept)
EARLY_MAX = 10_000  # handle reports kept for instances whose creation has not arrived yet
#: How long a locate of an id never seen waits for its ``CREATE_INSTANCE`` (which travels on
#: its own rpc and can come after a handle's first call), before it answers "does not exist".
CREATION_WAIT_S = 30.0

# -- events ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Create(Event):
    """``CREATE_INSTANCE``: ``spec`` is the creation spec (see ``protocol.InstanceSpec``);
    ``now`` becomes the record's ``created_at``."""

    spec: dict
    now: float = 0.0


@dataclass(frozen=True, slots=True)
class Placed(Event):
    """The resources asked for by ``AcquireResources`` are held on ``worker``."""

    instance_id: str
    worker: str


@dataclass(frozen=True, slots=True)
class PlacementFailed(Event):
    """No worker could hold the instance in time (``reason``: the ledger's explanation)."""

    instance_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class InstanceStarted(Event):
    """The worker built the instance (``init_failed``: ``__init__`` raised; calls fail with
    it, the instance still counts as running).  ``worker`` the reporter, for stale reports."""

    instance_id: str
    worker: str | None = None
    init_failed: bool = False
    endpoint: str = ""  # a process instance's own address, where its callers send calls
    incarnation: int = -1  # the restart the reporting process runs (-1: not said)


@dataclass(frozen=True, slots=True)
class InstanceExited(Event):
    """The instance's process ended it (``yr.exit()`` or the like)."""

    instance_id: str
    worker: str | None = None
    why: str = ""  # what the worker knows of it (an isolated process's exit code or signal)


@dataclass(frozen=True, slots=True)
class ProcessDied(Event):
    """The instance's own process died on ``worker`` and the worker lives (an isolated
    instance's child, docs/isolation.md): restart it there, or end it, by the same
    ``recover_retry_times`` budget as a worker loss.  ``why``: the exit code or signal.
    ``incarnation``: the restart that process was (``-1``: not said); the death of a
    restarted process that died before it came up is a new death, not the same one twice."""

    instance_id: str
    worker: str
    why: str = ""
    incarnation: int = -1


@dataclass(frozen=True, slots=True)
class Kill(Event):
    """``KILL_INSTANCE`` (an alias id is resolved); ``force``: it stops without its shutdown
    hook (Ray's ``ray.kill``), its descendants as usual."""

    instance_id: str
    reason: str = "terminated"
    force: bool = False


@dataclass(frozen=True, slots=True)
class Crash(Event):
    """``KILL_INSTANCE`` with ``restart`` (Ray's ``ray.kill(actor, no_restart=False)``): kill
    its process as if it crashed (an alias id is resolved)."""

    instance_id: str
    reason: str = "killed with ray.kill(no_restart=False)"


@dataclass(frozen=True, slots=True)
class OwnerGone(Event):
    """An owner (a job) went away: its non-detached instances end."""

    owner: str
    reason: str


@dataclass(frozen=True, slots=True)
class WorkerLost(Event):
    """Dask removed ``worker``: its instances restart or end; it holds no handle any more;
    the ledger has dropped its holdings already."""

    worker: str
    now: float


@dataclass(frozen=True, slots=True)
class HandleRefs(Event):
    """A holder's ``HANDLE_REFS`` report."""

    holder: str
    deltas: dict
    transit: Any = ()
    arrived: Any = ()
    now: float = 0.0


@dataclass(frozen=True, slots=True)
class HolderLost(Event):
    """A holder process is gone (its handles with it)."""

    holder: str
    now: float


@dataclass(frozen=True, slots=True)
class ReleaseCheck(Event):
    """A ``WakeAt`` fired: end the instances unheld for the whole grace period."""

    now: float


@dataclass(frozen=True, slots=True)
class AwaitCreation(Event):
    """A locate of an id this machine has never seen (:meth:`Lifecycle.unknown`): its
    creation may still be on the way.  Answered by ``AnswerWaiters(iid, "created")`` at
    its ``Create`` or, with the reason, ``creation_wait_s`` after ``now``."""

    instance_id: str
    now: float


@dataclass(frozen=True, slots=True)
class SaveState(Event):
    """``yr.save_state()``: the pickled instance, to restart from."""

    instance_id: str
    state: bytes


@dataclass(frozen=True, slots=True)
class Move(Event):
    """Scale-down (``scheduler/drain.py``): the instance on ``worker``, which retires, was
    drained there (its calls held, none running) and ``state`` is its current state.  It
    moves: its resources there go back and it is placed anew, never on ``avoid`` (the
    workers retiring), and started from ``state``.  Not a restart: its budget is kept."""

    instance_id: str
    worker: str
    state: bytes
    avoid: tuple = ()


@dataclass(frozen=True, slots=True)
class Stopped(Event):
    """The worker confirmed ``StopInstance`` (or cannot be reached): forget the record."""

    instance_id: str


# -- instructions ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AcquireResources(Instruction):
    """Hold ``shape`` for the instance (holding id = instance id); answer ``Placed`` or
    ``PlacementFailed``."""

    instance_id: str
    shape: dict
    timeout_ms: int
    affinity: Any = ()
    labels: tuple = ()
    avoid: tuple = ()  # workers it must not go to (a move off retiring workers)


@dataclass(frozen=True, slots=True)
class CancelAcquire(Instruction):
    """The instance ended while its ``AcquireResources`` waits: drop the request (a late
    ``Placed`` is answered with ``ReleaseResources``)."""

    instance_id: str


@dataclass(frozen=True, slots=True)
class StartInstance(Instruction):
    """Send ``START_INSTANCE`` to ``worker``: ``spec`` plus, on a restart, ``incarnation``
    (the restart count) and ``checkpoint``."""

    worker: str
    instance_id: str
    spec: dict
    incarnation: int
    checkpoint: bytes | None


@dataclass(frozen=True, slots=True)
class StopInstance(Instruction):
    """``STOP_INSTANCE`` rpc to ``worker``; answer ``Stopped`` when it returns or fails.
    ``force``: without its shutdown hook."""

    worker: str
    instance_id: str
    reason: str
    force: bool = False


@dataclass(frozen=True, slots=True)
class CrashInstance(Instruction):
    """``CRASH_INSTANCE`` to ``worker`` (on its stream): kill the instance's process as a
    crash; the worker reports the death (``ProcessDied`` with ``incarnation``)."""

    worker: str
    instance_id: str
    reason: str
    incarnation: int


@dataclass(frozen=True, slots=True)
class ReleaseResources(Instruction):
    """Release the instance's holding in the ledger."""

    instance_id: str


@dataclass(frozen=True, slots=True)
class WakeAt(Instruction):
    """Send ``ReleaseCheck(now)`` at or after ``at``."""

    at: float


@dataclass(frozen=True, slots=True)
class AnswerWaiters(Instruction):
    """Wake the rpcs waiting for the instance to reach ``stage`` (``"placed"``: it has a
    worker; ``"alive"``: it has run): ``worker``, or ``None`` and ``reason`` if it ended."""

    instance_id: str
    stage: str
    worker: str | None
    reason: str = ""


PLACED, ALIVE_STAGE, CREATED = "placed", "alive", "created"

# -- records ---------------------------------------------------------------------------------


@dataclass(eq=False)
class InstanceRecord:
    """What the lifecycle knows of one instance (the dashboard reads these)."""

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
    created_at: float = 0.0
    restarts: int = 0
    checkpoint: bytes | None = None  # the last yr.save_state() of the instance
    acquiring: bool = False  # an AcquireResources is outstanding
    held: bool = False  # its resources are held in the ledger
    ever_alive: bool = False
    release_at: float | None = None  # unheld: ends at this time if still unheld
    ended_at: float | None = None  # when it ended (the machine's ``now`` then)
    moving_from: str | None = None  # a move (scale-down) is placing it; its held copy is there
    # where the process of one that runs alone serves, from its start until it dies or moves
    # (its worker's address when the worker hosts it after all: no process could start)
    endpoint: str | None = None

    @property
    def can_restart(self) -> bool:
        limit = self.spec.get("recover_retry_times") or 0
        return limit == -1 or self.restarts < limit

    @property
    def refcounted(self) -> bool:
        return self.name_key is None and not self.detached

    @property
    def address(self) -> str | None:
        """Where its callers send calls: its worker, or for an instance that runs alone its
        process's endpoint once that process serves (``None`` until then)."""
        if not runs_alone(self.spec):
            return self.worker
        if self.state != P.ALIVE or self.moving_from is not None:
            return None
        return self.endpoint

    @property
    def unheld(self) -> bool:
        return not self.holders and not self.transit


def runs_alone(spec: dict[str, Any]) -> bool:
    """The instance runs in a process of its own (a process instance, isolated work, or
    devices): callers reach that process at its own endpoint, which its worker reports once
    it serves (``InstanceStarted.endpoint``), not at the worker (docs/isolation.md)."""
    if spec.get("isolation") is not None:
        return True
    shape = spec.get("shape") or {}
    return bool(shape.get("GPU") or shape.get("NPU"))


# -- the machine -----------------------------------------------------------------------------


class Lifecycle:
    """All instances of the cluster and the rules above (see module docstring)."""

    def __init__(self, release_grace_s: float = RELEASE_GRACE_S,
                 story_len: int = 20_000, ended_kept: int = ENDED_KEPT,
                 creation_wait_s: float = CREATION_WAIT_S) -> None:
        self.release_grace_s = release_grace_s
        self.creation_wait_s = creation_wait_s
        # ids never seen that a locate waits for (AwaitCreation) -> when it gives up
        self.awaited: dict[str, float] = {}
        self.now = 0.0  # the latest time an event carried (or the adapter set): stamps
        # Tombstones of forgotten instances, newest last (bounded): see :meth:`ended_rows`.
        self.ended: deque[dict[str, Any]] = deque(maxlen=max(0, ended_kept))
        self.job_of_ended: dict[str, str] = {}  # forgotten instance -> its job (bounded)
        self.instances: dict[str, InstanceRecord] = {}
        self.names: dict[tuple[str, str], str] = {}
        self.children: dict[str, set[str]] = {}  # owner id -> instance ids
        self.released_tokens: set[str] = set()  # arrived before their transit report
        self.aliases: dict[str, str] = {}  # id of a named creation that bound an existing one
        self.graveyard: dict[str, str] = {}  # forgotten instance -> why it ended (bounded)
        # Handle reports that overtook their instance's CREATE_INSTANCE (the stream and the
        # rpc race): id -> ({holder: net delta}, transit tokens), applied at Create (bounded).
        self.early: dict[str, tuple[dict[str, int], set[str]]] = {}
        self.release_due: dict[str, float] = {}  # unheld instance -> when it ends
        self.next_wake: float | None = None
        self.last_ended: list[InstanceRecord] = []  # ended by the last event, deepest first
        self.story = Story(story_len)
        self._losing: str | None = None  # the worker a WorkerLost is about, while handled
        self._handlers = {
            Create: self._create, Placed: self._placed, PlacementFailed: self._placement_failed,
            InstanceStarted: self._started, InstanceExited: self._exited, Kill: self._kill,
            Crash: self._crash,
            ProcessDied: self._process_died,
            OwnerGone: self._owner_gone, WorkerLost: self._worker_lost,
            HandleRefs: self._handle_refs, HolderLost: self._holder_lost,
            ReleaseCheck: self._release_check, SaveState: self._save_state,
            Stopped: self._stopped, AwaitCreation: self._await_creation, Move: self._move,
        }

    # -- queries ---------------------------------------------------------------------------

    def resolve(self, instance_id: str) -> str:
        """The real id of ``instance_id`` (an alias of a named creation that bound another)."""
        return self.aliases.get(instance_id, instance_id)

    def named(self, namespace: str, name: str) -> InstanceRecord | None:
        """The live instance of that name, if any."""
        iid = self.names.get((namespace, name))
        rec = self.instances.get(iid) if iid else None
        return rec if rec is not None and rec.state != P.DEAD else None

    def releasable(self, iid: str) -> bool:
        """Would end now for lack of handles (before the grace period)."""
        rec = self.instances.get(iid)
        return rec is not None and rec.state != P.DEAD and rec.refcounted and rec.unheld

    def why_gone(self, iid: str) -> str:
        reason = self.graveyard.get(iid)
        if reason is None:
            return f"instance {iid} does not exist (it has ended)"
        return f"it has ended: {reason}"

    def status(self, iid: str) -> dict[str, Any]:
        """``{state, worker, restarts, reason}`` (an ended, forgotten one: ``DEAD``)."""
        rec = self.instances.get(self.resolve(iid))
        if rec is None:
            return {"state": P.DEAD, "worker": None, "restarts": None,
                    "reason": self.why_gone(self.resolve(iid))}
        return {"state": rec.state, "worker": rec.worker, "restarts": rec.restarts,
                "reason": rec.reason}

    def answer(self, iid: str, stage: str) -> tuple[str | None, str] | None:
        """``(worker, "")`` or ``(None, reason)`` if ``stage`` is reached, else ``None``
        (then an ``AnswerWaiters`` for it will come).  ``"alive"`` is reached once the
        instance has run at all: a restarting one answers ``(None, "")`` (wait ``"placed"``
        next), an ended one ``(None, reason)``."""
        rec = self.instances.get(iid)
        if rec is None:
            return None, self.why_gone(iid)
        if rec.state == P.DEAD:
            return None, rec.reason
        if stage == PLACED:
            address = rec.address
            return (address, "") if address is not None else None
        return (rec.worker, "") if rec.ever_alive else None

    def unknown(self, iid: str) -> bool:
        """Never seen here: not live, not an alias, not in the graveyard (its creation may
        not have arrived yet, or it ended so long ago that the graveyard forgot it)."""
        return iid not in self.instances and iid not in self.aliases \
            and iid not in self.graveyard

    def is_live(self, iid: str) -> bool:
        rec = self.instances.get(iid)
        return rec is not None and rec.state != P.DEAD

    def checkpoint_of(self, iid: str) -> bytes | None:
        rec = self.instances.get(iid)
        return None if rec is None else rec.checkpoint

    def story_of(self, *keys: str) -> list:
        return self.story.about(*keys)

    def job_of(self, owner: str) -> str:
        """The job an owner (a job id or an instance id) belongs to, up the owner tree."""
        seen = 0
        while seen < 1000:  # owner trees are shallow; never loop on a corrupt one
            rec = self.instances.get(owner)
            if rec is None:
                return self.job_of_ended.get(owner, owner)
            owner, seen = rec.owner, seen + 1
        return owner

    def ended_rows(self, limit: int | None = None) -> list[dict[str, Any]]:
        """The tombstones, newest first (at most ``limit``): ``{instance_id, class, name,
        namespace, owner, job, worker, reason, created_at, ended_at, restarts, detached}``."""
        rows = list(reversed(self.ended))
        return rows if limit is None else rows[:limit]

    def snapshot(self) -> list[dict[str, Any]]:
        """Every record as a plain dict (``cluster_info``, the dashboard's source)."""
        return [
            {"instance_id": r.instance_id, "class": r.spec.get("cls_name"), "state": r.state,
             "worker": r.worker, "owner": r.owner,
             "name": r.name_key[1] if r.name_key else "",
             "namespace": r.name_key[0] if r.name_key else "", "detached": r.detached,
             "restarts": r.restarts, "resources": r.spec.get("shape"), "reason": r.reason,
             "created_at": r.created_at}
            for r in self.instances.values()
        ]

    # -- events ----------------------------------------------------------------------------

    def handle(self, event: Event) -> list[Instruction]:
        """Apply ``event``; returns what the adapter must do, in order."""
        self.last_ended = []
        now = getattr(event, "now", None)
        if now:
            self.now = now
        handler = self._handlers.get(type(event))
        if handler is None:
            self.story.log(event.stimulus_id, ("unknown-event", type(event).__name__), ())
            return []
        out: list[Instruction] = []
        handler(event, out)
        return out

    def _log(self, sid: str, *what: Any, keys: tuple = ()) -> None:
        self.story.log(sid, what, keys or (what[1],))

    def _create(self, ev: Create, out: list) -> None:
        spec, sid = ev.spec, ev.stimulus_id
        iid = spec["instance_id"]
        if iid in self.instances or iid in self.aliases or iid in self.graveyard:
            self._log(sid, "create-ignored", iid)
            return
        if self.awaited.pop(iid, None) is not None:  # locates that overtook it: go on
            self._log(sid, "awaited-created", iid)
            out.append(AnswerWaiters(sid, iid, CREATED, None, ""))
        name = spec.get("name")
        name_key = (spec.get("namespace") or "", name) if name else None
        if name_key is not None:
            existing = self.named(*name_key)
            if existing is not None:
                self.aliases[iid] = existing.instance_id
                self._log(sid, "bound", iid, existing.instance_id,
                          keys=(iid, existing.instance_id))
                return
        rec = InstanceRecord(iid, spec, spec["owner"], name_key, bool(spec.get("detached")),
                             created_at=ev.now)
        counts = {spec["holder"]: 1} if spec.get("holder") else {}
        early = self.early.pop(iid, None)
        if early is not None:  # reports that came first: the creator's -1 cancels its +1
            for holder, delta in early[0].items():
                counts[holder] = counts.get(holder, 0) + delta
            rec.transit |= early[1]
            self._log(sid, "early-refs-applied", iid, dict(early[0]), len(early[1]))
        rec.holders.update(h for h, n in counts.items() if n > 0)
        self.instances[iid] = rec
        self.children.setdefault(rec.owner, set()).add(iid)
        if name_key is not None:
            self.names[name_key] = iid
        self._log(sid, "created", iid, rec.owner)
        owner = self.instances.get(rec.owner)
        owner_reason = (owner.reason if owner is not None and owner.state == P.DEAD
                        else self.graveyard.get(rec.owner))
        if owner_reason is not None and not rec.detached:
            self._end(rec, f"its owner {rec.owner} has ended ({owner_reason})", sid, out)
            return
        self._acquire(rec, spec.get("timeout_ms", -1), sid, out)
        self._schedule_release([iid], ev.now, sid, out)  # created with no holder

    def _placed(self, ev: Placed, out: list) -> None:
        rec = self.instances.get(ev.instance_id)
        sid = ev.stimulus_id
        if rec is None or not rec.acquiring:
            if rec is None or rec.state == P.DEAD:  # ended while it waited
                self._log(sid, "placed-released", ev.instance_id, ev.worker)
                out.append(ReleaseResources(sid, ev.instance_id))
            else:
                self._log(sid, "placed-ignored", ev.instance_id, ev.worker)
            return
        rec.acquiring, rec.held, rec.worker, rec.endpoint = False, True, ev.worker, None
        if rec.moving_from is not None:
            self._log(sid, "moved", rec.instance_id, rec.moving_from, ev.worker)
            rec.moving_from = None
        self._log(sid, "placed", rec.instance_id, ev.worker)
        out.append(StartInstance(sid, ev.worker, rec.instance_id, rec.spec, rec.restarts,
                                 rec.checkpoint))
        if not runs_alone(rec.spec):  # one that runs alone is reached once it serves
            out.append(AnswerWaiters(sid, rec.instance_id, PLACED, ev.worker))

    def _placement_failed(self, ev: PlacementFailed, out: list) -> None:
        rec = self.instances.get(ev.instance_id)
        if rec is None or not rec.acquiring:
            self._log(ev.stimulus_id, "placement-failed-ignored", ev.instance_id)
            return
        rec.acquiring = False
        if rec.moving_from is not None:
            self._end(rec, f"its worker {rec.moving_from} retired and no other worker could "
                           f"take it: {ev.reason}", ev.stimulus_id, out)
        elif rec.state == P.RESTARTING:
            self._end(rec, f"{rec.reason}; no worker could take it back: {ev.reason}",
                      ev.stimulus_id, out)
        else:
            self._end(rec, ev.reason, ev.stimulus_id, out, answer=ev.reason)

    def _started(self, ev: InstanceStarted, out: list) -> None:
        rec = self.instances.get(ev.instance_id)
        sid = ev.stimulus_id
        if (rec is None or rec.state == P.DEAD or rec.worker is None
                or (ev.worker is not None and rec.worker != ev.worker)  # an earlier home's
                or 0 <= ev.incarnation != rec.restarts):  # a process restarted since
            self._log(sid, "started-ignored", ev.instance_id, ev.worker)
            return
        rec.state = P.ALIVE
        if ev.init_failed:
            rec.reason = "__init__ raised"
        rec.ever_alive = True
        rec.endpoint = ev.endpoint or rec.worker
        self._log(sid, P.ALIVE, rec.instance_id, rec.reason, rec.endpoint)
        out.append(AnswerWaiters(sid, rec.instance_id, ALIVE_STAGE, rec.worker))
        if runs_alone(rec.spec):  # its callers reach it here now (waiting since _placed)
            out.append(AnswerWaiters(sid, rec.instance_id, PLACED, rec.endpoint))

    def _exited(self, ev: InstanceExited, out: list) -> None:
        rec = self.instances.get(ev.instance_id)
        if (rec is None or rec.state == P.DEAD
                or (ev.worker is not None and rec.worker != ev.worker)):
            self._log(ev.stimulus_id, "exited-ignored", ev.instance_id, ev.worker)
            return
        self._end(rec, ev.why or "it exited", ev.stimulus_id, out)

    def _process_died(self, ev: ProcessDied, out: list) -> None:
        rec = self.instances.get(ev.instance_id)
        sid = ev.stimulus_id
        said = ev.incarnation >= 0
        if (rec is None or rec.state == P.DEAD or rec.worker != ev.worker
                or (said and ev.incarnation != rec.restarts)  # an earlier process's
                or (rec.state == P.RESTARTING and not said)):  # twice, or not known which
            self._log(sid, "process-died-ignored", ev.instance_id, ev.worker)  # stale or twice
            return
        cause = ev.why or "its process died"
        if not self._restart_or_end(rec, cause, sid, out):
            return
        out.append(StartInstance(sid, rec.worker, rec.instance_id, rec.spec, rec.restarts,
                                 rec.checkpoint))

    def _restart_or_end(self, rec: InstanceRecord, cause: str, sid: str, out: list) -> bool:
        """The process hosting ``rec`` died of ``cause``: charge a restart (``RESTARTING``,
        its non-detached children end) and say so, or end it when no restart is left."""
        if not rec.can_restart:
            limit = rec.spec.get("recover_retry_times") or 0
            if limit:
                cause += f" and it had used all its {limit} restarts"
            self._end(rec, cause, sid, out)
            return False
        rec.restarts += 1
        rec.state, rec.reason = P.RESTARTING, cause
        self._log(sid, P.RESTARTING, rec.instance_id, f"{cause} (restart {rec.restarts})")
        for child in list(self.children.get(rec.instance_id, ())):
            crec = self.instances.get(child)
            if crec is not None and not crec.detached and crec.state != P.DEAD:
                self._end(crec, f"its owner {rec.instance_id} was restarted ({cause})",
                          sid, out)
        return True

    def _kill(self, ev: Kill, out: list) -> None:
        rec = self.instances.get(self.resolve(ev.instance_id))
        if rec is None or rec.state == P.DEAD:
            self._log(ev.stimulus_id, "kill-ignored", ev.instance_id)
            return
        self._end(rec, ev.reason, ev.stimulus_id, out, force=ev.force)

    def _crash(self, ev: Crash, out: list) -> None:
        rec = self.instances.get(self.resolve(ev.instance_id))
        if rec is None or rec.state != P.ALIVE or rec.worker is None:
            self._log(ev.stimulus_id, "crash-ignored", ev.instance_id,
                      rec.state if rec is not None else None)
            return
        self._log(ev.stimulus_id, "crash", rec.instance_id, rec.worker, ev.reason)
        out.append(CrashInstance(ev.stimulus_id, rec.worker, rec.instance_id, ev.reason,
                                 rec.restarts))

    def _owner_gone(self, ev: OwnerGone, out: list) -> None:
        owner = ev.owner
        self._log(ev.stimulus_id, "owner-gone", owner)
        for iid in list(self.children.get(owner, ())):
            rec = self.instances.get(iid)
            if rec is not None and not rec.detached and rec.state != P.DEAD:
                self._end(rec, ev.reason, ev.stimulus_id, out)
        if not self.children.get(owner):
            self.children.pop(owner, None)

    def _worker_lost(self, ev: WorkerLost, out: list) -> None:
        worker, sid = ev.worker, ev.stimulus_id
        self._log(sid, "worker-lost", worker)
        self._losing = worker
        try:
            restarting: list[InstanceRecord] = []
            on_it = [r for r in self.instances.values() if r.worker == worker]
            for rec in on_it:
                rec.held = False  # the ledger dropped the worker's holdings
            for rec in on_it:
                if rec.state == P.DEAD:  # ended above, as a child of another one
                    continue
                if self._restart_or_end(rec, f"its worker {worker} was lost", sid, out):
                    rec.worker = None
                    restarting.append(rec)
            for rec in restarting:
                if rec.state == P.RESTARTING:
                    timeout = rec.spec.get("timeout_ms", -1)
                    timeout = -1 if timeout < 0 else max(timeout, RESTART_TIMEOUT_MS)
                    self._acquire(rec, timeout, sid, out)
        finally:
            self._losing = None
        self._drop_holder(worker, ev.now, sid, out)

    def _handle_refs(self, ev: HandleRefs, out: list) -> None:
        touched: list[str] = []
        instances = self.instances
        for iid, token in ev.transit:
            rec = instances.get(iid)
            if token in self.released_tokens:
                self.released_tokens.discard(token)
            elif rec is not None:
                rec.transit.add(token)
            elif self._not_yet_created(iid):
                self._early_of(iid)[1].add(token)
        for iid, delta in ev.deltas.items():
            rec = instances.get(iid)
            if rec is None:
                if self._not_yet_created(iid):
                    counts = self._early_of(iid)[0]
                    counts[ev.holder] = counts.get(ev.holder, 0) + delta
                continue
            if delta > 0:
                rec.holders.add(ev.holder)
            else:
                rec.holders.discard(ev.holder)
                touched.append(iid)
        for iid, token in ev.arrived:
            rec = instances.get(iid)
            early = self.early.get(iid) if rec is None else None
            if rec is not None and token in rec.transit:
                rec.transit.discard(token)
                touched.append(iid)
            elif early is not None and token in early[1]:
                early[1].discard(token)
            else:
                self.released_tokens.add(token)
        self.story.log(ev.stimulus_id, ("handles", ev.holder, dict(ev.deltas), len(ev.transit),
                                        len(ev.arrived)), tuple(ev.deltas))
        self._schedule_release(touched, ev.now, ev.stimulus_id, out)

    def _not_yet_created(self, iid: str) -> bool:
        """An id this scheduler has never seen: its creation may still be on its way."""
        return iid not in self.graveyard and iid not in self.aliases

    def _early_of(self, iid: str) -> tuple[dict[str, int], set[str]]:
        entry = self.early.get(iid)
        if entry is None:
            entry = self.early[iid] = ({}, set())
            if len(self.early) > EARLY_MAX:  # creations that never came: forget the oldest
                for old in list(self.early)[:EARLY_MAX // 2]:
                    del self.early[old]
        return entry

    def _holder_lost(self, ev: HolderLost, out: list) -> None:
        self._drop_holder(ev.holder, ev.now, ev.stimulus_id, out)

    def _await_creation(self, ev: AwaitCreation, out: list) -> None:
        iid, sid = ev.instance_id, ev.stimulus_id
        if not self.unknown(iid):  # created meanwhile: the locate goes on at once
            self._log(sid, "await-ignored", iid)
            out.append(AnswerWaiters(sid, iid, CREATED, None, ""))
            return
        if iid not in self.awaited:
            self.awaited[iid] = ev.now + self.creation_wait_s
            self._log(sid, "await-creation", iid, self.awaited[iid])
        self._wake(sid, out)

    def _release_check(self, ev: ReleaseCheck, out: list) -> None:
        self.next_wake = None  # the timer that brought this check is spent
        for iid in [i for i, at in self.awaited.items() if at <= ev.now]:
            del self.awaited[iid]
            self._log(ev.stimulus_id, "await-gave-up", iid)
            out.append(AnswerWaiters(
                ev.stimulus_id, iid, CREATED, None,
                f"instance {iid} does not exist (it has ended, or its creation did not reach "
                f"the scheduler within {self.creation_wait_s:g} s)"))
        for iid in [i for i, at in self.release_due.items() if at <= ev.now]:
            if self.release_due.pop(iid, None) is None:
                continue  # ended meanwhile, with its owner
            rec = self.instances.get(iid)
            if rec is not None:
                rec.release_at = None
                if self.releasable(iid):
                    self._end(rec, "no handle to it is left", ev.stimulus_id, out)
        self._wake(ev.stimulus_id, out)

    def _save_state(self, ev: SaveState, out: list) -> None:
        rec = self.instances.get(ev.instance_id)
        if rec is None or rec.state == P.DEAD:
            self._log(ev.stimulus_id, "save-ignored", ev.instance_id)
            return
        rec.checkpoint = ev.state
        self._log(ev.stimulus_id, "saved", ev.instance_id, len(ev.state))

    def _move(self, ev: Move, out: list) -> None:
        rec = self.instances.get(ev.instance_id)
        sid = ev.stimulus_id
        if (rec is None or rec.state != P.ALIVE or rec.worker != ev.worker
                or rec.moving_from is not None):
            self._log(sid, "move-ignored", ev.instance_id, ev.worker)
            return
        rec.checkpoint = ev.state  # its state now: what the new home starts from
        rec.moving_from, rec.worker = ev.worker, None
        self._log(sid, "move", rec.instance_id, ev.worker, len(ev.state))
        if rec.held:  # before the acquire (the adapter releases after this event's steps)
            rec.held = False
            out.append(ReleaseResources(sid, rec.instance_id))
        timeout = rec.spec.get("timeout_ms", -1)
        timeout = -1 if timeout < 0 else max(timeout, RESTART_TIMEOUT_MS)
        self._acquire(rec, timeout, sid, out, avoid=tuple(ev.avoid) or (ev.worker,))

    def _stopped(self, ev: Stopped, out: list) -> None:
        rec = self.instances.get(ev.instance_id)
        if rec is None or rec.state != P.DEAD:
            self._log(ev.stimulus_id, "stopped-ignored", ev.instance_id)
            return
        self._forget(rec, ev.stimulus_id)

    # -- helpers ---------------------------------------------------------------------------

    def _acquire(self, rec: InstanceRecord, timeout_ms: int, sid: str, out: list,
                 avoid: tuple = ()) -> None:
        spec = rec.spec
        rec.acquiring = True
        self._log(sid, "acquire", rec.instance_id, timeout_ms)
        out.append(AcquireResources(sid, rec.instance_id, spec.get("shape") or {}, timeout_ms,
                                    spec.get("affinity") or (), tuple(spec.get("labels") or ()),
                                    avoid))

    def _end(self, rec: InstanceRecord, reason: str, sid: str, out: list,
             answer: str | None = None, force: bool = False) -> None:
        """End ``rec`` and its non-detached descendants (deepest first); waiters for it get
        ``answer`` (default: ``reason``, saying if it never started).  ``force``: its stop
        skips its shutdown hook (not its descendants')."""
        iid = rec.instance_id
        kids = self.children.get(iid, ())
        for child in list(kids):
            crec = self.instances.get(child)
            if crec is not None and not crec.detached and crec.state != P.DEAD:
                self._end(crec, f"its owner {iid} ended ({reason})", sid, out)
        never_placed = rec.worker is None and not rec.ever_alive and rec.restarts == 0
        if rec.worker is None and rec.moving_from is not None:  # its held copy is there
            rec.worker, rec.moving_from = rec.moving_from, None
        rec.state, rec.reason, rec.ended_at = P.DEAD, reason, self.now
        if rec.name_key is not None and self.names.get(rec.name_key) == iid:
            del self.names[rec.name_key]
        siblings = self.children.get(rec.owner)
        if siblings is not None:
            siblings.discard(iid)
            if not siblings and self._ended_owner(rec.owner):
                del self.children[rec.owner]
        if not kids:  # detached children stay listed under their (ended) owner
            self.children.pop(iid, None)
        if self.release_due.pop(iid, None) is not None:
            rec.release_at = None
        self._log(sid, "ended", iid, reason)
        self.last_ended.append(rec)
        if rec.acquiring:
            rec.acquiring = False
            out.append(CancelAcquire(sid, iid))
        if rec.held:
            rec.held = False
            out.append(ReleaseResources(sid, iid))
        why = answer if answer is not None else (
            f"instance {iid} ended before it started: {reason}" if never_placed else reason)
        out.append(AnswerWaiters(sid, iid, PLACED, None, why))
        out.append(AnswerWaiters(sid, iid, ALIVE_STAGE, None, why))
        if rec.worker is not None and rec.worker != self._losing:
            out.append(StopInstance(sid, rec.worker, iid, reason, force))
        else:
            self._forget(rec, sid)

    def _ended_owner(self, owner: str) -> bool:
        rec = self.instances.get(owner)
        return (rec.state == P.DEAD) if rec is not None else owner in self.graveyard

    def _forget(self, rec: InstanceRecord, sid: str) -> None:
        iid = rec.instance_id
        del self.instances[iid]
        self.graveyard[iid] = rec.reason
        job = self.job_of(rec.owner)
        self.job_of_ended[iid] = job
        if len(self.graveyard) > GRAVEYARD_MAX:
            for old in list(self.graveyard)[:GRAVEYARD_MAX // 2]:
                del self.graveyard[old]
                self.job_of_ended.pop(old, None)
        if self.ended.maxlen:
            self.ended.append({
                "instance_id": iid, "class": rec.spec.get("cls_name") or "",
                "name": rec.name_key[1] if rec.name_key else "",
                "namespace": rec.name_key[0] if rec.name_key else "", "owner": rec.owner,
                "job": job, "worker": rec.worker or "", "reason": rec.reason,
                "created_at": rec.created_at,
                "ended_at": rec.ended_at if rec.ended_at is not None else self.now,
                "restarts": rec.restarts, "detached": rec.detached})
        if self.aliases:
            for alias in [a for a, real in self.aliases.items() if real == iid]:
                del self.aliases[alias]
        self._log(sid, "forgotten", iid)

    def _drop_holder(self, holder: str, now: float, sid: str, out: list) -> None:
        for counts, _transit in self.early.values():
            counts.pop(holder, None)
        touched = []
        for rec in self.instances.values():
            if holder in rec.holders:
                rec.holders.discard(holder)
                touched.append(rec.instance_id)
        if touched:
            self._log(sid, "holder-lost", holder, len(touched), keys=(holder, *touched))
        self._schedule_release(touched, now, sid, out)

    def _schedule_release(self, iids: list[str], now: float, sid: str, out: list) -> None:
        at = now + self.release_grace_s
        armed = False
        for iid in iids:
            if self.releasable(iid):
                self.release_due[iid] = at
                self.instances[iid].release_at = at
                armed = True
        if armed:
            self._wake(sid, out)

    def _wake(self, sid: str, out: list) -> None:
        if not self.release_due and not self.awaited:
            return
        earliest = min([*self.release_due.values(), *self.awaited.values()])
        if self.next_wake is not None and self.next_wake <= earliest:
            return
        self.next_wake = earliest
        out.append(WakeAt(sid, earliest))

    # -- shorthands for tests and tools (each is one event) --------------------------------

    def add(self, spec: dict[str, Any], now: float = 0.0) -> InstanceRecord | None:
        """``Create``; returns the new record (``None`` if the name bound an existing one)."""
        self.handle(Create("add", spec, now))
        return self.instances.get(spec["instance_id"])

    def placed(self, iid: str, worker: str) -> None:
        """``Placed``."""
        self.handle(Placed("placed", iid, worker))

    def set_state(self, iid: str, state: str, reason: str = "") -> InstanceRecord | None:
        """``InstanceStarted`` (``state`` must be ``ALIVE``); the record, or ``None`` if the
        report was ignored."""
        assert state == P.ALIVE, state
        self.handle(InstanceStarted("set_state", iid, None, bool(reason)))
        rec = self.instances.get(iid)
        return rec if rec is not None and rec.state == P.ALIVE else None

    def end(self, iid: str, reason: str) -> list[InstanceRecord]:
        """``Kill``; returns the records it ended, deepest first."""
        self.handle(Kill("end", iid, reason))
        return self.last_ended

    def forget(self, iid: str) -> None:
        """``Stopped``."""
        self.handle(Stopped("forget", iid))

    # -- invariants ------------------------------------------------------------------------

    def validate(self) -> None:
        """Check the machine's invariants (tests and the simulation call it after each step)."""
        for iid, rec in self.instances.items():
            assert rec.instance_id == iid
            dead = rec.state == P.DEAD
            if dead:
                assert not rec.acquiring and not rec.held, f"dead {iid} holds or acquires"
                assert iid not in self.release_due, f"dead {iid} due for release"
                assert rec.worker is not None, f"dead {iid} kept with no stop to wait for"
                continue
            assert iid in self.children.get(rec.owner, ()), f"{iid} missing under {rec.owner}"
            if rec.acquiring:
                assert rec.worker is None and not rec.held, f"{iid} acquires while placed"
                assert rec.state in (P.PENDING, P.RESTARTING) or (
                    rec.state == P.ALIVE and rec.moving_from is not None), (iid, rec.state)
            else:
                assert rec.worker is not None, f"{iid} neither placed nor acquiring (stalled)"
                assert rec.moving_from is None, f"{iid} moving but not acquiring"
            assert rec.held == (rec.worker is not None), f"{iid}: held={rec.held} worker={rec.worker}"
            if rec.state == P.RESTARTING:
                assert rec.restarts >= 1
            limit = rec.spec.get("recover_retry_times") or 0
            assert limit == -1 or rec.restarts <= limit, f"{iid} restarted past its limit"
            if rec.name_key is not None:
                assert self.names.get(rec.name_key) == iid, f"{iid} lost its name"
            owner = self.instances.get(rec.owner)
            if not rec.detached and owner is not None:
                assert owner.state != P.DEAD, f"{iid} outlives its owner {rec.owner}"
            if not rec.detached:
                assert rec.owner not in self.graveyard, f"{iid} outlives its owner {rec.owner}"
            if self.releasable(iid):
                assert iid in self.release_due, f"{iid} unheld and no release planned"
        for key, iid in self.names.items():
            rec = self.instances.get(iid)
            assert rec is not None and rec.state != P.DEAD and rec.name_key == key, key
        for owner, kids in self.children.items():
            for kid in kids:
                rec = self.instances.get(kid)
                assert rec is not None and rec.owner == owner and rec.state != P.DEAD, \
                    f"children of {owner} lists {kid}"
                assert rec.detached or not self._ended_owner(owner), f"{kid} outlives {owner}"
        for alias, real in self.aliases.items():
            assert real in self.instances, f"alias {alias} of forgotten {real}"
        for iid, at in self.release_due.items():
            rec = self.instances.get(iid)
            assert rec is not None and rec.refcounted and rec.release_at == at, iid
        if self.release_due:
            assert self.next_wake is not None and self.next_wake <= min(
                self.release_due.values()), "releases due with no timer"
        for iid, at in self.awaited.items():
            assert self.unknown(iid), f"{iid} is awaited though its creation came"
            assert self.next_wake is not None and self.next_wake <= at, \
                f"a locate awaits {iid} with no timer"
