"""yr's module paths (yr_api §1.0): ``import yr.config`` ... resolve to the very objects of the
top-level API (``is``, not copies), so code written against openYuanrong's modules runs."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import yr
import yrdask

pytestmark = pytest.mark.timeout(60)

#: module path -> names it must hold, each the same object as ``yrdask.<name>``.
PATHS: dict[str, list[str]] = {
    "yr.config": ["Config", "InvokeOptions", "ClientInfo"],
    "yr.exception": ["YRError", "YRRuntimeError", "YRTimeoutError", "YRValueError",
                     "YRTypeError", "YRInvokeError", "YRequestError", "GetTimeoutError",
                     "CancelError", "CancelledError", "InstanceDiedError", "ScheduleError",
                     "KVExistsError", "KVFullError", "DependencyError"],
    "yr.decorator.instance_proxy": ["InstanceProxy", "InstanceCreator", "MethodProxy",
                                    "get_instance"],
    "yr.decorator.function_proxy": ["FunctionProxy"],
    "yr.object_ref": ["ObjectRef"],
    "yr.affinity": ["Affinity", "AffinityKind", "AffinityScope", "AffinityType",
                    "LabelOperator", "OperatorType"],
    "yr.runtime": ["ExistenceOpt", "WriteMode", "CacheType", "ConsistencyType", "SetParam",
                   "MSetParam", "CreateParam", "GetParam", "GetParams"],
    "yr.apis": ["init", "finalize", "is_initialized", "invoke", "instance", "method", "get",
                "put", "wait", "cancel", "get_instance", "list_named_instances",
                "kill_instance", "exit", "kv_write", "kv_write_with_param", "kv_read",
                "kv_set", "kv_get", "kv_get_with_param", "kv_del", "kv_m_write_tx",
                "resources", "get_node_ip_address", "get_node_id", "get_namespace",
                "save_state", "load_state"],
}

#: names yr has only below the top level: compared with their yrdask definition instead.
DEEP = {
    ("yr.config", "ResourceGroupOptions"): ("yrdask.options", "ResourceGroupOptions"),
    ("yr.generator", "ObjectRefGenerator"): ("yrdask.api.generators", "ObjectRefGenerator"),
    ("yr.resource_group", "ResourceGroup"): ("yrdask.api.resource_groups", "ResourceGroup"),
    ("yr.group", "Group"): ("yrdask.api.group", "Group"),
    ("yr.group", "GroupOptions"): ("yrdask.api.group", "GroupOptions"),
    ("yr.apis", "create_resource_group"): ("yrdask.api.resource_groups",
                                           "create_resource_group"),
    ("yr.apis", "remove_resource_group"): ("yrdask.api.resource_groups",
                                           "remove_resource_group"),
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_module_path_imports_and_holds_the_same_objects(path):
    module = importlib.import_module(path)
    for name in PATHS[path]:
        assert getattr(module, name) is getattr(yrdask, name), f"{path}.{name}"
        assert getattr(module, name) is getattr(yr, name), f"{path}.{name} vs yr.{name}"
    assert set(PATHS[path]) <= set(module.__all__), path


@pytest.mark.parametrize("where,origin", sorted(DEEP.items()))
def test_names_below_top_level_are_the_yrdask_objects(where, origin):
    (path, name), (src, src_name) = where, origin
    assert getattr(importlib.import_module(path), name) is \
        getattr(importlib.import_module(src), src_name)


def test_from_imports_as_yr_programs_write_them():
    from yr.config import InvokeOptions
    from yr.decorator.instance_proxy import InstanceProxy
    from yr.exception import CancelError, YRInvokeError
    from yr.object_ref import ObjectRef

    assert InvokeOptions is yr.InvokeOptions and InstanceProxy is yr.InstanceProxy
    assert ObjectRef is yr.ObjectRef and YRInvokeError is yr.YRInvokeError
    assert CancelError is yr.CancelledError  # yr's name for the cancelled-task error


def test_every_module_all_resolves():
    for path in sorted({*PATHS, *(p for p, _ in DEEP)}):
        module = importlib.import_module(path)
        missing = [n for n in module.__all__ if not hasattr(module, n)]
        assert not missing, f"{path}: {missing}"


def test_submodules_are_attributes_after_a_bare_import():
    """openYuanrong's Monte Carlo example annotates ``-> yr.decorator.instance_proxy.InstanceProxy``
    after a bare ``import yr``: yr's submodules (and ``yrdask.decorator``) are attributes of the
    package without importing them by name; a fresh interpreter, so nothing imported them yet."""
    code = ("import yr, yrdask\n"
            "def make() -> yr.decorator.instance_proxy.InstanceProxy: ...\n"
            "assert make.__annotations__['return'] is yr.InstanceProxy\n"
            "assert yrdask.decorator.instance_proxy.InstanceProxy is yrdask.InstanceProxy\n"
            "assert yrdask.decorator.function_proxy.FunctionProxy is yrdask.FunctionProxy\n"
            "assert yr.config.InvokeOptions is yr.InvokeOptions\n"
            "assert yr.exception.YRInvokeError is yr.YRInvokeError\n"
            "assert yr.runtime.SetParam is yr.SetParam\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
