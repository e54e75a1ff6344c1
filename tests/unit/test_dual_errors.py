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
