"""``@yr.invoke``: stateless remote functions and their proxies."""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any, Callable

from yrdask.affinity import to_wire
from yrdask.api.resource_groups import bundle_wire_of, check_bundle_index
from yrdask.api.generators import ObjectRefGenerator
from yrdask.api.signatures import check_call
from yrdask.runtime.context import current_runtime
from yrdask.runtime.runtime import function_id
from yrdask.errors import YRRuntimeError, YRTypeError, YRValueError
from yrdask.runtime.isolation import IsolatedFunction, isolation_spec
from yrdask.options import (InvokeOptions, check_invoke_options, check_no_unknown,
                             check_return_nums)
from yrdask.protocol import STREAMING
from yrdask.serialization import dumps_definition


class FunctionProxy:
    """A remote function: ``f.invoke(*args, **kwargs)`` runs it on the cluster.

    ``f.options(InvokeOptions(...))`` returns a new proxy with those options; the original
    keeps its own (unlike openYuanrong, where ``options`` changes the proxy in place).
    """

    # Set per proxy by the Ray surface; the class defaults spare every yr ``invoke`` the
    # AttributeError that getattr(self, name, default) raises inside for a missing name.
    _wait_nested = True  # refs nested in the arguments gate the start (yr's rule)
    _max_crashes: int | None = None  # reruns after a lost worker (None: the config's bound)
    _events = True  # False: its tasks leave no record (Ray's enable_task_events=False)

    def __init__(self, func: Callable, options: InvokeOptions, return_nums: int,
                 initializer: Callable | None = None) -> None:
        self._func = func
        self._options = options
        self._return_nums = return_nums
        self._initializer = initializer
        self._signature = inspect.signature(func)
        self._name = getattr(func, "__qualname__", getattr(func, "__name__", "function"))
        self._payload: bytes | None = None
        self._fn_id = ""
        self._shape = options.resource_shape()
        # Tasks of one key share leases; a lease runs `concurrency` of them at once.
        self._shape_key = (tuple(sorted(self._shape.items())), options.schedule_timeout_ms,
                           options.concurrency or 1,
                           to_wire(options.schedule_affinities) + bundle_wire_of(options))
        functools.update_wrapper(self, func)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise YRRuntimeError(
            f"invoke function cannot be called directly: instead of {self._name}(...), "
            f"use {self._name}.invoke(...) and yr.get() the result")

    def __reduce__(self):
        return (FunctionProxy, (self._func, self._options, self._return_nums, self._initializer))

    def options(self, invoke_options: InvokeOptions) -> "FunctionProxy":
        """A new proxy of the same function with ``invoke_options``."""
        opts = check_invoke_options(invoke_options).copy()
        proxy = FunctionProxy(self._func, opts, self._return_nums, self._initializer)
        if not getattr(self, "_wait_nested", True):  # the Ray surface's rule carries over
            proxy._wait_nested = False
        if getattr(self, "_max_crashes", None) is not None:  # and its max_retries
            proxy._max_crashes = self._max_crashes
        if not getattr(self, "_events", True):  # and its enable_task_events=False
            proxy._events = False
        return proxy

    def get_original_func(self) -> Callable:
        return self._func

    def invoke(self, *args: Any, **kwargs: Any) -> Any:
        """Submit one call; returns an ObjectRef (a list of them for return_nums > 1, or None)."""
        rt = current_runtime()
        try:
            check_call(self._signature, args, kwargs)
        except TypeError as e:
            raise TypeError(f"{self._name}.invoke(): {e}") from None
        if self._options.group_name:
            raise YRValueError(
                f"{self._name}.invoke(): InvokeOptions.group_name applies to instances "
                "(yr.Group creates them together), not to stateless functions; use "
                "resource_group_options= to run calls inside a resource group")
        if self._options.resource_group_options is not None:
            check_bundle_index(rt, self._options)
        if self._payload is None:
            target = self._func if self._initializer is None else _with_initializer(
                self._func, self._initializer)
            iso = isolation_spec(self._options)  # env_vars / working_dir: docs/isolation.md
            if iso is not None and self._return_nums == STREAMING:
                raise YRValueError(
                    f"{self._name}.invoke(): a generator function cannot run in its own process "
                    "yet (env_vars, runtime_env or isolated=True ask for one); drop those "
                    "options, or return a list instead of yielding")
            if iso is not None:
                if getattr(self, "_max_calls", 0):  # the Ray surface's max_calls
                    iso = {**iso, "max_calls": self._max_calls}
                target = IsolatedFunction(target, rt.with_working_dir(iso))
            self._payload = dumps_definition(target, f"the function {self._name}")
            self._fn_id = function_id(self._payload, self._name)
        opts = self._options
        refs = rt.submit_task(self._fn_id, self._payload, self._name, args, kwargs,
                              self._return_nums, self._shape, self._shape_key,
                              opts.schedule_timeout_ms, opts.retry_times,
                              wait_nested=self._wait_nested, max_crashes=self._max_crashes,
                              events=self._events)
        if self._return_nums == 0:
            return None
        if self._return_nums == 1:
            return refs[0]
        if self._return_nums == STREAMING:  # a generator function
            return ObjectRefGenerator(refs[0])
        return refs


class _with_initializer:
    """Runs the user's initializer once per worker process before the function."""

    def __init__(self, func: Callable, initializer: Callable) -> None:
        self.func, self.initializer, self.done = func, initializer, False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.done:
            self.initializer()
            self.done = True
        return self.func(*args, **kwargs)


def invoke(*args: Any, invoke_options: InvokeOptions | None = None,
           return_nums: int | None = None, initializer: Callable | None = None,
           **unknown: Any) -> Any:
    """Decorate a function as a yr remote function: ``@yr.invoke`` or ``@yr.invoke(...)``."""
    check_no_unknown("@yr.invoke", unknown)  # it takes invoke_options=, return_nums=, initializer=
    if initializer is not None and not callable(initializer):
        raise YRTypeError(f"@yr.invoke: initializer must be callable, got {initializer!r}")
    if invoke_options is not None:  # checked here too, so @yr.invoke(...) itself fails
        check_invoke_options(invoke_options)
    if return_nums is not None:
        check_return_nums(return_nums)

    def make(func: Any) -> FunctionProxy:
        if not isinstance(func, types.FunctionType):
            raise YRRuntimeError("@yr.invoke decorator must be applied to a function, "
                                 f"got {type(func).__name__}")
        if inspect.iscoroutinefunction(func):
            raise YRRuntimeError(
                f"'async def' cannot be a yr task ({func.__qualname__}); make it a plain def "
                "that calls asyncio.run(...), or an async method of a @yr.instance class")
        if inspect.isasyncgenfunction(func):
            raise YRRuntimeError(
                f"an async generator cannot be a yr task ({func.__qualname__}); make it a plain "
                "generator (def with yield), or an async generator method of a @yr.instance class")
        opts = check_invoke_options(invoke_options).copy() if invoke_options is not None \
            else InvokeOptions()
        nret = 1 if return_nums is None else check_return_nums(return_nums)
        if inspect.isgeneratorfunction(func):  # decided once: .invoke() gives a generator
            if nret != 1:
                raise YRValueError(
                    f"@yr.invoke(return_nums={return_nums}) on the generator function "
                    f"{func.__qualname__}: a generator streams its values one ref per yield "
                    "(an ObjectRefGenerator); drop return_nums")
            nret = STREAMING
        return FunctionProxy(func, opts, nret, initializer)

    if len(args) == 1 and callable(args[0]) and invoke_options is None and return_nums is None \
            and initializer is None:
        return make(args[0])
    if args:
        raise YRRuntimeError("@yr.invoke takes only keyword arguments: "
                             "invoke_options=, return_nums=, initializer=")
    return make
