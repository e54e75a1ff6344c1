"""The wire protocol (yrdask/protocol.py): one typed message per op, exact msgpack round trips,
handler tables built from the table, live scheduler and worker handler tables that match it,
and no hand-built ``{"op": ...}`` dict anywhere else in the package."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest
from distributed import Client
from distributed.protocol import dumps, loads

import yrdask
from yrdask import protocol as P

pytestmark = pytest.mark.timeout(120)

ROOT = Path(yrdask.__file__).parent

#: one filled-in instance per message class; sequences as tuples: Dask's msgpack reads arrays
#: back as tuples (``use_list=False``), so that is the form a message arrives in.
SAMPLES: list[P.Message] = [
    P.JobWelcome(protocol_version=1, dashboard="http://h:8787/status", error=None),
    P.ConnectJob("job-1", "tcp://127.0.0.1:4000", P.PROTOCOL_VERSION),
    P.RegisterWorker("tcp://w:1", {"CPU": 4000.0, "Memory": 1024.0}, P.PROTOCOL_VERSION),
    P.RequestLease("tcp://o:1", {"CPU": 1000.0}, -1, local="tcp://w:1", queue="q1",
                   avoid=("tcp://w:2",), affinity=(("RESOURCE", "gpu", "Exists", (), True),),
                   request_id="r7"),
    P.ClusterInfo(instances=False),
    P.StateRecords(kind="tasks", limit=100),
    P.OwnerAlive("tcp://o:1"),
    P.CreateInstance({"instance_id": "i-1", "cls": b"\x80pickled", "cls_name": "C",
                      "args": b"args", "deps": (), "shape": {"CPU": 1000.0}, "timeout_ms": -1,
                      "owner": "job-1", "holder": "tcp://o:1", "name": None,
                      "namespace": None, "detached": False, "concurrency": 1,
                      "is_async": False, "meta": {"m": (1, False)}}),
    P.LocateInstance("i-1", lost="tcp://w:1", lost_server_id="Worker-5a1e"),
    P.InstanceStatus("i-1"),
    P.SaveState("i-1", b"\x00state\xff"),
    P.LoadState("i-1"),
    P.GetNamed("counter", "ns", 2.5),
    P.ListNamed(all_namespaces=True, namespace="ns"),
    P.KillInstance("i-1", "crashed by test", restart=True),
    P.KVPut(("k1", "k2"), (b"v1", b"\x00v2"), nx=True, ttl_s=2.5, evictable=True),
    P.KVGet(("k1",), timeout=None),
    P.KVDel(("k1", "k2")),
    P.CreateResourceGroup("tcp://o:1", "rg-1", ({"CPU": 1000.0, "Memory": 128.0},), "STRICT_SPREAD"),
    P.RemoveResourceGroup("rg-1"),
    P.WaitResourceGroup("rg-1", timeout=2.5),
    P.GetResourceGroup("rg-1"),
    P.ReturnLeases(("l-1", "l-2")),
    P.WithdrawLeaseRequests("tcp://o:1", ("r1", "r2")),
    P.LeaseBlocked("l-1"),
    P.LeaseUnblocked("l-1"),
    P.HandleRefs({"i-1": 1, "i-2": -1}, transit=(("i-1", "tok"),), arrived=(("i-2", "tok2"),)),
    P.InstanceState("i-1", "RESTARTING", None, "exited with code 9", 2, "tcp://h:4001"),
    P.TaskRecords((("f", "ab1", 1.5, 2.5, 140001, True),), {"C.m": 1}, {"f": 2}),
    P.CloseStream(),
    P.RevokeLeases(("l-3",)),
    P.WorkerLost("tcp://w:2", "Worker-7d1e"),
    P.WaitWarning("Counter instance i-1 waits for {CPU: 500} (6 s so far): ..."),
    P.WorkerExited("tcp://n:1", -9, pid=4242),
    P.WorkerExit("tcp://w:2", "exited with code 3", "Worker-7d1e"),
    P.WorkerJoined("tcp://w:2", "Worker-99aa"),
    P.OpenChannel("tcp://o:1", expect="Worker-99aa"),
    P.FetchObject("t-1.0", timeout=None),
    P.FreeObjects(("t-1.0", "t-2")),
    P.TaskOutput((("f pid=1, node=tcp://h:1", "stdout", "hi\n"),)),
    P.WaitRefsRemoved("tcp://o:1", (("t-1", 3, None), ("t-2", 1, "t-9"))),
    P.RefsRemoved("tcp://w:1", (("t-1", 3),)),
    P.AddBorrower((("t-1", "tcp://w:1", None), ("t-2", "tcp://w:2", "t-7"))),
    P.CancelOwned(("t-1.0",), True),
    P.StartInstance({"instance_id": "i-1", "incarnation": 2, "checkpoint": b"ck"}),
    P.StopInstance("i-1", "killed"),
    P.CrashInstance("i-1", "killed with ray.kill(no_restart=False)", 2),
    P.WarmZygote(),
    P.AssignIsolated({"env": {"A": "1"}, "cwd": "/tmp", "worker": "tcp://w:1"},
                     {"op": P.START_ISOLATED, "spec": {"instance_id": "i-1"}}),
    P.StartIsolated({"instance_id": "i-1", "isolation": {"env": {"A": "1"}, "cwd": "/tmp"}}),
    P.StopIsolated("terminated"),
    P.DrainInstance("i-1", 5.0),
    P.InstanceMoved("i-1", "tcp://w:3"),
    P.EndProcesses(("i-1", "i-2")),
    P.CheckpointIsolated(),
    P.KeptObjects(),
    P.ResultsKept(("c-1", "c-2.0")),
    P.AgentRequest(3, {"op": P.DRAIN_INSTANCE, "instance_id": "i-1", "timeout_s": 5.0}),
    P.AgentReply(3, b"\x80ck"),
    P.CallRecords((("Tally.add", "c-1", 1.0, 1.5, 140, True),), {"Tally.add": 1}, 2, 7),
    P.AdoptObjects("tcp://w:2", ("o-1",)),
    P.ObjectsMoved("tcp://w:2", "tcp://w:3", ("o-1",)),
    P.RunIsolated("t-1", "l-1", "f-1", b"\x80fn", b"\x80args", (("t-0", "value", b"v"),), 1,
                  "job-1"),
    P.RunTask("t-1", "l-1", "f-1", b"\x80fn", b"\x80args", (("t-0", "value", b"v"),), 2,
              "job-1", "add", slots=3),
    P.CancelTask("t-1"),
    P.TaskDone("t-1", results=(("value", b"\x80r"), ("location", "tcp://w:1")), took=0.25,
               refs=("tcp://w:1", ("t-0",), (("t-1", (("t-5", "tcp://w:3"),)),))),
    P.CallMethod("c-1", "i-1", "incr", b"\x80args", (), 1, 2),
    P.GeneratorItem("t-1", 3, ("value", b"\x80item")),
    P.CallRetried("c-1"),
]
RUN = next(m for m in SAMPLES if isinstance(m, P.RunTask))


def _op_constants() -> dict[str, str]:
    """The module's op-name constants: NAME -> op."""
    return {k: v for k, v in vars(P).items()
            if k.isupper() and isinstance(v, str) and (v.startswith("yr_") or v == P.CLOSE_STREAM)}


# -- the table -----------------------------------------------------------------------------


def test_every_op_has_exactly_one_class():
    constants = _op_constants()
    assert len(set(constants.values())) == len(constants), "two constants name one op"
    classes = [c for c in vars(P).values()
               if isinstance(c, type) and issubclass(c, P.Message) and c is not P.Message]
    by_op: dict[str, list[type]] = {}
    for cls in classes:
        by_op.setdefault(cls.op, []).append(cls)
    assert set(by_op) == set(constants.values()) == set(P.MESSAGES)
    for op, found in by_op.items():
        assert len(found) == 1, f"{op} has classes {found}"
        assert P.MESSAGES[op] is found[0]


def test_messages_are_frozen_slotted_documented_dataclasses():
    for op, cls in P.MESSAGES.items():
        assert dataclasses.is_dataclass(cls), op
        assert cls.__dataclass_params__.frozen, op
        assert "__slots__" in cls.__dict__ and not hasattr(cls(**_required(cls)), "__dict__"), op
        assert cls.__doc__ and "->" in cls.__doc__, f"{cls.__name__}: who sends it to whom?"
        assert op == P.CLOSE_STREAM or (op.startswith("yr_") and "-" not in op), op
        assert isinstance(cls.handler, str) and cls.handler.isidentifier(), op
        if P.ON_SCHEDULER_RPC in cls.channels or P.ON_WORKER_RPC in cls.channels:
            assert "Reply" in cls.__doc__ or "reply" in cls.__doc__, f"{cls.__name__}: reply?"
    with pytest.raises(dataclasses.FrozenInstanceError):
        SAMPLES[0].dashboard = "x"  # type: ignore[misc]


def _required(cls: type) -> dict:
    return {f.name: f"<{f.name}>" for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING}


def test_channel_groups_are_derived_from_the_table():
    assert set(P.SCHEDULER_RPC) == {P.CONNECT_JOB, P.REGISTER_WORKER, P.REQUEST_LEASE,
                                    P.CLUSTER_INFO, P.CREATE_INSTANCE, P.LOCATE_INSTANCE,
                                    P.GET_NAMED, P.LIST_NAMED, P.KILL_INSTANCE,
                                    P.INSTANCE_STATUS, P.SAVE_STATE, P.LOAD_STATE,
                                    P.CREATE_RESOURCE_GROUP, P.REMOVE_RESOURCE_GROUP,
                                    P.WAIT_RESOURCE_GROUP, P.GET_RESOURCE_GROUP, P.KV_PUT,
                                    P.KV_GET, P.KV_DEL,
                                    P.WORKER_EXITED, P.OWNER_ALIVE, P.STATE_RECORDS}
    assert set(P.SCHEDULER_STREAM) == {P.RETURN_LEASES, P.LEASE_BLOCKED, P.LEASE_UNBLOCKED,
                                       P.HANDLE_REFS, P.INSTANCE_STATE, P.TASK_RECORDS,
                                       P.WITHDRAW_LEASE_REQUESTS}
    assert set(P.JOB_STREAM) == {P.RETURN_LEASES, P.HANDLE_REFS,  # an isolated process
                                 P.LEASE_BLOCKED, P.LEASE_UNBLOCKED,  # lends on its own
                                 P.WITHDRAW_LEASE_REQUESTS}
    assert set(P.DRIVER_STREAM) == {P.REVOKE_LEASES, P.WORKER_LOST, P.WAIT_WARNING,
                                    P.WORKER_EXIT, P.WORKER_JOINED, P.OBJECTS_MOVED}
    assert set(P.WORKER_RPC) == {P.OPEN_CHANNEL, P.FETCH_OBJECT, P.FREE_OBJECTS,
                                 P.STOP_INSTANCE, P.WAIT_REFS_REMOVED, P.REFS_REMOVED,
                                 P.ADD_BORROWER, P.CANCEL_OWNED, P.DRAIN_INSTANCE,
                                 P.INSTANCE_MOVED, P.KEPT_OBJECTS, P.ADOPT_OBJECTS,
                                 P.END_PROCESSES}
    assert set(P.WORKER_STREAM) == {P.REVOKE_LEASES, P.START_INSTANCE, P.CRASH_INSTANCE,
                                    P.WARM_ZYGOTE, P.WORKER_LOST, P.WORKER_EXIT,
                                    P.WORKER_JOINED, P.OBJECTS_MOVED}
    assert P.OWNER_RPC == (P.FETCH_OBJECT, P.TASK_OUTPUT, P.WAIT_REFS_REMOVED, P.REFS_REMOVED,
                           P.ADD_BORROWER, P.CANCEL_OWNED)
    assert set(P.CHANNEL_TO_WORKER) == {P.RUN_TASK, P.CANCEL_TASK, P.CALL_METHOD}
    assert set(P.ISOLATED_RPC) == {P.OPEN_CHANNEL, P.ASSIGN_ISOLATED, P.START_ISOLATED,
                                    P.STOP_ISOLATED,
                                    P.RUN_ISOLATED, P.CHECKPOINT_ISOLATED}
    assert set(P.ISOLATED_TO_AGENT) == {P.CALL_RECORDS, P.RESULTS_KEPT, P.AGENT_REPLY}
    assert set(P.SUPERVISION) == {P.AGENT_REQUEST, P.STOP_ISOLATED, P.DRAIN_INSTANCE,
                                  P.INSTANCE_MOVED}
    assert P.CHANNEL_TO_CALLER == (P.TASK_DONE, P.GENERATOR_ITEM, P.CALL_RETRIED)
    for group in (P.SCHEDULER_RPC, P.SCHEDULER_STREAM, P.WORKER_RPC, P.WORKER_STREAM):
        assert all(op in P.MESSAGES for op in group)


# -- wire form -----------------------------------------------------------------------------


def test_samples_cover_every_message():
    assert sorted(type(m).op for m in SAMPLES) == sorted(P.MESSAGES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip_through_msgpack(msg: P.Message):
    wire = msg.to_msg()
    names = [f.name for f in dataclasses.fields(msg)]
    assert wire["op"] == msg.op
    assert [k for k in wire if k not in ("op", "reply")] == names
    assert wire.get("reply", True) is (not msg.opens_stream)
    back = loads(dumps(wire))
    assert back == wire
    assert type(msg).from_msg(back) == msg
    assert P.decode(back) == msg


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_wire_reads_back_as_the_message_to_msg_builds(msg: P.Message):
    fields = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    full = msg.to_msg()
    for wire in (type(msg).wire(**fields), type(msg).wire(*fields.values())):
        # the same items, less the fields left at their defaults
        assert wire.items() <= full.items()
        assert all(full[k] == f.default for f in dataclasses.fields(msg)
                   if (k := f.name) not in wire)
        assert type(msg).from_msg(loads(dumps(wire))) == msg
        assert P.decode(wire) == msg


def test_wire_leaves_defaults_out():
    assert P.TaskDone.wire("t", requeue=True) == {"op": P.TASK_DONE, "task_id": "t",
                                                  "requeue": True}
    assert P.TaskDone.from_msg(P.TaskDone.wire("t", requeue=True)) == P.TaskDone("t",
                                                                                 requeue=True)
    run = P.RunTask.wire("t", "l", "f", None, b"a", [], 1, "o", "n", 2)
    assert run["slots"] == 2 and "log_to" not in run and run["fn"] is None  # (no default)


def test_to_msg_does_not_copy_payloads():
    deps = [["t-0", "value", b"v" * 1000]]
    msg = P.RunTask("t", "l", "f", None, b"a", deps, 1, "o", "n").to_msg()
    assert msg["deps"] is deps


def test_from_msg_fills_defaults_and_ignores_extra_keys():
    done = P.TaskDone.from_msg({"op": P.TASK_DONE, "task_id": "t", "requeue": True, "x": 1})
    assert done == P.TaskDone("t", requeue=True)
    assert done.results is None and done.error is None and done.retryable is False
    assert P.RunTask.from_msg(RUN.to_msg() | {"slots": 1}).slots == 1
    with pytest.raises(KeyError):
        P.CancelTask.from_msg({"op": P.CANCEL_TASK})


# -- handler tables and dispatch -----------------------------------------------------------


class _Handlers:
    def __init__(self):
        self.seen: list = []

    def revoke_leases(self, lease_ids, keep=False):
        self.seen.append(("revoke", lease_ids, keep))

    def worker_lost(self, worker, server_id=""):
        self.seen.append(("lost", worker))
        return "ok"

    def wait_warning(self, text):
        self.seen.append(("wait", text))

    def worker_exit(self, worker, how, server_id=""):
        self.seen.append(("exit", worker, how))

    def worker_joined(self, worker, server_id=""):
        self.seen.append(("joined", worker))

    def objects_moved(self, worker, to, object_ids):
        self.seen.append(("moved", worker, to))


class _More:
    def run_task(self, peer, **fields):
        return peer, fields


def test_handlers_maps_ops_to_declared_methods_of_the_first_target_that_has_them():
    a, b = _Handlers(), _More()
    table = P.handlers(P.DRIVER_STREAM, a, b)
    assert table == {P.REVOKE_LEASES: a.revoke_leases, P.WORKER_LOST: a.worker_lost,
                     P.WAIT_WARNING: a.wait_warning, P.WORKER_EXIT: a.worker_exit,
                     P.WORKER_JOINED: a.worker_joined, P.OBJECTS_MOVED: a.objects_moved}
    both = P.handlers((P.WORKER_LOST, P.RUN_TASK), b, a)
    assert both[P.RUN_TASK] == b.run_task and both[P.WORKER_LOST] == a.worker_lost
    with pytest.raises(LookupError, match="cancel_task"):
        P.handlers((P.CANCEL_TASK,), a, b)


def test_dispatch_calls_the_handler_with_fields_and_leaves_the_dict_alone():
    a = _Handlers()
    table = P.handlers(P.DRIVER_STREAM, a)
    msg = P.WorkerLost("tcp://w:9").to_msg()
    assert P.dispatch(table, msg) == "ok"
    P.dispatch(table, P.RevokeLeases(["l-1"]).to_msg())
    P.dispatch(table, P.RevokeLeases(["l-2"], keep=True).to_msg())
    assert a.seen == [("lost", "tcp://w:9"), ("revoke", ["l-1"], False),
                      ("revoke", ["l-2"], True)]
    assert msg == {"op": P.WORKER_LOST, "worker": "tcp://w:9", "server_id": ""}
    peer, fields = P.dispatch(P.handlers((P.RUN_TASK,), _More()), RUN.to_msg(), "peer")
    assert peer == "peer" and P.RunTask(**fields) == RUN
    with pytest.raises(P.UnknownMessage):
        P.dispatch(table, P.CloseStream().to_msg())
    with pytest.raises(P.UnknownMessage):
        P.decode({"op": "nonsense"})


# -- the live handler tables ---------------------------------------------------------------


def _yr_tables(server) -> list[dict]:
    """{op: (parameters, takes **kwargs)} of a server's yr rpc and stream handlers."""
    out = []
    for table in (server.handlers, server.stream_handlers):
        entry = {}
        for op, fn in table.items():
            if op.startswith("yr_"):
                params = inspect.signature(fn).parameters.values()
                entry[op] = ([(p.name, p.default is inspect.Parameter.empty) for p in params
                              if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)],
                             any(p.kind == p.VAR_KEYWORD for p in params))
        out.append(entry)
    return out


#: parameters a handler gets from Dask or its reader, not from the message.
INJECTED = {"comm", "worker", "holder"}


def _check_signatures(table: dict, where: str) -> None:
    """Each handler accepts exactly the fields of its message (plus what Dask injects)."""
    for op, (params, var_kw) in table.items():
        cls = P.MESSAGES[op]
        fields = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        names = {name for name, _ in params}
        must = {name for name, req in params if req} - INJECTED
        assert must <= required, f"{where} {op}: handler requires {must - required}, " \
                                 f"which {cls.__name__} may omit"
        assert var_kw or fields <= names, f"{where} {op}: handler lacks {fields - names}"


def test_handler_tables_match_protocol(yr_cluster):
    with Client(yr_cluster.address, set_as_default=False, timeout=30) as client:
        sched = client.run_on_scheduler(lambda dask_scheduler: _yr_tables(dask_scheduler))
        workers = client.run(lambda dask_worker: _yr_tables(dask_worker))
    assert set(sched[0]) == set(P.SCHEDULER_RPC)
    assert set(sched[1]) == set(P.SCHEDULER_STREAM)
    _check_signatures(sched[0], "scheduler rpc")
    _check_signatures(sched[1], "scheduler stream")
    assert workers, "no workers answered"
    for addr, (rpc, stream) in workers.items():
        assert set(rpc) == set(P.WORKER_RPC), addr
        assert set(stream) == set(P.WORKER_STREAM), addr
        _check_signatures(rpc, f"worker {addr} rpc")
        _check_signatures(stream, f"worker {addr} stream")


# -- no hand-built messages ----------------------------------------------------------------


def op_literals(root: Path = ROOT) -> list[str]:
    """``file:line`` of every dict literal with an ``"op"`` key outside protocol.py."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path == root / "protocol.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Dict) and any(
                    isinstance(k, ast.Constant) and k.value == "op" for k in node.keys):
                found.append((str(path.relative_to(root.parent)), node.lineno))
    return [f"{path}:{line}" for path, line in sorted(found)]


def test_op_literal_scan_finds_dict_literals(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "protocol.py").write_text('M = {"op": "yr_a"}\n')  # the one allowed place
    (pkg / "mod.py").write_text('x = {"op": "yr_a", "b": 1}\ny = {**x, "c": 2}\n'
                                'z = f({"task": 1}, {"op": P.RUN_TASK})\n')
    assert op_literals(pkg) == ["pkg/mod.py:1", "pkg/mod.py:3"]


def test_no_op_dict_literals_outside_protocol():
    assert op_literals() == []


def test_signature_check_catches_a_handler_that_does_not_fit_its_message():
    def fits(comm, job_id, owner_address, protocol_version, api="yr"): ...
    def lacks_field(comm, job_id, owner_address): ...
    def requires_optional(instance_id, lost): ...

    def table(op, fn):
        return _yr_tables(type("S", (), {"handlers": {op: fn}, "stream_handlers": {}}))[0]

    _check_signatures(table(P.CONNECT_JOB, fits), "t")
    with pytest.raises(AssertionError, match="lacks"):
        _check_signatures(table(P.CONNECT_JOB, lacks_field), "t")
    with pytest.raises(AssertionError, match="may omit"):
        _check_signatures(table(P.LOCATE_INSTANCE, requires_optional), "t")
