"""The scheduler's lease adapter decisions (``scheduler/lease_service.py``) on a recording edge:
what is refused before it is asked, which grants are released at once, where answers,
revocations and timers go.  The simulation drives the same class (tests/sim)."""
from __future__ import annotations

import pytest

from yrdask import protocol as P
from yrdask.scheduler.lease_service import LeaseService
from yrdask.scheduler.requests import LeaseRequest
from tests.unit.recording_edges import LeaseRecorder

pytestmark = pytest.mark.timeout(30)

W1, W2 = "tcp://w1:1", "tcp://w2:1"
CPU1 = {"CPU": 1000.0, "Memory": 100.0}


@pytest.fixture
def svc():
    s = LeaseService(LeaseRecorder(jobs={"d1", "d2"}, workers={W1, W2}))
    s.worker_joined(W1, {"CPU": 1000.0, "Memory": 4000.0})
    return s


def ask(svc, owner="d1", timeout_ms=5000, shape=CPU1):
    answers: list = []
    rid = svc.open(LeaseRequest(owner, dict(shape)), timeout_ms, answers.append)
    return rid, answers


def test_a_request_that_fits_is_answered_at_once_exactly_once(svc):
    rid, answers = ask(svc)
    assert rid == "R1" and len(answers) == 1 and answers[0][1] == W1
    svc.close(rid)  # the caller's finally: nothing more happens
    assert len(answers) == 1 and answers[0][0] in svc.leases.ledger.holdings


def test_a_requester_with_no_job_and_no_worker_is_refused_before_asking(svc):
    assert svc.requester_gone("d1") is None and svc.requester_gone(W2) is None
    assert "the requester ghost is gone" == svc.requester_gone("ghost")


def test_a_waiting_request_revokes_leases_and_its_grant_to_a_gone_owner_is_released(svc):
    lid = ask(svc, "d1")[1][0][0]
    rid, answers = ask(svc, "d2")
    assert answers == [] and rid in svc.leases.pending
    assert svc.edge.sent == [("d1", P.RevokeLeases([lid]).to_msg())]
    assert svc.edge.timers and svc.edge.timers[0][0] == pytest.approx(5.0)
    svc.edge.jobs.discard("d2")  # d2's job ended before the room came
    svc.release([lid])
    assert answers == [[None, "the requester d2 is gone"]]
    assert not svc.leases.ledger.holdings  # the grant was released at once


def test_a_grant_that_finds_no_one_waiting_is_released(svc):
    lid = ask(svc, "d1")[1][0][0]
    rid, answers = ask(svc, "d2")
    svc._answers.pop(rid)  # as if answered already (a second answer of the machine)
    svc.release([lid])
    assert answers == [] and not svc.leases.ledger.holdings


def test_close_withdraws_a_waiting_request(svc):
    ask(svc, "d1")
    rid, answers = ask(svc, "d2")
    svc.close(rid)
    assert rid not in svc.leases.pending and answers == []


def test_a_deadline_refuses_through_the_timer_and_every_event_reaches_after_feed(svc):
    rid, answers = ask(svc, "d1", shape={"CPU": 64000.0})
    assert answers == [] and rid in svc.leases.pending
    [(at, fn)] = svc.edge.timers
    svc.edge.t = at
    fn()  # the timer fires: a Tick at the deadline
    assert answers and answers[0][0] is None and "can never be scheduled" in answers[0][1]
    assert svc.edge.feeds >= 3


def test_withdraw_names_the_owners_own_id_and_answers_a_waiting_request_once(svc):
    lid = ask(svc, "d1")[1][0][0]
    answers: list = []
    rid = svc.open(LeaseRequest("d2", dict(CPU1), own_id="r5"), 5000, answers.append)
    svc.withdraw_lease_requests("d1", ["r5"])  # another owner's id: nothing
    assert rid in svc.leases.pending and answers == []
    svc.withdraw_lease_requests("d2", ["r9", "r5"])  # r9: not heard of yet (overtaken): remembered
    assert rid not in svc.leases.pending and answers[0][0] is None and len(answers) == 1
    assert svc._own == {}
    svc.withdraw_lease_requests("d2", ["r5"])  # answered already
    svc.release([lid])
    assert len(answers) == 1 and not svc.leases.ledger.holdings
    late: list = []  # the overtaken request comes: refused at once, nothing held
    svc.open(LeaseRequest("d2", dict(CPU1), own_id="r9"), 5000, late.append)
    assert late[0][0] is None and "before it arrived" in late[0][1] and len(late) == 1
    assert not svc.leases.ledger.holdings and svc._own == {}


def test_a_withdraw_after_the_grant_changes_nothing(svc):
    answers: list = []
    svc.open(LeaseRequest("d1", dict(CPU1), own_id="r1"), 5000, answers.append)
    assert answers[0][1] == W1 and svc._own == {}
    svc.withdraw_lease_requests("d1", ["r1"])
    assert answers[0][0] in svc.leases.ledger.holdings and len(answers) == 1


def test_the_lease_rpcs_decision_refuses_a_gone_requester_at_once_and_asks_nothing(svc):
    answers: list = []
    assert svc.request_lease(answers.append, "ghost", CPU1, 5000) == ""
    assert answers == [[None, "the requester ghost is gone"]] and not svc.leases.pending
    rid = svc.request_lease(answers.append, "d1", CPU1, 5000, request_id="q1")
    assert rid == "R1" and answers[1][1] == W1  # it fits: granted before it returns


def test_an_abandoned_rpc_withdraws_its_request_or_releases_its_grant(svc):
    lid = ask(svc, "d1")[1][0][0]
    answers: list = []
    rid = svc.request_lease(answers.append, "d2", CPU1, -1)
    svc.abandon(rid, None)  # its caller went away while it waited
    assert rid not in svc.leases.pending and answers == []
    rid = svc.request_lease(answers.append, "d2", CPU1, -1)
    svc.release([lid])  # granted, but the caller was cancelled before it read the answer
    assert answers and answers[0][0] is not None
    svc.abandon(rid, answers[0])
    assert not svc.leases.ledger.holdings
