"""Every field of ``yr.InvokeOptions`` and ``yr.Config`` is honoured or rejected (SPEC §7b).

The walk iterates ``dataclasses.fields`` of both classes: a field added without a decision in
:data:`DECISIONS` fails ``test_every_field_has_a_decision``.  A rejected field, set to a value
other than its default, must raise a ``YRValueError`` naming it and saying what to use instead.
An honoured field has a check below that shows its behaviour: on the real embedded cluster of
this module (one ``yr.init`` with every honoured Config field set), or, for the fields that
only matter when a driver connects (TLS), on the code that reads them.  docs/options.md is
the same table for readers.

Some honoured fields are implemented by other engineers' work (env_vars, runtime_env,
isolated, working_dir: isolated processes; resource_group_options, group_name: resource
groups); their checks assert the real behaviour.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import subprocess
import sys
import threading
import time
import uuid
from typing import Any, Callable

import pytest

import yrdask as yr
from yrdask.field_specs import field_default, rejection
from yrdask.options import Config, InvokeOptions
from yrdask.runtime.security import resolve_security

from conftest import wait_until

pytestmark = pytest.mark.timeout(240)

T = 60
SMALL = dict(cpu=100, memory=10)  # fits anywhere, many at once


# --------------------------------------------------------------------------- the table


@dataclasses.dataclass(frozen=True)
class Rejected:
    """Rejected when set: ``sample`` is a well-formed non-default value."""

    sample: Any


@dataclasses.dataclass(frozen=True)
class Honoured:
    """Honoured: ``how`` in a few words; its check is ``CHECKS[(cls, field)]``."""

    how: str


R, H = Rejected, Honoured
DECISIONS: dict[tuple[str, str], Rejected | Honoured] = {
    # -- InvokeOptions
    ("InvokeOptions", "cpu"): H("millicores held while the call runs / the instance lives"),
    ("InvokeOptions", "memory"): H("MB held likewise"),
    ("InvokeOptions", "cpu_limit"): R(1000),
    ("InvokeOptions", "mem_limit"): R(1000),
    ("InvokeOptions", "concurrency"): H("calls of one instance running at once"),
    ("InvokeOptions", "custom_resources"): H("tags a worker must offer"),
    ("InvokeOptions", "custom_extensions"): H('only {"lifecycle": "detached"}'),
    ("InvokeOptions", "pod_labels"): R({"app": "x"}),
    ("InvokeOptions", "labels"): H("instance labels, targets of INSTANCE affinities"),
    ("InvokeOptions", "affinity"): R({"k": "v"}),
    ("InvokeOptions", "device"): R(object()),
    ("InvokeOptions", "max_invoke_latency"): R(100),
    ("InvokeOptions", "min_instances"): R(1),
    ("InvokeOptions", "max_instances"): R(4),
    ("InvokeOptions", "recover_retry_times"): H("instance restarts after its process dies"),
    ("InvokeOptions", "need_order"): H("calls of one caller run in order (concurrency 1)"),
    ("InvokeOptions", "name"): H("named instances"),
    ("InvokeOptions", "namespace"): H("namespace of a named instance"),
    ("InvokeOptions", "schedule_affinities"): H("where calls and instances may / prefer to run"),
    ("InvokeOptions", "is_data_affinity"): H("always on: work goes where large arguments are"),
    ("InvokeOptions", "resource_group_options"): H("runs in a bundle of a resource group"),
    ("InvokeOptions", "function_group_options"): R(object()),
    ("InvokeOptions", "env_vars"): H("own process with these environment variables"),
    ("InvokeOptions", "retry_times"): H("reruns of a task that raised"),
    ("InvokeOptions", "trace_id"): R("trace-1"),
    ("InvokeOptions", "alias_params"): R({"a": "b"}),
    ("InvokeOptions", "runtime_env"): H("env_vars and working_dir, in an own process"),
    ("InvokeOptions", "debug"): R(object()),
    ("InvokeOptions", "preempted_allowed"): R(True),
    ("InvokeOptions", "instance_priority"): R(1),
    ("InvokeOptions", "schedule_timeout_ms"): H("an impossible request fails after it"),
    ("InvokeOptions", "group_name"): H("gang creation with yr.Group"),
    ("InvokeOptions", "idle_timeout"): R(60),
    ("InvokeOptions", "is_delete_remote_tensor"): R(True),
    ("InvokeOptions", "bypass_datasystem"): R(True),
    ("InvokeOptions", "skip_serialize"): R(True),
    ("InvokeOptions", "port_forwardings"): R([8080]),
    ("InvokeOptions", "get_if_exists"): H("binds the existing named instance"),
    ("InvokeOptions", "isolated"): H("the instance runs in its own process"),
    ("InvokeOptions", "light"): H("a light instance, or a process instance"),
    # -- Config
    ("Config", "function_id"): R("sn:cn:yrk:default:function:0-x-y:$latest"),
    ("Config", "cpp_function_id"): R("urn"),
    ("Config", "cpp_auto_function_name"): R("f"),
    ("Config", "function_name"): R("f"),
    ("Config", "server_address"): H("joins that Dask scheduler"),
    ("Config", "ds_address"): R("127.0.0.1:1"),
    ("Config", "is_driver"): R(False),
    ("Config", "log_level"): H("level of the 'yrdask' logger"),
    ("Config", "invoke_timeout"): R(60),
    ("Config", "local_mode"): H("yr's local mode runs on the embedded cluster"),
    ("Config", "code_dir"): R("/code"),
    ("Config", "connection_nums"): R(10),
    ("Config", "recycle_time"): R(10),
    ("Config", "in_cluster"): R(True),
    ("Config", "job_id"): H("the job's id"),
    ("Config", "tls_config"): R(object()),
    ("Config", "auto"): H("embedded cluster (the default without server_address)"),
    ("Config", "deployment_config"): R(object()),
    ("Config", "rt_server_address"): R("127.0.0.1:1"),
    ("Config", "log_dir"): R("/tmp/logs"),
    ("Config", "env_file"): H("KEY=VALUE lines set in the driver's os.environ"),
    ("Config", "log_file_size_max"): R(10),
    ("Config", "log_file_num_max"): R(10),
    ("Config", "log_flush_interval"): R(1),
    ("Config", "logger"): H("yrdask's log records go to it"),
    ("Config", "runtime_id"): R("rt-1"),
    ("Config", "max_task_instance_num"): R(10),
    ("Config", "load_paths"): R(["/code"]),
    ("Config", "rpc_timeout"): R(60),
    ("Config", "enable_mtls"): H("mutual TLS from the *_path fields"),
    ("Config", "enable_tls"): H("mutual TLS from the *_path fields"),
    ("Config", "private_key_path"): H("client key (with enable_tls)"),
    ("Config", "certificate_file_path"): H("client certificate (with enable_tls)"),
    ("Config", "verify_file_path"): H("CA file (with enable_tls)"),
    ("Config", "private_key_paaswd"): R("pw"),
    ("Config", "server_name"): R("scheduler.example"),
    ("Config", "http_ioc_threads_num"): R(8),
    ("Config", "ns"): R("team"),
    ("Config", "tenant_id"): R("t1"),
    ("Config", "auth_token"): R("tok"),
    ("Config", "enable_metrics"): R(False),
    ("Config", "bypass_datasystem"): R(True),
    ("Config", "custom_envs"): R({"LD_LIBRARY_PATH": "/x"}),
    ("Config", "master_addr_list"): R(["127.0.0.1:1"]),
    ("Config", "working_dir"): H("working directory of isolated work"),
    ("Config", "enable_ds_encrypt"): R(True),
    ("Config", "ds_public_key_path"): R("/k"),
    ("Config", "runtime_public_key_path"): R("/k"),
    ("Config", "runtime_private_key_path"): R("/k"),
    ("Config", "num_cpus"): H("size of the embedded cluster"),
    ("Config", "num_gpus"): H("GPUs the embedded cluster's node offers (declared)"),
    ("Config", "resources"): H("node-wide resources of the embedded cluster"),
    ("Config", "object_store_memory"): H("size of the node's shared-memory object store"),
    ("Config", "runtime_env"): R({"env_vars": {"A": "1"}}),
    ("Config", "log_to_driver"): H("prints of tasks and methods reach the driver"),
    ("Config", "dedup_logs"): H("repeated lines from several processes collapse"),
    ("Config", "security"): H("the Dask TLS settings the driver uses"),
}

ALL_FIELDS = [(cls.__name__, f.name) for cls in (InvokeOptions, Config)
              for f in dataclasses.fields(cls)]
CLASSES = {"InvokeOptions": InvokeOptions, "Config": Config}


def _field(cls_name: str, name: str) -> dataclasses.Field:
    return {f.name: f for f in dataclasses.fields(CLASSES[cls_name])}[name]


# --------------------------------------------------------------------------- the walk (no cluster)


@pytest.mark.parametrize("cls_name,name", ALL_FIELDS, ids=[f"{c}.{n}" for c, n in ALL_FIELDS])
def test_every_field_has_a_decision(cls_name, name):
    decision = DECISIONS.get((cls_name, name))
    assert decision is not None, (
        f"{cls_name}.{name} has no decision: honour it (and add a check here and a row in "
        "docs/options.md) or reject it with unsupported(...) in yrdask/options.py")
    rejected_in_code = rejection(_field(cls_name, name)) is not None
    assert rejected_in_code == isinstance(decision, Rejected), (
        f"{cls_name}.{name}: options.py {'rejects' if rejected_in_code else 'accepts'} it, "
        f"the table says {type(decision).__name__}")
    if isinstance(decision, Honoured):
        assert (cls_name, name) in CHECKS, f"{cls_name}.{name} is honoured but has no check"


def test_no_stale_decisions():
    assert set(DECISIONS) <= set(ALL_FIELDS), set(DECISIONS) - set(ALL_FIELDS)


def test_docs_list_every_field():
    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "options.md").read_text()
    missing = [f"{c}.{n}" for c, n in ALL_FIELDS if f"`{n}`" not in text]
    assert not missing, f"docs/options.md does not list {missing}"


REJECTED = [k for k in ALL_FIELDS if isinstance(DECISIONS.get(k), Rejected)]


@pytest.mark.parametrize("cls_name,name", REJECTED, ids=[f"{c}.{n}" for c, n in REJECTED])
def test_rejected_field_names_itself_and_the_alternative(cls_name, name):
    cls, sample = CLASSES[cls_name], DECISIONS[(cls_name, name)].sample
    f = _field(cls_name, name)
    assert sample != field_default(f)
    why, instead = rejection(f)
    # set in the constructor: fails there (or at validate(), for fields of cross-field rules)
    with pytest.raises(yr.YRValueError) as ei:
        cls(**{name: sample}).validate()
    msg = str(ei.value)
    assert f"{cls_name}.{name} is not supported by yrdask" in msg and instead in msg, msg
    # set one by one, yr's habit: validate() (at .options(), the decorators, yr.init) fails
    obj = cls()
    setattr(obj, name, sample)
    with pytest.raises(yr.YRValueError, match=f"{cls_name}.{name} is not supported"):
        obj.validate()
    # the default is fine
    assert cls(**{name: field_default(f)}).validate()


def test_rejection_surfaces_at_use_for_tasks_and_init(cluster):
    cluster.finalize()  # yr.init below must be the first
    f = yr.invoke(lambda: 1)
    opts = yr.InvokeOptions()
    opts.pod_labels = {"app": "x"}
    with pytest.raises(yr.YRValueError, match="InvokeOptions.pod_labels is not supported"):
        f.options(opts)
    conf = yr.Config()
    conf.ds_address = "127.0.0.1:1"
    with pytest.raises(yr.YRValueError, match="Config.ds_address is not supported"):
        yr.init(conf)
    assert not yr.is_initialized()


# --------------------------------------------------------------------------- the cluster


@yr.invoke
def where() -> tuple[int, str]:
    return os.getpid(), yr.get_node_id()


@yr.invoke
def env_of(key: str) -> str | None:
    return os.environ.get(key)


@yr.invoke
def read_relative(path: str) -> str:
    with open(path) as f:
        return f.read()


@yr.invoke
def flaky(marker: str) -> str:
    if not os.path.exists(marker):
        open(marker, "w").close()
        raise RuntimeError("first run fails")
    return "second run"


@yr.invoke
def make_big() -> bytes:
    return b"x" * (2 * 2**20)  # stays on the worker that made it


@yr.invoke
def size_here(data: bytes) -> tuple[int, str]:
    return len(data), yr.get_node_id()


@yr.invoke
def shout(text: str) -> int:
    print(text)
    return os.getpid()


@yr.instance
class Shouter:
    def shout(self, text: str) -> int:
        print(text)
        return os.getpid()


@yr.instance
class Probe:
    def __init__(self) -> None:
        self.seen: list[int] = []
        self.barrier = threading.Barrier(2, timeout=30)

    def where(self) -> tuple[int, str]:
        return os.getpid(), yr.get_node_id()

    def meet(self) -> bool:
        self.barrier.wait()  # passes only if two calls run at once
        return True

    def record(self, i: int) -> None:
        self.seen.append(i)

    def seen_list(self) -> list[int]:
        return self.seen

    def env(self, key: str) -> str | None:
        return os.environ.get(key)

    def read(self, path: str) -> str:
        with open(path) as f:
            return f.read()

    def pid(self) -> int:
        return os.getpid()

    def die_once(self, marker: str) -> str:
        if not os.path.exists(marker):  # a redelivered call finds it and returns
            open(marker, "w").close()
            os._exit(1)
        return "delivered again"

    def child(self, detached: bool) -> Any:
        ext = {"lifecycle": "detached"} if detached else {}
        return Probe.options(yr.InvokeOptions(**SMALL, custom_extensions=ext)).invoke()


class Walk:
    """What the cluster checks share: the init's Config and what it left behind."""

    def __init__(self, tmp: pathlib.Path) -> None:
        self.tmp = tmp
        self.records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = self.records.append  # type: ignore[method-assign]
        self.logger = logging.getLogger(f"walk-{uuid.uuid4().hex[:6]}")
        self.logger.addHandler(handler)
        self.logger.setLevel(logging.DEBUG)
        self.logger.propagate = False
        self.env_key = f"YR_WALK_{uuid.uuid4().hex[:6].upper()}"
        (tmp / "walk.env").write_text(f"# from env_file\nexport {self.env_key}='from file'\n")
        self.workdir = tmp / "jobdir"
        self.workdir.mkdir()
        (self.workdir / "marker.txt").write_text("job working dir")
        self.job_id = f"job-walk-{uuid.uuid4().hex[:6]}"
        self.conf = yr.Config(num_cpus=2, num_gpus=1, resources={"walk_node_tag": 3},
                              auto=True, local_mode=True, job_id=self.job_id,
                              log_level="INFO",
                              logger=self.logger, env_file=str(tmp / "walk.env"),
                              working_dir=str(self.workdir), log_to_driver=True,
                              dedup_logs=True, object_store_memory=STORE_BYTES)
        self.info: Any = None


@pytest.fixture(scope="module")
def walk(cluster, tmp_path_factory):
    cluster.finalize()
    w = Walk(tmp_path_factory.mktemp("walk"))
    w.info = yr.init(w.conf)
    try:
        yield w
    finally:
        yr.finalize()
        os.environ.pop(w.env_key, None)


def held(resource: str) -> float:
    return sum(n["capacity"].get(resource, 0) - n["allocatable"].get(resource, 0)
               for n in yr.resources())


def check_cpu(w: Walk) -> None:
    before = held("CPU")
    h = Probe.options(yr.InvokeOptions(cpu=700, memory=10)).invoke()
    yr.get(h.where.invoke(), T)
    assert held("CPU") - before == pytest.approx(700)
    h.terminate()


def check_memory(w: Walk) -> None:
    before = held("Memory")
    h = Probe.options(yr.InvokeOptions(cpu=100, memory=321)).invoke()
    yr.get(h.where.invoke(), T)
    assert held("Memory") - before == pytest.approx(321)
    h.terminate()


def check_concurrency(w: Walk) -> None:
    h = Probe.options(yr.InvokeOptions(**SMALL, concurrency=2)).invoke()
    assert yr.get([h.meet.invoke(), h.meet.invoke()], T) == [True, True]
    h.terminate()


def check_custom_resources(w: Walk) -> None:
    opts = yr.InvokeOptions(**SMALL, custom_resources={"walk_tag": 1}, schedule_timeout_ms=300)
    with pytest.raises(yr.ScheduleError, match="walk_tag"):
        yr.get(where.options(opts).invoke(), T)


def check_custom_extensions(w: Walk) -> None:
    parent = Probe.options(yr.InvokeOptions(**SMALL)).invoke()
    kept = yr.get(parent.child.invoke(True), T)
    gone = yr.get(parent.child.invoke(False), T)
    yr.get([kept.where.invoke(), gone.where.invoke()], T)
    parent.terminate()  # its non-detached child ends with it, the detached one stays

    def child_ended() -> bool:
        try:
            yr.get(gone.where.invoke(), 10)
            return False
        except yr.YRError:
            return True

    wait_until(child_ended, T, "the non-detached child to end with its creator")
    assert yr.get(kept.where.invoke(), T)
    kept.terminate()


def node_affinity(kind: Any, key: str, values: list[str]) -> list:
    return [yr.Affinity(kind, yr.AffinityType.REQUIRED,
                        [yr.LabelOperator(yr.OperatorType.LABEL_IN, key, values)])]


def check_labels(w: Walk) -> None:
    tag = uuid.uuid4().hex[:6]
    h = Probe.options(yr.InvokeOptions(**SMALL, labels=[f"walk:{tag}"])).invoke()
    node = yr.get(h.where.invoke(), T)[1]
    near = yr.InvokeOptions(**SMALL, schedule_affinities=node_affinity(
        yr.AffinityKind.INSTANCE, "walk", [tag]))
    assert {n for _, n in yr.get([where.options(near).invoke() for _ in range(4)], T)} == {node}
    h.terminate()


def check_schedule_affinities(w: Walk) -> None:
    nodes = sorted(n["id"] for n in yr.resources())
    target = nodes[-1]
    opts = yr.InvokeOptions(**SMALL, schedule_affinities=node_affinity(
        yr.AffinityKind.RESOURCE, "NODE_ID", [target]))
    assert {n for _, n in yr.get([where.options(opts).invoke() for _ in range(4)], T)} == {target}


def check_recover_retry_times(w: Walk) -> None:
    h = Probe.options(yr.InvokeOptions(**SMALL, recover_retry_times=1)).invoke()
    pid = yr.get(h.where.invoke(), T)[0]
    marker = str(w.tmp / f"die-{uuid.uuid4().hex[:6]}")
    assert yr.get(h.die_once.invoke(marker), T) == "delivered again"
    assert yr.get(h.where.invoke(), T)[0] != pid  # restarted in a new process
    h.terminate()


def check_need_order(w: Walk) -> None:
    h = Probe.options(yr.InvokeOptions(**SMALL, need_order=True)).invoke()
    for i in range(30):
        h.record.invoke(i)
    assert yr.get(h.seen_list.invoke(), T) == list(range(30))
    h.terminate()


def check_name(w: Walk) -> None:
    name = f"walk-{uuid.uuid4().hex[:6]}"
    h = Probe.options(yr.InvokeOptions(**SMALL, name=name)).invoke()
    assert yr.get_instance(name, timeout=T).instance_id == h.instance_id
    h.terminate()


def check_namespace(w: Walk) -> None:
    name = f"walk-{uuid.uuid4().hex[:6]}"
    a = Probe.options(yr.InvokeOptions(**SMALL, name=name, namespace="ns-a")).invoke()
    b = Probe.options(yr.InvokeOptions(**SMALL, name=name, namespace="ns-b")).invoke()
    assert a.instance_id != b.instance_id
    assert yr.get_instance(name, "ns-a", timeout=T).instance_id == a.instance_id
    assert yr.get_instance(name, "ns-b", timeout=T).instance_id == b.instance_id
    a.terminate()
    b.terminate()


def check_get_if_exists(w: Walk) -> None:
    name = f"walk-{uuid.uuid4().hex[:6]}"
    opts = yr.InvokeOptions(**SMALL, name=name, get_if_exists=True)
    first = Probe.options(opts).invoke()
    yr.get(first.where.invoke(), T)
    assert Probe.options(opts).invoke().instance_id == first.instance_id
    first.terminate()


def check_is_data_affinity(w: Walk) -> None:
    big = make_big.options(yr.InvokeOptions(**SMALL)).invoke()
    yr.wait([big], timeout=T)
    keeper = yr.get(where.options(yr.InvokeOptions(**SMALL)).invoke(), T)  # any node
    opts = yr.InvokeOptions(**SMALL, is_data_affinity=True)
    got = yr.get([size_here.options(opts).invoke(big) for _ in range(3)], T)
    assert all(n == 2 * 2**20 for n, _ in got)
    del keeper
    # the value stayed on the worker that made it; every consumer ran there
    assert len({node for _, node in got}) == 1


def check_retry_times(w: Walk) -> None:
    marker = str(w.tmp / f"flaky-{uuid.uuid4().hex[:6]}")
    assert yr.get(flaky.options(yr.InvokeOptions(**SMALL, retry_times=1)).invoke(marker), T) \
        == "second run"


def check_schedule_timeout_ms(w: Walk) -> None:
    opts = yr.InvokeOptions(cpu=10**7, memory=10, schedule_timeout_ms=300)
    t0 = time.monotonic()
    with pytest.raises(yr.ScheduleError):
        yr.get(where.options(opts).invoke(), T)
    assert time.monotonic() - t0 < 20


def check_env_vars(w: Walk) -> None:
    opts = yr.InvokeOptions(**SMALL, env_vars={"YR_WALK_VAR": "on"})
    assert yr.get(env_of.options(opts).invoke("YR_WALK_VAR"), T) == "on"
    h = Probe.options(opts).invoke()
    assert yr.get(h.env.invoke("YR_WALK_VAR"), T) == "on"
    h.terminate()


def check_runtime_env(w: Walk) -> None:
    d = w.tmp / f"renv-{uuid.uuid4().hex[:6]}"
    d.mkdir()
    (d / "marker.txt").write_text("from runtime_env")
    opts = yr.InvokeOptions(**SMALL, runtime_env={"env_vars": {"YR_WALK_RENV": "yes"},
                                                  "working_dir": str(d)})
    assert yr.get(env_of.options(opts).invoke("YR_WALK_RENV"), T) == "yes"
    assert yr.get(read_relative.options(opts).invoke("marker.txt"), T) == "from runtime_env"


def check_isolated(w: Walk) -> None:
    h = Probe.options(yr.InvokeOptions(**SMALL, isolated=True)).invoke()
    plain = Probe.options(yr.InvokeOptions(**SMALL)).invoke()
    worker_pids = {yr.get(plain.where.invoke(), T)[0]}
    worker_pids |= {p for p, _ in yr.get([where.options(
        yr.InvokeOptions(**SMALL)).invoke() for _ in range(4)], T)}
    assert yr.get(h.pid.invoke(), T) not in worker_pids  # its own process
    h.terminate()
    plain.terminate()


def check_light(w: Walk) -> None:
    import dask

    light = [Probe.options(yr.InvokeOptions(**SMALL, light=True)).invoke() for _ in range(3)]
    own = Probe.options(yr.InvokeOptions(**SMALL, light=False)).invoke()
    with dask.config.set({"yrdask.instances.light": False}):  # the job's default
        by_default = Probe.options(yr.InvokeOptions(**SMALL)).invoke()
    pids = yr.get([h.pid.invoke() for h in (*light, own, by_default)], T)
    assert len(set(pids[:3])) < 3  # light: worker processes, shared (two workers)
    assert len(set(pids[3:])) == 2 and not set(pids[3:]) & set(pids[:3])  # their own
    with pytest.raises(yr.YRValueError, match="light must not be True with env_vars"):
        yr.InvokeOptions(light=True, env_vars={"A": "1"}).validate()
    for h in (*light, own, by_default):
        h.terminate()


def check_working_dir(w: Walk) -> None:
    h = Probe.options(yr.InvokeOptions(**SMALL, isolated=True)).invoke()
    assert yr.get(h.read.invoke("marker.txt"), T) == "job working dir"
    h.terminate()


def check_resource_group_options(w: Walk) -> None:
    rg = yr.create_resource_group([{"CPU": 300, "Memory": 20}], name=f"walk-{uuid.uuid4().hex[:6]}")
    rg.wait(T)
    inside = yr.InvokeOptions(cpu=300, memory=20,
                              resource_group_options=yr.ResourceGroupOptions(
                                  rg.resource_group_name, 0))
    assert yr.get(where.options(inside).invoke(), T)
    too_big = yr.InvokeOptions(cpu=600, memory=20, schedule_timeout_ms=300,
                               resource_group_options=yr.ResourceGroupOptions(
                                   rg.resource_group_name, 0))
    with pytest.raises(yr.YRError):  # more than its bundle holds
        yr.get(where.options(too_big).invoke(), T)
    yr.remove_resource_group(rg)


def check_group_name(w: Walk) -> None:
    name = f"walk-{uuid.uuid4().hex[:6]}"
    opts = yr.InvokeOptions(**SMALL, group_name=name)
    hs = [Probe.options(opts).invoke() for _ in range(2)]  # held until the group is invoked
    group = yr.Group(name)
    group.invoke()
    assert len(yr.get([h.where.invoke() for h in hs], T)) == 2
    group.terminate()


# -- Config


_JOINER = """
import sys, yrdask as yr
info = yr.init(yr.Config(server_address=sys.argv[1]))
f = yr.invoke(lambda: 6 * 7)
print(info.scheduler_address, yr.get(f.invoke(), 60))
yr.finalize()
"""


def check_server_address(w: Walk) -> None:
    # a second driver joins this module's cluster by its scheduler's address
    address = w.info.scheduler_address
    out = subprocess.run([sys.executable, "-c", _JOINER, address], capture_output=True,
                         text=True, timeout=T * 2)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [address, "42"]


def check_log_level(w: Walk) -> None:
    assert logging.getLogger("yrdask").getEffectiveLevel() == logging.INFO


def check_job_id(w: Walk) -> None:
    assert w.info.job_id == w.job_id


def check_auto(w: Walk) -> None:
    assert w.info.scheduler_address.startswith("tcp://127.0.0.1:")  # started here
    assert yr.get(where.invoke(), T)


def check_local_mode(w: Walk) -> None:
    check_auto(w)  # an embedded cluster, with cluster semantics (yr's own local mode differs)
    with pytest.raises(yr.YRValueError, match="Config.local_mode.*drop server_address"):
        yr.Config(local_mode=True, server_address="tcp://127.0.0.1:1").validate()


def check_env_file(w: Walk) -> None:
    assert os.environ.get(w.env_key) == "from file"
    # the embedded cluster's workers start after it is read: they inherit it
    assert yr.get(env_of.options(yr.InvokeOptions(**SMALL)).invoke(w.env_key), T) == "from file"


def check_logger(w: Walk) -> None:
    logging.getLogger("yrdask.walk").info("probe %s", w.job_id)
    assert any(r.getMessage() == f"probe {w.job_id}" for r in w.records)


def check_num_cpus(w: Walk) -> None:
    assert sum(n["capacity"]["CPU"] for n in yr.resources()) == pytest.approx(2000)


def check_num_gpus(w: Walk) -> None:
    (node,) = yr.resources()  # the embedded cluster is one node
    assert node["capacity"]["GPU"] == 1.0
    gpu = yr.InvokeOptions(custom_resources={"GPU": 1}, **SMALL)
    assert yr.get(env_of.options(gpu).invoke("CUDA_VISIBLE_DEVICES"), T) == "0"


def check_resources(w: Walk) -> None:
    (node,) = yr.resources()
    assert node["capacity"]["walk_node_tag"] == 3.0  # once per node, not once per process
STORE_BYTES = 2 * 10**9


def check_object_store_memory(w: Walk) -> None:
    from yrdask.runtime.store import node_store

    assert node_store().capacity() == STORE_BYTES
    big = bytes(range(256)) * 8192  # 2 MiB: stored in the node's store, read back whole
    assert bytes(yr.get(yr.put(big), T)) == big


def check_log_to_driver(w: Walk, capsys: Any = None) -> None:
    text = f"walk-print-{uuid.uuid4().hex[:6]}"
    pid = yr.get(shout.invoke(text), T)
    out: list[str] = []

    def arrived() -> bool:
        out.append(capsys.readouterr().out)
        return any(f"(shout pid={pid}, node=" in s and s.endswith(f") {text}")
                   for s in "".join(out).splitlines())

    wait_until(arrived, T, f"the driver to print {text!r}")


def check_dedup_logs(w: Walk, capsys: Any = None) -> None:
    text = f"walk-same-{uuid.uuid4().hex[:6]}"
    # Two instances of one CPU each fill the node's two worker processes, one in each.
    # light instances, pinned: see test_prints' dedup test (the open issue it names)
    shouters = [Shouter.options(yr.InvokeOptions(cpu=1000, memory=10, light=True)).invoke()
                for _ in range(2)]
    pids = yr.get([s.shout.invoke(text) for s in shouters], T)  # same line, two processes
    assert len(set(pids)) == 2, pids
    for s in shouters:
        s.terminate()
    out: list[str] = []

    def summarised() -> bool:
        out.append(capsys.readouterr().out)
        return any(s.endswith(f"{text} [repeated 1x across cluster]")
                   for s in "".join(out).splitlines())

    wait_until(summarised, T, "the repeat summary")
    lines = [s for s in "".join(out).splitlines() if s.endswith(f") {text}")]
    assert len(lines) == 1, lines  # printed once, then counted


def check_tls_fields(field_name: str) -> Callable[[Walk], None]:
    def check(w: Walk) -> None:
        paths = {"verify_file_path": str(w.tmp / "ca.pem"),
                 "certificate_file_path": str(w.tmp / "cert.pem"),
                 "private_key_path": str(w.tmp / "key.pem")}
        flag = {"enable_mtls": True} if field_name == "enable_mtls" else {"enable_tls": True}
        # the driver reads the files the fields name: a missing one is named in the error
        with pytest.raises(yr.YRValueError) as ei:
            resolve_security(Config(**flag, **paths))
        assert "Config.verify_file_path: no such file" in str(ei.value)
        if field_name in paths:
            missing = {**paths}
            missing[field_name] = ""
            with pytest.raises(yr.YRValueError, match=f"Config.{field_name} must be set"):
                resolve_security(Config(**flag, **missing))

    return check


def check_security(w: Walk) -> None:
    from distributed.security import Security

    sec = Security()
    assert resolve_security(Config(security=sec)) is sec


CHECKS: dict[tuple[str, str], Callable[..., None]] = {
    ("InvokeOptions", "cpu"): check_cpu,
    ("InvokeOptions", "memory"): check_memory,
    ("InvokeOptions", "concurrency"): check_concurrency,
    ("InvokeOptions", "custom_resources"): check_custom_resources,
    ("InvokeOptions", "custom_extensions"): check_custom_extensions,
    ("InvokeOptions", "labels"): check_labels,
    ("InvokeOptions", "recover_retry_times"): check_recover_retry_times,
    ("InvokeOptions", "need_order"): check_need_order,
    ("InvokeOptions", "name"): check_name,
    ("InvokeOptions", "namespace"): check_namespace,
    ("InvokeOptions", "schedule_affinities"): check_schedule_affinities,
    ("InvokeOptions", "is_data_affinity"): check_is_data_affinity,
    ("InvokeOptions", "resource_group_options"): check_resource_group_options,
    ("InvokeOptions", "env_vars"): check_env_vars,
    ("InvokeOptions", "retry_times"): check_retry_times,
    ("InvokeOptions", "runtime_env"): check_runtime_env,
    ("InvokeOptions", "schedule_timeout_ms"): check_schedule_timeout_ms,
    ("InvokeOptions", "group_name"): check_group_name,
    ("InvokeOptions", "get_if_exists"): check_get_if_exists,
    ("InvokeOptions", "isolated"): check_isolated,
    ("InvokeOptions", "light"): check_light,
    ("Config", "server_address"): check_server_address,
    ("Config", "log_level"): check_log_level,
    ("Config", "job_id"): check_job_id,
    ("Config", "auto"): check_auto,
    ("Config", "local_mode"): check_local_mode,
    ("Config", "env_file"): check_env_file,
    ("Config", "logger"): check_logger,
    ("Config", "enable_mtls"): check_tls_fields("enable_mtls"),
    ("Config", "enable_tls"): check_tls_fields("enable_tls"),
    ("Config", "private_key_path"): check_tls_fields("private_key_path"),
    ("Config", "certificate_file_path"): check_tls_fields("certificate_file_path"),
    ("Config", "verify_file_path"): check_tls_fields("verify_file_path"),
    ("Config", "working_dir"): check_working_dir,
    ("Config", "num_cpus"): check_num_cpus,
    ("Config", "num_gpus"): check_num_gpus,
    ("Config", "resources"): check_resources,
    ("Config", "object_store_memory"): check_object_store_memory,
    ("Config", "log_to_driver"): check_log_to_driver,
    ("Config", "dedup_logs"): check_dedup_logs,
    ("Config", "security"): check_security,
}

HONOURED = [k for k in ALL_FIELDS if isinstance(DECISIONS.get(k), Honoured)]


@pytest.mark.parametrize("cls_name,name", HONOURED, ids=[f"{c}.{n}" for c, n in HONOURED])
def test_honoured_field_behaves(walk, capsys, cls_name, name):
    check = CHECKS[(cls_name, name)]
    if name in ("log_to_driver", "dedup_logs"):
        check(walk, capsys)
    else:
        check(walk)
