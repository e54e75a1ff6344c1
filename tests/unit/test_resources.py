"""Unit tests of yrdask.scheduler.resources.Ledger: holdings, placement choice and fit checks.

SPEC §6: a request must fit on one node (the worker processes of one host together); an instance holds its request for its
whole life, a task lease while it runs (and lends its CPU back while blocked); a request
that cannot be met fails with a message naming what it needs and what holds the cluster.
"""

from __future__ import annotations

import pytest

from yrdask.scheduler.resources import Holding, Ledger, format_shape

pytestmark = pytest.mark.timeout(30)

A, B, C = "tcp://a:1", "tcp://b:1", "tcp://c:1"


def shape(cpu=500, mem=500, **tags):
    return {"CPU": float(cpu), "Memory": float(mem), **{k: float(v) for k, v in tags.items()}}


def ledger(**workers):
    led = Ledger()
    for addr, cap in workers.items():
        led.add_worker(addr, cap)
    return led


@pytest.fixture
def two():
    """Two 1-CPU workers with 4 GB each."""
    return ledger(**{A: shape(1000, 4096), B: shape(1000, 4096)})


def inst(hid, worker, s, owner="job-1"):
    return Holding(hid, "instance", worker, s, owner)


def lease(hid, worker, s, owner="tcp://driver:1"):
    return Holding(hid, "lease", worker, s, owner)


# --------------------------------------------------------------------------- hold and release


def test_hold_and_release_restore_free_resources(two):
    two.hold(inst("i1", A, shape(300, 100)))
    two.hold(lease("L1", A, shape(500, 200, gpu=1)))
    ws = two.workers[A]
    assert ws.held["CPU"] == pytest.approx(800)
    assert ws.held["Memory"] == pytest.approx(300)
    assert ws.free("CPU") == pytest.approx(200)
    assert ws.holdings == {"i1", "L1"}
    assert two.release("i1").holding_id == "i1"
    assert two.release("L1").kind == "lease"
    assert ws.held["CPU"] == pytest.approx(0)
    assert ws.held["Memory"] == pytest.approx(0)
    assert ws.held.get("gpu", 0) == pytest.approx(0)
    assert ws.holdings == set()
    assert two.holdings == {}


def test_release_unknown_or_twice_is_none(two):
    assert two.release("nope") is None
    two.hold(inst("i1", A, shape()))
    assert two.release("i1") is not None
    assert two.release("i1") is None
    assert two.workers[A].held["CPU"] == pytest.approx(0)


def test_release_after_the_worker_is_gone(two):
    two.hold(inst("i1", A, shape()))
    gone = two.remove_worker(A)
    assert [h.holding_id for h in gone] == ["i1"]
    assert A not in two.workers
    assert two.release("i1") is None
    assert two.remove_worker(A) == []


def test_snapshot_shows_capacity_and_held(two):
    two.hold(inst("i1", B, shape(1000, 500)))
    snap = two.snapshot()
    assert snap[A]["capacity"] == shape(1000, 4096) and snap[A]["held"] == {}
    assert snap[A]["processes"] == [A] and snap[A]["gpus"] == {}
    assert snap[B]["held"] == shape(1000, 500)
    assert snap[B]["capacity"] == shape(1000, 4096)


# --------------------------------------------------------------------------- placement choice


def test_choose_prefers_the_local_worker_when_it_fits(two):
    two.hold(inst("i1", A, shape(500)))  # A is the busier one
    assert two.choose(shape(500), prefer=A) == A
    assert two.choose(shape(500)) == B


def test_choose_ignores_a_local_worker_that_does_not_fit(two):
    two.hold(inst("i1", A, shape(800)))
    assert two.choose(shape(500), prefer=A) == B
    assert two.choose(shape(500), prefer="tcp://unknown:1") == B


def test_choose_takes_the_largest_free_cpu_fraction():
    led = ledger(**{A: shape(4000, 4096), B: shape(1000, 4096), C: shape(2000, 4096)})
    led.hold(inst("a", A, shape(3000)))  # A: 1000/4000 free = 25%
    led.hold(inst("c", C, shape(500)))  # C: 1500/2000 free = 75%
    led.hold(inst("b", B, shape(500)))  # B: 500/1000 free = 50%
    assert led.choose(shape(300)) == C
    # a fraction, not an absolute amount: A has as much free CPU as B in millicores
    led.release("c")
    led.hold(inst("c2", C, shape(1800)))  # C: 10%
    assert led.choose(shape(300)) == B


def test_choose_breaks_ties_by_fewer_holdings(two):
    two.hold(inst("a1", A, shape(0, 10)))
    two.hold(inst("a2", A, shape(0, 10)))
    two.hold(inst("b1", B, shape(0, 10)))
    assert two.choose(shape(500)) == B


def test_choose_spreads_equal_requests(two):
    first = two.choose(shape(1000))
    two.hold(inst("x", first, shape(1000)))
    second = two.choose(shape(1000))
    assert {first, second} == {A, B}
    two.hold(inst("y", second, shape(1000)))
    assert two.choose(shape(1000)) is None
    assert two.choose(shape(1)) is None


def test_choose_respects_memory_and_custom_tags():
    led = ledger(**{A: shape(1000, 1000), B: {**shape(1000, 8000), "gpu_node": 1.0}})
    assert led.choose(shape(100, 4000)) == B
    assert led.choose(shape(100, 100, gpu_node=1)) == B
    led.hold(inst("g", B, shape(0, 0, gpu_node=1)))
    assert led.choose(shape(100, 100, gpu_node=1)) is None
    assert led.choose(shape(100, 100, ssd=1)) is None


def test_choose_with_no_workers():
    assert Ledger().choose(shape()) is None


# --------------------------------------------------------------------------- lending a blocked lease's CPU


def test_lend_cpu_gives_the_cpu_back_and_takes_it_again(two):
    two.hold(lease("L1", A, shape(1000, 100)))
    assert two.choose(shape(1000), prefer=A) == B
    assert two.lend_cpu("L1", True) is True
    assert two.workers[A].held["CPU"] == pytest.approx(0)
    assert two.workers[A].held["Memory"] == pytest.approx(100)  # only CPU is lent
    assert two.lend_cpu("L1", True) is False  # already lent
    assert two.choose(shape(1000), prefer=A) == A
    assert two.lend_cpu("L1", False) is True
    assert two.workers[A].held["CPU"] == pytest.approx(1000)
    assert two.lend_cpu("L1", False) is False
    assert two.lend_cpu("unknown", True) is False


def test_release_of_a_lent_lease_does_not_give_the_cpu_back_twice(two):
    two.hold(lease("L1", A, shape(1000, 100)))
    two.lend_cpu("L1", True)
    two.hold(lease("L2", A, shape(1000, 100)))  # took the lent CPU
    two.release("L1")
    ws = two.workers[A]
    assert ws.held["CPU"] == pytest.approx(1000)  # L2 still holds its CPU
    assert ws.held["Memory"] == pytest.approx(100)
    two.release("L2")
    assert ws.held["CPU"] == pytest.approx(0)
    assert ws.held["Memory"] == pytest.approx(0)


# --------------------------------------------------------------------------- fit checks and explanations


def test_could_ever_fit_needs_one_node_for_the_whole_request(two):
    assert two.could_ever_fit(shape(1000, 4096))
    assert not two.could_ever_fit(shape(1500))  # 2000 in total, but on two nodes
    assert not two.could_ever_fit(shape(100, 5000))
    assert not two.could_ever_fit(shape(100, 100, gpu=1))
    two.hold(inst("i", A, shape(1000)))
    assert two.could_ever_fit(shape(1000))  # held is not capacity
    assert not Ledger().could_ever_fit(shape())


def test_lease_holders_on_fitting_workers():
    led = ledger(**{A: shape(1000, 4096), B: shape(4000, 4096)})
    led.hold(lease("La", A, shape(500)))
    led.hold(lease("Lb", B, shape(500)))
    led.hold(inst("ib", B, shape(500)))
    assert {h.holding_id for h in led.lease_holders_on_fitting_workers(shape(500))} == {"La", "Lb"}
    assert {h.holding_id for h in led.lease_holders_on_fitting_workers(shape(2000))} == {"Lb"}
    assert led.lease_holders_on_fitting_workers(shape(9000)) == []


def test_explain_with_no_workers():
    msg = Ledger().explain_unfit(shape())
    assert "no yr workers" in msg


def test_explain_never_fits_names_the_missing_cpu_and_the_offers(two):
    msg = two.explain_unfit(shape(64000))
    assert "never" in msg
    assert "CPU=64000" in msg
    assert "largest offer: 1000" in msg
    assert "Memory=" not in msg  # memory is not what is missing
    assert A in msg and B in msg  # what the workers offer
    assert "one node" in msg


def test_explain_never_fits_names_a_missing_custom_tag(two):
    msg = two.explain_unfit(shape(100, 100, gpu_node=1))
    assert "gpu_node=1" in msg
    assert "largest offer: 0" in msg
    assert "CPU=" not in msg


def test_explain_never_fits_names_memory(two):
    msg = two.explain_unfit(shape(100, 10000))
    assert "Memory=10000" in msg and "largest offer: 4096" in msg


def test_explain_busy_names_the_holders(two):
    two.hold(inst("inst-1", A, shape(1000)))
    two.hold(inst("inst-2", B, shape(600)))
    two.hold(lease("L7", B, shape(400)))
    msg = two.explain_unfit(shape(1000))
    assert "never" not in msg
    assert "did not fit in time" in msg
    assert format_shape(shape(1000)) in msg  # what it needs
    for hid in ("inst-1", "inst-2", "L7"):
        assert hid in msg
    assert "instance inst-1" in msg and "lease L7" in msg
    assert A in msg and B in msg


def test_explain_busy_lists_only_workers_that_could_run_it():
    led = ledger(**{A: shape(1000, 4096), B: shape(4000, 4096)})
    led.hold(inst("small", A, shape(1000)))
    led.hold(inst("big", B, shape(4000)))
    msg = led.explain_unfit(shape(2000))
    assert "big" in msg and B in msg
    assert "small" not in msg and A not in msg


def test_format_shape_is_sorted_and_compact():
    assert format_shape({"Memory": 500.0, "CPU": 1000.0}) == "{CPU: 1000, Memory: 500}"
    assert format_shape({}) == "{}"


def test_explanations_name_classes_and_suggest_the_fix(two):
    from yrdask.scheduler.resources import FIX_HINT

    two.hold(Holding("i1", "instance", A, shape(500), "job", label="Counter"))
    two.hold(Holding("i2", "instance", A, shape(500), "job", label="Counter"))
    two.hold(Holding("i3", "instance", B, shape(1000), "job", label="Model"))
    busy = two.explain_unfit(shape(500))
    assert "Counter instance i1 {CPU: 500" in busy and "Model instance i3" in busy
    assert busy.endswith(FIX_HINT) and "InvokeOptions(cpu=" in busy and "Config(num_cpus=" in busy
    assert two.explain_unfit(shape(64000)).endswith(FIX_HINT)
    assert two.explain_wait(shape(500)) == [
        f"worker {A}: needs CPU 500, free 0 of 1000 millicores; held by 2 Counter instances "
        "(i1, i2)",
        f"worker {B}: needs CPU 500, free 0 of 1000 millicores; held by Model instance i3"]
    # Only what it lacks is named; workers that can never run it come last.
    assert two.explain_wait(shape(500, 9000)) == [
        f"can never run it: {A} (offers {{CPU: 1000, Memory: 4096}}), "
        f"{B} (offers {{CPU: 1000, Memory: 4096}})"]
    assert two.explain_wait(shape(500), avoid=(A,))[-1] == \
        f"can never run it: {A} (unreachable to the requester)"
    assert Ledger().explain_wait(shape()) == ["the cluster has no yr workers"]
    two.release("i3")
    assert [line for line in two.explain_wait(shape(500)) if B in line] == []  # B fits now


# --------------------------------------------------------------------------- nodes are hosts
# docs/nodes.md: the worker processes of one host pool their offers; a request takes from the
# pool and runs in one process of it; GPUs are leased by device id.

P1, P2 = "tcp://10.0.0.1:1", "tcp://10.0.0.1:2"


def node_of_two(**gpu):
    """One node ``n1`` of two 1-CPU processes (4 GB each), ``gpu`` passed to both."""
    led = Ledger()
    led.add_worker(P1, shape(1000, 4096), "n1", **gpu)
    led.add_worker(P2, shape(1000, 4096), "n1", **gpu)
    return led


def test_processes_of_a_node_pool_their_offers():
    led = node_of_two()
    assert list(led.workers) == ["n1"] and set(led.processes) == {P1, P2}
    node = led.workers["n1"]
    assert node.capacity == shape(2000, 8192)
    assert led.could_ever_fit(shape(2000))  # a 2-CPU request fits the node of two 1-CPU ones
    where = led.choose(shape(2000))
    assert where in (P1, P2)
    led.hold(lease("L1", where, shape(2000)))
    assert led.holdings["L1"].node == "n1" and node.free("CPU") == pytest.approx(0)
    assert led.choose(shape(100)) is None


def test_work_goes_to_the_least_loaded_process_unless_its_own_fits():
    led = node_of_two()
    led.hold(inst("i1", P1, shape(500)))
    assert led.choose(shape(500)) == P2  # P1 already runs something
    assert led.choose(shape(500), prefer=P1) == P1  # local first: the submitter's process
    assert led.choose(shape(500), avoid=[P2]) == P1


def test_a_process_leaving_takes_its_work_and_its_share():
    led = node_of_two()
    led.hold(inst("i1", P1, shape(500)))
    led.hold(inst("i2", P2, shape(500)))
    lost = led.remove_worker(P1)
    assert [h.holding_id for h in lost] == ["i1"]
    node = led.workers["n1"]
    assert node.capacity["CPU"] == 1000 and node.held["CPU"] == pytest.approx(500)
    assert [h.holding_id for h in led.remove_worker(P2)] == ["i2"]
    assert led.workers == {} and led.holdings == {}


def test_registering_again_keeps_what_the_process_holds():
    led = node_of_two()
    led.hold(inst("i1", P1, shape(500)))
    led.add_worker(P1, shape(3000, 4096), "n1")
    assert led.workers["n1"].capacity["CPU"] == 4000
    assert "i1" in led.holdings and led.processes[P1].holdings == {"i1"}


def test_shared_resources_do_not_add_up_over_processes():
    led = node_of_two(gpus=("0",), shared={"accelerator_type:H200": 1.0})
    cap = led.workers["n1"].capacity
    assert cap["accelerator_type:H200"] == 1.0
    assert cap["GPU"] == 1.0  # both processes see the same device


def test_whole_gpus_take_distinct_device_ids():
    led = node_of_two(gpus=("0", "1"))
    got = []
    for hid in ("L1", "L2"):
        where = led.choose({"CPU": 100.0, "GPU": 1.0})
        h = lease(hid, where, {"CPU": 100.0, "GPU": 1.0})
        led.hold(h)
        got.append(h.gpu_ids)
    assert got == [["0"], ["1"]]
    assert led.choose({"CPU": 100.0, "GPU": 1.0}) is None  # no device left
    assert led.choose({"CPU": 100.0, "GPU": 0.5}) is None
    led.release("L1")
    h = lease("L3", P1, {"CPU": 100.0, "GPU": 1.0})
    led.hold(h)
    assert h.gpu_ids == ["0"]


def test_fractions_pack_onto_one_device_and_leave_whole_ones_free():
    led = node_of_two(gpus=("0", "1"))
    halves = [lease(f"H{i}", P1, {"GPU": 0.5}) for i in range(2)]
    for h in halves:
        led.hold(h)
    assert [h.gpus for h in halves] == [(("0", 0.5),), (("0", 0.5),)]
    assert led.workers["n1"].gpu_used == {"0": 1.0, "1": 0.0}
    whole = lease("W", P2, {"GPU": 1.0})
    led.hold(whole)
    assert whole.gpu_ids == ["1"]
    assert led.choose({"GPU": 0.1}) is None
    led.release("H0")
    assert led.choose({"GPU": 0.5}) is not None and led.choose({"GPU": 1.0}) is None


def test_two_gpus_need_two_free_devices_not_two_halves():
    led = node_of_two(gpus=("0", "1"))
    led.hold(lease("H", P1, {"GPU": 0.5}))
    assert led.workers["n1"].free("GPU") == pytest.approx(1.5)
    assert led.choose({"GPU": 1.0}) is not None
    assert led.choose({"GPU": 2.0}) is None  # 1.5 free in total, but one whole device
    assert led.could_ever_fit({"GPU": 2.0})


def test_gpu_work_runs_in_a_process_that_sees_the_device():
    """dask-cuda style: each process of the host sees one device of its own."""
    led = Ledger()
    led.add_worker(P1, shape(1000), "n1", gpus=("0",))
    led.add_worker(P2, shape(1000), "n1", gpus=("1",))
    assert led.workers["n1"].capacity["GPU"] == 2.0
    first = lease("L1", led.choose({"GPU": 1.0}), {"GPU": 1.0})
    led.hold(first)
    second_where = led.choose({"GPU": 1.0})
    assert second_where != first.worker
    second = lease("L2", second_where, {"GPU": 1.0})
    led.hold(second)
    assert {first.worker: first.gpu_ids, second.worker: second.gpu_ids} == {P1: ["0"], P2: ["1"]}


def test_a_gpu_count_without_ids_offers_ids_from_zero():
    led = Ledger()
    led.add_worker(P1, {"CPU": 1000.0, "GPU": 2.0}, "n1")
    assert led.processes[P1].gpus == ("0", "1") and led.workers["n1"].capacity["GPU"] == 2.0


def test_assign_gpus_rules():
    from yrdask.scheduler.resources import assign_gpus

    assert assign_gpus({"0": 1.0, "1": 1.0}, 2) == (("0", 1.0), ("1", 1.0))
    assert assign_gpus({"0": 0.5, "1": 1.0}, 1) == (("1", 1.0),)
    assert assign_gpus({"0": 0.5, "1": 0.75}, 0.5) == (("0", 0.5),)  # the fullest that fits
    assert assign_gpus({"0": 0.25}, 0.5) is None
    assert assign_gpus({}, 0) == ()


def test_gpu_lease_ids_carry_their_devices():
    from yrdask import protocol as P
    from yrdask.scheduler import leases as LQ

    q = LQ.LeaseQueue()
    q.handle(LQ.WorkerJoined("j1", P1, shape(1000), "n1", ("0", "1")))
    q.handle(LQ.WorkerJoined("j2", P2, shape(1000), "n1", ("0", "1")))
    granted = []
    for i in range(2):
        out = q.handle(LQ.HoldRequested(f"r{i}", f"R{i}", "tcp://d:1", "lease",
                                        {"CPU": 1000.0, "GPU": 1.0}, 1000, None, "q", (), (),
                                        (), None, 0.0))
        (g,) = out
        granted.append(g)
        q.validate()
    assert [P.lease_devices(g.holding_id) for g in granted] == [("0", 1.0), ("1", 1.0)]
    assert {g.worker for g in granted} == {P1, P2}
    q.handle(LQ.HoldingsReleased("rel", (granted[0].holding_id,)))
    q.validate()
    assert q.ledger.workers["n1"].gpu_used == {"0": 0.0, "1": 1.0}
    assert P.lease_devices("L9") == ("", 0.0)


def test_cpu_work_fills_each_processs_own_share_before_doubling_up():
    """Two 1-CPU tasks on a node of two 1-CPU processes run in different processes (one GIL
    each), even when one submitter prefers its own; a blocked task lends its share back."""
    led = node_of_two()
    led.hold(lease("L1", led.choose(shape(1000), prefer=P1), shape(1000)))
    assert led.holdings["L1"].worker == P1
    assert led.choose(shape(1000), prefer=P1) == P2
    led.lend_cpu("L1", True)
    assert led.choose(shape(1000), prefer=P1) == P1
    led.lend_cpu("L1", False)
    led.release("L1")
    assert led.processes[P1].cpu_held == pytest.approx(0)


def test_npus_are_leased_by_id_apart_from_gpus():
    """NPUs are devices of their own kind (ids ``NPU:<n>``): a GPU request never takes one."""
    led = Ledger()
    led.add_worker(P1, shape(2000), "n1", gpus=("0", "NPU:0", "NPU:1"))
    cap = led.workers["n1"].capacity
    assert cap["GPU"] == 1.0 and cap["NPU"] == 2.0
    a = lease("A", led.choose({"NPU": 1.0}), {"NPU": 1.0})
    led.hold(a)
    b = lease("B", led.choose({"NPU": 1.0, "GPU": 1.0}), {"NPU": 1.0, "GPU": 1.0})
    led.hold(b)
    assert a.gpu_ids == ["NPU:0"] and b.gpu_ids == ["0", "NPU:1"]
    assert led.choose({"NPU": 0.5}) is None and led.choose({"GPU": 0.5}) is None
    assert not led.could_ever_fit({"NPU": 3.0})
    led.release("A")
    half = lease("H", P1, {"NPU": 0.5})
    led.hold(half)
    assert half.gpus == (("NPU:0", 0.5),)


def test_an_npu_count_without_ids_offers_ids_from_zero():
    led = Ledger()
    led.add_worker(P1, {"CPU": 1000.0, "NPU": 2.0, "GPU": 1.0}, "n1")
    assert led.processes[P1].gpus == ("0", "NPU:0", "NPU:1")
    assert "NPU" not in led.processes[P1].capacity
    assert led.workers["n1"].capacity["NPU"] == 2.0
