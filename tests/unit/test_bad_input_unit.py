"""The bad-input matrix, part 1: the checks that need no cluster.

Options, settings and decorators are checked where they are written: each row below makes one
bad call and expects a typed error from that very call, whose message names the problem.
The rows that need a cluster (arguments, objects, instances, resources, calls before
``yr.init``) are in ``tests/test_bad_input.py``; ``docs/errors.md`` lists both.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import pytest

import yrdask as yr

pytestmark = pytest.mark.timeout(30)


@dataclasses.dataclass(frozen=True)
class Case:
    """One bad call: ``act()`` must raise ``exc`` whose message contains ``says``."""

    call: str  # the public call, as docs/errors.md names it
    bad: str  # what is wrong with the input
    act: Callable[[], Any]
    exc: type[BaseException]
    says: str  # a substring of str(error), compared case-insensitively

    @property
    def id(self) -> str:
        return f"{self.call} | {self.bad}"


def plain(a, b=1):
    return a + b


async def coro():
    return 1


class Plain:
    def m(self, x):
        return x


f = yr.invoke(plain)
C = yr.instance(Plain)


def _set(opts: yr.InvokeOptions, **fields) -> yr.InvokeOptions:
    for k, v in fields.items():
        setattr(opts, k, v)
    return opts


CASES = [
    # -- yr.InvokeOptions: each field checked at construction, cross-field rules at use
    Case("yr.InvokeOptions", "unknown option name", lambda: yr.InvokeOptions(num_cpus=1),
         TypeError, "unexpected keyword argument 'num_cpus'"),
    Case("yr.InvokeOptions", "class flag as constructor argument",
         lambda: yr.InvokeOptions(preferred_priority=False), TypeError, "preferred_priority"),
    Case("yr.InvokeOptions", "cpu of the wrong type", lambda: yr.InvokeOptions(cpu="1000"),
         yr.YRTypeError, "InvokeOptions.cpu must be an int (millicores), got '1000'"),
    Case("yr.InvokeOptions", "cpu as a float", lambda: yr.InvokeOptions(cpu=1.5),
         yr.YRTypeError, "InvokeOptions.cpu must be an int"),
    Case("yr.InvokeOptions", "memory as a bool", lambda: yr.InvokeOptions(memory=True),
         yr.YRTypeError, "InvokeOptions.memory must be an int"),
    Case("yr.InvokeOptions", "negative cpu", lambda: yr.InvokeOptions(cpu=-1),
         yr.YRValueError, "InvokeOptions.cpu must be >= 0, got -1"),
    Case("yr.InvokeOptions", "concurrency out of [1, 1000]",
         lambda: yr.InvokeOptions(concurrency=1001), yr.YRValueError, "[1, 1000]"),
    Case("yr.InvokeOptions", "negative retry_times", lambda: yr.InvokeOptions(retry_times=-1),
         yr.YRValueError, "InvokeOptions.retry_times must be in [0, 2147483647]"),
    Case("yr.InvokeOptions", "schedule_timeout_ms below -1",
         lambda: yr.InvokeOptions(schedule_timeout_ms=-5), yr.YRValueError,
         "InvokeOptions.schedule_timeout_ms must be >= -1"),
    Case("yr.InvokeOptions", "custom_resources not a dict",
         lambda: yr.InvokeOptions(custom_resources=["GPU"]), yr.YRTypeError,
         "InvokeOptions.custom_resources must be a dict"),
    Case("yr.InvokeOptions", "custom_resources amount not a number",
         lambda: yr.InvokeOptions(custom_resources={"GPU": "1"}), yr.YRTypeError,
         "value of 'GPU' is a str"),
    Case("yr.InvokeOptions", "negative custom resource",
         lambda: yr.InvokeOptions(custom_resources={"GPU": -1}), yr.YRValueError,
         "key 'GPU' is negative"),
    Case("yr.InvokeOptions", "CPU given as a custom resource",
         lambda: yr.InvokeOptions(custom_resources={"CPU": 1}), yr.YRValueError,
         "set InvokeOptions.cpu (millicores) instead"),
    Case("yr.InvokeOptions", "name not a str", lambda: yr.InvokeOptions(name=1),
         yr.YRTypeError, "InvokeOptions.name must be a str"),
    Case("yr.InvokeOptions", "env_vars value not a str",
         lambda: yr.InvokeOptions(env_vars={"A": 1}), yr.YRTypeError, "InvokeOptions.env_vars"),
    Case("yr.InvokeOptions", "need_order with concurrency > 1 (at use)",
         lambda: f.options(yr.InvokeOptions(need_order=True, concurrency=2)), yr.YRValueError,
         "need_order must not be true with concurrency=2"),
    Case("yr.InvokeOptions", "get_if_exists without a name (at use)",
         lambda: C.options(yr.InvokeOptions(get_if_exists=True)), yr.YRValueError,
         "get_if_exists"),
    Case("yr.InvokeOptions", "cpu_limit below cpu (at use)",
         lambda: f.options(yr.InvokeOptions(cpu=1000, cpu_limit=500)), yr.YRValueError,
         "cpu_limit must be 0 or >= cpu"),
    Case("yr.InvokeOptions", "bad field set after construction (at use)",
         lambda: f.options(_set(yr.InvokeOptions(), cpu="x")), yr.YRTypeError,
         "InvokeOptions.cpu must be an int"),
    # -- yr.Config: each setting checked at construction
    Case("yr.Config", "unknown setting", lambda: yr.Config(cpus=2), TypeError,
         "unexpected keyword argument 'cpus'"),
    Case("yr.Config", "num_cpus of the wrong type", lambda: yr.Config(num_cpus="2"),
         yr.YRTypeError, "Config.num_cpus must be None or an int"),
    Case("yr.Config", "num_cpus negative", lambda: yr.Config(num_cpus=-1), yr.YRValueError,
         "Config.num_cpus must be >= 0, got -1"),
    Case("yr.Config", "server_address not a str", lambda: yr.Config(server_address=8786),
         yr.YRTypeError, "Config.server_address must be a str"),
    Case("yr.Config", "recycle_time out of (0, 300]", lambda: yr.Config(recycle_time=301),
         yr.YRValueError, "Config.recycle_time must be in (0, 300]"),
    Case("yr.Config", "log_level of the wrong type", lambda: yr.Config(log_level=1.5),
         yr.YRTypeError, "Config.log_level"),
    Case("yr.Config", "security not a Security", lambda: yr.Config(security="tls"),
         yr.YRTypeError, "Config.security"),
    # -- @yr.invoke
    Case("@yr.invoke", "unknown keyword (Ray's num_cpus=)", lambda: yr.invoke(num_cpus=1),
         yr.YRTypeError, "unknown keyword argument(s) 'num_cpus'"),
    Case("@yr.invoke", "positional argument that is not a function", lambda: yr.invoke(1),
         yr.YRRuntimeError, "only keyword arguments"),
    Case("@yr.invoke", "applied to a class", lambda: yr.invoke(Plain), yr.YRRuntimeError,
         "must be applied to a function"),
    Case("@yr.invoke", "applied to an async def", lambda: yr.invoke(coro), yr.YRRuntimeError,
         "'async def' cannot be a yr task"),
    Case("@yr.invoke", "invoke_options not an InvokeOptions",
         lambda: yr.invoke(invoke_options={"cpu": 1000}), yr.YRTypeError,
         "expected yr.InvokeOptions, got dict"),
    Case("@yr.invoke", "return_nums not an int", lambda: yr.invoke(return_nums="2"),
         yr.YRTypeError, "return_nums must be an int"),
    Case("@yr.invoke", "return_nums out of [0, 100]",
         lambda: yr.invoke(return_nums=101)(plain), yr.YRValueError,
         "return_nums must be in [0, 100], got 101"),
    Case("@yr.invoke", "initializer not callable", lambda: yr.invoke(initializer=5),
         yr.YRTypeError, "initializer must be callable"),
    # -- @yr.instance / @yr.method
    Case("@yr.instance", "unknown keyword", lambda: yr.instance(num_cpus=1), yr.YRTypeError,
         "unknown keyword argument(s) 'num_cpus'"),
    Case("@yr.instance", "applied to a function", lambda: yr.instance(plain), yr.YRRuntimeError,
         "only the keyword argument invoke_options"),
    Case("@yr.instance", "invoke_options not an InvokeOptions",
         lambda: yr.instance(invoke_options=1), yr.YRTypeError, "expected yr.InvokeOptions"),
    Case("@yr.method", "unknown keyword", lambda: yr.method(num_returns=2), yr.YRTypeError,
         "unknown keyword argument(s) 'num_returns'"),
    Case("@yr.method", "return_nums not an int", lambda: yr.method(return_nums=2.0),
         yr.YRTypeError, "return_nums must be an int"),
    Case("@yr.method", "return_nums negative", lambda: yr.method(return_nums=-1),
         yr.YRValueError, "return_nums must be in [0, 100]"),
    # -- proxies, before any cluster is needed
    Case("f.options", "not an InvokeOptions", lambda: f.options({"cpu": 1000}), yr.YRTypeError,
         "expected yr.InvokeOptions, got dict"),
    Case("f.options", "Ray-style keywords", lambda: f.options(num_cpus=1), TypeError,
         "num_cpus"),
    Case("f(...)", "called directly", lambda: f(1), yr.YRRuntimeError,
         "use plain.invoke(...)"),
    Case("C.options", "not an InvokeOptions", lambda: C.options("fast"), yr.YRTypeError,
         "expected yr.InvokeOptions, got str"),
    Case("C.options", "unknown Ray-style keyword", lambda: C.options(max_restart=1),
         yr.YRTypeError, "unknown option 'max_restart'"),
    Case("C.options", "a method name as a keyword", lambda: C.options(validate=False),
         yr.YRTypeError, "unknown option 'validate'"),
    Case("C.options", "lifetime other than 'detached'", lambda: C.options(lifetime="forever"),
         yr.YRValueError, "lifetime must be 'detached'"),
    Case("C.options", "resources not a dict", lambda: C.options(resources=2), yr.YRTypeError,
         "resources must be a dict"),
    Case("C.options", "resources amount not a number", lambda: C.options(resources={"a": "1"}),
         yr.YRTypeError, "value of 'a' is a str"),
    Case("C.options", "name not a str", lambda: C.options(name=7), yr.YRTypeError,
         "InvokeOptions.name must be a str"),
    Case("C.options", "concurrency out of range", lambda: C.options(concurrency=0),
         yr.YRValueError, "InvokeOptions.concurrency must be in [1, 1000]"),
    Case("C(...)", "instantiated directly", lambda: C(), yr.YRRuntimeError,
         "use Plain.invoke(...)"),
    # -- the KV API: arguments are checked before the cluster is asked
    Case("yr.kv_write", "key not a str", lambda: yr.kv_write(1, b"v"), yr.YRTypeError,
         "key must be a str, got int"),
    Case("yr.kv_write", "value a str", lambda: yr.kv_write("k", "v"), yr.YRTypeError,
         "value must be bytes, got str (encode a str first"),
    Case("yr.kv_write", "write_mode with a second-level cache",
         lambda: yr.kv_write("k", b"v", write_mode=yr.WriteMode.WRITE_THROUGH_L2_CACHE),
         yr.YRValueError, "needs a second-level cache"),
    Case("yr.kv_write", "cache_type DISK",
         lambda: yr.kv_write("k", b"v", cache_type=yr.CacheType.DISK), yr.YRValueError,
         "CacheType.DISK is not supported"),
    Case("yr.kv_write", "negative ttl_second", lambda: yr.kv_write("k", b"v", ttl_second=-1),
         yr.YRValueError, "ttl_second must be an int >= 0"),
    Case("yr.kv_write_with_param", "not a SetParam",
         lambda: yr.kv_write_with_param("k", b"v", {}), yr.YRTypeError, "expected a yr.SetParam"),
    Case("yr.kv_set", "SetParam with an int existence",
         lambda: yr.kv_set("k", b"v", yr.SetParam(existence=1)), yr.YRTypeError,
         "existence must be a yr.ExistenceOpt"),
    Case("yr.kv_m_write_tx", "existence not NX",
         lambda: yr.kv_m_write_tx(["k"], [b"v"], yr.MSetParam(existence=yr.ExistenceOpt.NONE)),
         yr.YRValueError, "existence should be NX"),
    Case("yr.kv_m_write_tx", "keys and values of different lengths",
         lambda: yr.kv_m_write_tx(["a", "b"], [b"v"]), yr.YRValueError, "size not equal"),
    Case("yr.kv_read", "timeout below -1", lambda: yr.kv_read("k", -2), yr.YRValueError,
         "'timeout' should be greater than or equal to 0 or equal to -1"),
    Case("yr.kv_read", "an empty list of keys", lambda: yr.kv_read([]), yr.YRTypeError,
         "non-empty list of str"),
    Case("yr.kv_get", "timeout 0", lambda: yr.kv_get("k", 0), yr.YRValueError,
         "'timeout' should be greater than 0 or equal to -1"),
    Case("yr.kv_get_with_param", "GetParams without params",
         lambda: yr.kv_get_with_param(["k"], yr.GetParams()), yr.YRValueError,
         "does not accept empty list"),
    Case("yr.kv_get_with_param", "a negative offset",
         lambda: yr.kv_get_with_param(["k"], yr.GetParams([yr.GetParam(offset=-1)])),
         yr.YRValueError, "GetParam.offset must be an int >= 0"),
    Case("yr.kv_del", "key not a str or list", lambda: yr.kv_del(3), yr.YRTypeError,
         "key must be a str or a non-empty list of str"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input_raises_typed_error_at_the_call(case: Case):
    with pytest.raises(case.exc) as info:
        case.act()
    assert case.says.lower() in str(info.value).lower(), (
        f"{case.id}: message does not name the problem: {info.value!r}")


def test_yr_type_and_value_errors_are_also_the_builtin_types():
    with pytest.raises(TypeError):
        yr.InvokeOptions(cpu="x")
    with pytest.raises(ValueError):
        yr.InvokeOptions(cpu=-1)


def test_good_options_still_construct_and_may_be_set_field_by_field():
    opts = yr.InvokeOptions(get_if_exists=True)  # cross-field rules wait for use
    opts.name = "n"
    assert C.options(opts) is not C


def test_method_accepts_the_keywords_yr_documents_as_ignored():
    @yr.method(return_nums=2, concurrency_group="io")
    def two(self):
        return 1, 2

    assert two.__yr_return_nums__ == 2



def test_owner_timeouts_are_read_from_the_config_and_checked():
    """``yrdask.object-store.owner-probe`` / ``owner-unreachable`` (docs/faults.md)."""
    import dask

    from yrdask.runtime.object_access import owner_timeouts

    assert owner_timeouts() == (1.0, 4.0)
    with dask.config.set({"yrdask.object-store.owner-unreachable": "500ms"}):
        assert owner_timeouts() == (1.0, 0.5)
    with dask.config.set({"yrdask.object-store.owner-probe": 0}):
        with pytest.raises(yr.errors.YRValueError, match="owner-probe must be a positive"):
            owner_timeouts()


def test_gc_freeze_key_is_a_bool():
    """``yrdask.process.gc-freeze`` (docs/scheduling.md): a non-bool is refused by name
    (``yr.init`` checks it before it starts anything: test_embedded_cluster)."""
    import dask

    from yrdask.runtime.heap import freeze_enabled

    assert freeze_enabled() is True
    with dask.config.set({"yrdask.process.gc-freeze": False}):
        assert freeze_enabled() is False
    with dask.config.set({"yrdask.process.gc-freeze": "no"}):
        with pytest.raises(yr.errors.YRValueError, match="gc-freeze is 'no'; set it to true"):
            freeze_enabled()
