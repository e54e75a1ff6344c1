"""Ray's exception types (``ray.exceptions``) and the mapping from yrdask's errors to them.

::

    Exception
    └── RayError
        ├── RayTaskError            a task or actor method raised; ``ray.get`` raises
        │                           ``RayTaskError(E)``, an instance of both this and the user's E
        ├── RayActorError
        │   ├── ActorDiedError      the actor ended (killed, exited, out of restarts, bad __init__)
        │   └── ActorUnavailableError
        ├── GetTimeoutError         (also TimeoutError) ``ray.get`` ran out of time
        ├── TaskCancelledError      the task was cancelled with ``ray.cancel``
        ├── WorkerCrashedError      the task's worker process died more often than retries allow
        ├── ObjectLostError
        │   ├── OwnerDiedError
        │   └── ObjectReconstructionFailedError  its task was cancelled: not rebuilt
        ├── RuntimeEnvSetupError
        ├── TaskUnschedulableError  (also yrdask's ScheduleError) no node can ever run the task
        ├── ActorUnschedulableError (also yrdask's ScheduleError) ... nor create the actor
        ├── RaySystemError
        └── UnsupportedOptionError  (yrdask; also ValueError) a Ray option yrdask does not support
"""

from __future__ import annotations

import re
from typing import Any

from yrdask import errors as _yr
from yrdask.words import in_ray_words

__all__ = ["RayError", "RayTaskError", "RayActorError", "ActorDiedError",
           "ActorUnavailableError", "GetTimeoutError", "TaskCancelledError",
           "WorkerCrashedError", "ObjectLostError", "OwnerDiedError",
           "ObjectReconstructionFailedError", "RuntimeEnvSetupError",
           "RaySystemError", "TaskUnschedulableError", "ActorUnschedulableError",
           "ObjectRefStreamEndOfStreamError", "AsyncioActorExit", "UnsupportedOptionError",
           "from_yr_error"]


class RayError(Exception):
    """Base of every Ray error."""


class RayTaskError(RayError):
    """A task or actor method raised; ``cause`` is the user's exception.

    ``ray.get`` raises :meth:`as_instanceof_cause`: an instance of a class derived from both
    this class and the cause's class, so ``except ValueError`` and ``except RayTaskError`` both
    catch it, as on Ray.
    """

    def __init__(self, function_name: str = "", traceback_str: str = "",
                 cause: BaseException | None = None, proctitle: str = "", pid: int = 0,
                 ip: str = "", actor_repr: str | None = None, actor_id: str | None = None) -> None:
        self.function_name = function_name
        self.traceback_str = traceback_str
        self.cause = cause
        self.proctitle, self.pid, self.ip = proctitle, pid, ip
        self.actor_repr, self.actor_id = actor_repr, actor_id
        RayError.__init__(self, traceback_str or repr(cause))

    def __str__(self) -> str:
        return self.traceback_str or repr(self.cause)

    def __reduce__(self):
        return (RayTaskError, (self.function_name, self.traceback_str, self.cause))

    def as_instanceof_cause(self) -> "RayTaskError":
        """This error as an instance of ``RayTaskError(<cause's class>)`` (see class doc)."""
        cause = self.cause
        if cause is None or isinstance(cause, RayTaskError):
            return self
        cls = type(cause)
        dual = _dual_classes.get(cls)
        if dual is None:
            def __getattr__(self, name):  # noqa: N807 - the cause's own attributes
                return getattr(self.__dict__["cause"], name)

            try:
                dual = type(f"RayTaskError({cls.__name__})", (RayTaskError, cls),
                            {"__getattr__": __getattr__, "__module__": cls.__module__,
                             "__str__": RayTaskError.__str__,
                             "__reduce__": RayTaskError.__reduce__,
                             "__init__": RayTaskError.__init__})
            except TypeError:  # the user's class cannot be combined with ours
                return self
            _dual_classes[cls] = dual
        err = dual.__new__(dual)
        err.__dict__.update(self.__dict__)
        err.args = (cause,)  # as on Ray: the cause itself is the one argument
        return err


_dual_classes: dict[type, type] = {}


class RayActorError(RayError):
    """An actor could not run the call: it died or is unreachable."""

    BASE_ERROR_MSG = "The actor died unexpectedly before finishing this task."

    def __init__(self, message: str = BASE_ERROR_MSG, actor_id: str | None = None) -> None:
        super().__init__(message)
        self.actor_id = actor_id
        self.error_msg = message


class ActorDiedError(RayActorError):
    """The actor ended: killed, exited, out of restarts, or its ``__init__`` raised."""


class ActorUnavailableError(RayActorError):
    """The actor is temporarily unreachable (restarting)."""


class GetTimeoutError(RayError, TimeoutError):
    """``ray.get`` / ``ray.wait``-style waits ran out of time."""


class TaskCancelledError(RayError):
    """The task was cancelled by ``ray.cancel``."""

    def __init__(self, task_id: Any = None, error_message: str | None = None) -> None:
        self.task_id = task_id
        super().__init__(error_message or f"Task: {task_id} was cancelled.")


class WorkerCrashedError(RayError):
    """The worker process running the task died (more often than the task's retries allow)."""


class ObjectLostError(RayError):
    """An object's value is lost (its keeper died)."""


class OwnerDiedError(ObjectLostError):
    """The process owning an object died."""


class ObjectReconstructionFailedError(ObjectLostError):
    """An object's value is lost and its task was cancelled, so it is not computed again."""


class RuntimeEnvSetupError(RayError):
    """The ``runtime_env`` of a task or actor could not be set up."""


class RaySystemError(RayError):
    """An internal failure of the system."""


class TaskUnschedulableError(RayError, _yr.ScheduleError):
    """The task can never be scheduled (no node could ever give what it asks for); also
    yrdask's ``ScheduleError``."""

    def __init__(self, error_message: str) -> None:
        super().__init__(error_message)
        self.error_message = error_message

    def __str__(self) -> str:
        return f"The task is not schedulable: {self.error_message}"


class ActorUnschedulableError(RayError, _yr.ScheduleError):
    """The actor can never be scheduled; also yrdask's ``ScheduleError``."""

    def __init__(self, error_message: str) -> None:
        super().__init__(error_message)
        self.error_message = error_message

    def __str__(self) -> str:
        return f"The actor is not schedulable: {self.error_message}"


class AsyncioActorExit(RayError):
    """Ray's signal of ``exit_actor()`` in an async actor.  Defined for ``except`` clauses:
    yrdask's ``exit_actor()`` ends the actor before it raises, so catching what it raises
    does not keep the actor alive, as on Ray."""


class ObjectRefStreamEndOfStreamError(RayError):
    """Ray's end of a generator's stream.  Defined for ``except`` clauses: yrdask's
    ``ObjectRefGenerator`` ends with ``StopIteration`` / ``StopAsyncIteration``, as Ray's
    does for ``next()`` and ``for``."""


class UnsupportedOptionError(RayError, _yr.YRValueError):
    """A Ray option or value that yrdask does not support; the message names it and says why."""


class ActorExitRequest(Exception):
    """Raised by ``ray.actor.exit_actor()`` to end the method; callers see ActorDiedError."""


def from_yr_error(err: BaseException, what: str = "") -> BaseException:
    """The Ray error to raise for a yrdask error ``err`` (``err`` itself when none fits)."""
    if isinstance(err, RayError) and not isinstance(err, _yr.YRInvokeError):
        return err
    if isinstance(err, _yr.YRInvokeError):
        cause = err.cause
        if isinstance(cause, ActorExitRequest):
            return ActorDiedError("The actor exited via ray.actor.exit_actor() in this call.")
        if isinstance(cause, _yr.CancelledError):
            return TaskCancelledError(error_message=str(cause))
        text = err.traceback_str
        if isinstance(cause, RayTaskError) and cause.cause is not None:
            # a nested ray.get re-raised, or a stored RayTaskError (a dynamic generator's
            # error ref) read from another process: keep the original cause, and its
            # traceback text when this error has none of its own
            text = text or cause.traceback_str
            cause = cause.cause
        if isinstance(cause, RayError):
            return cause
        if isinstance(cause, _CreationFailed):
            return ActorDiedError(
                "The actor died because of an error raised in its creation task: "
                f"{cause.traceback_str}")
        return RayTaskError(what, text, cause).as_instanceof_cause()
    # each message in Ray's words (yrdask/words.py: the one table of yr phrase -> Ray's)
    if isinstance(err, _yr.CancelledError):
        return TaskCancelledError(error_message=in_ray_words(str(err)))
    if isinstance(err, _yr.YRTimeoutError):
        return GetTimeoutError(in_ray_words(str(err)))
    if isinstance(err, _yr.TaskCrashedError):
        return WorkerCrashedError(in_ray_words(str(err)))
    if isinstance(err, _yr.OwnerDiedError):
        return OwnerDiedError(in_ray_words(str(err)))
    if isinstance(err, _yr.ObjectReconstructionFailedError):
        return ObjectReconstructionFailedError(in_ray_words(str(err)))
    if isinstance(err, _yr.ObjectLostError):
        return ObjectLostError(in_ray_words(str(err)))
    if isinstance(err, _yr.CallCrashedError):  # the call is given up; the actor restarts
        return actor_unavailable(str(err))
    if isinstance(err, _yr.InstanceDiedError):
        return actor_died(str(err))
    if isinstance(err, _yr.ScheduleError):
        text = str(err)
        kind = ActorUnschedulableError if _INSTANCE.search(text) else TaskUnschedulableError
        return kind(in_ray_words(text))
    return err


_ON_INSTANCE = re.compile(r"on instance (?P<id>\S+)")


def actor_unavailable(message: str) -> "ActorUnavailableError":
    """``ActorUnavailableError`` worded as Ray's for a call cut short by a crash of its
    actor's process, which was (or is being) restarted: not "The actor is dead"."""
    found = _ON_INSTANCE.search(message)
    actor_id = found.group("id") if found else None
    return ActorUnavailableError(
        f"The actor {actor_id or ''} is unavailable: The actor is temporarily unavailable: "
        f"{in_ray_words(message.rstrip('.'))}. The task may or may not have been executed on "
        "the actor.", actor_id=actor_id)


_ENDED = re.compile(r"instance (?P<id>\S+) \((?P<cls>[^)]*)\) has ended: (?P<why>.*)", re.S)
_UNAVAILABLE = re.compile(r"instance (?P<id>\S+) is not available: (?P<why>.*)", re.S)
_CRASHED = re.compile(r"call \S+ on instance (?P<id>\S+) (?:may have been|was) running when",
                      re.S)
_INSTANCE = re.compile(r"\binstance i-")


def _because(why: str) -> str:
    """yr's reason worded to follow "because": an intended exit's reason ("exited by
    sys.exit()") says who exited."""
    why = why.rstrip(".")
    return f"it {why}" if why.startswith("exited by ") else why


def actor_died(message: str, actor_id: str | None = None,
               class_name: str | None = None) -> "ActorDiedError":
    """``ActorDiedError`` worded as Ray's ("The actor is dead because ...", or for a call
    its actor's death cut short "The actor died unexpectedly before finishing this task."),
    then the actor's class and id, from yr's message about the instance."""
    first = f"The actor is dead because {_because(message)}."
    detail = None
    for pattern in (_ENDED, _UNAVAILABLE, _CRASHED):
        found = pattern.search(message)
        if found:
            actor_id = actor_id or found.group("id")
            class_name = class_name or found.groupdict().get("cls")
            if pattern is _CRASHED:
                first, detail = RayActorError.BASE_ERROR_MSG, message
            else:
                first = f"The actor is dead because {_because(found.group('why'))}."
            break
    lines = [in_ray_words(first)]
    if class_name:
        lines.append(f"\tclass_name: {class_name}")
    if actor_id:
        lines.append(f"\tactor_id: {actor_id}")
    if detail:
        lines.append(f"\tdetail: {in_ray_words(detail)}")
    return ActorDiedError("\n".join(lines), actor_id=actor_id)


class _CreationFailed(Exception):
    """An actor's ``__init__`` raised (travels from the worker; becomes ActorDiedError)."""

    def __init__(self, traceback_str: str) -> None:
        super().__init__(traceback_str)
        self.traceback_str = traceback_str
