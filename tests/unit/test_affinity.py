"""Unit tests of yrdask.affinity and the ledger's affinity-aware choice (no cluster)."""

from __future__ import annotations

import pytest

import yrdask as yr
from yrdask.affinity import evaluate, to_wire
from yrdask.scheduler.resources import Holding, Ledger

pytestmark = pytest.mark.timeout(30)

A, B = "tcp://10.0.0.1:1", "tcp://10.0.0.2:1"
R, I = yr.AffinityKind.RESOURCE, yr.AffinityKind.INSTANCE
IN, NOT_IN = yr.OperatorType.LABEL_IN, yr.OperatorType.LABEL_NOT_IN
EXISTS, NOT_EXISTS = yr.OperatorType.LABEL_EXISTS, yr.OperatorType.LABEL_NOT_EXISTS


def aff(typ, *ops, kind=R):
    return yr.Affinity(kind, typ, [yr.LabelOperator(*op) for op in ops])


@pytest.fixture
def ledger():
    led = Ledger()
    led.add_worker(A, {"CPU": 1000.0, "gpu": 1.0})
    led.add_worker(B, {"CPU": 1000.0})
    return led


def choose(led, *affs, prefer=None):
    return led.choose({"CPU": 100.0}, prefer=prefer, affinity=to_wire(affs))


def test_required_node_id_pins(ledger):
    assert choose(ledger, aff(yr.AffinityType.REQUIRED, (IN, "NODE_ID", [B]))) == B
    assert choose(ledger, aff(yr.AffinityType.REQUIRED, (IN, "NODE_ID", [A]))) == A


def test_required_anti_excludes(ledger):
    assert choose(ledger, aff(yr.AffinityType.REQUIRED_ANTI, (IN, "NODE_ID", [A])), prefer=A) == B


def test_preferred_ranks_above_local_preference(ledger):
    assert choose(ledger, aff(yr.AffinityType.PREFERRED, (IN, "NODE_ID", [B])), prefer=A) == B
    # a preference no worker meets only ranks: local still wins
    assert choose(ledger, aff(yr.AffinityType.PREFERRED, (IN, "NODE_ID", ["x"])), prefer=A) == A


def test_tags_and_ip_are_resource_labels(ledger):
    assert choose(ledger, aff(yr.AffinityType.REQUIRED, (EXISTS, "gpu", []))) == A
    assert choose(ledger, aff(yr.AffinityType.REQUIRED, (NOT_EXISTS, "gpu", []))) == B
    assert choose(ledger, aff(yr.AffinityType.REQUIRED, (IN, "NODE_IP", ["10.0.0.2"]))) == B


def test_operators_and_within_or_across(ledger):
    both = aff(yr.AffinityType.REQUIRED, (IN, "NODE_ID", [A]), (NOT_EXISTS, "gpu", []))
    assert choose(ledger, both) is None  # A has gpu: AND fails everywhere
    either = [aff(yr.AffinityType.REQUIRED, (IN, "NODE_ID", ["nope"])),
              aff(yr.AffinityType.REQUIRED, (IN, "NODE_ID", [B]))]
    assert choose(ledger, *either) == B


def test_instance_affinity_matches_labels_of_instances_there(ledger):
    ledger.hold(Holding("i-1", "instance", B, {"CPU": 100.0}, "job", labels=("role:db",)))
    near = aff(yr.AffinityType.REQUIRED, (IN, "role", ["db"]), kind=I)
    assert choose(ledger, near, prefer=A) == B
    away = aff(yr.AffinityType.REQUIRED_ANTI, (EXISTS, "role", []), kind=I)
    assert choose(ledger, away, prefer=B) == A


def test_unmet_affinity_is_explained(ledger):
    wire = to_wire([aff(yr.AffinityType.REQUIRED, (IN, "NODE_ID", ["tcp://gone:1"]))])
    assert not ledger.could_ever_fit({"CPU": 1.0}, wire)
    msg = ledger.explain_unfit({"CPU": 1.0}, wire)
    assert "affinity" in msg and "REQUIRED" in msg and "tcp://gone:1" in msg


def test_evaluate_counts_soft_matches():
    labels = {R: {"NODE_ID": {A}}}
    wire = to_wire([aff(yr.AffinityType.PREFERRED, (IN, "NODE_ID", [A])),
                    aff(yr.AffinityType.PREFERRED_ANTI, (IN, "NODE_ID", [B]))])
    assert evaluate(wire, labels) == (True, 2)
    assert evaluate((), labels) == (True, 0)


@pytest.mark.parametrize("bad,exc", [
    (lambda: yr.LabelOperator(99, "k", ["v"]), yr.YRValueError),
    (lambda: yr.LabelOperator(IN, "", ["v"]), yr.YRTypeError),
    (lambda: yr.LabelOperator(IN, "k", []), yr.YRValueError),
    (lambda: yr.LabelOperator(IN, "k", [1]), yr.YRTypeError),
    (lambda: yr.Affinity(R, yr.AffinityType.REQUIRED, []), yr.YRTypeError),
    (lambda: yr.Affinity(7, yr.AffinityType.REQUIRED, [yr.LabelOperator(EXISTS, "k")]),
     yr.YRValueError),
])
def test_bad_affinities_raise_typed_errors(bad, exc):
    with pytest.raises(exc):
        bad()


@pytest.mark.parametrize("typ,target", [
    (yr.AffinityType.REQUIRED, B), (yr.AffinityType.REQUIRED_ANTI, B),
    (yr.AffinityType.PREFERRED, B), (yr.AffinityType.PREFERRED_ANTI, A),
])
def test_single_label_operator_schedules_like_a_one_element_list(ledger, typ, target):
    op = yr.LabelOperator(IN, "NODE_ID", [target])
    single = yr.Affinity(R, typ, op)  # yr's docs write it without the list
    listed = yr.Affinity(R, typ, [yr.LabelOperator(IN, "NODE_ID", [target])])
    assert single.label_operators == [op]
    assert single == listed
    assert to_wire([single]) == to_wire([listed])
    for prefer in (A, B):
        assert choose(ledger, single, prefer=prefer) == choose(ledger, listed, prefer=prefer)


def test_a_non_operator_is_still_a_typed_error():
    with pytest.raises(yr.YRTypeError, match="LabelOperator"):
        yr.Affinity(R, yr.AffinityType.REQUIRED, "NODE_ID")
