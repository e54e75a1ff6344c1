"""The dual-typed errors ``yr.get`` raises (``YRInvokeError(E)``, yrdask/errors.py): their
class is cached per cause type, and must not keep the first cause of that type alive."""

from __future__ import annotations

import gc
import weakref

from yrdask.errors import YRInvokeError


class _Held:
    """Stands for what a failed read's frames hold (the ObjectRef being read)."""


class _CauseError(Exception):
    pass


def _raise_and_drop(held: _Held) -> weakref.ref:
    """Rebuild a remote failure, raise it in a frame whose locals hold ``held`` (as a failed
    ``yr.get`` does), catch it and drop it; return a weak reference to the cause."""
    err = YRInvokeError(_CauseError("boom"), "Traceback ...\n_CauseError: boom\n").origin_error()
    assert isinstance(err, _CauseError) and isinstance(err, YRInvokeError)
    cause = weakref.ref(err.cause)

    def reader(ref: _Held) -> None:
        raise err

    try:
        reader(held)
    except _CauseError:
        pass
    return cause


def test_the_cached_dual_class_does_not_keep_its_first_cause_alive():
    held = _Held()
    gone = weakref.ref(held)
    cause = _raise_and_drop(held)
    del held
    gc.collect()
    assert cause() is None, "the first cause of its type is kept (by the cached class)"
    assert gone() is None, "what the raising frames held is kept alive"
    again = YRInvokeError(_CauseError("two"), "tb two").origin_error()
    assert type(again).__name__ == "YRInvokeError(_CauseError)" and str(again) == "tb two"
    assert again.cause.args == ("two",) and again.args == ("two",)


def test_a_dual_error_is_both_types_and_pickles_as_the_plain_error():
    """What travels between processes (a task re-raising a failed get) and what a copy gives:
    ``YRInvokeError(cause, text)``, whose ``origin_error()`` is the cached dual class again."""
    import copy
    import pickle

    err = YRInvokeError(_CauseError("boom"), "tb boom").origin_error()
    assert isinstance(err, _CauseError) and isinstance(err, YRInvokeError)
    assert isinstance(err, RuntimeError)
    for back in (pickle.loads(pickle.dumps(err)), copy.copy(err)):
        assert type(back) is YRInvokeError
        assert str(back) == "tb boom" and back.cause.args == ("boom",)
        again = back.origin_error()
        assert type(again) is type(err) and str(again) == "tb boom"
        assert again.args == ("boom",)


def test_the_oserror_family_gets_a_dual_class_with_its_attributes():
    """OSError's subclasses (and Dask's CommClosedError, one of them) have a layout of their
    own: the dual error is made by their ``__new__``, and keeps errno and filename."""
    from distributed.comm.core import CommClosedError

    for cause in (FileNotFoundError(2, "No such file", "a.txt"), ConnectionResetError(104, "x"),
                  CommClosedError("in <TCP>: Stream is closed")):
        err = YRInvokeError(cause, "tb").origin_error()
        assert isinstance(err, type(cause)) and isinstance(err, YRInvokeError), type(err)
        assert err.args == cause.args and str(err) == "tb"
        assert (err.errno, err.filename) == (cause.errno, cause.filename)


class _NeedsArgsError(OSError):
    def __new__(cls, code, text):
        return super().__new__(cls, code, text)


def test_a_cause_whose_new_wants_arguments_gives_the_plain_invoke_error():
    err = YRInvokeError(_NeedsArgsError(1, "x"), "tb").origin_error()
    assert type(err) is YRInvokeError and err.cause.args == (1, "x") and str(err) == "tb"


def test_a_dependency_error_of_an_oserror_is_that_oserror_too():
    from yrdask.errors import DependencyError, dependency_error

    cause = YRInvokeError(FileNotFoundError(2, "No such file", "a.txt"), "tb")
    err = dependency_error("a nested ref failed", "obj-1", cause)
    assert isinstance(err, DependencyError) and isinstance(err, FileNotFoundError)
    assert err.dependency == "obj-1" and err.cause is cause and str(err) == "a nested ref failed"
    assert (err.errno, err.filename) == (2, "a.txt")  # what `except FileNotFoundError` reads
