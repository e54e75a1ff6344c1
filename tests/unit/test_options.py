"""Unit tests for yrdask.options: InvokeOptions, Config and their checks."""

from __future__ import annotations

import dataclasses
import logging
import re

import pytest

import yrdask as yr
from yrdask.errors import YRTypeError, YRValueError
from yrdask.options import (
    Config,
    InvokeOptions,
    check_config,
    check_invoke_options,
    check_return_nums,
)

pytestmark = pytest.mark.timeout(30)

INT32_MAX = 0x7FFFFFFF


# --------------------------------------------------------------------------- InvokeOptions defaults


def test_invoke_options_defaults_match_yr():
    o = InvokeOptions()
    assert (o.cpu, o.memory, o.cpu_limit, o.mem_limit) == (500, 500, 0, 0)
    assert o.concurrency is None
    assert o.custom_resources == {} and o.custom_extensions == {} and o.env_vars == {}
    assert o.labels == [] and o.port_forwardings == []
    assert o.schedule_affinities == [] and isinstance(o.schedule_affinities, list)
    assert o.max_invoke_latency == 5000
    assert o.recover_retry_times == 0 and o.retry_times == 0
    assert o.need_order is None
    assert o.name == "" and o.namespace == ""
    assert o.schedule_timeout_ms == 30000
    assert o.idle_timeout == 300
    assert o.get_if_exists is False and o.bypass_datasystem is False
    assert o.device is None and o.debug is None
    assert o.preferred_priority is True
    assert o.required_priority is False
    assert o.preferred_anti_other_labels is False


def test_invoke_options_field_names_are_complete():
    expected = {
        "cpu", "memory", "cpu_limit", "mem_limit", "concurrency", "custom_resources",
        "custom_extensions", "pod_labels", "labels", "affinity", "device", "max_invoke_latency",
        "min_instances", "max_instances", "recover_retry_times", "need_order", "name", "namespace",
        "schedule_affinities", "is_data_affinity", "resource_group_options",
        "function_group_options", "env_vars", "retry_times", "trace_id", "alias_params",
        "runtime_env", "debug", "preempted_allowed", "instance_priority", "schedule_timeout_ms",
        "group_name", "idle_timeout", "is_delete_remote_tensor", "bypass_datasystem",
        "skip_serialize", "port_forwardings", "get_if_exists", "isolated", "light",
    }
    assert {f.name for f in dataclasses.fields(InvokeOptions)} == expected


def test_mutable_defaults_are_not_shared():
    a, b = InvokeOptions(), InvokeOptions()
    a.custom_resources["gpu"] = 1
    a.labels.append("x")
    assert b.custom_resources == {} and b.labels == []


@pytest.mark.parametrize("attr", ["preferred_priority", "required_priority", "preferred_anti_other_labels"])
def test_priority_flags_are_not_constructor_kwargs(attr):
    with pytest.raises(TypeError):
        InvokeOptions(**{attr: True})


def test_priority_flags_can_be_set_on_instance_and_are_checked():
    o = InvokeOptions()
    o.preferred_priority = False
    assert o.validate().preferred_priority is False
    assert InvokeOptions.preferred_priority is True
    o.preferred_priority = "yes"
    with pytest.raises(YRTypeError, match="preferred_priority"):
        o.validate()


# --------------------------------------------------------------------------- InvokeOptions validation


def test_validate_returns_self():
    o = InvokeOptions(cpu=1000, memory=1024, name="a")
    assert o.validate() is o


def test_type_error_message_names_field_value_and_expectation():
    with pytest.raises(YRTypeError) as ei:
        InvokeOptions(cpu="1").validate()
    assert str(ei.value) == "InvokeOptions.cpu must be an int (millicores), got '1' (str)"
    assert isinstance(ei.value, TypeError)


BAD_TYPES = [
    ("cpu", True), ("cpu", 1.5), ("memory", "1"), ("memory", False),
    ("cpu_limit", 1.0), ("mem_limit", None),
    ("concurrency", True), ("concurrency", "2"),
    ("custom_resources", []), ("custom_resources", {1: 1}), ("custom_resources", {"gpu": "1"}),
    ("custom_resources", {"gpu": True}),
    ("custom_extensions", "x"), ("custom_extensions", {1: "a"}), ("custom_extensions", {"a": 1.5}),
    ("custom_extensions", {"a": True}),
    ("env_vars", []), ("env_vars", {"A": 1}), ("env_vars", {1: "a"}),
    ("labels", "a"), ("labels", ["a", 1]),
    ("name", 1), ("namespace", None), ("trace_id", b"x"), ("group_name", 0),
    ("retry_times", "3"), ("recover_retry_times", 1.0), ("min_instances", True),
    ("max_instances", "1"), ("max_invoke_latency", 1.5),
    ("schedule_timeout_ms", 1.5), ("idle_timeout", "300"), ("instance_priority", "0"),
    ("is_data_affinity", 1), ("preempted_allowed", "no"), ("is_delete_remote_tensor", 0),
    ("bypass_datasystem", None), ("skip_serialize", 1), ("get_if_exists", "yes"),
    ("need_order", 1), ("need_order", "true"),
    ("schedule_affinities", {}), ("schedule_affinities", [object()]), ("runtime_env", []), ("port_forwardings", ()),
    ("pod_labels", {"a": 1}),
]


@pytest.mark.parametrize("name,value", BAD_TYPES)
def test_bad_types_raise_yr_type_error_naming_field(name, value):
    with pytest.raises(YRTypeError) as ei:
        InvokeOptions(**{name: value}).validate()
    assert f"InvokeOptions.{name} " in str(ei.value)
    assert repr(value)[:20] in str(ei.value)


BAD_VALUES = [
    ("cpu", -1), ("memory", -1),
    ("concurrency", 0), ("concurrency", 1001), ("concurrency", -5),
    ("retry_times", -1), ("retry_times", INT32_MAX + 1),
    ("recover_retry_times", -2), ("recover_retry_times", INT32_MAX + 1),
    ("min_instances", -1), ("min_instances", INT32_MAX + 1),
    ("max_instances", -2), ("max_instances", INT32_MAX + 1),
    ("max_invoke_latency", -2), ("max_invoke_latency", INT32_MAX + 1),
    ("schedule_timeout_ms", -2), ("idle_timeout", -1),
    ("custom_resources", {"gpu": -1}),
]


@pytest.mark.parametrize("name,value", BAD_VALUES)
def test_bad_values_raise_yr_value_error_naming_field(name, value):
    with pytest.raises(YRValueError) as ei:
        InvokeOptions(**{name: value}).validate()
    assert f"InvokeOptions.{name} " in str(ei.value)
    assert isinstance(ei.value, ValueError)


GOOD_VALUES = [
    ("cpu", 0), ("memory", 0), ("concurrency", 1), ("concurrency", 1000), ("concurrency", None),
    ("retry_times", 0), ("retry_times", INT32_MAX),
    ("recover_retry_times", -1), ("recover_retry_times", INT32_MAX),
    ("schedule_timeout_ms", -1), ("schedule_timeout_ms", 0),
    ("custom_resources", {"gpu": 1, "ssd": 0.5, "zero": 0}),
    ("custom_extensions", {"lifecycle": "detached"}),
    ("env_vars", {"A": "1"}), ("labels", ["k", "k:v"]), ("need_order", True),
    ("need_order", False), ("runtime_env", {"env_vars": {"A": "1"}}),
    ("schedule_affinities", [yr.Affinity(yr.AffinityKind.RESOURCE, yr.AffinityType.REQUIRED,
                                         [yr.LabelOperator(yr.OperatorType.LABEL_IN, "NODE_ID",
                                                           ["tcp://h:1"])])]),
]


@pytest.mark.parametrize("name,value", GOOD_VALUES)
def test_good_values_pass(name, value):
    o = InvokeOptions(**{name: value})
    assert o.validate() is o


def test_error_message_shows_the_bad_value_and_range():
    with pytest.raises(YRValueError) as ei:
        InvokeOptions(concurrency=1001).validate()
    msg = str(ei.value)
    assert "concurrency" in msg and "1001" in msg and "[1, 1000]" in msg


@pytest.mark.parametrize("limit,base", [("cpu_limit", "cpu"), ("mem_limit", "memory")])
def test_limits_must_be_zero_or_at_least_request(limit, base):
    assert InvokeOptions(**{base: 1000, limit: 0}).validate()
    # a limit >= the request is well formed, but yrdask caps nothing: it is rejected by name
    with pytest.raises(YRValueError, match=f"InvokeOptions.{limit} is not supported"):
        InvokeOptions(**{base: 1000, limit: 2000}).validate()
    with pytest.raises(YRValueError) as ei:
        InvokeOptions(**{base: 1000, limit: 999}).validate()
    assert f"InvokeOptions.{limit} " in str(ei.value) and "999" in str(ei.value)
    with pytest.raises(YRValueError, match=limit):
        InvokeOptions(**{limit: -1}).validate()


@pytest.mark.parametrize("key,hint", [("CPU", "cpu"), ("Memory", "memory")])
def test_custom_resources_cpu_memory_keys_point_to_fields(key, hint):
    with pytest.raises(YRValueError) as ei:
        InvokeOptions(custom_resources={key: 1}).validate()
    msg = str(ei.value)
    assert "InvokeOptions.custom_resources" in msg
    assert f"InvokeOptions.{hint}" in msg


def test_need_order_with_concurrency_above_one_is_value_error():
    assert InvokeOptions(need_order=True, concurrency=1).validate()
    assert InvokeOptions(need_order=False, concurrency=8).validate()
    assert InvokeOptions(need_order=None, concurrency=8).validate()
    with pytest.raises(YRValueError) as ei:
        InvokeOptions(need_order=True, concurrency=2).validate()
    assert "need_order" in str(ei.value) and "concurrency" in str(ei.value)


def test_get_if_exists_requires_name():
    with pytest.raises(YRValueError, match="get_if_exists"):
        InvokeOptions(get_if_exists=True).validate()
    assert InvokeOptions(get_if_exists=True, name="a").validate()


# --------------------------------------------------------------------------- behaviour helpers


def test_resource_shape_includes_cpu_memory_and_nonzero_custom():
    o = InvokeOptions(cpu=1500, memory=2048, custom_resources={"gpu": 1, "ssd": 0, "npu": 0.5})
    shape = o.resource_shape()
    assert shape == {"CPU": 1500.0, "Memory": 2048.0, "gpu": 1.0, "npu": 0.5}
    assert all(isinstance(v, float) for v in shape.values())


def test_resource_shape_defaults():
    assert InvokeOptions().resource_shape() == {"CPU": 500.0, "Memory": 500.0}


def test_is_detached():
    assert InvokeOptions().is_detached is False
    assert InvokeOptions(custom_extensions={"lifecycle": "detached"}).is_detached is True
    with pytest.raises(YRValueError, match="InvokeOptions.custom_extensions"):
        InvokeOptions(custom_extensions={"lifecycle": "other"})


@pytest.mark.parametrize("ext", [{"Concurrency": "2"}, {"RECOVER_RETRY_TIMEOUT": "100"},
                                 {"GRACEFUL_SHUTDOWN_TIME": "-1"},
                                 {"GRACEFUL_SHUTDOWN_TIME": "soon"}])
def test_custom_extensions_other_than_the_honoured_ones_are_rejected(ext):
    with pytest.raises(YRValueError) as ei:
        InvokeOptions(custom_extensions=ext)
    assert "InvokeOptions.custom_extensions" in str(ei.value)
    assert "GRACEFUL_SHUTDOWN_TIME" in str(ei.value)


@pytest.mark.parametrize("grace", [0, "0", 10, "30"])
def test_a_whole_number_of_seconds_is_a_grace_period(grace):
    opts = InvokeOptions(custom_extensions={"GRACEFUL_SHUTDOWN_TIME": grace})
    assert opts.custom_extensions == {"GRACEFUL_SHUTDOWN_TIME": grace}


def test_copy_is_independent():
    o = InvokeOptions(
        custom_resources={"gpu": 1},
        custom_extensions={"lifecycle": "detached"},
        labels=["a"],
        env_vars={"A": "1"},
        runtime_env={"env_vars": {"B": "2"}},
        name="n",
    )
    o.preferred_priority = False
    c = o.copy()
    assert c == o and c is not o
    assert c.preferred_priority is False
    c.custom_resources["gpu"] = 5
    c.custom_extensions.clear()
    c.labels.append("b")
    c.env_vars["C"] = "3"
    c.runtime_env["env_vars"]["B"] = "changed"
    c.name = "m"
    assert o.custom_resources == {"gpu": 1}
    assert o.custom_extensions == {"lifecycle": "detached"}
    assert o.labels == ["a"]
    assert o.env_vars == {"A": "1"}
    assert o.runtime_env == {"env_vars": {"B": "2"}}
    assert o.name == "n"


def test_check_invoke_options():
    o = InvokeOptions()
    assert check_invoke_options(o) is o
    with pytest.raises(YRTypeError, match=r"expected yr\.InvokeOptions, got dict"):
        check_invoke_options({"cpu": 1})
    with pytest.raises(YRTypeError, match="expected yr.InvokeOptions"):
        check_invoke_options(None)
    with pytest.raises(YRValueError, match="InvokeOptions.cpu"):
        check_invoke_options(InvokeOptions(cpu=-1))


# --------------------------------------------------------------------------- check_return_nums


@pytest.mark.parametrize("n", [0, 1, 2, 100])
def test_check_return_nums_accepts(n):
    assert check_return_nums(n) == n


@pytest.mark.parametrize("n", [True, 1.0, "1", None])
def test_check_return_nums_type_error(n):
    with pytest.raises(YRTypeError, match="return_nums"):
        check_return_nums(n)


@pytest.mark.parametrize("n", [-1, 101])
def test_check_return_nums_value_error(n):
    with pytest.raises(YRValueError) as ei:
        check_return_nums(n)
    assert "return_nums" in str(ei.value) and str(n) in str(ei.value)


def test_check_return_nums_uses_given_name():
    with pytest.raises(YRValueError, match="num_returns"):
        check_return_nums(200, "num_returns")


# --------------------------------------------------------------------------- Config


def test_config_defaults():
    c = Config()
    assert c.server_address == "" and c.log_level == "" and c.job_id == "" and c.ns == ""
    assert c.is_driver is True and c.local_mode is False
    assert c.invoke_timeout == 900 and c.rpc_timeout == 1800
    assert c.connection_nums == 100 and c.recycle_time == 2
    assert c.log_dir == "./" and c.runtime_id == "driver" and c.max_task_instance_num == -1
    assert c.tls_config is None and c.deployment_config is None and c.logger is None
    assert c.num_cpus is None and c.security is None and c.in_cluster is None
    assert c.load_paths == [] and c.custom_envs == {} and c.master_addr_list == []
    assert c.enable_metrics is True and c.dedup_logs is True and c.log_to_driver is False
    assert c.http_ioc_threads_num == 400
    assert c.validate() is c


def test_config_repr_hides_secrets():
    c = Config()
    c.auth_token, c.private_key_paaswd = "tok-secret", "pw-secret"
    text = repr(c)
    assert "tok-secret" not in text and "pw-secret" not in text


@pytest.mark.parametrize("name", ["auth_token", "private_key_paaswd"])
def test_rejected_secret_is_not_shown(name):
    with pytest.raises(YRValueError) as ei:
        Config(**{name: "s3cret"})
    assert f"Config.{name} is not supported" in str(ei.value) and "s3cret" not in str(ei.value)


def test_config_resolved_from_env(monkeypatch):
    monkeypatch.setenv("YR_SERVER_ADDRESS", "10.0.0.1:8786")
    monkeypatch.setenv("YR_LOG_LEVEL", "DEBUG")
    conf = Config()
    r = conf.resolved()
    assert r is not conf
    assert r.server_address == "10.0.0.1:8786"
    assert r.log_level == "DEBUG"
    assert r.ns == ""
    assert re.fullmatch(r"job-[0-9a-f]{8}", r.job_id)
    assert conf.server_address == "" and conf.job_id == ""  # original untouched


def test_config_resolved_defaults_without_env(monkeypatch):
    monkeypatch.delenv("YR_SERVER_ADDRESS", raising=False)
    monkeypatch.delenv("YR_LOG_LEVEL", raising=False)
    r = Config().resolved()
    assert r.server_address == ""
    assert r.log_level == "WARNING"
    assert r.job_id.startswith("job-")


def test_config_resolved_keeps_explicit_values(monkeypatch):
    monkeypatch.setenv("YR_SERVER_ADDRESS", "env:1")
    monkeypatch.setenv("YR_LOG_LEVEL", "DEBUG")
    r = Config(server_address="explicit:2", log_level="INFO", job_id="job-mine").resolved()
    assert (r.server_address, r.log_level, r.job_id) == ("explicit:2", "INFO", "job-mine")


def test_config_resolved_job_ids_differ():
    assert Config().resolved().job_id != Config().resolved().job_id


def test_config_resolved_copy_is_independent():
    c = Config(custom_envs={}, log_level="INFO")
    r = c.resolved()
    r.custom_envs["B"] = "b"
    assert c.custom_envs == {}


CONFIG_BAD_TYPES = [
    ("server_address", 1), ("function_id", None), ("ns", 0), ("job_id", 1),
    ("is_driver", 1), ("local_mode", "yes"), ("auto", None), ("enable_metrics", 0),
    ("in_cluster", "x"),
    ("num_cpus", 1.5), ("num_cpus", True), ("connection_nums", "1"), ("recycle_time", 1.5),
    ("recycle_time", True), ("log_level", 1.0), ("log_level", True), ("log_level", None),
    ("invoke_timeout", "900"), ("rpc_timeout", 1.0), ("load_paths", "a"),
    ("custom_envs", {"A": 1}), ("runtime_env", []),
]


@pytest.mark.parametrize("name,value", CONFIG_BAD_TYPES)
def test_config_bad_types(name, value):
    with pytest.raises(YRTypeError) as ei:
        Config(**{name: value}).validate()
    assert f"Config.{name} " in str(ei.value)


CONFIG_BAD_VALUES = [
    ("num_cpus", -1), ("connection_nums", 0), ("recycle_time", 0), ("recycle_time", 301),
    ("recycle_time", -1), ("invoke_timeout", 0), ("rpc_timeout", -1),
]


@pytest.mark.parametrize("name,value", CONFIG_BAD_VALUES)
def test_config_bad_values(name, value):
    with pytest.raises(YRValueError) as ei:
        Config(**{name: value}).validate()
    assert f"Config.{name} " in str(ei.value) and str(value) in str(ei.value)


@pytest.mark.parametrize(
    "name,value",
    [("num_cpus", 0), ("num_cpus", 1), ("num_cpus", None),
     ("log_level", logging.INFO), ("log_level", "ERROR"),
     ("logger", logging.getLogger("x")), ("log_to_driver", True), ("dedup_logs", False)],
)
def test_config_good_values(name, value):
    c = Config(**{name: value})
    assert c.validate() is c


def test_config_security():
    from distributed.security import Security

    sec = Security()
    assert Config(security=sec).validate().security is sec
    with pytest.raises((YRTypeError, YRValueError), match="Config.security"):
        Config(security="tls://").validate()


def test_config_resolved_validates():
    with pytest.raises(YRValueError, match="Config.recycle_time"):
        Config(recycle_time=1000).resolved()


def test_check_config(monkeypatch):
    monkeypatch.setenv("YR_SERVER_ADDRESS", "host:1")
    r = check_config(None)
    assert isinstance(r, Config) and r.server_address == "host:1" and r.job_id.startswith("job-")
    c = Config(job_id="job-x")
    r2 = check_config(c)
    assert r2.job_id == "job-x" and r2 is not c
    with pytest.raises(YRTypeError, match=r"expected yr\.Config, got dict"):
        check_config({})


def test_check_config_num_cpus_with_server_address_is_rejected(monkeypatch):
    monkeypatch.delenv("YR_SERVER_ADDRESS", raising=False)
    with pytest.raises(YRValueError, match="Config.num_cpus sizes only the embedded cluster"):
        check_config(Config(server_address="tcp://h:1", num_cpus=2))
    # an address from the environment does not make a script sized for the embedded one fail
    monkeypatch.setenv("YR_SERVER_ADDRESS", "tcp://h:1")
    assert check_config(Config(num_cpus=2)).server_address == "tcp://h:1"


@pytest.mark.parametrize("name", ["verify_file_path", "certificate_file_path", "private_key_path"])
def test_tls_paths_without_enable_tls_are_rejected(name):
    with pytest.raises(YRValueError) as ei:
        Config(**{name: "/x.pem"}).validate()
    assert f"Config.{name} is read only when enable_tls=True" in str(ei.value)
    assert Config(**{name: "/x.pem"}, enable_tls=True).validate()


def test_auto_with_server_address_is_rejected():
    assert Config(auto=True).validate()
    with pytest.raises(YRValueError, match="Config.auto"):
        Config(auto=True, server_address="tcp://h:1").validate()


# --------------------------------------------------------------------------- honoured Config fields (driver side)

import asyncio  # noqa: E402

from yrdask.api import session  # noqa: E402

A = "f pid=1, node=tcp://h:1"
B = "f pid=2, node=tcp://h:2"


@pytest.fixture
def printer_loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def test_printer_prefixes_lines_and_keeps_streams_apart(printer_loop, capsys):
    p = session._Printer(dedup=False, loop=printer_loop)
    p([(A, "stdout", "one\ntwo\n"), (A, "stderr", "oops\n"), (B, "stdout", "partial")])
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"({A}) one", f"({A}) two", f"({B}) partial"]
    assert err.splitlines() == [f"({A}) oops"]


def test_printer_dedup_counts_a_line_repeated_by_other_processes(printer_loop, capsys):
    p = session._Printer(dedup=True, loop=printer_loop)
    p([(A, "stdout", "same\n"), (B, "stdout", "same\n")])
    p([("g pid=2, node=tcp://h:2", "stdout", "same\n")])  # same process, other function
    p([(A, "stdout", "same\n")])  # repeats of one process are all printed
    assert capsys.readouterr().out.splitlines() == [f"({A}) same", f"({A}) same"]
    p.expire(everything=True)
    assert capsys.readouterr().out.splitlines() == [
        "(g pid=2, node=tcp://h:2) same [repeated 2x across cluster]"]


def test_printer_without_dedup_prints_every_line(printer_loop, capsys):
    p = session._Printer(dedup=False, loop=printer_loop)
    p([(A, "stdout", "same\n"), (B, "stdout", "same\n")])
    assert capsys.readouterr().out.splitlines() == [f"({A}) same", f"({B}) same"]


def test_env_file_sets_driver_environment(tmp_path, monkeypatch):
    path = tmp_path / ".env"
    path.write_text("# comment\n\nexport YR_T_A=1\nYR_T_B = 'two words'\nYR_T_C=\"x=y\"\n")
    for k in ("YR_T_A", "YR_T_B", "YR_T_C"):
        monkeypatch.delenv(k, raising=False)
    session._load_env_file(str(path))
    import os

    assert (os.environ["YR_T_A"], os.environ["YR_T_B"], os.environ["YR_T_C"]) == \
        ("1", "two words", "x=y")
    for k in ("YR_T_A", "YR_T_B", "YR_T_C"):
        monkeypatch.delenv(k)


def test_env_file_errors_name_the_file_and_line(tmp_path):
    with pytest.raises(YRValueError, match="Config.env_file .* cannot be read"):
        session._load_env_file(str(tmp_path / "missing.env"))
    bad = tmp_path / "bad.env"
    bad.write_text("OK=1\nnot a setting\n")
    with pytest.raises(YRValueError, match="line 2 is not KEY=VALUE"):
        session._load_env_file(str(bad))


def test_logger_gets_yrdask_records_until_reset():
    got: list[logging.LogRecord] = []
    target = logging.getLogger("test-options-target")
    handler = logging.Handler()
    handler.emit = got.append  # type: ignore[method-assign]
    target.addHandler(handler)
    yl = logging.getLogger("yrdask")
    old_level = yl.level
    yl.setLevel(logging.INFO)
    try:
        session._forward_logs(target)
        logging.getLogger("yrdask.sub").info("to the user's logger")
        session._forward_logs(None)
        logging.getLogger("yrdask.sub").info("not any more")
    finally:
        session._forward_logs(None)
        yl.setLevel(old_level)
        target.removeHandler(handler)
    assert [r.getMessage() for r in got] == ["to the user's logger"]
    assert yl.propagate is True
