"""``@ray.remote`` classes (actors), the driver's side: ``ActorClass``, ``ActorHandle``,
``ActorMethod``, ``ray.method`` and ``ray.actor.exit_actor``, over yr's stateful instances.

What runs on the worker is the *host class* (a subclass of the user's class, made by
:func:`yrdask.ray._actor_host.host_class` when the actor is created): the job context, Ray's
``ActorDiedError`` for a failed ``__init__``, task names, retries and concurrency groups
live there."""

from __future__ import annotations

import inspect
import types
from typing import Any, Callable

from yrdask.api.instances import (_EVENTS, _REDELIVERIES, InstanceCreator, InstanceProxy,
                                  MethodProxy, _kill)
from yrdask.runtime.context import current_runtime
from yrdask.ray._actor_host import _GROUP, _NRET, _RETRY, _TASK_RETRIES, host_class
from yrdask.ray._context import STATE, current_ctx, hosted_instance
from yrdask.ray._util import captured_group, in_captured_group, with_capture
from yrdask.ray._options import (ACTOR, METHOD, check_keys, check_num_returns, check_resources,
                                 check_task_events, node_affinity)
from yrdask.ray._options import to_invoke_options
from yrdask.ray.exceptions import ActorExitRequest, UnsupportedOptionError, actor_died

__all__ = ["ActorClass", "ActorHandle", "ActorMethod", "ActorProxy", "method", "exit_actor"]

#: Ray's methods of every actor: ``__ray_ready__`` (True once constructed) and
#: ``__ray_terminate__`` (a queued graceful exit), defined by the host class.
_RAY_CALLS = ("__ray_ready__", "__ray_terminate__")

#: Per-call method options that go to the actor with the call (``__ray_call__``).
_PER_CALL = ("max_task_retries", "retry_exceptions", "concurrency_group", "name",
             "_gen_returns")


def method(*args: Any, num_returns: Any = None, concurrency_group: str | None = None,
           max_task_retries: int | None = None, retry_exceptions: Any = None,
           enable_task_events: bool | None = None, **unknown: Any) -> Callable:
    """Annotate an actor method: ``@ray.method(num_returns=2, concurrency_group="io")``;
    ``@ray.method`` and ``@ray.method()`` leave the method's options as they are (Ray 2.x).
    ``enable_task_events=False``: its calls leave no record (it wins over the actor's)."""
    bare = len(args) == 1 and callable(args[0]) and not unknown and num_returns is None \
        and concurrency_group is None and max_task_retries is None \
        and retry_exceptions is None and enable_task_events is None
    if args and not bare:
        raise TypeError("The @ray.method decorator takes keyword arguments only (num_returns, "
                        "concurrency_group, max_task_retries, retry_exceptions, "
                        "enable_task_events), e.g. @ray.method(num_returns=2); got positional "
                        f"{args!r}")
    if enable_task_events is not None:
        check_task_events(enable_task_events)
    check_keys(unknown, METHOD)  # names any other Ray method option
    if num_returns is not None:
        check_num_returns(num_returns)
    if concurrency_group is not None and not isinstance(concurrency_group, str):
        raise TypeError(f"concurrency_group must be a str, got {concurrency_group!r}")
    if retry_exceptions is not None:
        from yrdask.ray._options import _retry_exceptions

        retry_exceptions = _retry_exceptions(retry_exceptions)

    def mark(fn: Callable) -> Callable:
        is_gen = inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn)
        nret = num_returns
        if nret is not None:
            check_num_returns(nret, is_gen, fn.__qualname__)
            nret = _method_returns(nret, "@ray.method")
        if nret is not None and is_gen != (nret < 0):
            raise ValueError(f"@ray.method(num_returns=...) on {fn.__qualname__}: a generator "
                             "method streams (num_returns='streaming'); other methods return "
                             "a number of values")
        if nret is not None and not is_gen:
            setattr(fn, _NRET, nret)
        if concurrency_group is not None:
            setattr(fn, _GROUP, concurrency_group)
        if retry_exceptions is not None:
            setattr(fn, _RETRY, retry_exceptions)
        if max_task_retries is not None:
            setattr(fn, _TASK_RETRIES, max_task_retries)
            setattr(fn, _REDELIVERIES, max_task_retries)  # after a crash, too (yr's bound)
        if enable_task_events is not None:
            setattr(fn, _EVENTS, enable_task_events)
        return fn

    return mark(args[0]) if bare else mark


def _method_returns(n: Any, what: str) -> int:
    """yr's number of returns of a method for Ray's ``num_returns``."""
    from yrdask.protocol import STREAMING

    if n == "streaming":
        return STREAMING
    if n == "dynamic":
        raise UnsupportedOptionError(f"{what}: num_returns='dynamic' is not supported for "
                                     "actor methods by yrdask.ray; use 'streaming'")
    return n


def exit_actor() -> None:
    """End the actor running this method: this call and later ones raise ActorDiedError."""
    inst = hosted_instance()
    if inst is None:
        raise TypeError("exit_actor API is called on a non-actor worker (call it inside an "
                        "actor method)")
    try:
        from yrdask.api.instances import exit_with
    except ImportError:  # older yrdask: end it here
        _kill(current_runtime(), inst.instance_id, False)
        raise ActorExitRequest() from None
    exit_with("exited by ray.actor.exit_actor()")


# -- classes, handles, methods -----------------------------------------------------------------


class ActorClass:
    """A ``@ray.remote`` class: ``.remote(*args)`` creates an actor, ``.options(**kw)`` a copy
    with other options."""

    def __class_getitem__(cls, item: Any) -> Any:
        """``ActorClass[Counter]`` in type hints (Ray's actors page writes
        ``CounterActor: ActorClass[Counter] = ray.remote(Counter)``)."""
        return types.GenericAlias(cls, item)

    def __init__(self, cls: type, options: dict) -> None:
        check_keys(options, ACTOR)
        check_resources(options)  # Ray checks them here, not at the first .remote()
        self._cls = cls
        self._options = dict(options)
        self._creator: tuple[int, InstanceCreator, Any] | None = None
        self.__name__ = cls.__name__
        self.__qualname__ = cls.__qualname__
        self.__doc__ = cls.__doc__
        self.__module__ = cls.__module__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"Actors cannot be instantiated directly. Instead of "
                        f"'{self.__name__}()', use '{self.__name__}.remote()'.")

    def __reduce__(self):
        return (ActorClass, (self._cls, self._options))

    def options(self, **options: Any) -> "ActorClass":
        return ActorClass(self._cls, {**self._options, **options})

    def bind(self, *args: Any, **kwargs: Any) -> Any:
        """A :class:`~yrdask.ray.dag.ClassNode`: this actor in a DAG, created anew by each
        ``dag.execute()`` (Ray's DAG API)."""
        from yrdask.ray.dag.class_node import ClassNode

        return ClassNode(self, args, kwargs)

    def _creator_for_session(self) -> tuple[InstanceCreator, Any]:
        sess = STATE.session
        if self._creator is not None and self._creator[0] == id(sess):
            return self._creator[1], self._creator[2]
        ctx = sess.ctx() if sess is not None else dict(current_ctx())
        options = self._options
        if sess is not None and sess.default_lifetime and options.get("lifetime") is None:
            options = dict(options, lifetime=sess.default_lifetime)
        ropts = to_invoke_options(options, ACTOR, ctx["namespace"],
                                  sess.job_env if sess is not None else None,
                                  self._cls.__qualname__)
        ctx = with_capture(dict(ctx, resources=ropts.resources), ropts.capture)
        ctx.pop("placement_group_id", None)  # a parent's is not its child's
        if ropts.group is not None:
            ctx["placement_group_id"] = ropts.group.id
        host, concurrency = host_class(self._cls, ctx, ropts.concurrency_groups,
                                       ropts.max_concurrency, ropts.max_retries,
                                       options.get("allow_out_of_order_execution"))
        ropts.invoke.concurrency = concurrency
        if not ropts.events:  # enable_task_events=False: its creation and calls leave no
            setattr(host, _EVENTS, False)  # record, but for methods that say otherwise
        creator = InstanceCreator(host, ropts.invoke.validate())
        self._creator = (id(sess), creator, ropts)
        return creator, ropts

    def remote(self, *args: Any, **kwargs: Any) -> "ActorHandle":
        """Create the actor (asynchronously); returns its handle at once."""
        from yrdask.ray._session import ensure_init

        ensure_init()
        group = captured_group(self._options)
        if group is not None:  # created by work whose group captures its children
            return ActorClass(self._cls, in_captured_group(self._options, group)).remote(
                *args, **kwargs)
        creator, ropts = self._creator_for_session()
        if ropts.spread:
            from yrdask.ray._util import next_spread_node

            node = next_spread_node()
            if node is not None:
                opts = ropts.invoke.copy()
                opts.schedule_affinities = [*opts.schedule_affinities,
                                            *node_affinity(node, soft=True)]
                creator = creator.options(opts)
        return ActorHandle(creator.invoke(*args, **kwargs))


class ActorID(str):
    """An actor's id (a str) with Ray's ``hex()``."""

    def hex(self) -> str:  # noqa: A003 - Ray's name
        return str(self)


class ActorHandle:
    """A handle to an actor: ``handle.method.remote(...)``; picklable, comparable by actor."""

    def __init__(self, proxy: InstanceProxy) -> None:
        self._proxy = proxy
        self._killed = False

    def __getattr__(self, name: str) -> "ActorMethod":
        proxy = self.__dict__.get("_proxy")
        if name in _RAY_CALLS and proxy is not None:  # Ray's methods of every actor
            return ActorMethod(self, name, 1, None, {})
        if proxy is None or name.startswith("__"):
            raise AttributeError(name)
        info = proxy._methods.get(name)
        if info is None:
            raise AttributeError(f"'ActorHandle' object has no attribute '{name}' "
                                 f"(actor class {proxy._cls_name})")
        if name in proxy._invocation:
            return _WrappedMethod(self, name, info[0], info[1], {})
        return ActorMethod(self, name, info[0], info[1], {})

    def __reduce__(self):
        return (ActorHandle, (self._proxy,))

    def __repr__(self) -> str:
        return f"Actor({self._proxy._cls_name}, {self._proxy.instance_id})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ActorHandle) and \
            other._proxy.instance_id == self._proxy.instance_id

    def __hash__(self) -> int:
        return hash(self._proxy.instance_id)

    def __class_getitem__(cls, item: Any) -> Any:
        """``ActorHandle[Counter]`` / ``ActorProxy[Counter]`` in type hints, as on Ray."""
        return types.GenericAlias(cls, item)

    @property
    def _actor_id(self) -> ActorID:
        return ActorID(self._proxy.instance_id)

    #: Ray's attribute behind ``_actor_id`` (Ray's tests and tools read ``_ray_actor_id.hex()``)
    _ray_actor_id = _actor_id

    def _kill(self) -> None:
        """``ray.kill(actor)``: it ends at once, as Ray's force kill: its running call is cut
        short, and neither ``__ray_shutdown__`` nor its atexit handlers run."""
        from yrdask import protocol as P

        self._killed = True
        proxy = self._proxy
        if not proxy._rt.closed:
            proxy._rt.scheduler_call(P.KILL_INSTANCE, instance_id=proxy.instance_id,
                                     reason="it was killed by `ray.kill`", force=True)

    def _crash(self) -> None:
        """``ray.kill(actor, no_restart=False)``: its process is killed as if it crashed, so
        it restarts while it has ``max_restarts`` left (the handle stays usable)."""
        from yrdask import protocol as P

        proxy = self._proxy
        if not proxy._rt.closed:
            proxy._rt.scheduler_call(P.KILL_INSTANCE, instance_id=proxy.instance_id,
                                     reason="killed by ray.kill(no_restart=False)",
                                     restart=True)


#: Ray's name for a typed actor handle in type hints (``counter: ActorProxy[Counter]``).
ActorProxy = ActorHandle


class ActorMethod:
    """One method of an actor handle: ``.remote(*args)``, ``.options(num_returns=...)``."""

    def __init__(self, handle: ActorHandle, name: str, nret: Any, sig: Any,
                 options: dict) -> None:
        self._handle, self._name, self._nret, self._sig = handle, name, nret, sig
        self._options = options

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"Actor methods cannot be called directly. Instead of running "
                        f"'object.{self._name}()', try 'object.{self._name}.remote()'.")

    def options(self, **options: Any) -> "ActorMethod":
        """Per-call options (Ray's): ``num_returns``, ``max_task_retries``,
        ``retry_exceptions``, ``concurrency_group``, ``name``; they override the method's
        ``@ray.method`` options and the actor's for calls made through the returned object."""
        from yrdask.protocol import STREAMING

        check_keys(options, METHOD)
        checked: dict = {}
        default = self._options
        if "num_returns" in options and options["num_returns"] is None:  # the method's own
            options = {k: v for k, v in options.items() if k != "num_returns"}
            default = {k: v for k, v in default.items()
                       if k not in ("num_returns", "_gen_returns")}
        for key, value in options.items():
            if key == "num_returns":
                check_num_returns(value, self._nret == STREAMING, self._name)
            if key == "num_returns" and self._nret == STREAMING and value != "streaming":
                # a generator method called with an int or "dynamic" num_returns (Ray's
                # static and dynamic generators): the actor collects what it yields
                checked["_gen_returns"] = check_num_returns(value)
                value = 1 if value == "dynamic" else value
            elif key == "num_returns":
                value = _method_returns(check_num_returns(value), f"{self._name}.options()")
            elif key == "max_task_retries":
                if isinstance(value, bool) or not isinstance(value, int) or value < -1:
                    raise ValueError("The keyword 'max_task_retries' only accepts -1, 0 or a "
                                     f"positive integer, got {value!r}")
            elif key == "retry_exceptions":
                from yrdask.ray._options import _retry_exceptions

                value = _retry_exceptions(value)
            elif key == "concurrency_group":
                if not isinstance(value, str):
                    raise TypeError(f"concurrency_group must be a str, got {value!r}")
            elif key == "name":
                if not isinstance(value, str):
                    raise TypeError(f"name must be a str, got {value!r}")
            elif key == "enable_task_events":
                check_task_events(value)
            checked[key] = value
        merged = {**default, **checked}
        if "num_returns" in checked and "_gen_returns" not in checked:
            merged.pop("_gen_returns", None)  # streams again
        return type(self)(self._handle, self._name, self._nret, self._sig, merged)

    def bind(self, *args: Any, **kwargs: Any) -> Any:
        """A :class:`~yrdask.ray.dag.ClassMethodNode`: this call of this actor in a DAG,
        made by each ``dag.execute()`` (Ray's DAG API)."""
        from yrdask.ray.dag.class_node import (PARENT_CLASS_NODE_KEY,
                                               PREV_CLASS_METHOD_CALL_KEY, ClassMethodNode)

        if self._sig is not None:
            from yrdask.api.signatures import check_call

            try:
                check_call(self._sig, args, kwargs)
            except TypeError as e:
                raise TypeError(f"{self._handle._proxy._cls_name}.{self._name}.bind(): "
                                f"{e}") from None
        return ClassMethodNode(self._name, args, kwargs, dict(self._options),
                               {PARENT_CLASS_NODE_KEY: self._handle,
                                PREV_CLASS_METHOD_CALL_KEY: None}, method=self)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        """Call the method: an ObjectRef (a list of ``num_returns`` of them; None for 0)."""
        from yrdask.ray._session import ensure_init, failed_ref

        ensure_init()
        handle = self._handle
        nret = self._options.get("num_returns", self._nret)
        if handle._killed:
            err = actor_died("it was killed by `ray.kill`", handle._proxy.instance_id,
                             handle._proxy._cls_name)
            refs = [failed_ref(err) for _ in range(max(1, nret))]
            return None if nret == 0 else refs[0] if nret == 1 else refs
        events = self._options.get("enable_task_events")  # None: as the method or actor says
        per_call = {k: v for k, v in self._options.items() if k in _PER_CALL}
        if not per_call:
            return MethodProxy(handle._proxy, self._name, nret, self._sig, events).invoke(
                *args, **kwargs)
        return self._call_with_options(nret, per_call, args, kwargs, events)

    def _call_with_options(self, nret: int, per_call: dict, args: tuple, kwargs: dict,
                           events: bool | None = None) -> Any:
        """Send the call to the actor's ``__ray_call__`` with its per-call options; a call
        running when the actor's process dies is delivered again up to this call's
        ``max_task_retries`` times."""
        from yrdask.protocol import STREAMING

        proxy = self._handle._proxy
        if self._sig is not None:
            from yrdask.api.signatures import check_call

            try:
                check_call(self._sig, args, kwargs)
            except TypeError as e:
                raise TypeError(f"{proxy._cls_name}.{self._name}.remote(): {e}") from None
        redeliveries = per_call.get("max_task_retries",
                                    proxy._redeliveries.get(self._name))
        if nret == STREAMING:  # rerun after exceptions (retry_exceptions), not after crashes
            redeliveries = None
        if proxy._terminated or proxy._rt.closed:
            return MethodProxy(proxy, self._name, nret, None).invoke()  # raises, says why
        method_args = (self._name, per_call, *args)
        if events is None:
            events = self._name not in proxy._untraced
        refs = proxy._rt.call_method(proxy.instance_id, "__ray_call__", method_args, kwargs,
                                     nret, redeliveries, proxy._unordered,
                                     proxy._concurrency, events)
        if nret == 0:
            return None
        if nret == STREAMING:
            from yrdask.api.generators import ObjectRefGenerator

            return ObjectRefGenerator(refs[0])
        return refs[0] if nret == 1 else refs


class _WrappedMethod(ActorMethod):
    """A method with Ray's ``__ray_invocation_decorator__``: its calls go through it, as on
    Ray. ``.remote(*args, **kwargs)`` returns ``decorator(invocation)(args, kwargs)``, where
    ``invocation(args, kwargs)`` sends the call and returns its refs, so the decorator may
    change the arguments and return more than the refs."""

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        wrap = self._handle._proxy._invocation[self._name]
        return wrap(lambda a, kw: ActorMethod.remote(self, *a, **kw))(args, kwargs)
