"""The per-process object table: this process's entries by object id, and the adapter of
the reference counting machine.

:class:`ObjectTable` makes and drops the entries behind this process's refs (``ObjectRef``),
pickles refs (``reduce_ref``) and unpickles them as borrowed ones (``borrow``), and feeds the
pure counter of ``runtime/refcount.py`` with what happens to them: refs lent in arguments and
results, the owner's polls and a borrower's answers, processes that die or join.  It carries
out what the counter says (free a value and the copy a worker keeps, poll a borrower, answer
an owner).  Which lock guards what is in ``runtime/objects.py`` (:data:`REFS_LOCK`).
"""

from __future__ import annotations

from typing import Any

from yrdask import protocol as P
from yrdask.errors import ObjectLostError, OwnerDiedError
from yrdask.runtime import refcount as RC
from yrdask.runtime.objects import (PENDING, REFS_LOCK, Entry, ObjectRef, _pickled,
                                    _rebuild_ref)
from yrdask.runtime.store import drop_local_copy, node_store


class ObjectTable:
    """This process's entries by object id: owned ones and borrowed copies of others'.

    It is also the adapter of the reference counting machine (``counter``, fed under
    :data:`REFS_LOCK`): it tells it of refs that appear, die, leave in arguments and results,
    and carries out what it says (free, poll a borrower, answer an owner).
    """

    def __init__(self, runtime: Any, inline_limit: int) -> None:
        self.runtime = runtime
        self.inline_limit = inline_limit
        self.entries: dict[str, Entry] = {}
        self.counter = RC.RefCounter()

    @property
    def address(self) -> str:
        return self.runtime.address

    def new_ref(self, object_id: str, entry: Entry | None = None) -> ObjectRef:
        """A ref to a new entry this process owns (``entry``: one already settled, unseen)."""
        if entry is None:
            entry = Entry()
        with REFS_LOCK:
            entry.refs += 1
            self.entries[object_id] = entry
        return ObjectRef(object_id, self.runtime, entry)

    def drop_ref(self, object_id: str, entry: Entry) -> None:
        """A local ref died (any thread): the last one drops the entry, unless the counter
        keeps an object of ours for its borrowers (then it frees it when they are done)."""
        with REFS_LOCK:
            entry.refs -= 1
            if entry.refs > 0:
                return
            current = self.entries.get(object_id) is entry
            if current and object_id in self.counter.refs:
                self._handle(RC.LocalRefs("ref-died", object_id, False))
                if entry.owner is None:
                    return  # freed just now (FreeObject), or kept for its borrowers
            if current:
                del self.entries[object_id]
            free = entry.owner is None and entry.state == P.LOCATION
            stored = entry.owner is None and (entry.stored or free)
        if stored:  # this node's copy (a put, or a result pulled or written here)
            drop_local_copy(object_id)
        if free:
            self.runtime.free_remote(entry.location, [object_id])

    def reduce_ref(self, ref: ObjectRef):
        entry = ref._entry
        owner = entry.owner or self.runtime.address
        if entry.stored:  # in this node's store: readers map it there, or pull it once
            snap: list | None = [P.LOCATION, owner]
        else:
            snap = entry.snapshot(self.inline_limit)
        counted = snap is None or snap[0] == P.LOCATION  # a reader needs the owner
        rec = _pickled.rec
        recorded = rec is not None
        if recorded:  # see pack_counting (its dicts are made on the first ref met)
            if rec[0] is None:
                rec[0], rec[1] = {}, {}
            rec[0].setdefault(ref._id, ref)
            if counted:
                rec[1][ref._id] = owner
        if counted:
            with REFS_LOCK:
                entry.shared = True  # a reader may come back to us for it
                if not recorded:  # pickled where nobody counts it: keep it to the end
                    self.pin({ref._id: owner})
        return (_rebuild_ref, (ref._id, owner, snap))

    def borrow(self, object_id: str, owner: str, snap: list | None) -> ObjectRef:
        """A ref unpickled here (any thread): shares the entry this process has for the id."""
        counted = owner != self.runtime.address and (snap is None or snap[0] == P.LOCATION)
        fresh: Entry | None = None
        while True:
            with REFS_LOCK:
                entry = self.entries.get(object_id)
                if entry is None and fresh is not None:
                    entry = self.entries[object_id] = fresh
                if entry is not None:
                    entry.refs += 1
                    if entry.refs == 1 and (counted or object_id in self.counter.refs):
                        self._handle(RC.LocalRefs("unpickled", object_id, True, owner))
                    break
            fresh = Entry(owner=None if owner == self.runtime.address else owner)
            if snap is not None:
                fresh.set_result(*snap)  # settled before any other thread can see it
            elif fresh.owner is None:  # ours, and freed: its last holder died lending it
                fresh.set_error(ObjectLostError(
                    f"object {object_id} was freed by its owner {owner}: the process that "
                    "lent this ref died before the owner learned of its borrower"))
        if counted:
            found = _pickled.unpickled
            if found is not None:
                found[object_id] = owner
        return ObjectRef(object_id, self.runtime, entry)

    # -- the reference counting machine ----------------------------------------------------

    def _handle(self, event: RC.Event) -> None:
        """Feed the counter (:data:`REFS_LOCK` held) and carry out its instructions."""
        if not self.counter.address:
            self.counter.address = self.runtime.address
        for ins in self.counter.handle(event):
            kind = type(ins)
            if kind is RC.FreeObject:
                self._free(ins.object_id)
            elif kind is RC.SendWait:
                self.runtime.refs_message(ins.borrower, P.WaitRefsRemoved,
                                          [ins.object_id, ins.seq, ins.via])
            elif kind is RC.SendRemoved:
                self.runtime.refs_message(ins.owner, P.RefsRemoved, [ins.object_id, ins.seq])
            elif kind is RC.SendAddBorrower:
                self.runtime.refs_message(ins.owner, P.AddBorrower,
                                          [ins.object_id, ins.borrower, ins.via, ins.token])
            elif kind is RC.OwnersDied:
                self.runtime.on_loop_later(self._owner_died, ins.owner, ins.object_ids)
            # RC.ForgetObject: the entry went with its last local ref already

    def _free(self, object_id: str) -> None:
        """Nobody holds an object of ours any more: drop the value and the worker's copy."""
        entry = self.entries.get(object_id)
        if entry is None or entry.refs > 0 or entry.owner is not None:
            return
        del self.entries[object_id]
        free = entry.state == P.LOCATION
        if entry.stored or free:  # this node's copy (a put, or a result pulled or written here)
            drop_local_copy(object_id)
        if free:
            self.runtime.free_remote(entry.location, [object_id])

    def _owner_died(self, owner: str, object_ids: tuple) -> None:
        """(loop) Borrowed objects of a dead owner: reading one not read yet raises."""
        for oid in object_ids:
            entry = self.entries.get(oid)
            if entry is None or entry.has_value or entry.state in (P.VALUE, P.ERROR):
                continue
            error = OwnerDiedError(
                f"object {oid} cannot be read: its owner {owner} (the process that created it) "
                "died; keep the owner alive while others read its objects, or return the value "
                "itself instead of a ref to it")
            if entry.state == P.LOCATION:  # the keeper's copy goes with its owner (Ray's rule)
                entry.location, entry.state = None, PENDING
            entry.set_error(error)

    def lend(self, counted: dict, to: str, via: str | None = None) -> None:
        """``to`` holds the refs ``counted`` (``{id: owner}``) now, from this process.  Lent
        to itself via a generator item not received yet (a call it made to itself), the item
        holds them from now on if its stream will keep it (it is released if it never does)."""
        coming = (via is not None and to == self.runtime.address and via not in self.entries
                  and self._item_coming(via))  # (outside REFS_LOCK: takes the stream's lock)
        with REFS_LOCK:
            via_alive = via is not None and (via in self.entries or coming)  # lent to itself
            for oid, owner in counted.items():
                entry = self.entries.get(oid)
                held = entry is not None and entry.refs > 0
                self._handle(RC.Lent("lent", oid, to, via,
                                     None if owner == self.runtime.address else owner, held,
                                     via_alive))

    def lend_result(self, counted: dict, caller: str | None, result_id: str) -> list | None:
        """Counted refs nested in the result ``result_id``: lent to ``caller`` via that result,
        and its ``TaskDone.refs`` nested entry ``[result_id, [[id, owner], ...]]`` returned; or
        pinned (``None`` returned) when the caller is not known."""
        if caller is None:
            self.pin(counted)
            return None
        self.lend(counted, caller, result_id)
        return [result_id, [[i, o] for i, o in counted.items()]]

    def contains(self, outer: str, inner: Any) -> None:
        """The value of ``outer`` (ours, alive) holds ``inner``: ``[(id, owner), ...]``."""
        with REFS_LOCK:
            if outer in self.entries:
                entries = self.entries
                self._handle(RC.Contains("contains", outer, tuple(
                    (oid, None if owner == self.runtime.address else owner,
                     oid in entries and entries[oid].refs > 0) for oid, owner in inner)))

    def pin(self, counted: dict) -> None:
        """Refs pickled where no protocol counts them: their owners keep them to the end."""
        with REFS_LOCK:
            for oid, owner in counted.items():
                if owner == self.runtime.address:
                    self._handle(RC.Pinned("pinned", oid))
                else:
                    self.runtime.refs_message(owner, P.AddBorrower, [oid, "", None, None])

    def on_done_refs(self, refs: list) -> None:
        """The ``refs`` of a ``TaskDone`` (before the call drops its argument refs)."""
        holder, borrowed, nested = refs
        if borrowed:
            with REFS_LOCK:
                for oid in borrowed:
                    entry = self.entries.get(oid)
                    if entry is not None:
                        self._handle(RC.Lent("task-done", oid, holder, None, entry.owner,
                                             entry.refs > 0))
        for outer, inner in nested or ():
            self.contains(outer, inner)

    def on_wait(self, sender: str, items: list) -> None:
        """``WAIT_REFS_REMOVED`` from an owner.  ``via`` counts as alive also when it is a
        generator item not received yet: its producer lends before it sends the item, on
        another connection, so the poll may come first (``GeneratorItem.refs``)."""
        entries = self.entries
        coming = {via for _oid, _seq, via in items
                  if via is not None and via not in entries and self._item_coming(via)}
        with REFS_LOCK:
            for oid, seq, via in items:
                self._handle(RC.WaitReceived("wait", oid, sender, seq, via,
                                             via is not None and (via in entries
                                                                  or via in coming)))

    def _item_coming(self, via: str) -> bool:
        """Whether ``via`` is an item (``<call id>.<index>``) a live generator stream of
        this process will still keep when it arrives (it then holds what was lent via it)."""
        call_id, _, index = via.rpartition(".")
        streams = getattr(self.runtime, "streams", None)
        stream = streams.get(call_id) if streams and call_id else None
        return stream is not None and index.isdigit() and stream.expect(int(index))

    def release_unreceived(self, object_id: str) -> None:
        """A generator item polls were told of (:meth:`on_wait`) will not be kept after all
        (dropped on arrival, or never sent): what was lent via it is answered now."""
        with REFS_LOCK:
            if object_id not in self.entries and self.counter.knows(object_id):
                self._handle(RC.LocalRefs("item-dropped", object_id, False))

    def on_removed(self, sender: str, items: list) -> None:
        """``REFS_REMOVED`` from a borrower."""
        with REFS_LOCK:
            for oid, seq in items:
                self._handle(RC.RemovedReceived("removed", oid, sender, seq))

    def add_borrower(self, items: list) -> list:
        """``ADD_BORROWER``: ``[[object_id, borrower, via], ...]``; borrower ``""``: pin it.
        Returns the ids unknown here (freed, or not ours)."""
        unknown = []
        with REFS_LOCK:
            for oid, borrower, via, *_ in items:
                entry = self.entries.get(oid)
                if entry is None or entry.owner is not None:
                    unknown.append(oid)
                elif not borrower:
                    self._handle(RC.Pinned("pinned", oid))
                else:
                    self._handle(RC.BorrowerAdded("add-borrower", oid, borrower, via,
                                                  entry.refs > 0))
        return unknown

    def added(self, items: list) -> None:
        """The owner answered the ``AddBorrower`` of ``items`` (``[id, borrower, via, token]``)."""
        with REFS_LOCK:
            for oid, _borrower, _via, token in items:
                if token is not None:
                    self._handle(RC.AddAcked("added", oid, token))

    def process_died(self, address: str) -> None:
        with REFS_LOCK:
            self._handle(RC.ProcessDied(f"died-{address}", address))

    def process_joined(self, address: str) -> None:
        """A new process registered at ``address`` (a worker restarted at a dead one's
        address): it may own and borrow objects again."""
        with REFS_LOCK:
            self._handle(RC.ProcessJoined(f"joined-{address}", address))

    def location_moved(self, worker: str, to: str, object_ids: list) -> None:
        """(loop) ``worker`` retires and ``to`` keeps these values now (scale-down): entries
        that recorded ``worker`` for one of them record ``to`` (reads and frees go there)."""
        for oid in object_ids:
            entry = self.entries.get(oid)
            if entry is not None and entry.state == P.LOCATION and entry.location == worker:
                entry.location = to

    def location_lost(self, worker: str, rebuilt: list) -> None:
        """(loop) ``worker`` is gone with the values it kept.  Ours that no task recomputes
        (``rebuilt``: those that one does) fail with ``ObjectLostError`` (a method call's
        result or generator item: Ray does not rebuild those either); borrowed ones ask their owner again."""
        rebuilt = set(rebuilt)
        for oid, entry in list(self.entries.items()):
            if entry.state != P.LOCATION or entry.location != worker or entry.has_value:
                continue
            if oid in rebuilt or node_store().contains(oid):
                continue  # computed again, or still in this node's store (readers map it)
            if entry.owner is None:
                if oid not in rebuilt:
                    entry.lose(ObjectLostError(
                        f"object {oid} was lost with worker {worker}, which kept its value: "
                        "only the results and generator items of tasks are computed again "
                        "(not method call results)"))
            elif entry.owner != worker:
                entry.lose(None)  # its owner knows where it is now

    def register_reads(self, found: dict) -> None:
        """Refs unpickled out of a borrowed value (``{id: owner}``): tell their owners this
        process borrows them, and wait for the answers (the value is still held meanwhile)."""
        by_owner: dict[str, list] = {}
        me = self.runtime.address
        for oid, owner in found.items():
            if owner != me:
                by_owner.setdefault(owner, []).append([oid, me, None])
        for owner, items in by_owner.items():
            self.runtime.add_borrower(owner, items)

    def figures(self) -> dict:
        """Entries and counter records of this process (the leak test reads these)."""
        with REFS_LOCK:
            figures = self.counter.figures()
            figures["entries"] = len(self.entries)
        return figures
