"""Ownership reference counting: when a value, and every copy of it, may be freed.

One :class:`RefCounter` per process; pure (no I/O, threads or clocks), driven by the object
table (``runtime/object_table.py``) and by the protocol messages :class:`~yrdask.protocol.WaitRefsRemoved`,
:class:`~yrdask.protocol.RefsRemoved` and :class:`~yrdask.protocol.AddBorrower`.

The protocol is Ray's ownership protocol (``reference_count.cc``: borrowers, borrowers of
borrowers, ``WaitForRefRemoved``), reduced to what yrdask needs:

* The **owner** (the process that created the object) keeps a *record* while anyone may read
  it: its own live refs (``local``; a task or call in flight keeps the refs of its arguments
  alive, so "submitted" is ``local`` here), the outer objects of this process whose value
  contains it (``contained_in``), the **borrowers** it knows, and a fallback ``pinned`` for a
  ref pickled where nobody counts it (until the runtime ends, as before this machine).
* A process learns of a borrower only from one that holds the ref at that moment, so the ref
  cannot be freed in between: a worker lists the refs it unpickled from a call's arguments in
  the call's ``TaskDone`` (``borrowed``), which reaches the caller while the call still holds
  them; a worker returning a ref nested in a result names the caller as borrower *via* that
  result before it sends it; a reader of a borrowed value that contains refs registers itself
  with their owners (``AddBorrower``, answered) while it still holds the outer value.
* A borrower that lent the ref on (a call it made reports the callee kept it, or it returns
  the ref nested in a result) registers the new borrower with the owner
  (:class:`SendAddBorrower`, ``AddBorrower``) and keeps holding the ref until the owner
  answered (:class:`AddAcked`): Ray's borrower-of-borrower, told at once rather than with
  the borrower's own removal, so no later message can overtake it.
* A ref lent to this very process nested in a result (a task calling an instance on its own
  worker, no socket in between) is held by that result as by :class:`Contains`, from the
  moment it is packed: the call's frame drops its ref before the result's ``TaskDone`` is read.
* The owner polls a borrower each time it learns of it: :class:`SendWait`
  (``WaitRefsRemoved``) with a sequence number; the borrower answers each poll once
  (:class:`SendRemoved`, ``RefsRemoved``) when it holds the ref no longer, locally, through
  an outer value, or through the result named ``via``.  The borrower is removed when every
  poll sent to it is answered, so duplicate, late and reordered messages change nothing.
* Dead processes: a dead borrower is removed everywhere (and not added again while it is
  dead); records owned by a dead process are dropped and their readers fail with
  ``OwnerDiedError`` (:class:`OwnersDied`).  A new process at a dead one's address
  (:class:`ProcessJoined`, a worker restarted at a fixed port) is alive again: it starts
  with no records, as the dead one's were dropped.

A record is **freed** (:class:`FreeObject`) when it has no local refs, no containing object
and no borrower: the adapter deletes the value and every copy (the worker stores holding it),
and the refs nested in it are released in turn.  :meth:`RefCounter.validate` checks the
record invariants; ``tests/sim`` checks the global ones (nothing freed while referenced,
everything freed at quiescence).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from yrdask.statemachine import Event, Instruction, Story

# --- events -------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalRefs(Event):
    """This process's live refs of ``object_id`` appeared (``present``) or all died.
    ``owner``: the owner's address (``None``: this process) for a record made here."""

    object_id: str
    present: bool
    owner: str | None = None


@dataclass(frozen=True)
class Lent(Event):
    """This process handed ``object_id`` to ``borrower``: listed in a call's ``borrowed``, or
    nested in the result ``via`` (an object owned by ``borrower``) this process sends it."""

    object_id: str
    borrower: str
    via: str | None = None
    owner: str | None = None  # the object's owner (None: this process)
    held: bool = False  # live refs of it exist here (a record is made if none exists)
    via_alive: bool = False  # ``via`` is alive here (its entry exists): for a lend to itself


@dataclass(frozen=True)
class Contains(Event):
    """The value of ``outer`` (owned here) holds refs to ``inner``: ``((id, owner, held),
    ...)``, ``held`` whether live refs of it exist here; each stays alive while ``outer``
    does."""

    outer: str
    inner: tuple


@dataclass(frozen=True)
class Pinned(Event):
    """``object_id`` (owned here) was pickled where nobody counts it: keep it to the end."""

    object_id: str


@dataclass(frozen=True)
class WaitReceived(Event):
    """The owner ``owner`` asks to hear when this process holds ``object_id`` no longer
    (also not through the object ``via``, which the adapter says is alive here or not)."""

    object_id: str
    owner: str
    seq: int
    via: str | None = None
    via_alive: bool = False


@dataclass(frozen=True)
class RemovedReceived(Event):
    """``borrower`` answers poll ``seq`` of ``object_id``: it holds it no longer."""

    object_id: str
    borrower: str
    seq: int


@dataclass(frozen=True)
class BorrowerAdded(Event):
    """``AddBorrower`` at the owner: ``borrower`` holds ``object_id`` (through its object
    ``via``, if given); sent by a borrower that lent it on, or by a reader that unpickled it
    out of a value.  The adapter answers the sender once this is handled."""

    object_id: str
    borrower: str
    via: str | None = None
    held: bool = False  # live refs of it exist here (a record is made if none exists)


@dataclass(frozen=True)
class AddAcked(Event):
    """The owner answered this process's ``AddBorrower`` ``token`` of ``object_id``."""

    object_id: str
    token: str


@dataclass(frozen=True)
class ProcessDied(Event):
    """The process at ``address`` is gone (a lost worker, or a poll that could not be sent)."""

    address: str


@dataclass(frozen=True)
class ProcessJoined(Event):
    """A new process registered at ``address``, where one died (a worker restarted at a
    fixed port, or given a reused one): it owns and borrows afresh.  Nothing of the dead
    one's comes back: its records were dropped when it died."""

    address: str


# --- instructions -------------------------------------------------------------------------


@dataclass(frozen=True)
class SendWait(Instruction):
    """Send ``WaitRefsRemoved`` to ``borrower``."""

    borrower: str
    object_id: str
    seq: int
    via: str | None


@dataclass(frozen=True)
class SendRemoved(Instruction):
    """Send ``RefsRemoved`` to ``owner``."""

    owner: str
    object_id: str
    seq: int


@dataclass(frozen=True)
class SendAddBorrower(Instruction):
    """Send ``AddBorrower`` to ``owner``; feed :class:`AddAcked` with ``token`` on its answer."""

    owner: str
    object_id: str
    borrower: str
    via: str | None
    token: str


@dataclass(frozen=True)
class FreeObject(Instruction):
    """Nobody holds ``object_id`` (owned here) any more: delete its value and every copy."""

    object_id: str


@dataclass(frozen=True)
class ForgetObject(Instruction):
    """This process holds no more of the borrowed ``object_id``: drop what is cached."""

    object_id: str


@dataclass(frozen=True)
class OwnersDied(Instruction):
    """The owner ``owner`` died: reading any of ``object_ids`` raises ``OwnerDiedError``."""

    owner: str
    object_ids: tuple


# --- state ---------------------------------------------------------------------------------


@dataclass
class Record:
    """What this process knows of one object (see module docstring)."""

    owner: str | None  # None: owned here
    local: bool = False
    contained_in: set = field(default_factory=set)  # outer ids here whose value holds it
    contains: tuple = ()  # inner ids its value holds (objects owned here)
    pinned: bool = False
    borrowers: dict = field(default_factory=dict)  # owner: address -> polls not answered
    seq: int = 0  # owner: polls sent
    adding: set = field(default_factory=set)  # borrower: AddBorrower tokens not answered
    waits: list = field(default_factory=list)  # borrower: [(seq, via)] polls to answer


class RefCounter:
    """One process's ownership records (see module docstring)."""

    def __init__(self, address: str = "") -> None:
        self.address = address
        self.refs: dict[str, Record] = {}
        self.dead: set[str] = set()
        self.via_waiters: dict[str, set[str]] = {}  # outer id -> borrowed ids polled via it
        self.log = Story()
        self.freed = 0  # objects freed, for figures and tests
        self._tokens = 0

    # -- entry point -----------------------------------------------------------------------

    def handle(self, event: Event) -> list[Instruction]:
        self.log.log(event.stimulus_id, event, _keys(event))
        out: list[Instruction] = []
        kind = type(event)
        if kind is LocalRefs:
            self._local(event, out)
        elif kind is Lent:
            self._lent(event, out)
        elif kind is Contains:
            self._contains(event, out)
        elif kind is Pinned:
            self._record(event.object_id, None).pinned = True
        elif kind is WaitReceived:
            self._wait(event, out)
        elif kind is RemovedReceived:
            self._removed(event, out)
        elif kind is BorrowerAdded:
            rec = self.refs.get(event.object_id)
            if rec is None and event.held:  # untracked and alive: its live refs hold it
                rec = self._record(event.object_id, None)
                rec.local = True
            if rec is not None and rec.owner is None:
                self._add_borrower(event.object_id, rec, event.borrower, event.via,
                                   event.stimulus_id, out)
        elif kind is AddAcked:
            rec = self.refs.get(event.object_id)
            if rec is not None and event.token in rec.adding:
                rec.adding.discard(event.token)
                self._check(event.object_id, rec, event.stimulus_id, out)
        elif kind is ProcessDied:
            self._died(event, out)
        elif kind is ProcessJoined:
            self.dead.discard(event.address)
        else:
            raise TypeError(f"unknown refcount event {event!r}")
        for ins in out:
            self.log.log(ins.stimulus_id, ins, _keys(ins))
        return out

    def story(self, *keys: str) -> str:
        return self.log.dump(*keys)

    def knows(self, object_id: str) -> bool:
        """Whether a record exists (the adapter asks before telling of refs that die)."""
        return object_id in self.refs

    # -- handlers --------------------------------------------------------------------------

    def _record(self, oid: str, owner: str | None) -> Record:
        rec = self.refs.get(oid)
        if rec is None:
            rec = self.refs[oid] = Record(owner=owner if owner != self.address else None)
        return rec

    def _local(self, ev: LocalRefs, out: list) -> None:
        if ev.present:
            if ev.owner is not None and ev.owner in self.dead:
                return
            self._record(ev.object_id, ev.owner).local = True
            return
        rec = self.refs.get(ev.object_id)
        if rec is not None:
            rec.local = False
            self._check(ev.object_id, rec, ev.stimulus_id, out)

    def _lent(self, ev: Lent, out: list) -> None:
        if ev.borrower == self.address:
            # lent to this very process (a call it made to itself: a task or an instance on
            # its own worker): nested in the result ``via`` (ours), the ref must stay with
            # that result as if its value held it, or it would be freed (or its polls
            # answered) when the call's frame drops it, before the result is read here
            if ev.via is not None and ev.via_alive:
                self._contains(Contains(ev.stimulus_id, ev.via,
                                        ((ev.object_id, ev.owner, ev.held),)), out)
            return
        if ev.borrower in self.dead:
            return
        rec = self.refs.get(ev.object_id)
        if rec is None:
            if not ev.held or (ev.owner is not None and ev.owner in self.dead):
                return  # a ref nobody here counts was lent by whoever counts it
            rec = self._record(ev.object_id, ev.owner)
            rec.local = True
        if rec.owner is None:
            self._add_borrower(ev.object_id, rec, ev.borrower, ev.via, ev.stimulus_id, out)
        elif ev.borrower != rec.owner:
            self._tokens += 1
            token = f"{self.address}#{self._tokens}"
            rec.adding.add(token)
            out.append(SendAddBorrower(ev.stimulus_id, rec.owner, ev.object_id, ev.borrower,
                                       ev.via, token))

    def _add_borrower(self, oid: str, rec: Record, borrower: str, via: str | None,
                      sid: str, out: list) -> None:
        if borrower == self.address or borrower in self.dead:
            return
        rec.seq += 1
        rec.borrowers.setdefault(borrower, set()).add(rec.seq)
        out.append(SendWait(sid, borrower, oid, rec.seq, via))

    def _contains(self, ev: Contains, out: list) -> None:
        outer = self.refs.get(ev.outer)
        if outer is None:  # untracked: the adapter tells of an alive one (live refs) only
            outer = self._record(ev.outer, None)
            outer.local = True
        inner = []
        for oid, owner, held in ev.inner:
            if oid == ev.outer or (owner is not None and owner in self.dead):
                continue
            rec = self._record(oid, owner)
            rec.contained_in.add(ev.outer)
            rec.local = rec.local or held
            inner.append(oid)
        outer.contains = tuple(dict.fromkeys(outer.contains + tuple(inner)))

    def _wait(self, ev: WaitReceived, out: list) -> None:
        if ev.owner in self.dead:
            return  # a late poll of a dead owner: nobody to answer
        rec = self.refs.get(ev.object_id)
        if rec is None:
            if not ev.via_alive:  # holds nothing: answer now
                out.append(SendRemoved(ev.stimulus_id, ev.owner, ev.object_id, ev.seq))
                return
            rec = self.refs[ev.object_id] = Record(owner=ev.owner)
        if rec.owner is None:  # a poll for an object of ours: a confused sender
            return
        via = ev.via if ev.via_alive else None
        if via is not None:
            if via not in self.refs:  # untracked and alive: the adapter found its live refs
                self._record(via, None).local = True
            self.via_waiters.setdefault(via, set()).add(ev.object_id)
        rec.waits.append((ev.seq, via))
        self._check(ev.object_id, rec, ev.stimulus_id, out)

    def _removed(self, ev: RemovedReceived, out: list) -> None:
        rec = self.refs.get(ev.object_id)
        if rec is None or rec.owner is not None:
            return  # freed already (a duplicate), or not ours
        polls = rec.borrowers.get(ev.borrower)
        if polls is not None and ev.seq in polls:
            polls.discard(ev.seq)
            if not polls:  # every poll answered: the borrower holds it no longer
                del rec.borrowers[ev.borrower]
        self._check(ev.object_id, rec, ev.stimulus_id, out)

    def _died(self, ev: ProcessDied, out: list) -> None:
        addr = ev.address
        if addr == self.address:
            return
        self.dead.add(addr)
        orphans = []
        for oid, rec in list(self.refs.items()):
            if rec.owner == addr:
                orphans.append(oid)
                continue
            if rec.owner is None and addr in rec.borrowers:
                del rec.borrowers[addr]
        for oid in orphans:
            rec = self.refs.pop(oid)
            self._unwait(oid, rec)
        if orphans:
            out.append(OwnersDied(ev.stimulus_id, addr, tuple(orphans)))
        for oid, rec in list(self.refs.items()):
            if self.refs.get(oid) is rec:
                self._check(oid, rec, ev.stimulus_id, out)

    # -- freeing ---------------------------------------------------------------------------

    def _held(self, rec: Record) -> bool:
        return rec.local or bool(rec.contained_in) or bool(rec.adding)

    def _check(self, oid: str, rec: Record, sid: str, out: list) -> None:
        """Free, answer or forget ``oid`` if nothing here holds it any more."""
        if self._held(rec):
            return
        if rec.owner is None:
            if rec.borrowers or rec.pinned:
                return
            del self.refs[oid]
            self.freed += 1
            out.append(FreeObject(sid, oid))
            self._release_inner(oid, rec.contains, sid, out)
            return
        waits = [(s, v) for s, v in rec.waits if v is not None and v in self.refs]
        answer = [(s, v) for s, v in rec.waits if not (v is not None and v in self.refs)]
        for seq, _via in answer:
            out.append(SendRemoved(sid, rec.owner, oid, seq))
        rec.waits = waits
        if not rec.waits:
            del self.refs[oid]
            self._unwait(oid, rec)
            out.append(ForgetObject(sid, oid))
            self._release_inner(oid, rec.contains, sid, out)

    def _release_inner(self, outer: str, inner: tuple, sid: str, out: list) -> None:
        for oid in inner:
            rec = self.refs.get(oid)
            if rec is not None and outer in rec.contained_in:
                rec.contained_in.discard(outer)
                self._check(oid, rec, sid, out)
        # a borrowed record whose poll waited for ``outer`` to go may be answered now
        for oid in sorted(self.via_waiters.pop(outer, ())):
            rec = self.refs.get(oid)
            if rec is not None:
                self._check(oid, rec, sid, out)

    def _unwait(self, oid: str, rec: Record) -> None:
        for _seq, via in rec.waits:
            if via is not None:
                waiting = self.via_waiters.get(via)
                if waiting is not None:
                    waiting.discard(oid)
                    if not waiting:
                        del self.via_waiters[via]

    # -- checks ----------------------------------------------------------------------------

    def validate(self) -> None:
        """Record invariants (raise AssertionError)."""
        for oid, rec in self.refs.items():
            if rec.owner is None:
                assert not rec.waits, f"{oid}: an owned record has polls to answer"
                assert not rec.adding, f"{oid}: an owned record registers borrowers"
                assert self._held(rec) or rec.borrowers or rec.pinned, \
                    f"{oid}: owned, held by nobody, not freed"
            else:
                assert not rec.borrowers, f"{oid}: a borrowed record has borrowers"
                assert rec.owner not in self.dead, f"{oid}: kept after its owner died"
            for outer in rec.contained_in:
                assert outer in self.refs, f"{oid}: contained in {outer}, which is gone"
            for b in rec.borrowers:
                assert b not in self.dead, f"{oid}: dead borrower {b} kept"

    def figures(self) -> dict:
        owned = sum(1 for r in self.refs.values() if r.owner is None)
        return {"owned": owned, "borrowed": len(self.refs) - owned, "freed": self.freed}


def _keys(obj: object) -> list[str]:
    return [str(getattr(obj, k)) for k in ("object_id", "outer", "borrower", "owner", "address")
            if getattr(obj, k, None) is not None]
