"""Instance lifetimes (SPEC §4): owners, fate sharing, detached instances, handle reference
counting, named instances and ``yr.finalize``.

The scheduler's view (``cluster_info()`` of the yr scheduler extension, read through a
``distributed.Client``) is the ground truth: which instances are still there, in what state,
and what each worker's resources are held by.  Waiting on that eventual state uses bounded
polls; nothing here sleeps to order events.  All but the last test run on the embedded
cluster of ``Config(num_cpus=2)``: two worker processes of 1000 millicores each.
"""

from __future__ import annotations

import gc
import os
import time
import uuid

import distributed
import pytest

import yrdask as yr
from conftest import wait_until
from yrdask.runtime.context import current_runtime

pytestmark = pytest.mark.timeout(120)

T = 60  # seconds: explicit yr.get bound, well under the test time-out
RELEASE_S = 10  # bound for the manager to end an instance (it acts ~0.5 s after the trigger)
GRACE_WATCH_S = 1.5  # how long "it stays alive" is watched: three release grace periods

DETACHED = {"lifecycle": "detached"}

_CLUSTER_INFO = lambda dask_scheduler: dask_scheduler.extensions["yr"].cluster_info()  # noqa: E731


# --------------------------------------------------------------------------- observing the scheduler


class SchedulerView:
    """Read the yr extension's state on a scheduler."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.client = distributed.Client(address, set_as_default=False, timeout=30)

    def close(self) -> None:
        self.client.close()

    def info(self) -> dict:
        return self.client.run_on_scheduler(_CLUSTER_INFO)

    def live(self) -> dict[str, dict]:
        """Instances not ended, by id."""
        return {i["instance_id"]: i for i in self.info()["instances"] if i["state"] != "DEAD"}

    def held_cpu(self) -> float:
        return sum(w["held"].get("CPU", 0.0) for w in self.info()["workers"].values())

    def wait(self, predicate, what: str, timeout: float = RELEASE_S):
        return wait_until(predicate, timeout, lambda: (
            f"{what}; scheduler state: "
            f"held={ {a: w['held'] for a, w in self.info()['workers'].items()} } "
            f"instances={self.live()}"))

    def wait_gone(self, *iids: str, timeout: float = RELEASE_S) -> None:
        self.wait(lambda: not set(iids) & set(self.live()), f"instances {iids} to end", timeout)

    def wait_idle(self, timeout: float = RELEASE_S) -> None:
        """No live non-detached instance and no CPU held anywhere (idle leases go back in 1 s)."""
        self.wait(lambda: not [i for i in self.live().values() if not i["detached"]]
                  and self.held_cpu() == 0, "an idle cluster", timeout)

    def watch_alive(self, iid: str, seconds: float = GRACE_WATCH_S) -> None:
        """Assert ``iid`` becomes ALIVE without ending (its creation may still run: PENDING is
        not ended), then stays alive for ``seconds`` (bounded watch of a negative)."""
        def created() -> bool:
            rec = self.live().get(iid)
            assert rec is not None, f"instance {iid} ended while it should be alive"
            return rec["state"] == "ALIVE"

        self.wait(created, f"instance {iid} to be created", T)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            rec = self.live().get(iid)
            assert rec is not None and rec["state"] == "ALIVE", (
                f"instance {iid} ended while it should be alive: {rec}")
            time.sleep(0.1)


def scheduler_address() -> str:
    return current_runtime().info.scheduler_address


def uniq(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


@pytest.fixture
def embedded(cluster, request):
    """The embedded cluster, idle at the start; what a test leaves behind is killed after it.

    Leftovers fail the teardown unless the test itself failed (its traceback keeps its
    handles alive).
    """
    cluster(kind="embedded", num_cpus=2)
    view = SchedulerView(scheduler_address())
    failed_before = request.session.testsfailed
    try:
        view.wait_idle()
        yield view
        gc.collect()
        try:
            view.wait_idle()
            left = []
        except AssertionError:
            left = [i for i in view.live().values() if not i["detached"]]
            for i in left:
                yr.kill_instance(i["instance_id"])
        if request.session.testsfailed == failed_before:
            assert not left, f"instances left after {request.node.name}: {left}"
    finally:
        view.close()


# --------------------------------------------------------------------------- classes and tasks


@yr.instance
class Leaf:
    def ping(self):
        return "pong"

    def pid(self):
        return os.getpid()


@yr.instance(invoke_options=yr.InvokeOptions(cpu=1000))
class Big:
    def ping(self):
        return "pong"


@yr.instance
class Supervisor:
    def __init__(self):
        self.kids = []

    def spawn(self, n):
        kids = [Leaf.invoke() for _ in range(n)]
        assert yr.get([k.ping.invoke() for k in kids], T) == ["pong"] * n
        self.kids += kids
        return [k.instance_id for k in kids]

    def spawn_detached(self, name):
        kid = Leaf.options(yr.InvokeOptions(name=name, custom_extensions=dict(DETACHED))).invoke()
        assert yr.get(kid.ping.invoke(), T) == "pong"
        self.kids.append(kid)
        return kid.instance_id

    def spawn_and_forget(self):
        """Create an instance and keep no handle to it."""
        kid = Leaf.invoke()
        assert yr.get(kid.ping.invoke(), T) == "pong"
        return kid.instance_id


@yr.invoke
def hold_until(handle, started_path, release_path):
    """Hold only this handle until the driver says so, then use it."""
    with open(started_path, "w") as f:
        f.write(handle.instance_id)
    deadline = time.monotonic() + 60
    while not os.path.exists(release_path):
        if time.monotonic() > deadline:
            raise TimeoutError("the driver never released the task")
        time.sleep(0.02)
    return yr.get(handle.ping.invoke(), T)


@yr.invoke
def make_leaf():
    leaf = Leaf.invoke()
    yr.get(leaf.ping.invoke(), T)
    return leaf


def wait_file(path, timeout=T):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} was not written in {timeout} s"
        time.sleep(0.02)


# --------------------------------------------------------------------------- owners and fate sharing


def test_terminating_an_owner_ends_its_instances(embedded):
    sup = Supervisor.invoke()
    kid_ids = yr.get(sup.spawn.invoke(2), T)
    # A kid answers its caller as soon as it is built; its worker tells the scheduler on another
    # stream, so the scheduler may still say PENDING for a moment.
    embedded.wait(lambda: all(embedded.live()[k]["state"] == "ALIVE" for k in kid_ids),
                  "the kids to be ALIVE at the scheduler")
    live = embedded.live()
    for kid in kid_ids:
        assert live[kid]["owner"] == sup.instance_id  # instances made by an instance belong to it
    assert live[sup.instance_id]["owner"] == current_runtime().job_id
    # 3 instances of 500 millicores (the supervisor lent its CPU while blocked in yr.get, and
    # takes it back through a separate message: wait for it)
    embedded.wait(lambda: embedded.held_cpu() == 1500, "3 x 500 millicores held")
    sup.terminate()
    embedded.wait_gone(sup.instance_id, *kid_ids)
    embedded.wait(lambda: embedded.held_cpu() == 0, "the CPU of the supervisor tree to come back")


def test_kill_instance_ends_the_tree_too(embedded):
    sup = Supervisor.invoke()
    kid_ids = yr.get(sup.spawn.invoke(2), T)
    yr.kill_instance(sup.instance_id)  # synchronous
    embedded.wait_gone(sup.instance_id, *kid_ids)
    embedded.wait(lambda: embedded.held_cpu() == 0, "the CPU of the supervisor tree to come back")


def test_detached_child_survives_its_terminated_owner(embedded):
    name = uniq("detached-kid-")
    sup = Supervisor.invoke()
    kid_ids = yr.get(sup.spawn.invoke(1), T)
    det_id = yr.get(sup.spawn_detached.invoke(name), T)
    assert embedded.live()[det_id]["detached"] is True
    sup.terminate()
    embedded.wait_gone(sup.instance_id, *kid_ids)
    try:
        embedded.wait(lambda: embedded.held_cpu() == 500, "only the detached child to hold CPU")
        assert embedded.live()[det_id]["state"] == "ALIVE"
        det = yr.get_instance(name)
        assert yr.get(det.ping.invoke(), T) == "pong"
    finally:
        yr.kill_instance(det_id)
    embedded.wait_gone(det_id)
    embedded.wait(lambda: embedded.held_cpu() == 0, "the detached child's CPU to come back")


# --------------------------------------------------------------------------- handle reference counting


def test_dropping_all_handles_frees_the_resources(embedded):
    a, b = Big.invoke(), Big.invoke()  # the cluster fits exactly two
    assert yr.get([a.ping.invoke(), b.ping.invoke()], T) == ["pong", "pong"]
    first_ids = [a.instance_id, b.instance_id]
    embedded.wait(lambda: embedded.held_cpu() == 2000, "2 x 1000 millicores held")
    del a, b
    gc.collect()
    quick = Big.options(yr.InvokeOptions(cpu=1000, schedule_timeout_ms=5000))
    c, d = quick.invoke(), quick.invoke()
    assert yr.get([c.ping.invoke(), d.ping.invoke()], T) == ["pong", "pong"]
    assert not set(first_ids) & set(embedded.live())


def test_instance_made_by_an_instance_without_handles_ends(embedded):
    sup = Supervisor.invoke()
    kid = yr.get(sup.spawn_and_forget.invoke(), T)
    embedded.wait_gone(kid)
    assert sup.instance_id in embedded.live()


def test_handle_held_only_by_a_task_keeps_the_instance(embedded, tmp_path):
    started, release = str(tmp_path / "started"), str(tmp_path / "release")
    leaf = Leaf.invoke()
    assert yr.get(leaf.ping.invoke(), T) == "pong"
    iid = leaf.instance_id
    ref = hold_until.invoke(leaf, started, release)
    wait_file(started)  # the task has unpickled its handle
    del leaf
    gc.collect()
    try:
        embedded.watch_alive(iid)  # only the running task holds a handle now
    finally:  # a failure must not leave the task holding its CPU for the next tests
        with open(release, "w") as f:
            f.write("go")
    assert yr.get(ref, T) == "pong"
    embedded.wait_gone(iid)  # the task finished: no handle is left anywhere


def test_handle_in_transit_to_a_task_keeps_the_instance(embedded, tmp_path):
    started, release = str(tmp_path / "started"), str(tmp_path / "release")
    iid_holder = []

    def submit():
        leaf = Leaf.invoke()
        iid_holder.append(leaf.instance_id)
        return hold_until.invoke(leaf, started, release)  # the driver's handle dies here

    ref = submit()
    gc.collect()
    wait_file(started)
    try:
        embedded.watch_alive(iid_holder[0])
    finally:  # a failure must not leave the task holding its CPU for the next tests
        with open(release, "w") as f:
            f.write("go")
    assert yr.get(ref, T) == "pong"
    embedded.wait_gone(iid_holder[0])


def test_handle_returned_from_a_task_keeps_the_instance(embedded):
    leaf = yr.get(make_leaf.invoke(), T)  # the task's own handle is gone by now
    iid = leaf.instance_id
    embedded.watch_alive(iid)
    assert yr.get(leaf.ping.invoke(), T) == "pong"
    del leaf
    gc.collect()
    embedded.wait_gone(iid)


def test_pending_call_keeps_the_instance(embedded):
    @yr.instance
    class Slow:
        def nap(self, seconds):
            time.sleep(seconds)
            return "rested"

    ref = Slow.invoke().nap.invoke(2)  # no handle is kept, only the call
    assert yr.get(ref, T) == "rested"
    embedded.wait_idle()


def test_handles_of_a_failed_creation_do_not_pin_other_instances(embedded):
    """A caught error of an unschedulable creation must not keep other handles alive."""

    def scenario():
        keep = Leaf.invoke()
        assert yr.get(keep.ping.invoke(), T) == "pong"
        never = Leaf.options(yr.InvokeOptions(cpu=64000, schedule_timeout_ms=500)).invoke()
        with pytest.raises(yr.YRRuntimeError):
            yr.get(never.ping.invoke(), T)
        return keep.instance_id

    iid = scenario()
    gc.collect()
    embedded.wait_gone(iid)


@pytest.mark.parametrize("kind", ["named", "detached"])
def test_named_and_detached_instances_are_not_reference_counted(embedded, kind):
    name = uniq("named-")
    opts = (yr.InvokeOptions(name=name) if kind == "named"
            else yr.InvokeOptions(custom_extensions=dict(DETACHED)))
    h = Leaf.options(opts).invoke()
    assert yr.get(h.ping.invoke(), T) == "pong"
    iid = h.instance_id
    del h
    gc.collect()
    try:
        embedded.watch_alive(iid)
        if kind == "named":  # still reachable by name, and dropping that handle too is fine
            again = yr.get_instance(name)
            assert yr.get(again.ping.invoke(), T) == "pong"
            del again
            gc.collect()
            embedded.watch_alive(iid)
    finally:
        yr.kill_instance(iid)
    embedded.wait_gone(iid)


# --------------------------------------------------------------------------- yr.finalize


def test_finalize_ends_the_jobs_instances_but_not_detached_ones(cluster):
    """On a cli cluster the scheduler outlives the driver: look at it across two jobs."""
    cli = cluster.cli_processes()  # no runtime attached
    view = SchedulerView(cli.address)
    det_name = uniq("survivor-")
    small = yr.InvokeOptions(cpu=300)
    try:
        info = yr.init(yr.Config(server_address=cli.address))
        old_job = info.job_id
        a = Leaf.options(small).invoke()
        b = Leaf.options(small).invoke()
        named = Leaf.options(yr.InvokeOptions(cpu=300, name=uniq("job-named-"))).invoke()
        det = Leaf.options(yr.InvokeOptions(cpu=300, name=det_name,
                                            custom_extensions=dict(DETACHED))).invoke()
        det_unnamed = Leaf.options(yr.InvokeOptions(cpu=300,
                                                    custom_extensions=dict(DETACHED))).invoke()
        handles = [a, b, named, det, det_unnamed]
        assert yr.get([h.ping.invoke() for h in handles], T) == ["pong"] * 5
        ended = {a.instance_id, b.instance_id, named.instance_id}
        kept = {det.instance_id, det_unnamed.instance_id}
        yr.finalize()  # the handles are still referenced here: finalize, not refcounts, ends them

        view.wait(lambda: not ended & set(view.live()), "the job's instances to end")
        assert kept <= set(view.live())
        mine = {i for i, rec in view.live().items() if rec["owner"] == old_job}
        assert mine == kept

        yr.init(yr.Config(server_address=cli.address))  # a new job on the same cluster
        assert kept <= set(view.live())
        survivor = yr.get_instance(det_name)
        assert survivor.instance_id == det.instance_id
        assert yr.get(survivor.ping.invoke(), T) == "pong"
        for iid in kept:
            yr.kill_instance(iid)
        view.wait(lambda: not kept & set(view.live()), "the detached instances to end")
        view.wait(lambda: view.held_cpu() == 0, "all CPU to come back")
    finally:
        if yr.is_initialized():
            yr.finalize()
        view.close()


_CRASHING_DRIVER = """
import sys, time
import yrdask as yr
yr.init(yr.Config(server_address=sys.argv[1]))

@yr.instance(invoke_options=yr.InvokeOptions(cpu=300))
class Held:
    def ping(self):
        return "pong"

handles = [Held.invoke() for _ in range(2)]
assert yr.get([h.ping.invoke() for h in handles], 30) == ["pong", "pong"]
print(" ".join(h.instance_id for h in handles), flush=True)
time.sleep(600)  # killed by the test long before
"""


def test_driver_disconnect_ends_its_instances(cluster, tmp_path):
    """A driver killed without finalize: its job stream closes and its instances end."""
    import signal
    import subprocess
    import sys

    cli = cluster.cli_processes()  # no runtime attached in this process
    view = SchedulerView(cli.address)
    script = tmp_path / "driver.py"
    script.write_text(_CRASHING_DRIVER)
    proc = subprocess.Popen([sys.executable, str(script), cli.address], stdout=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True)
    try:
        iids = set(proc.stdout.readline().split())  # blocks until the instances answered
        assert len(iids) == 2, "the driver did not start its instances"
        assert iids <= set(view.live())
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        view.wait(lambda: not iids & set(view.live()), "the dead driver's instances to end")
        view.wait(lambda: view.held_cpu() == 0, "their CPU to come back")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stdout.close()
        view.close()
