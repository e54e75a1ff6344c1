"""Stateful instances (SPEC §3, §6; yr_api §1.3, programs P9-P13, P19).

The core programs run on both core cluster kinds (``yr_cluster``); the rest on the embedded
cluster (``Config(num_cpus=2)``: two worker processes of 1000 millicores each), the
deadlock-freedom chain on ``Config(num_cpus=1)``.  After every test, the instances the test
made must end (unnamed ones by reference counting, named ones because the test terminates
them); the ``_no_leftover_instances`` fixture checks that and cleans up, so one failure does
not starve the next tests of resources.
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import distributed
import pytest

import yrdask as yr
from conftest import wait_for_file, wait_until
from yrdask.runtime.context import current_runtime

pytestmark = pytest.mark.timeout(120)

T = 60  # seconds: explicit yr.get bound, well under the test time-out

_CLUSTER_INFO = lambda dask_scheduler: dask_scheduler.extensions["yr"].cluster_info()  # noqa: E731


# --------------------------------------------------------------------------- helpers


def scheduler_address() -> str:
    """The scheduler of the active runtime (``yr.init(...).scheduler_address``)."""
    return current_runtime().info.scheduler_address


def cluster_info() -> dict:
    with distributed.Client(scheduler_address(), set_as_default=False, timeout=30) as client:
        return client.run_on_scheduler(_CLUSTER_INFO)


def live_instances(info: dict) -> list[dict]:
    return [i for i in info["instances"] if i["state"] != "DEAD"]


def uniq(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


@pytest.fixture
def embedded(cluster):
    return cluster(kind="embedded", num_cpus=2)


@pytest.fixture
def one_cpu(cluster):
    return cluster(kind="embedded", num_cpus=1)


@pytest.fixture(autouse=True)
def _no_leftover_instances(request):
    """After a test: its non-detached instances end within a few seconds (SPEC §4).

    Leftovers are killed so that they do not starve the next tests of resources; they fail
    the test's teardown unless the test itself failed (its traceback keeps its handles).
    """
    failed_before = request.session.testsfailed
    yield
    if not yr.is_initialized():
        return
    gc.collect()
    with distributed.Client(scheduler_address(), set_as_default=False, timeout=30) as client:
        def leftovers():
            info = client.run_on_scheduler(_CLUSTER_INFO)
            return [i for i in live_instances(info) if not i["detached"]]

        deadline = time.monotonic() + 10
        left = leftovers()
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = leftovers()
        for i in left:
            try:
                yr.kill_instance(i["instance_id"])
            except Exception:
                pass
    if request.session.testsfailed > failed_before:
        return
    assert not left, f"instances left 10 s after {request.node.name}: " + "; ".join(
        f"{i['class']} {i['instance_id']} {i['state']} name={i['name']!r} owner={i['owner']}"
        for i in left)


# --------------------------------------------------------------------------- classes


class InitError(Exception):
    pass


class MethodError(Exception):
    pass


@yr.instance
class Counter:
    def __init__(self, start=0):
        self.value = start

    def add(self, n=1):
        self.value += n
        return self.value

    def get(self):
        return self.value

    def fail(self, msg):
        raise MethodError(msg)

    @yr.method(return_nums=0)
    def set_value(self, v):
        self.value = v

    @yr.method(return_nums=2)
    def pair(self, a, b):
        return a, b

    @yr.method(return_nums=3)
    def triple(self):
        return self.value, self.value + 1, self.value + 2

    def pid(self):
        return os.getpid()

    def sleep_then_add(self, seconds, started_path=None):
        if started_path:
            with open(started_path, "w") as f:
                f.write("started")
        time.sleep(seconds)
        return self.add()


@yr.instance
class StaticCounter:
    def __init__(self):
        self.cnt = 0

    def add(self):
        self.cnt += 1
        return self.cnt

    @classmethod
    def ca(cls, a):
        return a

    @staticmethod
    def sa(a):
        return a


@yr.instance
class Actor:
    def na(self, s):
        return f"{s} normal method"

    @classmethod
    def ca(cls, s):
        return f"{s} classmethod method"

    @staticmethod
    def sa(s):
        return f"{s} staticmethod method"


@yr.instance
class FailingInit:
    def __init__(self, msg):
        raise InitError(msg)

    def ping(self):
        return "pong"


@yr.instance
class SlowInit:
    def __init__(self, gate):
        open(f"{gate}.started", "w").close()
        wait_for_file(gate, 120)  # __init__ runs until the test creates ``gate``
        self.ready = True

    def ping(self):
        return "pong"


@yr.instance
class CountsCreations:
    def __init__(self, path):
        with open(path, "a") as f:
            f.write(f"{os.getpid()}\n")
        self.n = 0

    def add(self):
        self.n += 1
        return self.n


@yr.instance
class Relay:
    """Holds and calls handles of other instances."""

    def __init__(self, target=None):
        self.target = target

    def call_add(self, handle, n):
        return yr.get(handle.add.invoke(n))

    def store(self, handle):
        self.target = handle

    def add_via_stored(self, n):
        return yr.get(self.target.add.invoke(n))


@yr.instance(invoke_options=yr.InvokeOptions(cpu=300))
class Link:
    """A chain link: forwards to the next link and blocks in yr.get."""

    def __init__(self, nxt=None):
        self.nxt = nxt

    def ping(self, x):
        if self.nxt is None:
            return x + 1
        return yr.get(self.nxt.ping.invoke(x + 1), T)


@yr.instance(invoke_options=yr.InvokeOptions(cpu=1000))
class Burner:
    def pid(self):
        return os.getpid()

    def burn(self, seconds):
        # CPU-bound pure Python until this thread used `seconds` of CPU: two burners sharing
        # one GIL would each need twice the wall time.
        start = time.thread_time()
        x = 0
        while time.thread_time() - start < seconds:
            for i in range(1000):
                x += i * i
        return os.getpid()

    def burn_span(self, seconds):
        start = time.time()
        t0 = time.thread_time()
        x = 0
        while time.thread_time() - t0 < seconds:
            x += 1
        return os.getpid(), start, time.time()


@yr.instance(invoke_options=yr.InvokeOptions(concurrency=4))
class Sleeper:
    def __init__(self):
        self.gathered = threading.Barrier(4)

    def ping(self):
        return "pong"

    def meet(self):
        """Return once 4 calls are in here at the same time (a call that ran alone would
        break the barrier after 30 s): they run in parallel, whatever the machine's load."""
        self.gathered.wait(30)
        return threading.get_ident()


@yr.instance(invoke_options=yr.InvokeOptions(concurrency=2))
class ConcurrentAdder:
    def __init__(self):
        self.value = 0

    def ping(self):
        return "pong"

    def add(self, n):
        self.value += n
        return self.value


@yr.instance
class AsyncAdd:
    def __init__(self):
        self.arrived = 0
        self.both_in = asyncio.Event()

    async def ping(self):
        return "pong"

    async def meet(self):
        """Return once two calls are awaiting in here at the same time: they run concurrently
        on the instance's event loop (one that ran alone would time out after 30 s)."""
        self.arrived += 1
        if self.arrived == 2:
            self.both_in.set()
        await asyncio.wait_for(self.both_in.wait(), 30)
        return 1

    async def get(self):
        await asyncio.sleep(2)
        return 1


@yr.invoke
def delayed_output(x):
    time.sleep(1)
    return x


@yr.invoke
def caller(instance, x):
    return yr.get(instance.add.invoke(x), T)


@yr.invoke
def add_100(counter):
    return [counter.add.invoke() for _ in range(100)]


@yr.invoke
def use_static_and_class(c):
    return yr.get(c.add.invoke(), T) + yr.get(c.sa.invoke(10), T) + yr.get(c.ca.invoke(10), T)


@yr.invoke
def identity(x):
    return x


@yr.invoke
def add_via_stored_handle(refs):
    stored = yr.get(refs[0], T)
    return yr.get(stored["handle"].add.invoke(), T)


@yr.invoke
def make_counter(start):
    c = Counter.invoke(start)
    return c


# --------------------------------------------------------------------------- nested blocking chain (1 CPU)


def test_chain_of_three_instances_on_one_cpu(one_cpu):
    c = Link.invoke()
    b = Link.invoke(c)
    a = Link.invoke(b)
    assert yr.get(a.ping.invoke(0), T) == 3
    assert yr.get([a.ping.invoke(i) for i in range(5)], T) == [3, 4, 5, 6, 7]
    assert yr.get(b.ping.invoke(10), T) == 12


# --------------------------------------------------------------------------- terminate and kill


def test_terminate_sync_and_calls_pending_at_terminate_fail(embedded, tmp_path, wait_until):
    c = Counter.invoke()
    started = tmp_path / "started"
    pending = c.sleep_then_add.invoke(20, str(started))
    queued = c.add.invoke(1)  # queued behind the sleeping call (concurrency 1)
    wait_until(started.exists, T, "the long call to start")
    t0 = time.monotonic()
    c.terminate(is_sync=True)
    for ref in (pending, queued):
        with pytest.raises(RuntimeError):
            yr.get(ref, T)
    assert time.monotonic() - t0 < 10, "pending calls did not fail promptly at terminate"
    assert c.is_activate() is False


def test_kill_instance_by_id(embedded):
    c = Counter.invoke()
    assert yr.get(c.add.invoke(), T) == 1
    copy = yr.get(identity.invoke([c]), T)[0]  # another handle, unpickled from a task
    assert copy is not c and copy.instance_id == c.instance_id
    yr.kill_instance(c.instance_id)  # synchronous: the instance has ended
    iid = c.instance_id
    assert not any(i["instance_id"] == iid for i in live_instances(cluster_info()))
    for handle in (c, copy):
        with pytest.raises(RuntimeError):
            yr.get(handle.add.invoke(), T)
    with pytest.raises(TypeError):
        yr.kill_instance(123)


# --------------------------------------------------------------------------- concurrency


def test_concurrency_n_runs_calls_in_parallel(embedded):
    s = Sleeper.invoke()
    assert yr.get(s.ping.invoke(), T) == "pong"
    # each call waits at a barrier for the other three: all four run at once, on 4 threads
    idents = yr.get([s.meet.invoke() for _ in range(4)], T)
    assert len(set(idents)) == 4


def test_concurrency_one_runs_calls_one_at_a_time(embedded):
    c = Counter.invoke()
    assert yr.get(c.get.invoke(), T) == 0
    t0 = time.monotonic()
    assert yr.get([c.sleep_then_add.invoke(0.4) for _ in range(3)], T) == [1, 2, 3]
    assert time.monotonic() - t0 >= 1.2


# --------------------------------------------------------------------------- errors and call checks


def test_get_if_exists_requires_a_name(embedded):
    with pytest.raises(ValueError, match="get_if_exists"):
        Counter.options(yr.InvokeOptions(get_if_exists=True)).invoke()


def test_method_exception_does_not_kill_the_instance(embedded):
    c = Counter.invoke()
    assert yr.get(c.add.invoke(5), T) == 5
    with pytest.raises(MethodError) as info:
        yr.get(c.fail.invoke("method boom"), T)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, yr.YRInvokeError)
    assert "method boom" in str(info.value)
    assert "Traceback" in str(info.value)
    assert yr.get(c.add.invoke(1), T) == 6  # state kept


def test_method_return_nums(embedded):
    c = Counter.invoke()
    assert c.set_value.invoke(41) is None
    assert yr.get(c.get.invoke(), T) == 41  # the return_nums=0 call ran, in order
    refs = c.pair.invoke("a", "b")
    assert isinstance(refs, list) and len(refs) == 2
    assert yr.get(refs, T) == ["a", "b"]
    x, y, z = c.triple.invoke()
    assert yr.get([x, y, z], T) == [41, 42, 43]


def test_unknown_method_is_attribute_error(embedded):
    c = Counter.invoke()
    with pytest.raises(AttributeError, match="Counter.*no attribute 'nope'"):
        c.nope
    with pytest.raises(AttributeError):
        c.nope.invoke()
    assert not hasattr(c, "also_missing")
    assert yr.get(c.add.invoke(), T) == 1


def test_signature_checked_at_call_time(embedded):
    c = Counter.invoke()
    with pytest.raises(TypeError):
        c.add.invoke(1, 2, 3)
    with pytest.raises(TypeError):
        c.add.invoke(m=1)
    with pytest.raises(TypeError):
        c.set_value.invoke()
    with pytest.raises(TypeError):
        Counter.invoke(1, 2, 3)
    with pytest.raises(TypeError):
        Counter.invoke(bogus=1)
    s = StaticCounter.invoke()
    with pytest.raises(TypeError):
        s.sa.invoke()
    with pytest.raises(TypeError):
        s.ca.invoke(1, 2)
    with pytest.raises(TypeError):
        FailingInit.invoke()
    # the bad calls were not sent: the instances saw only the good ones
    assert yr.get(c.add.invoke(2), T) == 2
    assert yr.get(s.add.invoke(), T) == 1


def test_direct_calls_raise(embedded):
    with pytest.raises(RuntimeError):
        Counter()
    c = Counter.invoke()
    with pytest.raises(RuntimeError):
        c.add()


# --------------------------------------------------------------------------- handles travel


def test_handle_passed_to_another_instance(embedded):
    counter = Counter.invoke()
    relay = Relay.invoke()
    assert yr.get(relay.call_add.invoke(counter, 5), T) == 5
    assert yr.get(relay.store.invoke(counter), T) is None
    assert yr.get(relay.add_via_stored.invoke(2), T) == 7
    # the handle stored in the relay keeps working after the driver calls too
    assert yr.get(counter.add.invoke(1), T) == 8
    assert yr.get(relay.add_via_stored.invoke(1), T) == 9
    # and one given to the constructor
    relay2 = Relay.invoke(counter)
    assert yr.get(relay2.add_via_stored.invoke(1), T) == 10


def test_handle_returned_from_task_is_usable(embedded):
    h = yr.get(make_counter.invoke(40), T)
    assert isinstance(h, yr.InstanceProxy)
    assert yr.get(h.add.invoke(2), T) == 42
    assert yr.get(h.add.invoke(1), T) == 43


def test_handle_in_a_put_object(embedded):
    c = Counter.invoke()
    ref = yr.put({"handle": c})
    assert yr.get(add_via_stored_handle.invoke([ref]), T) == 1
    assert yr.get(c.add.invoke(), T) == 2
    assert yr.get(add_via_stored_handle.invoke([ref]), T) == 3


# --------------------------------------------------------------------------- resources (SPEC §6)


def test_cpu_bound_instances_run_in_parallel(embedded):
    a, b = Burner.invoke(), Burner.invoke()
    pid_a, pid_b = yr.get([a.pid.invoke(), b.pid.invoke()], T)
    assert pid_a != pid_b, "two 1-CPU instances share one worker process (one GIL)"
    # Both calls burn CPU at the same time, each in its own process: their busy intervals
    # overlap.  (How fast that is on a loaded machine is a benchmark figure, not a test.)
    spans = yr.get([a.burn_span.invoke(0.5), b.burn_span.invoke(0.5)], T)
    assert [p for p, _, _ in spans] == [pid_a, pid_b]
    assert max(s for _, s, _ in spans) < min(e for _, _, e in spans), spans


def test_instance_holds_its_resources_for_its_life(embedded):
    wait_until(lambda: all(w["held"].get("CPU", 0) == 0 for w in cluster_info()["workers"].values()),
             T, "an idle cluster")
    c = Counter.options(yr.InvokeOptions(cpu=700, memory=300)).invoke()
    assert yr.get(c.add.invoke(), T) == 1
    info = cluster_info()
    rec = next(i for i in info["instances"] if i["instance_id"] == c.instance_id)
    assert rec["resources"]["CPU"] == 700 and rec["resources"]["Memory"] == 300
    # Resources are held on the node (docs/nodes.md) of the worker process hosting it.
    held = next(n for n in info["workers"].values() if rec["worker"] in n["processes"])["held"]
    assert held["CPU"] == 700 and held["Memory"] == 300
    iid = c.instance_id
    c.terminate()
    wait_until(lambda: all(w["held"].get("CPU", 0) == 0 for w in cluster_info()["workers"].values()),
             T, "the terminated instance's CPU to come back")
    assert not any(i["instance_id"] == iid for i in live_instances(cluster_info()))


def test_request_that_can_never_fit_fails_at_get(embedded):
    huge = Counter.options(yr.InvokeOptions(cpu=64000, schedule_timeout_ms=1000))
    t0 = time.monotonic()
    h = huge.invoke()  # returns at once
    assert time.monotonic() - t0 < 1
    with pytest.raises(yr.YRRuntimeError) as info:
        yr.get(h.add.invoke(), T)
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert "CPU" in msg and "64000" in msg, msg
    assert elapsed < 15, f"the unschedulable creation took {elapsed:.1f} s to fail"
    # later calls on that handle fail the same way
    with pytest.raises(yr.YRRuntimeError, match="CPU"):
        yr.get(h.get.invoke(), T)


def test_request_blocked_by_instances_names_the_holders(embedded):
    big = Counter.options(yr.InvokeOptions(cpu=1000))
    a, b = big.invoke(), big.invoke()
    assert yr.get([a.add.invoke(), b.add.invoke()], T) == [1, 1]
    third = Counter.options(yr.InvokeOptions(cpu=1000, schedule_timeout_ms=1000)).invoke()
    with pytest.raises(yr.YRRuntimeError) as info:
        yr.get(third.add.invoke(), T)
    msg = str(info.value)
    assert "CPU" in msg, msg
    assert a.instance_id in msg and b.instance_id in msg, msg


# =========================================================================== core programs:
# on both core cluster kinds (kept after the embedded-only tests: pytest groups a module's
# ``yr_cluster`` tests by kind after the unparametrised ones that precede them)


# --------------------------------------------------------------------------- P9: counter and terminate


def test_p9_counter_and_terminate(yr_cluster):
    c = Counter.invoke()
    a = c.add.invoke(3)
    g = c.get.invoke()
    assert (yr.get(a, T), yr.get(g, T)) == (3, 3)

    c10 = Counter.invoke(10)
    assert yr.get(c10.add.invoke(5), T) == 15
    assert yr.get(c10.get.invoke(), T) == 15

    assert c.is_activate() is True
    assert isinstance(c.instance_id, str) and c.instance_id
    c.terminate()
    assert c.is_activate() is False
    with pytest.raises(RuntimeError, match="terminated"):
        c.add.invoke(1)
    c.terminate()  # a second terminate is a no-op
    assert c.is_activate() is False
    with pytest.raises(RuntimeError, match="terminated"):
        c.get.invoke()
    # the other instance is untouched
    assert yr.get(c10.add.invoke(1), T) == 16


# --------------------------------------------------------------------------- P10: ordering


def test_p10_ordering_driver_then_task(yr_cluster):
    counter = Counter.invoke()
    assert yr.get([counter.add.invoke() for _ in range(100)], T) == list(range(1, 101))
    refs = yr.get(add_100.invoke(counter), T)
    assert yr.get(refs, T) == list(range(101, 201))


def test_p10_thousand_calls_in_order(yr_cluster):
    counter = Counter.invoke()
    assert yr.get([counter.add.invoke() for _ in range(1000)], T) == list(range(1, 1001))


# --------------------------------------------------------------------------- P11: submitters and concurrency


def test_p11_multi_submitter_ordering(yr_cluster):
    instance = Counter.invoke()
    assert yr.get(instance.get.invoke(), T) == 0  # created before the timed part
    result0 = caller.invoke(instance, delayed_output.invoke(1))
    result1 = instance.add.invoke(2)
    result2 = instance.add.invoke(3)
    assert yr.get([result0, result1, result2], T) == [6, 2, 5]


def test_p11_concurrency_two(yr_cluster):
    adder = ConcurrentAdder.invoke()
    assert yr.get(adder.ping.invoke(), T) == "pong"
    r1, r2 = adder.add.invoke(1), adder.add.invoke(2)
    assert tuple(yr.get([r1, r2], T)) in [(1, 3), (3, 2)]


@yr.instance(invoke_options=yr.InvokeOptions(concurrency=2))
class SlowInitSet:
    def __init__(self):
        time.sleep(0.5)  # the first calls reach the worker while __init__ still runs
        self.seen = set()

    def add(self, x):
        self.seen.add(x)
        return len(self.seen)


def test_concurrency_two_calls_wait_for_init(yr_cluster):
    """A named instance with concurrency=2 (openYuanrong's named-instance system test): its
    first calls, sent at once, run only after ``__init__`` finished."""
    name = uniq("slow-init-")
    ins = SlowInitSet.options(yr.InvokeOptions(name=name, concurrency=2)).invoke()
    try:
        assert sorted(yr.get([ins.add.invoke(i) for i in range(4)], T)) == [1, 2, 3, 4]
    finally:
        ins.terminate()


# --------------------------------------------------------------------------- P12: handles in tasks, static/class methods


def test_p12_handle_to_task_with_static_and_class_methods(yr_cluster):
    counter = StaticCounter.invoke()
    assert yr.get(counter.add.invoke(), T) == 1
    assert yr.get(use_static_and_class.invoke(counter), T) == 22
    assert yr.get(counter.add.invoke(), T) == 3  # the task's call changed the same instance


def test_p12_methods_through_get_instance(yr_cluster):
    name = uniq("instance-actor-")
    ins = Actor.options(yr.InvokeOptions(name=name)).invoke()
    try:
        assert yr.get(ins.na.invoke("hello"), T) == "hello normal method"
        assert yr.get(ins.ca.invoke("hello"), T) == "hello classmethod method"
        assert yr.get(ins.sa.invoke("hello"), T) == "hello staticmethod method"
        got = yr.get_instance(name)
        assert got.instance_id == ins.instance_id
        assert yr.get(got.na.invoke("hello"), T) == "hello normal method"
        assert yr.get(got.ca.invoke("hello"), T) == "hello classmethod method"
        assert yr.get(got.sa.invoke("hello"), T) == "hello staticmethod method"
    finally:
        ins.terminate()


# --------------------------------------------------------------------------- P13: named instances


def test_p13_named_instances_and_namespaces(yr_cluster):
    name = uniq("actor1-")
    opt = yr.InvokeOptions(name=name)
    first = Counter.options(opt).invoke()
    second = Counter.options(opt).invoke(99)  # binds to the existing one; args ignored
    ns_opt = yr.InvokeOptions(name=name, namespace="ns1")
    ns_first = Counter.options(ns_opt).invoke()
    ns_second = Counter.options(ns_opt).invoke()
    try:
        assert yr.get(first.add.invoke(), T) == 1
        assert yr.get(second.add.invoke(), T) == 2
        assert yr.get(ns_first.add.invoke(), T) == 1  # another namespace: another instance
        assert yr.get(ns_second.add.invoke(), T) == 2
        assert yr.get(first.get.invoke(), T) == 2

        via_lookup = yr.get_instance(name, "ns1")
        assert yr.get(via_lookup.add.invoke(), T) == 3
        assert yr.get(ns_first.get.invoke(), T) == 3
        assert yr.get(yr.get_instance(name).get.invoke(), T) == 2

        assert name in yr.list_named_instances()
        everything = yr.list_named_instances(all_namespaces=True)
        assert {"name": name, "namespace": "ns1"} in everything
        assert {"name": name, "namespace": ""} in everything
        assert yr.list_named_instances().count(name) == 1  # the ns1 one is not listed
    finally:
        first.terminate()
        ns_first.terminate()
    wait_until(lambda: name not in yr.list_named_instances(), T, f"the name {name} to be freed")


def test_p13_get_instance_missing(yr_cluster):
    with pytest.raises(RuntimeError, match="failed to get instance"):
        yr.get_instance("actor_not_exist")
    with pytest.raises(RuntimeError, match="failed to get instance"):
        yr.get_instance("actor_not_exist", "some-namespace", 1)
    with pytest.raises(TypeError):
        yr.get_instance(123)
    with pytest.raises(TypeError):
        yr.get_instance("x", "ns", -1)


def test_p13_get_instance_timeout_while_init_runs(yr_cluster, tmp_path):
    name, ns = uniq("slow-"), "ns"
    gate = tmp_path / "init-may-end"  # __init__ runs until this exists
    h = SlowInit.options(yr.InvokeOptions(name=name, namespace=ns)).invoke(str(gate))
    try:
        # the scheduler knows the name (creation is asynchronous)
        wait_until(lambda: any(i["name"] == name for i in cluster_info()["instances"]), T,
                 f"the named instance {name} to be registered")
        # __init__ runs (not: the creation still waits for a place), as the test's name says
        wait_until(lambda: os.path.exists(f"{gate}.started"), T, "__init__ to start")
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="failed to get instance") as info:
            yr.get_instance(name, ns, 2)
        elapsed = time.monotonic() - t0
        assert isinstance(info.value, RuntimeError)
        assert 1.5 <= elapsed < 4.5, f"get_instance(timeout=2) returned after {elapsed:.2f} s"
        gate.touch()
        # with a long enough timeout it waits for __init__ and returns a working handle
        got = yr.get_instance(name, ns, 30)
        assert yr.get(got.ping.invoke(), T) == "pong"
    finally:
        gate.touch()
        h.terminate()


def test_p13_get_if_exists_creates_once_from_5_threads(yr_cluster, tmp_path):
    path = tmp_path / "creations.txt"
    name = uniq("gie-")
    barrier = threading.Barrier(5)
    shared = CountsCreations.options(yr.InvokeOptions(name=name, get_if_exists=True))

    def create(i):
        barrier.wait()
        if i % 2:  # a shared creator and per-thread creators
            return shared.invoke(str(path))
        return CountsCreations.options(
            yr.InvokeOptions(name=name, get_if_exists=True)).invoke(str(path))

    with ThreadPoolExecutor(5) as pool:
        handles = list(pool.map(create, range(5)))
    try:
        assert sorted(yr.get([h.add.invoke() for h in handles], T)) == [1, 2, 3, 4, 5]
        assert len(path.read_text().splitlines()) == 1, "get_if_exists created more than once"
        # once it exists, get_if_exists just binds to it
        again = shared.invoke(str(path))
        assert yr.get(again.add.invoke(), T) == 6
        assert len(path.read_text().splitlines()) == 1
    finally:
        handles[0].terminate()


# --------------------------------------------------------------------------- P19: async instances


def test_p19_async_methods_run_concurrently(yr_cluster):
    a = AsyncAdd.invoke()
    assert yr.get(a.ping.invoke(), T) == "pong"
    # each call awaits the other's arrival: they can only both return if they overlap
    assert yr.get([a.meet.invoke(), a.meet.invoke()], T) == [1, 1]


def test_p19_await_ref_in_asyncio(yr_cluster):
    a = AsyncAdd.invoke()
    c = Counter.invoke()

    async def main():
        first = await a.get.invoke()
        both = await asyncio.gather(c.add.invoke(1), c.add.invoke(2))
        return first, both

    assert asyncio.run(main()) == (1, [1, 3])


# --------------------------------------------------------------------------- P14 for instances: __init__ errors


def test_init_error_surfaces_at_get_with_its_type(yr_cluster):
    h = FailingInit.invoke("init boom")  # returns at once
    with pytest.raises(InitError) as info:
        yr.get(h.ping.invoke(), T)
    err = info.value
    assert isinstance(err, RuntimeError) and isinstance(err, yr.YRInvokeError)
    assert "init boom" in str(err)
    with pytest.raises(InitError):  # every call reports it
        yr.get(h.ping.invoke(), T)
