"""Error propagation (SPEC §2; yr_api §1.8, program P14) on embedded and cli clusters."""

from __future__ import annotations

import threading
import time

import pytest

import yrdask as yr

pytestmark = pytest.mark.timeout(180)

T = 60  # seconds: explicit yr.get bound, well under the test time-out


class CustomException(Exception):
    pass


class UnpicklableError(Exception):
    """Carries a lock, so it cannot be pickled back to the driver."""

    def __init__(self, msg):
        super().__init__(msg)
        self.lock = threading.Lock()


class NeedsTwoArgs(Exception):
    """Pickles, but cannot be rebuilt: unpickling calls ``NeedsTwoArgs("a-b")``."""

    def __init__(self, a, b):
        super().__init__(f"{a}-{b}")


@yr.invoke
def raise_runtime():
    raise RuntimeError("aaa")


@yr.invoke
def raise_custom():
    raise CustomException("custom boom")


@yr.invoke
def raise_builtin(kind):
    if kind == "value":
        raise ValueError("bad value")
    if kind == "key":
        return {}["missing"]
    if kind == "file":
        return open("/nonexistent-yrdask-dir/missing.txt")
    if kind == "reset":
        raise ConnectionResetError(104, "reset by peer")
    return 1 / 0


@yr.invoke
def identity(x):
    return x


@yr.invoke
def get_inside(refs):
    return yr.get(refs, 60)


@yr.invoke
def return_lock():
    return threading.Lock()


@yr.invoke
def raise_unpicklable():
    raise UnpicklableError("cannot travel")


@yr.invoke
def raise_needs_two_args():
    raise NeedsTwoArgs("a", "b")


def test_exception_classes():
    assert issubclass(yr.YRRuntimeError, yr.YRError) and issubclass(yr.YRRuntimeError, RuntimeError)
    assert issubclass(yr.YRTimeoutError, yr.YRRuntimeError) and issubclass(yr.YRTimeoutError, TimeoutError)
    assert issubclass(yr.YRInvokeError, yr.YRRuntimeError)
    assert issubclass(yr.YRValueError, yr.YRError) and issubclass(yr.YRValueError, ValueError)
    assert issubclass(yr.YRTypeError, yr.YRError) and issubclass(yr.YRTypeError, TypeError)


def test_p14_runtime_error(yr_cluster):
    with pytest.raises(RuntimeError, match="aaa") as info:
        yr.get(raise_runtime.invoke(), T)
    assert isinstance(info.value, yr.YRInvokeError)


def test_p14_custom_exception_keeps_its_type_and_traceback(yr_cluster):
    with pytest.raises(CustomException) as info:
        yr.get(raise_custom.invoke(), T)
    err = info.value
    assert isinstance(err, RuntimeError)
    assert isinstance(err, yr.YRInvokeError)
    text = str(err)
    assert "Traceback" in text
    assert "raise_custom" in text
    assert "custom boom" in text


@pytest.mark.parametrize(
    "kind, exc", [("value", ValueError), ("key", KeyError), ("zero", ZeroDivisionError),
                  ("file", FileNotFoundError), ("reset", ConnectionResetError)]
)
def test_builtin_exceptions_keep_their_type(yr_cluster, kind, exc):
    """The OSError family too: its base has a layout of its own, so the dual error is made
    by that base's ``__new__``, not RuntimeError's (which raises TypeError for it)."""
    with pytest.raises(exc) as info:
        yr.get(raise_builtin.invoke(kind), T)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, yr.YRInvokeError)
    if kind == "file":
        assert (info.value.errno, info.value.filename) == (2, "/nonexistent-yrdask-dir/missing.txt")


def test_p14_dependency_failure_has_the_same_type(yr_cluster):
    failed = raise_custom.invoke()
    dependent = identity.invoke(failed)
    with pytest.raises(CustomException):
        yr.get(dependent, T)
    with pytest.raises(CustomException):
        yr.get(identity.invoke(identity.invoke(failed)), T)
    with pytest.raises(RuntimeError, match="aaa"):
        yr.get(identity.invoke(raise_runtime.invoke()), T)


def test_p14_get_of_a_failed_list_inside_a_task(yr_cluster):
    refs = [identity.invoke(1), raise_runtime.invoke(), identity.invoke(3)]
    with pytest.raises(RuntimeError, match="aaa"):
        yr.get(get_inside.invoke(refs), T)
    with pytest.raises(CustomException):
        yr.get(get_inside.invoke([raise_custom.invoke()]), T)


def test_unpicklable_return_value_gives_a_clear_error(yr_cluster):
    start = time.monotonic()
    with pytest.raises(Exception) as info:
        yr.get(return_lock.invoke(), T)
    err = info.value
    assert not isinstance(err, TimeoutError), f"get timed out instead of failing: {err!r}"
    assert time.monotonic() - start < 30
    text = str(err).lower()
    assert "pickle" in text or "serializ" in text, f"error does not say what failed: {err!r}"
    assert "lock" in text, f"error does not name the unpicklable value: {err!r}"


def test_unpicklable_exception_still_gives_invoke_error(yr_cluster):
    with pytest.raises(yr.YRInvokeError) as info:
        yr.get(raise_unpicklable.invoke(), T)
    err = info.value
    assert isinstance(err, RuntimeError)
    text = str(err)
    assert "Traceback" in text
    assert "raise_unpicklable" in text
    assert "UnpicklableError" in text and "cannot travel" in text


def test_unrebuildable_exception_still_gives_invoke_error(yr_cluster):
    with pytest.raises(yr.YRInvokeError) as info:
        yr.get(raise_needs_two_args.invoke(), T)
    text = str(info.value)
    assert "Traceback" in text
    assert "raise_needs_two_args" in text
    assert "NeedsTwoArgs" in text
