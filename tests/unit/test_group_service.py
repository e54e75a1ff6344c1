"""The resource-group adapter's decisions (``scheduler/group_adapter.py``'s ``GroupService``)
on a recording edge, over the production lease adapter: what it refuses, when it lets the
lease queue grant again, what a removal revokes, whom it answers.  The simulation drives the
same class (tests/sim)."""
from __future__ import annotations

import pytest

from yrdask import protocol as P
from yrdask.scheduler.group_adapter import GroupService
from yrdask.scheduler.lease_service import LeaseService
from yrdask.scheduler.requests import LeaseRequest
from tests.unit.recording_edges import LeaseRecorder

pytestmark = pytest.mark.timeout(30)

W1, W2 = "tcp://w1:1", "tcp://w2:1"
HALF = {"CPU": 500.0, "Memory": 100.0}


class Edge(LeaseRecorder):
    """Both edges at once: the lease service's (recording) and the group service's."""

    def __init__(self) -> None:
        super().__init__(jobs={"d1"})
        self.settled: list[str] = []
        self.grants = 0
        self.groups: GroupService | None = None
        self.leases: LeaseService | None = None

    def after_feed(self) -> None:
        super().after_feed()
        if self.groups is not None:
            self.groups.after_feed()

    # GroupServiceEdge
    def grant_pending(self) -> None:
        self.grants += 1
        self.leases.tick()

    def kill_instance(self, instance_id, reason):
        raise AssertionError("no instances here")

    def group_settled(self, group) -> None:
        self.settled.append(group)

    def requester_gone(self, owner):
        return self.leases.requester_gone(owner)


@pytest.fixture
def edge():
    e = Edge()
    e.leases = LeaseService(e)
    e.groups = GroupService(e, e.leases.leases)
    return e


def join(edge: Edge, worker: str, cpu: float = 1000.0) -> None:
    edge.workers.add(worker)
    edge.leases.worker_joined(worker, {"CPU": cpu, "Memory": 4000.0})


def ask(edge: Edge, group: str, index: int = -1) -> list:
    answers: list = []
    edge.leases.open(LeaseRequest("d1", dict(HALF), affinity=P.bundle_wire(group, index)),
                     5000, answers.append)
    return answers


def test_a_duplicate_name_or_an_unknown_strategy_is_refused_saying_what_to_do(edge):
    join(edge, W1)
    assert edge.groups.create("d1", "g", [HALF]) == ""
    assert "already exists" in edge.groups.create("d1", "g", [HALF])
    assert "invalid strategy 'DENSE'" in edge.groups.create("d1", "h", [HALF], "DENSE")
    assert edge.settled == ["g"]  # placed at once: its waiters are answered


def test_a_request_for_a_pending_group_is_granted_in_its_bundle_once_it_is_placed(edge):
    join(edge, W1)
    assert edge.groups.create("d1", "g", [HALF, HALF], "STRICT_SPREAD") == ""
    answers = ask(edge, "g", 1)
    assert answers == [] and edge.settled == []  # one worker: STRICT_SPREAD waits
    join(edge, W2)  # the lease service's after_feed places it, then lets the queue grant
    assert edge.settled == ["g"] and edge.grants >= 1
    [[lease, _worker]] = answers
    ledger = edge.leases.leases.ledger
    bundle = ledger.holdings[lease].bundle
    assert edge.groups.machine.by_holding[bundle] == ("g", 1)


def test_removing_a_group_revokes_its_leases_and_refuses_what_asks_again(edge):
    join(edge, W1)
    edge.groups.create("d1", "g", [HALF])
    [[lease, _worker]] = ask(edge, "g")
    existed, kills = edge.groups.remove("g")
    assert existed and kills == []
    ledger = edge.leases.leases.ledger
    assert ledger.holdings == {}  # the bundle and the lease in it
    assert ("d1", P.RevokeLeases([lease]).to_msg()) in edge.sent
    assert edge.settled == ["g", "g"]
    [[none, why]] = ask(edge, "g")
    assert none is None and "resource group 'g' does not exist (removed: " in why
    assert edge.groups.remove("g") == (False, [])


def test_an_owner_gone_removes_its_groups_only(edge):
    join(edge, W1, 2000.0)
    edge.jobs.add("d2")
    edge.groups.create("d1", "mine", [HALF])
    edge.groups.create("d2", "theirs", [HALF])
    edge.groups.on_owner_gone("d1")
    assert edge.groups.machine.live("mine") is None
    assert edge.groups.machine.live("theirs") is not None


def test_a_create_that_comes_after_its_owner_ended_is_refused_and_holds_nothing(edge):
    """The create rpc can arrive after the job stream's end (whose OWNER_GONE removed the
    owner's groups): a group made now would never be removed, so it is refused."""
    join(edge, W1)
    edge.jobs.discard("d1")  # the job ended; its create was still on its way
    why = edge.groups.create("d1", "late", [HALF])
    assert why == ("resource group 'late' was not created: the requester d1 is gone (its job "
                   "ended or its worker left before the request arrived)")
    assert edge.groups.machine.live("late") is None and edge.settled == []
    assert edge.leases.leases.ledger.holdings == {}  # no bundle reserved
    # a worker's runtime (no job stream) may own groups: it is asked of the lease service too
    assert edge.groups.create(W1, "nested", [HALF]) == ""
    assert edge.groups.machine.live("nested") is not None
