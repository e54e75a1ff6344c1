"""yr demand in Dask's terms, without I/O: the shapes that wait, how many workers of the
deployer's shape they fill, which requests no such worker could run, and what the lease
queue does with a deployer's verdict (docs/deploy.md, "Scaling up")."""

from __future__ import annotations

import pytest

from yrdask.affinity import AffinityKind
from yrdask.errors import YRValueError
from yrdask.scheduler import demand as D
from yrdask.scheduler import groups as G
from yrdask.scheduler.leases import LeaseQueue, Refused, Tick, WakeAt, WorkerJoined

from unit.test_leases import cpu, req, required

pytestmark = pytest.mark.timeout(60)

WORKER = {"CPU": 1000.0, "Memory": 2000.0}


def needs(*shapes: dict, apart: str = "") -> list[D.Need]:
    return [D.Need(dict(s), apart) for s in shapes]


def test_offer_shape_counts_devices_and_node_wide_amounts():
    shape = D.offer_shape({"CPU": 2000.0, "Memory": 4000.0, "ssd": 1.0}, ("0", "1", "NPU:0"),
                          {"accelerator_type:A100": 1.0})
    assert shape == {"CPU": 2000.0, "Memory": 4000.0, "ssd": 1.0, "GPU": 2.0, "NPU": 1.0,
                     "accelerator_type:A100": 1.0}


def test_shapes_pack_onto_workers_first_fit_largest_first():
    # ten default yr tasks (half a CPU each) fill five one-CPU workers
    assert D.workers_needed(needs(*[{"CPU": 500, "Memory": 500}] * 10), WORKER) == (5, [])
    # memory binds: three 900 MB requests on 2000 MB workers take two of them
    assert D.workers_needed(needs(*[{"CPU": 100, "Memory": 900}] * 3), WORKER)[0] == 2
    # largest first: 700 + 300 share a worker, as do 600 + 400
    n, _ = D.workers_needed(needs({"CPU": 300}, {"CPU": 600}, {"CPU": 700}, {"CPU": 400}),
                            WORKER)
    assert n == 2
    assert D.workers_needed([], WORKER) == (0, [])


def test_a_need_larger_than_one_worker_is_unfit_not_counted():
    big = {"CPU": 2000.0}
    n, unfit = D.workers_needed(needs(big, {"CPU": 500}), WORKER)
    assert (n, [u.shape for u in unfit]) == (1, [big])
    # a tag the workers do not offer, a GPU on CPU workers
    assert D.workers_needed(needs({"ssd": 1}), WORKER)[0] == 0
    assert D.unfit_reason({"CPU": 500, "GPU": 1}, (), WORKER).startswith(
        "no worker the deployer adds could ever run it: it needs GPU=1 (a worker offers 0)")
    assert D.unfit_reason({"CPU": 1000, "Memory": 2000}, (), WORKER) == ""


def test_strict_spread_bundles_take_distinct_workers():
    small = {"CPU": 100}
    assert D.workers_needed(needs(small, small, small, apart="g"), WORKER)[0] == 3
    # different groups share
    assert D.workers_needed(needs(small, apart="g") + needs(small, apart="h"), WORKER)[0] == 1


def test_hard_affinities_against_a_new_worker():
    worker = {**WORKER, "ssd": 1.0}
    has_tag = required(AffinityKind.RESOURCE, "ssd")
    node = required(AffinityKind.RESOURCE, "NODE_ID", "10.0.0.7")
    with_instance = required(AffinityKind.INSTANCE, "db")
    away_from_instance = required(AffinityKind.INSTANCE, "db", anti=True)
    assert D.new_worker_allowed(has_tag, worker)
    assert not D.new_worker_allowed(has_tag, WORKER)
    assert not D.new_worker_allowed(node, worker)
    assert not D.new_worker_allowed(with_instance, worker)
    assert D.new_worker_allowed(away_from_instance, worker)
    assert "affinity" in D.unfit_reason({"CPU": 100}, node, worker)


def test_pending_needs_from_the_lease_queue_and_the_groups():
    q = LeaseQueue()
    groups = G.GroupMachine(q.ledger)
    q.bundles = groups
    q.handle(req("R1", shape=cpu(0.5)))
    q.handle(req("R2", shape=cpu(0.5), kind="instance", holding_id="I1"))
    for name, strategy in (("pack", "PACK"), ("strict", "STRICT_PACK"),
                           ("spread", "STRICT_SPREAD")):
        groups.handle(G.GroupRequested(f"c-{name}", name, "tcp://d:1",
                                       ({"CPU": 300.0}, {"CPU": 400.0}), strategy))
    got = D.pending_needs(q, groups)
    assert [(n.shape, n.apart) for n in got] == [
        (cpu(0.5), ""), (cpu(0.5), ""),
        ({"CPU": 300.0}, ""), ({"CPU": 400.0}, ""),
        ({"CPU": 700.0}, ""),
        ({"CPU": 300.0}, "spread"), ({"CPU": 400.0}, "spread")]
    # 2 x 500 + 300 + 400 + 700 + spread 300 | 400: four one-CPU workers
    assert D.workers_needed(got, WORKER)[0] == 4


def test_configured_shape_is_checked():
    assert D.configured_shape(None, "k") is None
    assert D.configured_shape({"CPU": 4000, "GPU": "1"}, "k") == {"CPU": 4000.0, "GPU": 1.0}
    for bad in ({}, 4, {"CPU": -1}, {"CPU": "many"}):
        with pytest.raises(YRValueError, match="^k"):
            D.configured_shape(bad, "k")


class Deployer:
    """The lease queue's view of an attached deployer (``ScaleUp.verdict``)."""

    def __init__(self, worker: dict | None) -> None:
        self.worker = worker

    def verdict(self, shape: dict, affinity: tuple) -> str | None:
        return "" if self.worker is None else D.unfit_reason(shape, affinity, self.worker)


class Detached:
    """No deployer asked lately: the usual rules."""

    def verdict(self, shape: dict, affinity: tuple) -> None:
        return None


def test_a_request_waits_past_its_deadline_while_the_deployer_can_grow_the_cluster():
    q = LeaseQueue()
    q.scaling = Deployer(WORKER)
    out = q.handle(req("R1", shape=cpu(0.5), timeout_ms=1000))
    assert out == [WakeAt("t", 1.0)]
    q.handle(Tick("t", 1.5))
    assert "R1" in q.pending  # extended, not refused
    q.handle(WorkerJoined("t", "tcp://w:1", WORKER))
    assert "R1" not in q.pending


def test_a_request_no_added_worker_could_run_is_refused_on_arrival():
    q = LeaseQueue()
    q.scaling = Deployer(WORKER)
    [refused] = q.handle(req("R1", shape=cpu(4)))
    assert isinstance(refused, Refused)
    assert refused.reason.startswith("request {CPU: 4000} can never be scheduled: no worker "
                                     "the deployer adds could ever run it: it needs CPU=4000")
    # ... unless a node there could run it: then it waits as usual
    q.handle(WorkerJoined("t", "tcp://big:1", cpu(8)))
    q.handle(req("R2", shape=cpu(8)))
    assert q.handle(req("R3", shape=cpu(4))) == [WakeAt("t", 1.0)]


def test_without_a_deployer_the_deadline_refuses_as_before():
    q = LeaseQueue()
    q.scaling = Detached()
    q.handle(req("R1", shape=cpu(0.5), timeout_ms=1000))
    [refused] = q.handle(Tick("t", 1.5))
    assert isinstance(refused, Refused) and "no yr workers" in refused.reason

