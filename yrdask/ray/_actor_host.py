"""The worker side of ``@ray.remote`` classes: the *host class*, the subclass of the user's
class that runs on the worker.

It carries the job context (``__ray_ctx__``), turns an ``__init__`` failure into Ray's
``ActorDiedError`` for every call, and wraps every method: it names the running task
(``get_runtime_context().get_task_name()``), reruns after the exceptions
``@ray.method(retry_exceptions=...)`` names up to ``max_task_retries`` times, and with
``concurrency_groups`` runs it in its group's own executor, as Ray does: a thread pool of the
group's size in a threaded actor, an event loop thread in an async actor (whose default group
is the actor's own loop).  ``__ray_call__`` runs a method with per-call options
(``actor.method.options(...)``).  The driver's side (classes, handles, methods) is
:mod:`yrdask.ray.actor`, which builds the host class with :func:`host_class`.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import threading
import traceback
import weakref
from typing import Any, Callable

from yrdask.api.instances import _CONCURRENCY, _REDELIVERIES, _UNORDERED
from yrdask.runtime.context import (current_lease, current_owner, running_method_call,
                                    task_context)
from yrdask.ray._context import current_method, set_task_ctx
from yrdask.ray._util import rerun_items, should_retry
from yrdask.ray.exceptions import _CreationFailed

_NRET = "__yr_return_nums__"  # what yr's instances read for a method's number of returns
_GROUP = "__ray_concurrency_group__"
_RETRY = "__ray_retry_exceptions__"
_TASK_RETRIES = "__ray_max_task_retries__"
_DEFAULT_GROUP = "_ray_default_group"
_SEMS_LOCK = threading.Lock()  # guards the creation of concurrency-group semaphores


def _semaphore(obj: Any, group: str, limit: int, is_async: bool) -> Any:
    """The bound of ``group``'s calls on ``obj``: one for its ``async def`` methods (an
    asyncio semaphore) and one for its sync ones (a thread semaphore), which an async
    actor's default group may hold both of."""
    table = type(obj).__dict__["__ray_sems__"]
    key = (id(obj), group, is_async)
    sem = table.get(key)
    if sem is None:
        with _SEMS_LOCK:
            sem = table.get(key)
            if sem is None:
                sem = table[key] = asyncio.Semaphore(limit) if is_async \
                    else threading.BoundedSemaphore(limit)
    return sem


def _enter(names: tuple[str, str]) -> Any:
    """Mark the running actor method (a module function: the host class's wrappers are
    pickled by value, and a ContextVar cannot be): ``[task name, function name, task id]``,
    the id made when first asked for (``get_runtime_context().get_task_id()``)."""
    return current_method.set([names[0], names[1], None])


def _leave(token: Any) -> None:
    current_method.reset(token)


def _wrap_method(fn: Callable, group: str | None, limit: int, retry: Any,
                 max_retries: int, names: tuple[str, str]) -> Callable:
    """The method as the host class runs it: under its group's limit, rerun after the
    exceptions ``retry`` names, with ``names`` (``Class.method``, its full name) as the
    running task's names for ``get_runtime_context()``.

    ``max_task_retries`` is one budget with the call's crashes (Ray's rule): a delivery
    after its host process died starts with the tries its caller charged, and each rerun
    is charged to the caller before it starts (``CallRetried``), so a rerun that ends the
    process counts as well."""
    def again(e: BaseException, attempt: int) -> bool:
        if not should_retry(e, retry):
            return False
        call = running_method_call()
        used = attempt + (call.tries if call is not None else 0)
        if max_retries != -1 and used >= max_retries:
            return False
        if call is not None:
            call.retried()
        return True

    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def run_async(self, *args, **kwargs):
            token = _enter(names)
            sem = _semaphore(self, group, limit, True) if group else None
            if sem is not None:
                await sem.acquire()
            try:
                attempt = 0
                while True:
                    try:
                        return await fn(self, *args, **kwargs)
                    except BaseException as e:  # noqa: BLE001
                        if not again(e, attempt):
                            raise
                        attempt += 1
            finally:
                if sem is not None:
                    sem.release()
                _leave(token)
        return run_async

    @functools.wraps(fn)
    def run(self, *args, **kwargs):
        token = _enter(names)
        sem = _semaphore(self, group, limit, False) if group else None
        if sem is not None:
            sem.acquire()
        try:
            attempt = 0
            while True:
                try:
                    return fn(self, *args, **kwargs)
                except BaseException as e:  # noqa: BLE001
                    if not again(e, attempt):
                        raise
                    attempt += 1
        finally:
            if sem is not None:
                sem.release()
            _leave(token)
    return run


def _retrying_generator(fn: Callable, retry: Any, max_retries: int) -> Callable:
    """A generator method rerun after the exceptions ``retry`` names, up to ``max_retries``
    times (-1: no bound), as Ray retries a streaming actor task: a rerun's items that the
    caller has already received (by position) are not sent again."""
    def again(e: BaseException, attempt: int) -> bool:
        return should_retry(e, retry) and (max_retries == -1 or attempt < max_retries)

    if inspect.isasyncgenfunction(fn):
        @functools.wraps(fn)
        async def run_async(self, *args, **kwargs):
            sent = attempt = 0
            while True:
                index = 0
                try:
                    async for item in fn(self, *args, **kwargs):
                        if index >= sent:
                            yield item
                            sent += 1
                        index += 1
                    return
                except (GeneratorExit, asyncio.CancelledError):
                    raise
                except BaseException as e:  # noqa: BLE001
                    if not again(e, attempt):
                        raise
                    attempt += 1
        return run_async

    @functools.wraps(fn)
    def run(self, *args, **kwargs):
        yield from rerun_items(lambda: fn(self, *args, **kwargs), again)
    return run


def _runner(raw: Callable, group: str | None, limit: int, retry: Any, max_retries: int,
            names: tuple[str, str], actor_async: bool) -> Callable:
    """How the host class runs a method.  Without concurrency groups: in the instance's
    executor.  With them, as Ray: each group has its own executor (a thread pool of its
    limit in a threaded actor, an event loop thread in an async actor, where the default
    group is the actor's own loop), and a method, sync or async, runs in its group's."""
    if group is None or (actor_async and group == _DEFAULT_GROUP):
        return _wrap_method(raw, group, limit, retry, max_retries, names)
    return _in_group(_wrap_method(raw, None, 0, retry, max_retries, names), group, limit,
                     actor_async)


def _in_group(inner: Callable, group: str, limit: int, actor_async: bool) -> Callable:
    @functools.wraps(inner)
    async def in_group(self, *args, **kwargs):
        executor = _group_executor(self, group, limit, actor_async)
        return await executor.run(inner, self, args, kwargs)

    return in_group


class _GroupThreads:
    """A concurrency group of a threaded actor: ``limit`` threads of its own."""

    def __init__(self, name: str, limit: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(limit, thread_name_prefix=f"ray-group-{name}")

    async def run(self, fn: Callable, obj: Any, args: tuple, kwargs: dict) -> Any:
        ctx = task_context(current_lease(), current_owner())  # nested calls: this actor's
        # in the call's context: its method sees the call it runs (running_method_call)
        return await asyncio.wrap_future(self.pool.submit(
            contextvars.copy_context().run, _in_context, ctx, fn, obj, args, kwargs))

    def close(self) -> None:
        self.pool.shutdown(wait=False)


def _in_context(ctx: Any, fn: Callable, obj: Any, args: tuple, kwargs: dict) -> Any:
    with ctx:
        return fn(obj, *args, **kwargs)


class _GroupLoop:
    """A concurrency group of an async actor: an event loop in a thread of its own, running
    up to ``limit`` of the group's calls at once (sync methods run on that thread too)."""

    def __init__(self, name: str, limit: int) -> None:
        self.limit = limit
        self.loop = asyncio.new_event_loop()
        self.sem: asyncio.Semaphore | None = None
        threading.Thread(target=self.loop.run_forever, daemon=True,
                         name=f"ray-group-{name}").start()

    async def run(self, fn: Callable, obj: Any, args: tuple, kwargs: dict) -> Any:
        ctx = task_context(current_lease(), current_owner())
        done = asyncio.run_coroutine_threadsafe(self._call(ctx, fn, obj, args, kwargs),
                                                self.loop)
        return await asyncio.wrap_future(done)

    async def _call(self, ctx: Any, fn: Callable, obj: Any, args: tuple, kwargs: dict) -> Any:
        if self.sem is None:
            self.sem = asyncio.Semaphore(self.limit)
        async with self.sem:
            with ctx:
                result = fn(obj, *args, **kwargs)
                if inspect.iscoroutine(result):
                    result = await result
            return result

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


def _group_executor(obj: Any, group: str, limit: int, actor_async: bool) -> Any:
    table = type(obj).__dict__["__ray_sems__"]
    key = (id(obj), "executor", group)
    executor = table.get(key)
    if executor is None:
        with _SEMS_LOCK:
            executor = table.get(key)
            if executor is None:
                executor = table[key] = (_GroupLoop if actor_async else _GroupThreads)(
                    group, limit)
                try:  # the actor ended: its groups' threads go too
                    weakref.finalize(obj, _close_executor, table, key)
                except TypeError:  # an object without weak references: they stay idle
                    pass
    return executor


def _close_executor(table: dict, key: tuple) -> None:
    executor = table.pop(key, None)
    if executor is not None:
        executor.close()


def _names(cls: type, name: str) -> tuple[str, str]:
    """Ray's task name and task function name of method ``name`` of ``cls``: the function
    name is ``module.Class.method``, for an ``async def`` method ``module.<its qualname>``
    (Ray's descriptors differ so)."""
    raw = inspect.getattr_static(cls, name, None)
    if inspect.iscoroutinefunction(raw):
        return f"{cls.__name__}.{name}", f"{cls.__module__}.{raw.__qualname__}"
    return f"{cls.__name__}.{name}", f"{cls.__module__}.{cls.__name__}.{name}"


def _ray_ready(self: Any) -> bool:
    """Ray's ``actor.__ray_ready__.remote()``: answers True once the actor is constructed."""
    return True


def _ray_terminate(self: Any) -> None:
    """Ray's ``actor.__ray_terminate__.remote()``: a call like any other, so the calls sent
    before it run first; then the actor exits by intent, as with ``exit_actor()`` (no
    restart; ``__ray_shutdown__`` and the atexit handlers run)."""
    from yrdask.api.instances import exit_with

    exit_with("exited by __ray_terminate__()")


def _ray_shutdown(self: Any, grace: int) -> Any:
    """yr's shutdown hook for a class that defines Ray's ``__ray_shutdown__()``: it runs
    when the actor ends gracefully (``__ray_terminate__``, ``exit_actor()``, its handles
    released), bounded by the grace period."""
    return self.__ray_shutdown__()


def _call_with_options(self: Any, name: str, options: dict, *args: Any, **kwargs: Any) -> Any:
    """Run method ``name`` with per-call options (``actor.method.options(...)``): Ray's
    ``retry_exceptions``, ``max_task_retries`` and ``concurrency_group`` for this call only,
    over the method's own (``@ray.method``) and the actor's.  Returns what the method returns
    (a coroutine for an ``async def`` one, which the instance's loop finishes)."""
    cls = type(self)
    raw = cls.__ray_raw__[name]
    group = options.get("concurrency_group", getattr(raw, _GROUP, None))
    groups = cls.__ray_groups__
    if group is not None and group not in groups:
        raise ValueError(f"{cls.__name__}.{name}.options(concurrency_group={group!r}): the "
                         f"actor defines no such concurrency group (concurrency_groups="
                         f"{groups})")
    if groups and group is None:
        group = _DEFAULT_GROUP
    retry = options.get("retry_exceptions", getattr(raw, _RETRY, None)) or False
    max_retries = options.get("max_task_retries",
                              getattr(raw, _TASK_RETRIES, cls.__ray_max_task_retries__))
    if inspect.isgeneratorfunction(raw) or inspect.isasyncgenfunction(raw):
        gen_returns = options.get("_gen_returns")  # an int or "dynamic" num_returns
        if gen_returns is None:  # streams
            if retry:
                return _retrying_generator(raw, retry, max_retries)(self, *args, **kwargs)
            return raw(self, *args, **kwargs)
        from yrdask.ray.generators import (async_generator_returns, dynamic_refs,
                                           generator_returns)

        if inspect.isasyncgenfunction(raw):
            return async_generator_returns(raw(self, *args, **kwargs), gen_returns)
        if gen_returns == "dynamic":
            return dynamic_refs(raw(self, *args, **kwargs), f"{cls.__mro__[1].__name__}.{name}")
        return generator_returns(raw(self, *args, **kwargs), gen_returns)
    limit = groups.get(group, cls.__ray_default_limit__)
    names = _names(cls.__mro__[1], name)
    if options.get("name"):  # .options(name=): the task name get_task_name() gives
        names = (options["name"], names[1])
    return _runner(raw, group, limit, retry, max_retries, names,
                   cls.__ray_async__)(self, *args, **kwargs)


class _PrepareImports:
    """Unpickling this installs the ``ray`` import alias (``python -m yrdask.ray`` runs) and
    puts the job's ``code_search_path`` on ``sys.path`` (``_alias.prepare_imports``)."""

    def __init__(self, alias: bool, code_paths: tuple) -> None:
        self.alias, self.code_paths = alias, code_paths

    def __reduce__(self):
        from yrdask.ray._alias import prepare_imports

        return (prepare_imports, (self.alias, self.code_paths))


def _alias_metaclass(base: type, alias: bool, code_paths: tuple) -> type:
    """A metaclass that carries :class:`_PrepareImports`: cloudpickle rebuilds a class's
    metaclass (and its attributes) before the class's bases, so on a worker the alias and the
    code paths are in place before the user's class is imported from a module that says
    ``import ray`` or lives in the job's ``code_search_path``."""
    return type(f"RayActorMeta({base.__name__})", (base,),
                {"_ray_alias": _PrepareImports(alias, code_paths)})


def _is_async_class(cls: type) -> bool:
    return any(inspect.iscoroutinefunction(m) or inspect.isasyncgenfunction(m)
               for _, m in inspect.getmembers(cls, inspect.isfunction))


def host_class(cls: type, ctx: dict, groups: dict, max_concurrency: int | None,
               max_task_retries: int, out_of_order: bool | None = None
               ) -> tuple[type, int | None]:
    """The subclass of ``cls`` that runs on the worker, and the instance concurrency it needs.
    ``out_of_order``: Ray's ``allow_out_of_order_execution`` (None: async and threaded actors
    run calls as their arguments resolve, others in submission order)."""
    is_async = _is_async_class(cls)
    if out_of_order is not None and not isinstance(out_of_order, bool):
        raise TypeError(f"allow_out_of_order_execution must be a bool, got {out_of_order!r}")
    if out_of_order is False and is_async:
        raise ValueError("If you're using async actors, Ray can't execute actor tasks in "
                         "order. Set `allow_out_of_order_execution=True` to allow "
                         "out-of-order execution.")
    if out_of_order is False and (max_concurrency or 1) > 1:
        raise ValueError("If you're using multi-threaded actors, Ray can't execute actor "
                         "tasks in order. Set `allow_out_of_order_execution=True` to allow "
                         "out-of-order execution.")
    default_limit = max_concurrency or (1000 if is_async else 1)
    ns: dict[str, Any] = {"__ray_ctx__": ctx, "__ray_sems__": {},
                          "__module__": cls.__module__, "__doc__": cls.__doc__,
                          # a call running when the actor's process dies is delivered again
                          # max_task_retries times (Ray's rule; default 0: it fails)
                          _REDELIVERIES: max_task_retries}
    raw_methods: dict[str, Callable] = {}
    off_loop: list[str] = []  # an async actor's methods in a group of their own
    for name, member in inspect.getmembers(cls):
        raw = inspect.getattr_static(cls, name, None)
        if not inspect.isfunction(raw) or (name.startswith("__") and name != "__call__"):
            continue
        raw_methods[name] = raw
        if inspect.isgeneratorfunction(raw) or inspect.isasyncgenfunction(raw):
            if getattr(raw, _RETRY, None):
                ns[name] = _retrying_generator(raw, getattr(raw, _RETRY),
                                               getattr(raw, _TASK_RETRIES, max_task_retries))
            continue
        group = getattr(raw, _GROUP, None)
        retry = getattr(raw, _RETRY, None)
        if group is not None and group not in groups:
            raise ValueError(f"{cls.__name__}.{name} uses concurrency group {group!r}, which "
                             f"the actor does not define (concurrency_groups={groups})")
        if groups and group is None:
            group = _DEFAULT_GROUP
        limit = groups.get(group, default_limit)
        if is_async and group not in (None, _DEFAULT_GROUP):
            off_loop.append(name)
        ns[name] = _runner(raw, group, limit, retry or False,
                           getattr(raw, _TASK_RETRIES, max_task_retries), _names(cls, name),
                           is_async)
    ns["__ray_async__"] = is_async
    ns["__ray_raw__"] = raw_methods
    ns["__ray_groups__"] = dict(groups)
    ns["__ray_default_limit__"] = default_limit
    ns["__ray_max_task_retries__"] = max_task_retries
    ns["__ray_call__"] = _call_with_options
    ns["__ray_ready__"] = _ray_ready
    ns["__ray_terminate__"] = _ray_terminate
    if hasattr(cls, "__ray_shutdown__") and not hasattr(cls, "__yr_shutdown__"):
        ns["__yr_shutdown__"] = _ray_shutdown
    # the worker starts their calls off the actor's own loop, which its default group's
    # calls may block (Ray: each group has its own executor)
    ns["__yr_off_loop__"] = tuple(off_loop)
    user_init = cls.__init__

    # __init__ runs in the actor's context (its job's namespace for get_actor, its job
    # id), as its methods do: the instance has no object to read it from yet
    @functools.wraps(user_init)
    def __init__(self, *args, **kwargs):
        prev = set_task_ctx(ctx)
        try:
            user_init(self, *args, **kwargs)
        except Exception:  # every call reports it as ActorDiedError (Ray's rule)
            raise _CreationFailed(traceback.format_exc()) from None
        finally:
            set_task_ctx(prev)

    if inspect.iscoroutinefunction(user_init):  # awaited on the actor's loop, as Ray does
        @functools.wraps(user_init)
        async def __init__(self, *args, **kwargs):  # noqa: F811 - the async form of the above
            prev = set_task_ctx(ctx)
            try:
                await user_init(self, *args, **kwargs)
            except Exception:
                raise _CreationFailed(traceback.format_exc()) from None
            finally:
                set_task_ctx(prev)

    ns["__init__"] = __init__
    code_paths = tuple(ctx.get("code_search_path", ()))
    meta = _alias_metaclass(type(cls), bool(ctx.get("alias")), code_paths) \
        if ctx.get("alias") or code_paths else type(cls)
    host = meta(cls.__name__, (cls,), ns)
    host.__qualname__ = cls.__qualname__
    concurrency = max_concurrency
    if groups:  # the groups' own executors bound their calls; the instance only hands over
        concurrency = max(1000, sum(groups.values()) + default_limit)
    if is_async or (concurrency or 1) > 1 or out_of_order:
        # Ray runs the calls of async and threaded actors as their arguments resolve: a
        # later call whose arguments are ready does not wait behind an earlier one's
        setattr(host, _UNORDERED, True)
    if concurrency is not None and concurrency > 1000:  # above yr's bound: the class says it
        setattr(host, _CONCURRENCY, concurrency)
        concurrency = 1000
    return host, concurrency
