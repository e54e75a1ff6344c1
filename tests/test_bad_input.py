"""The bad-input matrix on a real embedded cluster.

Every public call, given bad input, raises a typed error naming the problem at the call that
caused it.  The exceptions are what the SPEC makes asynchronous: a constructor's error, an
argument that cannot be unpickled on the worker, a call on an instance killed elsewhere and
a request no worker can meet surface at ``yr.get``; the infeasible ones after about
``schedule_timeout_ms`` (not never).  Each row is bounded (pytest-timeout, explicit ``yr.get``
timeouts).  ``tests/unit/test_bad_input_unit.py`` holds the rows that need no cluster;
``docs/errors.md`` documents both tables, and the last tests here keep the three in step.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import pathlib
import re
import socket
import sys
import threading
import time
import types
from types import SimpleNamespace
from typing import Any, Callable

import dask
import pytest

import yrdask as yr

pytestmark = pytest.mark.timeout(120)

T = 30  # seconds: the bound of every yr.get here, well under the test time-out
QUICK = 5  # seconds: an asynchronous call returns well within this
DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "errors.md"


# --------------------------------------------------------------------------- remote code


class InitError(Exception):
    pass


def _refuse(text):
    raise ValueError(text)


class Unrebuildable:
    """Pickles fine; unpickling it (on the worker) raises ValueError."""

    def __reduce__(self):
        return (_refuse, ("cannot rebuild Unrebuildable",))


@yr.invoke
def add(a, b=1):
    return a + b


@yr.invoke
def identity(x):
    return x


@yr.invoke(return_nums=2)
def returns_one_value():
    return 1


@yr.invoke(return_nums=3)
def returns_two_values():
    return 1, 2


@yr.instance
class Counter:
    def __init__(self, start=0):
        self.n = start

    def add(self, k=1):
        self.n += k
        return self.n

    @staticmethod
    def double(x):
        return 2 * x


@yr.instance
class FailsInit:
    def __init__(self):
        raise InitError("no luck in __init__")

    def ping(self):
        return "pong"


def driver_only_object() -> Any:
    """An instance of a class whose module exists only in this (driver) process."""
    name = "yrdask_driver_only_mod"
    mod = sys.modules.get(name)
    if mod is None:
        mod = types.ModuleType(name)
        mod.__file__ = f"/nonexistent/{name}.py"  # not dynamic: cloudpickle refers to it by name
        mod.OnlyHere = type("OnlyHere", (), {"__module__": name})
        sys.modules[name] = mod
    return mod.OnlyHere()


def unpicklable_function():
    lock = threading.Lock()

    def uses_lock():  # a local function travels by value, with the lock it closes over
        with lock:
            return 1

    return yr.invoke(uses_lock)


def unpicklable_class():
    lock = threading.Lock()

    class HoldsLock:
        def get(self):
            with lock:
                return 1

    return yr.instance(HoldsLock)


def gen():
    yield 1


# --------------------------------------------------------------------------- the matrix


@dataclasses.dataclass(frozen=True)
class Case:
    """One bad call.

    ``act(ctx)`` makes it.  ``at="call"``: it raises ``exc`` itself.  ``at="get"``: it
    returns an ObjectRef at once, and ``yr.get`` of that ref raises ``exc``.  Every string of
    ``says`` is in ``str(error)`` (case-insensitive).
    """

    call: str  # the public call, as docs/errors.md names it
    bad: str  # what is wrong with the input
    act: Callable[[Any], Any]
    exc: type[BaseException] | tuple[type[BaseException], ...]
    says: str | tuple[str, ...]
    at: str = "call"

    @property
    def id(self) -> str:
        return f"{self.call} | {self.bad}"


def _check_message(case: Case, err: BaseException) -> None:
    says = (case.says,) if isinstance(case.says, str) else case.says
    text = str(err).lower()
    for part in says:
        assert part.lower() in text, f"{case.id}: message does not say {part!r}: {err!r}"


def _terminated(ctx):
    h = Counter.invoke()
    h.terminate()
    return h.add.invoke()


def _killed_elsewhere(ctx):
    h = Counter.invoke()
    yr.get(h.add.invoke(), T)
    yr.kill_instance(h.instance_id)  # other handles are not marked (yr_api §1.3)
    return h.add.invoke()


BEFORE_INIT = [
    Case(call, "before yr.init", act, yr.YRRuntimeError, "not initialized")
    for call, act in [
        ("yr.get", lambda ctx: yr.get([])),
        ("yr.wait", lambda ctx: yr.wait([])),
        ("yr.put", lambda ctx: yr.put(1)),
        ("yr.cancel", lambda ctx: yr.cancel([])),
        ("f.invoke", lambda ctx: add.invoke(1)),
        ("C.invoke", lambda ctx: Counter.invoke()),
        ("yr.get_instance", lambda ctx: yr.get_instance("a")),
        ("yr.list_named_instances", lambda ctx: yr.list_named_instances()),
        ("yr.kill_instance", lambda ctx: yr.kill_instance("i-0")),
        ("yr.resources", lambda ctx: yr.resources()),
        ("yr.get_node_id", lambda ctx: yr.get_node_id()),
        ("yr.get_node_ip_address", lambda ctx: yr.get_node_ip_address()),
        ("yr.save_state", lambda ctx: yr.save_state()),
        ("yr.load_state", lambda ctx: yr.load_state()),
        ("yr.exit", lambda ctx: yr.exit()),
        ("yr.kv_write", lambda ctx: yr.kv_write("k", b"v")),
        ("yr.kv_write_with_param", lambda ctx: yr.kv_write_with_param("k", b"v", yr.SetParam())),
        ("yr.kv_set", lambda ctx: yr.kv_set("k", b"v")),
        ("yr.kv_m_write_tx", lambda ctx: yr.kv_m_write_tx(["k"], [b"v"])),
        ("yr.kv_read", lambda ctx: yr.kv_read("k")),
        ("yr.kv_get", lambda ctx: yr.kv_get("k")),
        ("yr.kv_get_with_param",
         lambda ctx: yr.kv_get_with_param(["k"], yr.GetParams([yr.GetParam()]))),
        ("yr.kv_del", lambda ctx: yr.kv_del("k")),
        ("yr.create_resource_group", lambda ctx: yr.create_resource_group([{"CPU": 100}])),
        ("yr.remove_resource_group", lambda ctx: yr.remove_resource_group("rg")),
    ]
] + [
    Case("yr.init", "conf not a Config", lambda ctx: yr.init({"num_cpus": 2}), yr.YRTypeError,
         "expected yr.Config, got dict"),
    Case("yr.init", "log_level not a level", lambda ctx: yr.init(yr.Config(log_level="LOUD")),
         yr.YRValueError, "'LOUD' is not a logging level"),
    Case("yr.init", "malformed server_address",
         lambda ctx: yr.init(yr.Config(server_address="no such host:::")), ValueError,
         "invalid address 'no such host:::'"),
]

CALL_CASES = [
    # -- yr.init on a running job
    Case("yr.init", "called twice", lambda ctx: yr.init(), yr.YRRuntimeError,
         "cannot be called twice"),
    Case("yr.init", "called twice with another Config",
         lambda ctx: yr.init(yr.Config(num_cpus=1)), yr.YRRuntimeError, "yr.finalize() first"),
    # -- yr.get
    Case("yr.get", "an int", lambda ctx: yr.get(1), yr.YRTypeError,
         "takes an ObjectRef or a list of ObjectRefs, got int"),
    Case("yr.get", "a str", lambda ctx: yr.get("ref"), yr.YRTypeError, "got str"),
    Case("yr.get", "a tuple of refs", lambda ctx: yr.get((ctx.ref,)), yr.YRTypeError,
         "got tuple"),
    Case("yr.get", "a list holding a non-ref", lambda ctx: yr.get([ctx.ref, 2]), yr.YRTypeError,
         ("obj_refs type error", "int")),
    Case("yr.get", "timeout 0", lambda ctx: yr.get(ctx.ref, 0), yr.YRValueError,
         "greater than 0 or equal to -1"),
    Case("yr.get", "timeout below -1", lambda ctx: yr.get(ctx.ref, -2), yr.YRValueError,
         "got -2"),
    Case("yr.get", "timeout a str", lambda ctx: yr.get(ctx.ref, "10"), yr.YRTypeError,
         "timeout must be a number of seconds, got str"),
    Case("yr.get", "timeout None", lambda ctx: yr.get(ctx.ref, None), yr.YRTypeError,
         "got NoneType"),
    Case("yr.get", "timeout nan", lambda ctx: yr.get(ctx.ref, math.nan), yr.YRValueError,
         "got nan"),
    Case("yr.get", "timeout inf (past the int32 limit)", lambda ctx: yr.get(ctx.ref, math.inf),
         yr.YRValueError, "at most 2147483647"),
    Case("yr.get", "allow_partial not a bool", lambda ctx: yr.get(ctx.ref, 10, "yes"),
         yr.YRTypeError, "allow_partial must be a bool"),
    # -- yr.wait (yr_api program P8)
    Case("yr.wait", "an int", lambda ctx: yr.wait(1), yr.YRTypeError, "obj_refs type error"),
    Case("yr.wait", "a list holding a non-ref", lambda ctx: yr.wait([1]), yr.YRTypeError,
         "obj_refs type error"),
    Case("yr.wait", "a tuple", lambda ctx: yr.wait((ctx.ref,)), yr.YRTypeError, "tuple"),
    Case("yr.wait", "a duplicate ref", lambda ctx: yr.wait([ctx.ref, ctx.ref], 2),
         yr.YRValueError, "duplicate obj_ref"),
    Case("yr.wait", "wait_num -1", lambda ctx: yr.wait([ctx.ref], -1), yr.YRValueError,
         "wait_num must be in [0, 1], got -1"),
    Case("yr.wait", "wait_num above len(refs)", lambda ctx: yr.wait([ctx.ref], 2),
         yr.YRValueError, "got 2"),
    Case("yr.wait", "wait_num a str", lambda ctx: yr.wait([ctx.ref], ""), yr.YRTypeError,
         "wait_num must be an int"),
    Case("yr.wait", "timeout a str", lambda ctx: yr.wait([ctx.ref], 1, ""), yr.YRTypeError,
         "timeout must be an int"),
    Case("yr.wait", "timeout a float", lambda ctx: yr.wait([ctx.ref], 1, 2.5), yr.YRTypeError,
         "got float"),
    Case("yr.wait", "timeout below -1", lambda ctx: yr.wait([ctx.ref], 1, -2), yr.YRValueError,
         "got -2"),
    # -- yr.put (yr_api program P5)
    Case("yr.put", "None", lambda ctx: yr.put(None), yr.YRValueError, "None or has zero length"),
    Case("yr.put", "empty bytes", lambda ctx: yr.put(b""), yr.YRValueError, "zero length"),
    Case("yr.put", "empty bytearray", lambda ctx: yr.put(bytearray()), yr.YRValueError,
         "zero length"),
    Case("yr.put", "empty memoryview", lambda ctx: yr.put(memoryview(b"")), yr.YRValueError,
         "zero length"),
    Case("yr.put", "an ObjectRef", lambda ctx: yr.put(ctx.ref), yr.YRTypeError,
         "put it inside a list"),
    Case("yr.put", "unpicklable (a lock)", lambda ctx: yr.put(threading.Lock()), yr.YRTypeError,
         ("cannot be pickled", "lock")),
    Case("yr.put", "unpicklable (a generator)", lambda ctx: yr.put(gen()), yr.YRTypeError,
         ("cannot be pickled", "generator")),
    # -- yr.cancel
    Case("yr.cancel", "a str", lambda ctx: yr.cancel("aaa"), yr.YRTypeError,
         ("obj_refs type error", "str")),
    Case("yr.cancel", "a list holding a str", lambda ctx: yr.cancel(["aaa"]), yr.YRTypeError,
         "obj_refs type error"),
    Case("yr.cancel", "a tuple", lambda ctx: yr.cancel((ctx.ref,)), yr.YRTypeError, "tuple"),
    # -- f.invoke: signature and pickling, checked at the call (SPEC §2)
    Case("f.invoke", "missing argument", lambda ctx: add.invoke(), TypeError,
         "add.invoke(): missing a required argument: 'a'"),
    Case("f.invoke", "too many arguments", lambda ctx: add.invoke(1, 2, 3), TypeError,
         "too many positional arguments"),
    Case("f.invoke", "unknown keyword argument", lambda ctx: add.invoke(1, c=3), TypeError,
         "unexpected keyword argument 'c'"),
    Case("f.invoke", "unpicklable argument (a lock)", lambda ctx: add.invoke(threading.Lock()),
         yr.YRTypeError, ("argument 0 (lock) cannot be pickled", "_thread.lock")),
    Case("f.invoke", "unpicklable keyword argument (a generator)",
         lambda ctx: add.invoke(1, b=gen()), yr.YRTypeError,
         "keyword argument 'b' (generator) cannot be pickled"),
    Case("f.invoke", "unpicklable value nested in a list",
         lambda ctx: identity.invoke([1, threading.Lock()]), yr.YRTypeError,
         ("argument 0 (list) cannot be pickled", "lock")),
    Case("f.invoke", "a function that cannot be pickled",
         lambda ctx: unpicklable_function().invoke(), yr.YRTypeError,
         ("the function", "uses_lock", "cannot be pickled")),
    # -- C.invoke: constructor signature and pickling
    Case("C.invoke", "too many arguments", lambda ctx: Counter.invoke(1, 2), TypeError,
         "Counter.invoke(): too many positional arguments"),
    Case("C.invoke", "unknown keyword argument", lambda ctx: Counter.invoke(begin=1), TypeError,
         "unexpected keyword argument 'begin'"),
    Case("C.invoke", "unpicklable argument (a lock)",
         lambda ctx: Counter.invoke(threading.Lock()), yr.YRTypeError,
         "argument 0 (lock) cannot be pickled"),
    Case("C.invoke", "a class that cannot be pickled",
         lambda ctx: unpicklable_class().invoke(), yr.YRTypeError,
         ("the class HoldsLock", "cannot be pickled")),
    Case("C.get_instance", "name not a str", lambda ctx: Counter.get_instance(1),
         yr.YRTypeError, "name and namespace must be str"),
    # -- handles and method calls (SPEC §3)
    Case("h.m.invoke", "missing argument", lambda ctx: ctx.h.double.invoke(), TypeError,
         "Counter.double.invoke(): missing a required argument: 'x'"),
    Case("h.m.invoke", "too many arguments", lambda ctx: ctx.h.add.invoke(1, 2), TypeError,
         "Counter.add.invoke(): too many positional arguments"),
    Case("h.m.invoke", "unpicklable argument (a lock)",
         lambda ctx: ctx.h.add.invoke(threading.Lock()), yr.YRTypeError,
         "argument 0 (lock) cannot be pickled"),
    Case("h.m.invoke", "after h.terminate()", _terminated, yr.YRRuntimeError,
         "this instance is terminated"),
    Case("h.m", "an unknown method", lambda ctx: ctx.h.no_such_method, AttributeError,
         "'Counter' object has no attribute 'no_such_method'"),
    Case("h.m(...)", "called directly", lambda ctx: ctx.h.add(1), yr.YRRuntimeError,
         "use handle.add.invoke(...)"),
    Case("h.m.options", "not an InvokeOptions", lambda ctx: ctx.h.add.options({"cpu": 1}),
         yr.YRTypeError, "expected yr.InvokeOptions, got dict"),
    Case("h.terminate", "is_sync not a bool", lambda ctx: ctx.h.terminate("yes"),
         yr.YRTypeError, "is_sync must be a bool"),
    # -- named instances
    Case("yr.get_instance", "name not a str", lambda ctx: yr.get_instance(1), yr.YRTypeError,
         "name and namespace must be str"),
    Case("yr.get_instance", "namespace not a str", lambda ctx: yr.get_instance("a", 1),
         yr.YRTypeError, "name and namespace must be str"),
    Case("yr.get_instance", "empty name", lambda ctx: yr.get_instance(""), yr.YRValueError,
         "name must not be empty"),
    Case("yr.get_instance", "negative timeout (TypeError, as in yr)",
         lambda ctx: yr.get_instance("a", "", -1), yr.YRTypeError, "timeout must be a number >= 0"),
    Case("yr.get_instance", "timeout a str", lambda ctx: yr.get_instance("a", "", "1"),
         yr.YRTypeError, "timeout must be a number"),
    Case("yr.get_instance", "a name nobody created", lambda ctx: yr.get_instance("nobody", "", 1),
         yr.YRRuntimeError, ("failed to get instance", "nobody", "does not exist")),
    Case("yr.list_named_instances", "all_namespaces not a bool",
         lambda ctx: yr.list_named_instances("yes"), yr.YRTypeError,
         "all_namespaces must be a bool"),
    Case("yr.exit", "called outside an instance method", lambda ctx: yr.exit(),
         yr.YRRuntimeError, "can only be called inside a method of an instance"),
    Case("yr.kv_read", "a key never written, timeout 0", lambda ctx: yr.kv_read("kv-never", 0),
         yr.YRTimeoutError, "['kv-never'] not present"),
    Case("yr.kill_instance", "instance_id not a str", lambda ctx: yr.kill_instance(1),
         yr.YRTypeError, "instance_id must be str, got int"),
    # -- instance-only calls made from the driver
    Case("yr.save_state", "outside an instance", lambda ctx: yr.save_state(), yr.YRRuntimeError,
         "can only be called inside a method of an instance"),
    Case("yr.save_state", "timeout_sec not > 0", lambda ctx: yr.save_state(0), yr.YRValueError,
         "timeout_sec must be > 0"),
    Case("yr.save_state", "timeout_sec not a number", lambda ctx: yr.save_state("1"),
         yr.YRTypeError, "timeout_sec must be a number"),
    Case("yr.load_state", "outside an instance", lambda ctx: yr.load_state(), yr.YRRuntimeError,
         "inside a method of an instance"),
    # -- ObjectRef methods
    Case("ref.get", "timeout 0", lambda ctx: ctx.ref.get(0), yr.YRValueError,
         "greater than 0 or equal to -1"),
    Case("ref.wait", "timeout a str", lambda ctx: ctx.ref.wait("1"), yr.YRTypeError,
         "timeout must be a number"),
    Case("ref.on_complete", "callback not callable", lambda ctx: ctx.ref.on_complete(5),
         yr.YRTypeError, "callback must be callable"),
    Case("yr.put", "create_param not a CreateParam", lambda ctx: yr.put(1, {"x": 1}),
         yr.YRTypeError, "create_param must be a yr.CreateParam"),
    Case("yr.put", "create_param with a disk tier",
         lambda ctx: yr.put(1, yr.CreateParam(cache_type=yr.CacheType.DISK)), yr.YRValueError,
         "cache_type=CacheType.DISK is not supported"),
    Case("yr.put", "create_param with a second-level cache",
         lambda ctx: yr.put(1, yr.CreateParam(write_mode=yr.WriteMode.WRITE_THROUGH_L2_CACHE)),
         yr.YRValueError, "write_mode=WriteMode.WRITE_THROUGH_L2_CACHE is not supported"),
    # -- resource groups
    Case("yr.create_resource_group", "bundles not a list",
         lambda ctx: yr.create_resource_group({"CPU": 100}), yr.YRTypeError,
         "invalid bundles type, actual: dict"),
    Case("yr.create_resource_group", "no bundles", lambda ctx: yr.create_resource_group([]),
         yr.YRValueError, "invalid bundles number, actual: 0, expect: > 0."),
    Case("yr.create_resource_group", "unknown strategy",
         lambda ctx: yr.create_resource_group([{"CPU": 100}], strategy="TIGHT"),
         yr.YRValueError, "invalid strategy 'TIGHT'"),
    Case("yr.remove_resource_group", "neither a name nor a ResourceGroup",
         lambda ctx: yr.remove_resource_group(3), yr.YRTypeError,
         "expect: str or yr.ResourceGroup"),
]

GET_CASES = [
    # An argument is unpickled where the code runs: its failure can only show at yr.get.
    Case("f.invoke", "argument that fails to unpickle on the worker",
         lambda ctx: identity.invoke(Unrebuildable()), (ValueError, yr.YRInvokeError),
         ("cannot rebuild Unrebuildable", "could not be unpickled in the worker"), at="get"),
    Case("f.invoke", "argument of a class the worker cannot import",
         lambda ctx: identity.invoke(driver_only_object()),
         (ModuleNotFoundError, yr.YRInvokeError), "yrdask_driver_only_mod", at="get"),
    Case("f.invoke", "yr.put value that fails to unpickle on the worker",
         lambda ctx: identity.invoke(yr.put(Unrebuildable())), (ValueError, yr.YRInvokeError),
         "cannot rebuild Unrebuildable", at="get"),
    Case("C.invoke", "argument that fails to unpickle on the worker",
         lambda ctx: Counter.invoke(Unrebuildable()).add.invoke(),
         (ValueError, yr.YRInvokeError), "cannot rebuild Unrebuildable", at="get"),
    Case("C.invoke", "__init__ raises (creation is asynchronous, SPEC §3)",
         lambda ctx: FailsInit.invoke().ping.invoke(), (InitError, yr.YRInvokeError),
         "no luck in __init__", at="get"),
    Case("h.m.invoke", "argument that fails to unpickle on the worker",
         lambda ctx: ctx.h.double.invoke(Unrebuildable()), (ValueError, yr.YRInvokeError),
         "cannot rebuild Unrebuildable", at="get"),
    Case("h.m.invoke", "instance killed by yr.kill_instance", _killed_elsewhere,
         (yr.InstanceDiedError, RuntimeError), "has ended", at="get"),
    Case("f.invoke", "return_nums=2 but one value returned",
         lambda ctx: returns_one_value.invoke()[0],
         (TypeError, yr.YRInvokeError), "cannot unpack non-iterable", at="get"),
    Case("f.invoke", "return_nums=3 but two values returned",
         lambda ctx: returns_two_values.invoke()[0], (ValueError, yr.YRInvokeError),
         "not enough values to unpack (expected 3, got 2)", at="get"),
]

# Requests no worker can meet fail with a ScheduleError after about schedule_timeout_ms.
SCHEDULE_TIMEOUT_MS = 1000  # as in the rows below
INFEASIBLE = [
    Case("f.invoke", "more CPU than any worker",
         lambda ctx: add.options(yr.InvokeOptions(cpu=64000, schedule_timeout_ms=1000)).invoke(1),
         yr.ScheduleError, ("can never be scheduled", "CPU=64000"), at="get"),
    Case("f.invoke", "more memory than any worker",
         lambda ctx: add.options(yr.InvokeOptions(memory=10**9,
                                                  schedule_timeout_ms=1000)).invoke(1),
         yr.ScheduleError, "Memory", at="get"),
    Case("f.invoke", "an unknown custom_resources tag",
         lambda ctx: add.options(yr.InvokeOptions(custom_resources={"no_such_tag": 1},
                                                  schedule_timeout_ms=1000)).invoke(1),
         yr.ScheduleError, "no worker offers no_such_tag=1", at="get"),
    Case("C.invoke", "more CPU than any worker",
         lambda ctx: Counter.options(yr.InvokeOptions(cpu=64000, schedule_timeout_ms=1000))
         .invoke().add.invoke(),
         yr.ScheduleError, "CPU=64000", at="get"),
    Case("C.invoke", "an unknown custom_resources tag (Ray-style resources=)",
         lambda ctx: Counter.options(resources={"no_such_tag": 2},
                                     schedule_timeout_ms=1000).invoke().add.invoke(),
         yr.ScheduleError, "no_such_tag", at="get"),
]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def not_initialized(cluster):
    cluster.finalize()
    assert not yr.is_initialized()


@pytest.fixture
def embedded(cluster):
    return cluster(kind="embedded", num_cpus=2)


@pytest.fixture
def ctx(embedded):
    """A ready ref and a live instance handle to aim the bad calls at."""
    h = Counter.invoke()
    space = SimpleNamespace(ref=add.invoke(1), h=h)
    assert yr.get([space.ref, h.add.invoke()], T) == [2, 1]
    yield space
    h.terminate()


def _run(case: Case, ctx: Any) -> BaseException:
    """Make the bad call; return the error, checking it came where the case says."""
    if case.at == "call":
        with pytest.raises(case.exc) as info:
            case.act(ctx)
        return info.value
    start = time.monotonic()
    ref = case.act(ctx)  # must not raise: the error belongs to the result
    assert time.monotonic() - start < QUICK, f"{case.id}: the call blocked"
    assert isinstance(ref, yr.ObjectRef), f"{case.id}: expected an ObjectRef, got {ref!r}"
    with pytest.raises(case.exc) as info:
        yr.get(ref, T)
    assert not isinstance(info.value, yr.YRTimeoutError), f"{case.id}: get timed out"
    return info.value


# --------------------------------------------------------------------------- tests


@pytest.mark.filterwarnings("ignore:Couldn't detect a suitable IP address:RuntimeWarning")
@pytest.mark.parametrize("case", BEFORE_INIT, ids=lambda c: c.id)
def test_before_init(not_initialized, case):
    _check_message(case, _run(case, None))
    assert not yr.is_initialized(), f"{case.id} left a runtime behind"


def test_init_to_an_unreachable_address_fails_naming_it(not_initialized):
    # A port bound and held, never listened on: connects are refused, and no other process
    # (a worker of another test) can take it meanwhile, as it could once a probe closed it.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        address = f"tcp://127.0.0.1:{port}"
        start = time.monotonic()
        with dask.config.set({"distributed.comm.timeouts.connect": "2s"}):
            with pytest.raises((yr.YRRuntimeError, OSError)) as info:
                yr.init(yr.Config(server_address=address))
    assert address in str(info.value)
    assert time.monotonic() - start < 30
    assert not yr.is_initialized()


def test_finalize_before_init_is_a_no_op(not_initialized):
    yr.finalize()
    assert not yr.is_initialized()


@pytest.mark.parametrize("case", CALL_CASES, ids=lambda c: c.id)
def test_bad_call_raises_at_the_call(ctx, case):
    _check_message(case, _run(case, ctx))


@pytest.mark.parametrize("case", GET_CASES, ids=lambda c: c.id)
def test_bad_input_the_cluster_finds_raises_at_get(ctx, case):
    _check_message(case, _run(case, ctx))


def test_the_job_still_works_after_the_bad_calls(ctx):
    assert yr.get(add.invoke(2), T) == 3
    assert yr.get(ctx.h.add.invoke(5), T) == 6
    with pytest.raises(ValueError):  # a method's bad argument does not kill the instance
        yr.get(ctx.h.double.invoke(Unrebuildable()), T)
    assert yr.get(ctx.h.double.invoke(4), T) == 8


@pytest.mark.parametrize("case", INFEASIBLE, ids=lambda c: c.id)
def test_infeasible_request_fails_after_the_schedule_timeout(ctx, case):
    start = time.monotonic()
    err = _run(case, ctx)
    elapsed = time.monotonic() - start
    _check_message(case, err)
    assert isinstance(err, RuntimeError)
    assert elapsed >= 0.9 * SCHEDULE_TIMEOUT_MS / 1000, f"failed too soon: {elapsed:.2f} s"
    assert elapsed < SCHEDULE_TIMEOUT_MS / 1000 + 10, f"failed only after {elapsed:.2f} s"


def test_zero_schedule_timeout_fails_at_once(ctx):
    ref = add.options(yr.InvokeOptions(cpu=64000, schedule_timeout_ms=0)).invoke(1)
    start = time.monotonic()
    with pytest.raises(yr.ScheduleError, match="CPU=64000"):
        yr.get(ref, T)
    assert time.monotonic() - start < QUICK


def test_refs_and_handles_do_not_outlive_finalize(cluster):
    cluster(kind="embedded", num_cpus=2)
    old = identity.invoke(yr.put(1))
    h = Counter.invoke()
    assert yr.get(h.add.invoke(), T) == 1
    cluster.finalize()
    with pytest.raises(yr.YRRuntimeError, match="not initialized"):
        yr.get(old, T)
    cluster(kind="embedded", num_cpus=2)  # a new job: the old refs and handles are dead
    for act in (lambda: yr.get(old, T), lambda: yr.wait([old], 1, T),
                lambda: old.get(T), lambda: identity.invoke(old)):
        start = time.monotonic()
        with pytest.raises(yr.YRRuntimeError, match="finalized"):
            act()
        assert time.monotonic() - start < QUICK
    with pytest.raises(yr.YRRuntimeError, match="this instance is terminated"):
        h.add.invoke()
    h.terminate()  # a no-op: yr.finalize() already ended it
    assert yr.get(add.invoke(1), T) == 2


# --------------------------------------------------------------------------- the matrix is complete

PROXIES = {yr.FunctionProxy: "f", yr.InstanceCreator: "C", yr.InstanceProxy: "h",
           yr.MethodProxy: "h.m", yr.ObjectRef: "ref"}
# Public calls that take no input that could be bad (docs/errors.md says so).
NO_INPUT = {"yr.finalize", "yr.is_initialized", "f.get_original_func", "C.get_original_cls",
            "h.is_activate", "ref.done", "ref.is_exception", "ref.get_future", "ref.as_future",
            "ref.id", "ref.task_id", "yr.get_namespace", "h.real_id", "ref.future", "ref.hex"}


def _all_cases() -> list:
    from unit.test_bad_input_unit import CASES as UNIT_CASES

    return BEFORE_INIT + CALL_CASES + GET_CASES + INFEASIBLE + UNIT_CASES


def _public_calls() -> set[str]:
    calls = set()
    for name in yr.__all__:
        obj = getattr(yr, name)
        if inspect.isfunction(obj):
            calls.add(f"yr.{name}")
    calls |= {"yr.Config", "yr.InvokeOptions"}
    for cls, prefix in PROXIES.items():
        calls |= {f"{prefix}.{n}" for n in dir(cls) if not n.startswith("_")}
    return calls


def test_every_public_call_has_rows_in_the_matrix():
    labels = {c.call for c in _all_cases()}

    def covered(call: str) -> bool:
        pattern = re.compile(rf"(^|[@\s]){re.escape(call)}(\b|$)")
        return any(pattern.search(label) for label in labels)

    missing = sorted(c for c in _public_calls() - NO_INPUT if not covered(c))
    assert not missing, f"public calls with no bad-input row (add rows and docs): {missing}"


def test_docs_list_every_call_of_the_matrix():
    text = DOCS.read_text()
    labels = {c.call for c in _all_cases()} | NO_INPUT
    missing = sorted(label for label in labels if f"`{label}" not in text)
    assert not missing, f"docs/errors.md does not list: {missing}"


@pytest.mark.parametrize("bad, says", [
    ({"yrdask.scheduling.pipeline-depth": 0}, "pipeline-depth=0: expected a whole number"),
    ({"yrdask.scheduling.pipeline-refill": "four"}, "pipeline-refill='four': expected a whole"),
    ({"yrdask.scheduling.pipeline-refill": 9}, "pipeline-refill=9 is more than"),
    ({"yrdask.instances.light": "sometimes"}, "instances.light='sometimes': expected true"),
    ({"yrdask.worker.labels": {"zone": 1}}, "labels={'zone': 1}: expected a mapping of label"),
])
def test_yr_init_refuses_a_bad_yrdask_key_before_it_starts_anything(not_initialized, bad, says,
                                                                    monkeypatch):
    """``yrdask.scheduling.pipeline-depth`` / ``pipeline-refill`` (docs/scheduling.md) and
    ``yrdask.instances.light`` (docs/isolation.md): a bad value is refused by ``yr.init``
    itself, naming the key, before the embedded cluster's launcher starts (the submitter
    reads them only once the workers are starting, creations later).  The shared
    cluster is finalized first (``not_initialized``): yr.init must get as far as its checks."""
    import dask
    import psutil

    from yrdask.deploy.embedded import EmbeddedCluster

    def launch(self) -> None:
        raise AssertionError("yr.init started the embedded cluster's launcher")

    monkeypatch.setattr(EmbeddedCluster, "launch", launch)
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    with dask.config.set(bad), pytest.raises(yr.errors.YRValueError, match=says):
        yr.init(yr.Config(num_cpus=1))
    assert not yr.is_initialized()
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children
