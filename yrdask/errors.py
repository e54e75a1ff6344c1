"""The yrdask exception tree, and the re-raise of remote user errors with their own type.

::

    Exception
    └── YRError                      base of every error yrdask raises itself
        ├── YRRuntimeError           (also RuntimeError) system and runtime failures
        │   ├── YRTimeoutError       (also TimeoutError) yr.get / lookups that ran out of time
        │   │   └── GetTimeoutError
        │   ├── YRInvokeError        user code raised; str() is the remote traceback
        │   │   └── YRInvokeError(E) built on the fly: also an instance of the user's E
        │   ├── YRequestError        a request to the cluster failed
        │   ├── CancelledError       the task was cancelled with yr.cancel
        │   ├── InstanceDiedError    the instance ended (terminated, lost, out of restarts)
        │   ├── SchedulerLostError   the driver's scheduler went away (stopped or restarted)
        │   ├── StateStoreError      the scheduler cannot use its state file (yrdask.state.path)
        │   ├── InstanceMovedError   (internal) a call reached the worker its instance left
        │   ├── ScheduleError        resources could not be found before schedule_timeout_ms
        │   ├── KVExistsError        an NX KV write found its key present
        │   ├── KVFullError          a KV write would exceed yrdask.kv.max-bytes
        │   ├── DependencyError      a ref nested in a task's arguments failed (code 4306)
        │   └── ObjectLostError      an object's value is gone (its keeper died, not rebuilt)
        │       ├── OwnerDiedError   the process owning a borrowed object died
        │       └── ObjectReconstructionFailedError  its task may not run again (cancelled)
        ├── YRValueError             (also ValueError) bad argument value
        └── YRTypeError              (also TypeError) bad argument type
"""

from __future__ import annotations

import pickle
from typing import Any

__all__ = [
    "YRError",
    "YRRuntimeError",
    "YRTimeoutError",
    "GetTimeoutError",
    "YRValueError",
    "YRTypeError",
    "YRInvokeError",
    "YRequestError",
    "CancelledError",
    "InstanceDiedError",
    "SchedulerLostError",
    "StateStoreError",
    "CallCrashedError",
    "TaskCrashedError",
    "ScheduleError",
    "KVExistsError",
    "KVFullError",
    "DependencyError",
    "ObjectLostError",
    "OwnerDiedError",
    "ObjectReconstructionFailedError",
    "RemoteError",
]


class YRError(Exception):
    """Base class of every error raised by yrdask itself."""


class YRRuntimeError(YRError, RuntimeError):
    """A system or runtime failure (not initialized, cluster unreachable, ...)."""


class YRTimeoutError(YRRuntimeError, TimeoutError):
    """An operation ran out of time (``yr.get``, ``yr.get_instance``)."""


class GetTimeoutError(YRTimeoutError):
    """Ray-compatible name for a ``get`` time-out."""


class YRValueError(YRError, ValueError):
    """An argument had a bad value; the message names it."""


class YRTypeError(YRError, TypeError):
    """An argument had a bad type; the message names it."""


class YRequestError(YRRuntimeError):
    """A request to the cluster failed."""


class CancelledError(YRRuntimeError):
    """The task was cancelled by ``yr.cancel``; ``yr.get`` raises this."""


def call_cancelled(call_id: str) -> CancelledError:
    """The error a cancelled method call settles with, at its caller or answered by its host
    (Ray's words, which ``TaskCancelledError`` keeps)."""
    return CancelledError(f"Task: {call_id} was cancelled.")


class SchedulerLostError(YRRuntimeError):
    """The scheduler this driver was connected to went away (stopped, crashed or restarted):
    its pending and later calls fail with this; the message names the scheduler's address and
    what to do (``yr.finalize()``, then ``yr.init()`` again)."""


class StateStoreError(YRRuntimeError):
    """The scheduler cannot use its state file (``yrdask.state.path``); the message names
    the file, why, and what to set instead."""


class InstanceDiedError(YRRuntimeError):
    """The instance a call was made on has ended; the message says which and why."""


class InstanceMovedError(YRRuntimeError):
    """A call reached the worker an instance left (scale-down moved it, with its state, to
    ``to``): it did not run there.  The caller's router sends it again where the instance
    runs now; user code never sees it."""

    def __init__(self, message: str = "", to: str = "") -> None:
        super().__init__(message)
        self.to = to

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.to))


def describe_exit(returncode: int) -> str:
    """``"exited with code 3"`` or ``"was killed by signal 11 (SIGSEGV)"`` (a process's
    return code as ``subprocess`` and Dask's nanny give it: negative for a signal)."""
    import signal

    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown"
        return f"was killed by signal {-returncode} ({name})"
    return f"exited with code {returncode}"


#: signals whose default action dumps core: a process they end crashed by its own hand
#: (openYuanrong's "core dump"); SIGKILL / SIGTERM come from outside (eviction, OOM killer).
CORE_DUMP_SIGNALS = frozenset({"SIGQUIT", "SIGILL", "SIGTRAP", "SIGABRT", "SIGBUS", "SIGFPE",
                               "SIGSEGV", "SIGSYS", "SIGXCPU", "SIGXFSZ"})


def crashed_by_itself(how: str | None) -> bool:
    """Did a process that ended as ``how`` (:func:`describe_exit`'s words) crash by its own
    hand: a non-zero exit code (``os._exit(3)``) or a core-dump signal?  ``None`` (nothing
    reported: a lost host, a graceful close) and an outside kill are not crashes."""
    if not how:
        return False
    if how.startswith("exited with code "):
        return how != "exited with code 0"
    return any(f"({name})" in how for name in CORE_DUMP_SIGNALS)


class _CrashError(YRRuntimeError):
    """Work lost with a process that died: ``worker`` is the last worker it was lost with."""

    def __init__(self, message: str = "", worker: str = "") -> None:
        super().__init__(message)
        self.worker = worker

    def with_exit(self, how: str) -> "_CrashError":
        """The same error, its message ending with how the process ended (``how``)."""
        args = self.__reduce__()[1]
        return type(self)(f"{args[0]}; its process {how}", *args[1:])

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.worker))


class CallCrashedError(_CrashError):
    """A method call was running each time its instance's process died, more often than
    ``yrdask.scheduling.max-call-redeliveries`` allows: it is not delivered again."""


class TaskCrashedError(_CrashError):
    """A stateless task's process died each time it ran, more often than its bound of reruns
    (``yrdask.scheduling.max-task-crashes``, or Ray's ``max_retries``) allows.  ``crashes`` is
    how often, ``worker`` the last worker it was lost with."""

    def __init__(self, message: str = "", crashes: int = 0, worker: str = "") -> None:
        super().__init__(message, worker)
        self.crashes = crashes

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.crashes, self.worker))


class ObjectLostError(YRRuntimeError):
    """An object's value is gone: the worker keeping it died and it cannot be computed again
    (a method call's result, a ``put`` value, or a task out of retries).  Ray's name."""


class OwnerDiedError(ObjectLostError):
    """The process that owns an object (the one that created it) died, so a borrower cannot
    read it any more: ownership is Ray's, and Ray raises this error too (docs/objects.md)."""


class ObjectReconstructionFailedError(ObjectLostError):
    """An object's value is gone and its task, which could have computed it again, was
    cancelled: a cancelled task never runs again, so the value stays lost (Ray's name)."""


class ScheduleError(YRRuntimeError):
    """No worker could give the requested resources within ``schedule_timeout_ms``."""


class KVExistsError(YRRuntimeError):
    """A KV write with ``ExistenceOpt.NX`` found its key(s) present; the message names them."""


class KVFullError(YRRuntimeError):
    """A KV write would take the store over ``yrdask.kv.max-bytes``; the message says so."""


class DependencyError(YRRuntimeError):
    """A ref nested in a task's arguments failed, so the task did not run (yr's error 4306,
    DEPENDENCY_FAILED).  ``dependency`` is the failed ref's id, ``cause`` its error."""

    code = 4306

    def __init__(self, message: str = "", dependency: str = "",
                 cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.dependency = dependency
        self.cause = cause

    def __reduce__(self):
        return (dependency_error, (str(self), self.dependency, self.cause))


def dependency_error(message: str, dependency: str, cause: BaseException | None
                     ) -> DependencyError:
    """A :class:`DependencyError` that is also the user's exception class when the failed
    ref's error came from user code (``except CustomError`` catches it, as it catches the
    error of a failed top-level argument)."""
    user = getattr(cause, "cause", None) if isinstance(cause, YRInvokeError) else None
    cls = type(user) if isinstance(user, BaseException) and not isinstance(user, YRError) \
        else None
    dual: type = DependencyError
    if cls is not None:
        dual = _dependency_classes.get(cls) or DependencyError
        if cls not in _dependency_classes:
            try:
                dual = type(f"DependencyError({cls.__name__})", (DependencyError, cls),
                            {"__module__": cls.__module__, "__str__": Exception.__str__,
                             "__reduce__": DependencyError.__reduce__})
            except TypeError:  # the user's class cannot be subclassed together with ours
                dual = DependencyError
            _dependency_classes[cls] = dual
    err = _blank(dual, cls) if dual is not DependencyError else None
    if err is None:
        return DependencyError(message, dependency, cause)
    DependencyError.__init__(err, message, dependency, cause)
    _keep_os_fields(err, user)
    return err


def _blank(dual: type, cls: type) -> BaseException | None:
    """An instance of ``dual`` (ours and the user's ``cls``) not yet initialised, or None.

    A ``cls`` whose base has a layout of its own (OSError and its family: FileNotFoundError,
    ConnectionResetError, Dask's CommClosedError) can only be made by that base's
    ``__new__``, and a user's ``__new__`` may want arguments (then: None)."""
    try:
        return dual.__new__(dual)
    except TypeError:
        try:
            return cls.__new__(dual)
        except Exception:  # noqa: BLE001 - a user's __new__ that wants arguments
            return None


_dependency_classes: dict[type, type] = {}


class YRInvokeError(YRRuntimeError):
    """User code raised in a task or instance method.

    ``str()`` is the remote traceback; ``cause`` is the original exception.  ``yr.get``
    raises a dynamic subclass ``YRInvokeError(E)`` that is also an ``E``, so ``except E``,
    ``except RuntimeError`` and ``except yr.YRInvokeError`` all catch it.
    """

    def __init__(self, cause: BaseException | None = None, traceback_str: str = "") -> None:
        super().__init__(traceback_str or repr(cause))
        self.cause = cause
        self.traceback_str = traceback_str

    def __str__(self) -> str:
        return self.traceback_str or repr(self.cause)

    def origin_error(self) -> BaseException:
        """The error to raise at ``yr.get``: dual-typed when the cause is a user exception."""
        cause = self.cause
        if cause is None or isinstance(cause, YRError):
            return self
        return _dual_typed(cause, self.traceback_str)

    def __reduce__(self):
        return (YRInvokeError, (self.cause, self.traceback_str))


_dual_classes: dict[type, type] = {}


def _dual_typed(cause: BaseException, traceback_str: str) -> BaseException:
    cls = type(cause)
    dual = _dual_classes.get(cls)
    if dual is None:

        # No defaults taken from this first cause: the class is cached for the process's
        # life, and a default would pin that exception, its traceback and every frame's
        # locals (the ObjectRef being read, so its object was never freed).
        def __init__(self, cause=None, traceback_str=""):  # noqa: N807
            YRInvokeError.__init__(self, cause, traceback_str)

        def __getattr__(self, name):  # noqa: N807
            return getattr(self.__dict__["cause"], name)

        try:
            dual = type(
                f"YRInvokeError({cls.__name__})",
                (YRInvokeError, cls),
                {"__init__": __init__, "__getattr__": __getattr__, "__module__": cls.__module__,
                 "__str__": YRInvokeError.__str__, "__reduce__": YRInvokeError.__reduce__},
            )
        except TypeError:  # the user's class cannot be subclassed together with ours
            return YRInvokeError(cause, traceback_str)
        _dual_classes[cls] = dual
    err = _blank(dual, cls)
    if err is None:
        return YRInvokeError(cause, traceback_str)
    YRInvokeError.__init__(err, cause, traceback_str)
    try:
        err.args = cause.args
    except Exception:  # noqa: BLE001 - a read-only attribute: the cause still has it
        pass
    _keep_os_fields(err, cause)
    return err


def _keep_os_fields(err: BaseException, cause: BaseException) -> None:
    """``errno``, ``strerror`` and the file names of an OSError ``cause`` on its dual error:
    slots of OSError's own, which neither ``__init__`` nor ``__getattr__`` fill from it."""
    if isinstance(cause, OSError) and isinstance(err, OSError):
        err.errno, err.strerror = cause.errno, cause.strerror
        err.filename, err.filename2 = cause.filename, cause.filename2


def user_traceback() -> str:
    """The traceback of the exception being handled, without the frame of the runner."""
    import sys
    import traceback

    etype, exc, tb = sys.exc_info()
    if tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return "".join(traceback.format_exception(etype, exc, tb))


class ReturnError:
    """One return value of a call with several that failed while the ones before it did not
    (Ray's generator called with ``num_returns=n`` that raised after yielding some): the
    worker sends it as that return's error, the others as values."""

    __slots__ = ("error", "traceback_str")

    def __init__(self, error: BaseException, traceback_str: str) -> None:
        self.error, self.traceback_str = error, traceback_str


class RemoteError:
    """A failure as it travels back from a worker: the pickled cause plus its traceback text.

    ``to_exception()`` rebuilds what ``yr.get`` raises.  If the user's exception cannot be
    pickled it travels as a ``YRInvokeError`` carrying only the traceback text.
    """

    __slots__ = ("payload", "traceback_str")

    def __init__(self, payload: bytes, traceback_str: str) -> None:
        self.payload = payload
        self.traceback_str = traceback_str

    @classmethod
    def from_exception(cls, exc: BaseException, traceback_str: str) -> "RemoteError":
        import cloudpickle

        if isinstance(exc, YRInvokeError) and not traceback_str:
            traceback_str = exc.traceback_str
        try:
            payload = cloudpickle.dumps(exc)
            pickle.loads(payload)
        except Exception:
            payload = cloudpickle.dumps(YRInvokeError(None, traceback_str))
        return cls(payload, traceback_str)

    def to_exception(self) -> BaseException:
        exc: Any = pickle.loads(self.payload)
        if isinstance(exc, YRInvokeError):
            return exc.origin_error()
        if isinstance(exc, YRError):
            return exc
        return YRInvokeError(exc, self.traceback_str).origin_error()
