"""``@ray.remote`` functions: ``f.remote(...)`` and ``f.options(...)`` over yr's FunctionProxy.

The function travels inside a :class:`TaskBody`, which on the worker

* installs the ``ray`` import alias first when the driver runs under ``python -m yrdask.ray``
  (so a body that says ``ray.get`` or ``import ray`` finds yrdask.ray there too), and puts the
  job's ``JobConfig(code_search_path=...)`` on ``sys.path``;
* sets the job context (namespace, job id, assigned resources) for ``ray.get_runtime_context``
  and ``ray.get_actor``;
* reruns the function after a user exception when ``retry_exceptions`` allows it, up to
  ``max_retries`` times (Ray's rule; reruns after a lost worker are bounded by the same
  ``max_retries``, handed to yr's submit queue as the task's own bound).
"""

from __future__ import annotations

import functools
import inspect
import pickle
import uuid
from typing import Any, Callable

import cloudpickle

from yrdask.api.functions import FunctionProxy
from yrdask.ray._context import STATE, current_ctx, set_task_ctx, title_begin, title_end
from yrdask.ray._options import (TASK, RayOptions, check_num_returns, node_affinity,
                                 to_invoke_options)
from yrdask.ray._util import (captured_group, in_captured_group, next_spread_node,
                              rerun_items, should_retry, with_capture)
from yrdask.ray.exceptions import UnsupportedOptionError

__all__ = ["RemoteFunction", "TaskBody", "should_retry"]


class TaskBody:
    """What runs on the worker for one ray task (see module docstring)."""

    def __init__(self, fn: Callable, ctx: dict, retry_exceptions: Any, max_retries: int,
                 mode: str = "plain", num_returns: int = 1) -> None:
        self.fn, self.ctx = fn, ctx
        self.retry_exceptions, self.max_retries = retry_exceptions, max_retries
        # "plain", "streaming" (yields), "dynamic" (a generator of refs), "collect" (a
        # generator function with num_returns=n: its n yielded values are the n returns)
        self.mode = mode
        self.num_returns = num_returns
        self.__name__ = getattr(fn, "__name__", "task")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)
        self.__module__ = getattr(fn, "__module__", None)
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__signature__ = inspect.signature(fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.mode == "streaming":
            return self._stream(args, kwargs)
        ctx = dict(self.ctx, task_id=uuid.uuid4().hex)
        prev = set_task_ctx(ctx)
        title = title_begin(ctx.get("task_name") or self.__name__)  # ray::<name>, as Ray
        try:
            attempt = 0
            while True:
                try:
                    if self.mode == "dynamic":  # values stored here, their refs returned
                        return self._dynamic(args, kwargs, attempt)
                    if self.mode == "collect":
                        return self._collect(self.fn(*args, **kwargs), attempt)
                    return self.fn(*args, **kwargs)
                except BaseException as e:  # noqa: BLE001 - rerun or re-raise
                    if self._again(e, attempt):
                        attempt += 1
                        continue
                    raise
        finally:
            title_end(title)
            set_task_ctx(prev)

    def _again(self, e: BaseException, attempt: int) -> bool:
        """Whether attempt ``attempt`` (0: the first run) failing with ``e`` is run again:
        ``retry_exceptions`` names ``e`` and ``max_retries`` allows one more."""
        return should_retry(e, self.retry_exceptions) and (
            self.max_retries == -1 or attempt < self.max_retries)

    def _dynamic(self, args: tuple, kwargs: dict, attempt: int) -> Any:
        """``num_returns="dynamic"``: the refs of the yielded values (the last one holds the
        error if the generator raised and is not rerun)."""
        from yrdask.ray.generators import dynamic_refs

        return dynamic_refs(self.fn(*args, **kwargs), self.__qualname__,
                            lambda e: self._again(e, attempt))

    def _collect(self, gen: Any, attempt: int) -> Any:
        """The ``num_returns`` values a generator yielded, as the task's returns."""
        from yrdask.ray.generators import generator_returns

        return generator_returns(gen, self.num_returns, lambda e: self._again(e, attempt))

    def _stream(self, args: tuple, kwargs: dict) -> Any:
        """A generator task: the context holds while it yields (the worker iterates it); it
        is run again after the exceptions ``retry_exceptions`` names, up to ``max_retries``
        times, the caller getting only the items it has not received yet."""
        prev = set_task_ctx(dict(self.ctx, task_id=uuid.uuid4().hex))
        try:
            yield from rerun_items(lambda: self.fn(*args, **kwargs), self._again)
        finally:
            set_task_ctx(prev)

    def __reduce__(self):
        state = cloudpickle.dumps((self.fn, self.ctx, self.retry_exceptions, self.max_retries,
                                   self.mode, self.num_returns), protocol=5)
        return (_rebuild_body, (bool(self.ctx.get("alias")), state,
                                tuple(self.ctx.get("code_search_path", ()))))


def _rebuild_body(alias: bool, state: bytes, code_paths: tuple = ()) -> TaskBody:
    if alias or code_paths:  # before the function is unpickled: its module may say
        from yrdask.ray._alias import prepare_imports  # `import ray`, or be in the job's

        prepare_imports(alias, code_paths)  # code_search_path
    return TaskBody(*pickle.loads(state))


class RemoteFunction:
    """A ``@ray.remote`` function: ``.remote(*args)`` submits it, ``.options(**kw)`` changes
    options for the calls made through the returned object only."""

    def __init__(self, fn: Callable, options: dict) -> None:
        from yrdask.ray._options import check_keys, check_resources

        check_keys(options, TASK)
        check_resources(options)  # Ray checks them here, not at the first .remote()
        if options.get("num_returns") is not None:  # None: Ray's default
            check_num_returns(options["num_returns"], inspect.isgeneratorfunction(fn),
                              getattr(fn, "__qualname__", ""))
        if inspect.iscoroutinefunction(fn):
            raise ValueError(  # Ray's type and advice
                f"'async def' should not be used for remote tasks ({fn.__qualname__}). You can "
                "wrap the async function with `asyncio.run(f())`, or make it an async actor "
                "method")
        self._function = fn
        self._options = dict(options)
        self._proxy: tuple[Any, FunctionProxy, RayOptions] | None = None
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        name = getattr(self._function, "__qualname__", "f")
        raise TypeError(f"Remote functions cannot be called directly. Instead of running "
                        f"'{name}()', try '{name}.remote()'.")

    def __reduce__(self):
        return (RemoteFunction, (self._function, self._options))

    def options(self, **options: Any) -> "RemoteFunction":
        """A copy with ``options`` merged over this function's (Ray's ``.options``)."""
        from yrdask.ray._options import check_keys

        return RemoteFunction(self._function, {**self._options, **options})

    def bind(self, *args: Any, **kwargs: Any) -> Any:
        """A :class:`~yrdask.ray.dag.FunctionNode`: this call in a DAG, made by
        ``dag.execute()`` (Ray's DAG API)."""
        from yrdask.ray.dag.function_node import FunctionNode

        return FunctionNode(self, args, kwargs)

    def _proxy_for_session(self) -> tuple[FunctionProxy, RayOptions]:
        sess = STATE.session
        cached = self._proxy
        key = id(sess)
        if cached is not None and cached[0] == key:
            return cached[1], cached[2]
        ctx = current_ctx() if sess is None else None
        namespace = (sess.namespace if sess is not None else ctx["namespace"])
        ropts = to_invoke_options(self._options, TASK, namespace,
                                  sess.job_env if sess is not None else None,
                                  getattr(self._function, "__qualname__", ""))
        if sess is not None:
            ctx = sess.ctx(ropts.resources)
        else:
            ctx = dict(ctx, resources=ropts.resources)
        ctx = with_capture(ctx, ropts.capture)
        ctx.pop("placement_group_id", None)  # a parent's is not its child's
        if ropts.group is not None:
            ctx["placement_group_id"] = ropts.group.id
        fn = self._function
        name = self._options.get("name")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str, got {name!r}")
        ctx["task_name"] = name or getattr(fn, "__name__", "task")  # Ray's get_task_name()
        ctx["function_name"] = (f"{getattr(fn, '__module__', None)}."  # Ray's: no qualname
                                f"{getattr(fn, '__name__', ctx['task_name'])}")
        nret, mode = self._returns(ropts.num_returns, bool(ropts.max_calls))
        body = TaskBody(self._function, ctx, ropts.retry_exceptions, ropts.max_retries, mode,
                        nret if mode == "collect" else 1)
        proxy = FunctionProxy(body, ropts.invoke, nret)
        proxy._wait_nested = False  # Ray's rule: refs nested in arguments are not waited for
        proxy._max_crashes = ropts.max_retries  # reruns after a lost worker (-1: no bound)
        proxy._events = ropts.events  # enable_task_events=False: its tasks leave no record
        if ropts.max_calls:
            if mode == "streaming":
                raise UnsupportedOptionError(
                    f"max_calls on the generator function {self.__qualname__} is not supported "
                    "by yrdask.ray (max_calls runs it in processes of its own, which do not "
                    "stream); drop max_calls or use num_returns='dynamic'")
            proxy._max_calls = ropts.max_calls  # its isolated processes end after as many
        if ropts.num_returns == "dynamic" and mode == "streaming":
            from yrdask.ray.generators import DynamicReturns

            proxy = DynamicReturns(proxy)  # its items streamed, their refs one value
        self._proxy = (key, proxy, ropts)
        return proxy, ropts

    def _returns(self, num_returns: Any, isolated: bool = False) -> tuple[int, str]:
        """yr's number of returns and the body's mode for Ray's ``num_returns``.
        ``"dynamic"`` streams (:class:`DynamicReturns` makes its one ref), except in the
        isolated processes of ``max_calls``, which do not stream: there the body stores
        each value and returns their refs."""
        from yrdask.protocol import STREAMING

        is_gen = inspect.isgeneratorfunction(self._function)
        if self._options.get("num_returns") is None and is_gen:
            num_returns = "streaming"  # Ray's default for generator functions
        if num_returns == "streaming" or (num_returns == "dynamic" and not isolated):
            return STREAMING, "streaming"
        if num_returns == "dynamic":
            return 1, "dynamic"
        if is_gen:  # Ray: the generator's yielded values are the num_returns returns
            return num_returns, "collect"
        return num_returns, "plain"

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        """Submit one call: an ObjectRef (a list of ``num_returns`` of them; None for 0)."""
        from yrdask.ray._session import ensure_init

        ensure_init()
        group = captured_group(self._options)
        if group is not None:  # a child of work whose group captures its children
            return self._captured(group).remote(*args, **kwargs)
        proxy, ropts = self._proxy_for_session()
        if ropts.spread:
            proxy = self._spread(proxy, ropts)
        return proxy.invoke(*args, **kwargs)

    def _captured(self, group: Any) -> "RemoteFunction":
        """This function placed into ``group`` (one copy per group, keeping its cache)."""
        cache = self.__dict__.setdefault("_captured_copies", {})
        key = getattr(group, "id", None) or id(group)
        fn = cache.get(key)
        if fn is None:
            fn = cache[key] = RemoteFunction(self._function,
                                             in_captured_group(self._options, group))
        return fn

    def _spread(self, proxy: FunctionProxy, ropts: RayOptions) -> FunctionProxy:
        """``"SPREAD"``: each call prefers the next node in turn (a soft affinity)."""
        node = next_spread_node()
        if node is None:
            return proxy
        cache = self.__dict__.setdefault("_spread_proxies", {})
        if cache.get("_for") is not proxy:  # proxies of an older session are stale
            cache.clear()
            cache["_for"] = proxy
        spread = cache.get(node)
        if spread is None:
            opts = ropts.invoke.copy()
            opts.schedule_affinities = [*opts.schedule_affinities, *node_affinity(node, soft=True)]
            spread = cache[node] = proxy.options(opts)
        return spread
