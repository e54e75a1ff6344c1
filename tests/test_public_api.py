"""The public surface (SPEC §1; STYLE §7.3 point 2): `yrdask.__all__` and the `yr` shim."""

from __future__ import annotations

import types

import pytest

import yr
import yrdask

pytestmark = pytest.mark.timeout(60)

#: Names this suite uses; each must be public.
CORE = {
    "init", "finalize", "is_initialized", "Config",
    "invoke", "get", "wait", "put", "cancel", "InvokeOptions",
    "YRError", "YRRuntimeError", "YRTimeoutError", "YRValueError", "YRTypeError", "YRInvokeError",
}


def test_all_is_sorted_and_unique():
    names = list(yrdask.__all__)
    assert names == sorted(names)
    assert len(names) == len(set(names))


def test_every_name_in_all_resolves():
    missing = [n for n in yrdask.__all__ if not hasattr(yrdask, n)]
    assert not missing


def test_core_names_are_public():
    assert CORE <= set(yrdask.__all__)


#: Names Dask itself looks up on a ``--preload`` module; they cannot take an underscore.
DASK_PRELOAD_HOOKS = {"dask_setup", "dask_teardown"}


def test_no_public_name_outside_all():
    extra = {
        name for name in dir(yrdask)
        if not name.startswith("_") and not isinstance(getattr(yrdask, name), types.ModuleType)
    } - set(yrdask.__all__) - DASK_PRELOAD_HOOKS
    assert not extra, f"public attributes of yrdask missing from __all__: {sorted(extra)}"


def test_yr_shim_exposes_exactly_yrdask_all():
    assert yr.__all__ == yrdask.__all__
    assert set(dir(yr)) >= set(yrdask.__all__)
    for name in yrdask.__all__:
        assert getattr(yr, name) is getattr(yrdask, name), name
