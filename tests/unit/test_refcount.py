"""The ownership reference counting machine (``yrdask/runtime/refcount.py``), without I/O.

Each test wires two or three machines by hand, the way the adapters and the wire would,
and checks what each one frees, polls and answers.
"""

from __future__ import annotations

from yrdask.runtime import refcount as R


def of(out: list, kind: type) -> list:
    return [i for i in out if type(i) is kind]


def deliver_removed(owner: R.RefCounter, borrower: str, out: list) -> list:
    """Hand every SendRemoved in ``out`` to ``owner`` (as the wire would)."""
    got = []
    for ins in of(out, R.SendRemoved):
        got += owner.handle(R.RemovedReceived("wire", ins.object_id, borrower, ins.seq))
    return got


def test_an_object_nobody_borrowed_is_freed_with_its_last_local_ref():
    w = R.RefCounter("W")
    assert w.handle(R.Contains("put", "x", (("r", None, True),))) == []
    out = w.handle(R.LocalRefs("drop", "r", False))
    assert out == []  # still inside x
    out = w.handle(R.LocalRefs("drop", "x", False))
    assert [i.object_id for i in of(out, R.FreeObject)] == ["x", "r"]
    assert w.refs == {} and w.freed == 2
    w.validate()


def test_a_result_borrowed_then_lent_to_an_instance_then_freed():
    """W returns [r] in result x to C; C lends r to instance A; everyone drops."""
    w, c, a = R.RefCounter("W"), R.RefCounter("C"), R.RefCounter("A")
    (wait,) = w.handle(R.Lent("pack", "r", "C", via="x", held=True))
    assert (wait.borrower, wait.via) == ("C", "x")
    assert w.handle(R.LocalRefs("task-ended", "r", False)) == []  # C borrows it
    c.handle(R.Contains("task-done", "x", (("r", "W", False),)))
    assert c.handle(R.WaitReceived("wire", "r", "W", wait.seq, "x", True)) == []
    c.handle(R.LocalRefs("read", "r", True, owner="W"))
    a.handle(R.LocalRefs("unpickled", "r", True, owner="W"))
    (add,) = c.handle(R.Lent("call-done", "r", "A", owner="W", held=True))
    assert (add.owner, add.borrower) == ("W", "A")  # the borrower of the borrower, at once
    (poll_a,) = w.handle(R.BorrowerAdded("wire", "r", "A", add.via))
    assert poll_a.borrower == "A"
    assert c.handle(R.LocalRefs("drop", "r", False)) == []  # still inside x
    c.handle(R.AddAcked("wire", "r", add.token))
    out = c.handle(R.LocalRefs("drop", "x", False))
    assert of(out, R.FreeObject) == [R.FreeObject("drop", "x")]
    assert not of(deliver_removed(w, "C", out), R.FreeObject)  # A still borrows
    assert a.handle(R.WaitReceived("wire", "r", "W", poll_a.seq)) == []  # A still holds it
    out = deliver_removed(w, "A", a.handle(R.LocalRefs("drop", "r", False)))
    assert of(out, R.FreeObject) == [R.FreeObject("wire", "r")]
    for m in (w, c, a):
        m.validate()
        assert m.refs == {}


def test_a_poll_before_the_result_arrives_waits_for_the_result_to_go():
    c = R.RefCounter("C")
    # the poll overtakes TaskDone(x): x is alive here (pending), so C must not answer yet
    assert c.handle(R.WaitReceived("wire", "r", "W", 1, "x", True)) == []
    c.handle(R.Contains("task-done", "x", (("r", "W", False),)))
    out = c.handle(R.LocalRefs("drop", "x", False))
    assert of(out, R.SendRemoved) == [R.SendRemoved("drop", "W", "r", 1)]
    assert c.refs == {}


def test_a_poll_for_a_dropped_result_is_answered_at_once():
    c = R.RefCounter("C")
    out = c.handle(R.WaitReceived("wire", "r", "W", 4, "x", False))
    assert out == [R.SendRemoved("wire", "W", "r", 4)]


def test_a_borrower_goes_once_every_poll_sent_to_it_is_answered():
    w = R.RefCounter("W")
    w.handle(R.Lent("a", "r", "B", held=True))  # poll 1
    w.handle(R.Lent("b", "r", "B", held=True))  # B borrows again: poll 2
    w.handle(R.LocalRefs("drop", "r", False))
    assert w.handle(R.RemovedReceived("wire", "r", "B", 1)) == []  # poll 2 is open
    assert w.handle(R.RemovedReceived("wire", "r", "B", 1)) == []  # duplicate
    assert of(w.handle(R.RemovedReceived("wire", "r", "B", 2)), R.FreeObject)
    assert w.handle(R.RemovedReceived("wire", "r", "B", 2)) == []  # duplicate after the free
    assert w.freed == 1


def test_a_dead_borrower_stops_holding_and_is_not_added_again_while_dead():
    w = R.RefCounter("W")
    w.handle(R.Lent("a", "r", "B", held=True))
    w.handle(R.LocalRefs("drop", "r", False))
    assert of(w.handle(R.ProcessDied("lost", "B")), R.FreeObject)
    w.handle(R.Lent("late", "s", "B", held=True))
    assert "s" not in w.refs  # nothing to count for a dead process


def test_records_of_a_dead_owner_are_dropped_and_reported():
    c = R.RefCounter("C")
    c.handle(R.LocalRefs("unpickled", "r", True, owner="W"))
    c.handle(R.LocalRefs("unpickled", "q", True, owner="V"))
    (died,) = c.handle(R.ProcessDied("lost", "W"))
    assert died == R.OwnersDied("lost", "W", ("r",))
    assert set(c.refs) == {"q"}
    c.handle(R.LocalRefs("unpickled", "r2", True, owner="W"))  # a late one is not kept
    assert "r2" not in c.refs
    c.validate()


def test_a_new_process_at_a_dead_ones_address_owns_and_borrows_afresh():
    """A worker restarted at its dead predecessor's address (ProcessJoined): what the dead
    one owned stays dropped, the new one's objects are counted as any live process's."""
    c = R.RefCounter("C")
    c.handle(R.LocalRefs("unpickled", "old", True, owner="W"))
    c.handle(R.ProcessDied("lost", "W"))
    assert c.handle(R.ProcessJoined("joined", "W")) == []
    assert "old" not in c.refs
    c.handle(R.LocalRefs("unpickled", "new", True, owner="W"))  # borrowed from the new one
    out = c.handle(R.WaitReceived("wire", "new", "W", 1, None, True))
    assert out == []  # held here: answered when it is dropped, not ignored as a dead poll
    (removed,) = of(c.handle(R.LocalRefs("drop", "new", False)), R.SendRemoved)
    assert (removed.owner, removed.object_id, removed.seq) == ("W", "new", 1)
    # lent to the new process: it is counted as a borrower
    (poll,) = of(c.handle(R.Lent("call", "mine", "W", held=True)), R.SendWait)
    assert poll.borrower == "W"
    c.validate()


def test_a_pinned_object_outlives_its_refs():
    w = R.RefCounter("W")
    w.handle(R.Pinned("pickled", "r"))
    assert w.handle(R.LocalRefs("drop", "r", False)) == []
    assert "r" in w.refs
    w.validate()


def test_a_borrower_that_lent_holds_the_ref_until_the_owner_heard_of_the_new_borrower():
    b = R.RefCounter("B")
    b.handle(R.LocalRefs("unpickled", "r", True, owner="W"))
    (add,) = b.handle(R.Lent("done", "r", "S", owner="W", held=True))
    assert b.handle(R.WaitReceived("wire", "r", "W", 3)) == []
    assert b.handle(R.LocalRefs("drop", "r", False)) == []  # AddBorrower not answered yet
    assert b.handle(R.AddAcked("wire", "r", "other-token")) == []
    out = b.handle(R.AddAcked("wire", "r", add.token))
    assert out[0] == R.SendRemoved("wire", "W", "r", 3)
    assert b.refs == {}


def test_story_names_the_object():
    w = R.RefCounter("W")
    w.handle(R.Lent("pack", "r", "C", via="x", held=True))
    assert "SendWait" in w.story("r") and "Lent" in w.story("r")


def test_a_ref_returned_to_a_call_of_this_very_process_stays_with_its_result():
    """A task calls an instance on its own worker (no socket): the method returns r (made
    there) nested in result x, owned by the same process; r must outlive the method's frame
    until x goes, as if x's value held it (random trees: ``spawn``)."""
    w = R.RefCounter("W")
    w.handle(R.LocalRefs("put", "r", True))  # the method's ref (a pending task result)
    assert w.handle(R.Lent("pack", "r", "W", via="x", held=True, via_alive=True)) == []
    assert w.handle(R.LocalRefs("frame-ended", "r", False)) == []  # x holds it
    w.handle(R.Contains("task-done", "x", (("r", None, False),)))  # TaskDone: idempotent
    w.validate()
    out = w.handle(R.LocalRefs("drop", "x", False))
    assert [i.object_id for i in of(out, R.FreeObject)] == ["x", "r"]
    assert w.refs == {}


def test_a_borrowed_ref_returned_to_this_very_process_is_not_answered_early():
    """The same with r owned elsewhere (O): the poll O sent is answered when x goes."""
    w = R.RefCounter("W")
    w.handle(R.LocalRefs("unpickled", "r", True, owner="O"))
    assert w.handle(R.WaitReceived("wire", "r", "O", 1)) == []
    w.handle(R.Lent("pack", "r", "W", via="x", owner="O", held=True, via_alive=True))
    assert w.handle(R.LocalRefs("frame-ended", "r", False)) == []
    out = w.handle(R.LocalRefs("drop", "x", False))
    assert of(out, R.SendRemoved) == [R.SendRemoved("drop", "O", "r", 1)]
    assert w.refs == {}


def test_a_ref_returned_to_this_process_for_a_result_nobody_holds_is_freed():
    w = R.RefCounter("W")
    w.handle(R.LocalRefs("put", "r", True))
    assert w.handle(R.Lent("pack", "r", "W", via="x", held=True, via_alive=False)) == []
    out = w.handle(R.LocalRefs("frame-ended", "r", False))
    assert of(out, R.FreeObject) == [R.FreeObject("frame-ended", "r")]
    assert w.refs == {}
