"""``@yr.instance`` classes, their handles, method proxies, named lookups and termination."""

from __future__ import annotations

import inspect
import threading
from typing import Any, Callable

from yrdask import protocol as P
from yrdask.affinity import to_wire
from yrdask.api.group import add_group_member
from yrdask.api.resource_groups import bundle_wire_of, check_bundle_index
from yrdask.runtime.objects import ObjectRef
from yrdask.runtime.context import current_runtime
from yrdask.api.generators import ObjectRefGenerator
from yrdask.api.signatures import check_call
from yrdask.errors import (YRRuntimeError, YRTimeoutError, YRTypeError, YRValueError)
from yrdask.options import InvokeOptions, check_invoke_options, check_return_nums
from yrdask.options import check_no_unknown as _no_unknown
from yrdask.runtime.isolation import instance_isolation
from yrdask.serialization import dumps, dumps_definition

_RETURN_NUMS = "__yr_return_nums__"
_REDELIVERIES = "__yr_max_redeliveries__"  # see _ClassInfo.redeliveries
#: A class attribute that raises the instance's concurrency above yr's bound of 1000 (the Ray
#: surface's ``max_concurrency``, which has no bound).
_CONCURRENCY = "__yr_concurrency__"
#: A class attribute: a call may pass earlier calls whose ref arguments are not ready yet (the
#: Ray surface's async and threaded actors, whose calls Ray runs as their arguments resolve).
_UNORDERED = "__yr_unordered_calls__"
#: A class or method attribute: False, its calls (a class's: its creation too) leave no
#: record (the Ray surface's ``enable_task_events=False``; a method's own value wins).
_EVENTS = "__yr_task_events__"
#: A method attribute: a caller-side wrapper of the method's calls (Ray's
#: ``__ray_invocation_decorator__``); handles carry it, the Ray surface's ``.remote()`` applies
#: it (``yrdask.ray.actor.ActorMethod``).
_INVOCATION = "__ray_invocation_decorator__"
_NONE: dict = {}  # no caller-side wrappers (shared, never written)
DEFAULT_GRACE_S = 30  # __yr_shutdown__'s default grace period, as in yr
REAL_ID_WAIT_S = 30  # InstanceProxy.real_id waits this long for a placement, as in yr


def method(*args: Any, return_nums: int = 1, **ignored: Any) -> Any:
    """Mark a method's number of return values: ``@yr.method(return_nums=2)``."""
    _no_unknown("@yr.method", ignored, ("concurrency_group", "tensor_transport_target",
                                        "enable_tensor_transport"))  # yr accepts, ignores
    nret = check_return_nums(return_nums)

    def mark(fn: Callable) -> Callable:
        target = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn
        setattr(target, _RETURN_NUMS, nret)
        return fn

    if len(args) == 1 and callable(args[0]):
        return mark(args[0])
    return mark


class _ClassInfo:
    """What handles need to know of a class: methods, their return counts and signatures."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.name = cls.__name__
        self.payload = dumps_definition(cls, f"the class {self.name}")
        self.methods: dict[str, tuple[int, inspect.Signature | None]] = {}
        # bounds of redelivery after a crash, where the class sets them (the Ray surface's
        # max_task_retries): the class's __yr_max_redeliveries__, or a method's own
        self.redeliveries: dict[str, int] = {}
        default_redeliveries = getattr(cls, _REDELIVERIES, None)
        default_events = getattr(cls, _EVENTS, True)
        self.untraced: list[str] = []  # methods whose calls leave no record (_EVENTS)
        self.invocation: dict[str, Callable] = {}  # their caller-side wrappers (_INVOCATION)
        self.is_async = False
        for name, member in inspect.getmembers(cls):
            raw = inspect.getattr_static(cls, name, None)
            func = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else member
            if name == "__init__" and inspect.iscoroutinefunction(func):
                self.is_async = True  # awaited on the instance's loop (worker/hosting.py)
            if not callable(member) or (name.startswith("__") and name != "__call__"):
                continue
            if inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func):
                self.is_async = True
            try:
                sig = inspect.signature(member if isinstance(raw, (staticmethod, classmethod))
                                        else func)
                if not isinstance(raw, (staticmethod, classmethod)):
                    params = list(sig.parameters.values())[1:]
                    sig = sig.replace(parameters=params)
            except (TypeError, ValueError):
                sig = None
            nret = getattr(func, _RETURN_NUMS, 1)
            if inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func):
                if nret != 1:
                    raise YRValueError(
                        f"@yr.method(return_nums={nret}) on the generator method "
                        f"{self.name}.{name}: a generator streams one ref per yield (an "
                        "ObjectRefGenerator); drop return_nums")
                nret = P.STREAMING  # decided once: .invoke() gives an ObjectRefGenerator
            self.methods[name] = (nret, sig)
            bound = getattr(func, _REDELIVERIES, default_redeliveries)
            if bound is not None:
                self.redeliveries[name] = bound
            if not getattr(func, _EVENTS, default_events):
                self.untraced.append(name)
            if callable(getattr(func, _INVOCATION, None)):
                self.invocation[name] = getattr(func, _INVOCATION)
        try:
            init_sig = inspect.signature(cls.__init__)
            self.init_sig: inspect.Signature | None = init_sig.replace(
                parameters=list(init_sig.parameters.values())[1:])
        except (TypeError, ValueError):
            self.init_sig = None
        self._info = {"name": self.name, "methods": self.methods,
                      "redeliveries": self.redeliveries, "untraced": self.untraced,
                      "unordered": bool(getattr(cls, _UNORDERED, False))}
        if self.invocation:
            self._info["invocation"] = self.invocation
        self.meta = dumps(self._info)
        self._metas: dict[int, bytes] = {1: self.meta}

    def concurrency(self, opts: Any) -> int:
        """The concurrency an instance created with ``opts`` runs with (as hosting has it)."""
        conc = getattr(self.cls, _CONCURRENCY, None) or opts.concurrency
        return conc or (1000 if self.is_async else 1)

    def meta_for(self, concurrency: int) -> bytes:
        """The handle metadata of an instance with this concurrency (its callers charge a
        lost worker's crash to up to that many calls: ``call_order.crash_window``)."""
        meta = self._metas.get(concurrency)
        if meta is None:
            meta = self._metas[concurrency] = dumps({**self._info, "concurrency": concurrency})
        return meta


class InstanceCreator:
    """A ``@yr.instance`` class: ``C.invoke(*args)`` creates an instance and returns its handle."""

    def __init__(self, cls: type, options: InvokeOptions) -> None:
        self._cls = cls
        self._options = options
        self._info: _ClassInfo | None = None
        self._lock = threading.Lock()
        self.__name__ = cls.__name__
        self.__qualname__ = cls.__qualname__
        self.__doc__ = cls.__doc__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise YRRuntimeError(
            f"instance class cannot be instantiated directly: instead of "
            f"{self._cls.__name__}(...), use {self._cls.__name__}.invoke(...)")

    def __reduce__(self):
        return (InstanceCreator, (self._cls, self._options))

    def _class_info(self) -> _ClassInfo:
        if self._info is None:
            self._info = _ClassInfo(self._cls)
        return self._info

    def get_original_cls(self) -> type:
        return self._cls

    def options(self, invoke_options: InvokeOptions | None = None, **kwargs: Any) -> "InstanceCreator":
        """A creator with these options for the next creations (the original keeps its own).

        Takes an ``InvokeOptions``, or Ray-style keywords ``name``, ``namespace``,
        ``lifetime="detached"``, ``get_if_exists``, ``resources``, ``concurrency``.
        """
        opts = check_invoke_options(invoke_options).copy() if invoke_options is not None \
            else self._options.copy()
        for key, value in kwargs.items():
            if key == "lifetime":
                if value != "detached":
                    raise YRValueError(f"lifetime must be 'detached', got {value!r}")
                opts.custom_extensions["lifecycle"] = "detached"
            elif key == "resources":
                if not isinstance(value, dict):
                    raise YRTypeError(f"resources must be a dict of tag -> amount, got {value!r}")
                opts.custom_resources.update(value)
            elif isinstance(getattr(InvokeOptions, key, None), bool) \
                    or key in InvokeOptions.__dataclass_fields__:  # a field or a class flag
                setattr(opts, key, value)
            else:
                raise YRTypeError(f"unknown option {key!r} for {self._cls.__name__}.options()")
        creator = InstanceCreator(self._cls, opts.validate())
        creator._info = self._info
        return creator

    def invoke(self, *args: Any, **kwargs: Any) -> "InstanceProxy":
        """Create an instance (asynchronously); returns its handle at once."""
        rt = current_runtime()
        info = self._class_info()
        if info.init_sig is not None:
            try:
                check_call(info.init_sig, args, kwargs)
            except TypeError as e:
                raise TypeError(f"{info.name}.invoke(): {e}") from None
        opts = self._options
        if opts.group_name:  # created with its yr.Group (api/group.py), at Group.invoke()
            iid = f"i-{rt.new_id()}"
            add_group_member(opts, iid, lambda o: self.options(o)._create(
                rt, info, args, kwargs, instance_id=iid))
            return InstanceProxy(iid, info.meta_for(info.concurrency(opts)), rt)
        if opts.get_if_exists:
            with self._lock:
                return self._get_or_create(rt, info, args, kwargs)
        return self._create(rt, info, args, kwargs)

    def _get_or_create(self, rt: Any, info: _ClassInfo, args: tuple, kwargs: dict) -> "InstanceProxy":
        iid, where, meta = rt.scheduler_call(P.GET_NAMED, name=self._options.name,
                                             namespace=self._options.namespace, timeout=60)
        if iid is not None:  # the existing instance's own metadata (its concurrency)
            return InstanceProxy(iid, meta or info.meta, rt)
        return self._create(rt, info, args, kwargs)

    def _create(self, rt: Any, info: _ClassInfo, args: tuple, kwargs: dict,
                instance_id: str | None = None) -> "InstanceProxy | None":
        """Send the creation; returns its handle (``None`` for a group member created under
        ``instance_id``, whose handle exists already)."""
        opts = self._options
        if opts.resource_group_options is not None:
            check_bundle_index(rt, opts)
        spec = {
            "cls": info.payload, "cls_name": info.name,
            "meta": info.meta_for(info.concurrency(opts)),
            "shape": opts.resource_shape(), "timeout_ms": opts.schedule_timeout_ms,
            "name": opts.name, "namespace": opts.namespace, "detached": opts.is_detached,
            "concurrency": getattr(info.cls, _CONCURRENCY, None) or opts.concurrency,
            "is_async": info.is_async,
            "recover_retry_times": opts.recover_retry_times,
            "affinity": to_wire(opts.schedule_affinities) + bundle_wire_of(opts),
            "labels": list(opts.labels),
            "grace_s": _grace_seconds(opts),  # __yr_shutdown__'s bound
            "isolation": instance_isolation(opts),  # docs/isolation.md
        }
        if not getattr(info.cls, _EVENTS, True):  # its creation leaves no record either
            spec["events"] = False
        if instance_id is not None:
            spec["instance_id"] = instance_id
            rt.create_instance(spec, args, kwargs)
            return None
        iid = rt.create_instance(spec, args, kwargs)
        handle = InstanceProxy(iid, spec["meta"], rt)
        handle._name = opts.name or ""  # for _repr_html_
        return handle

    def get_instance(self, name: str, namespace: str = "", timeout: int = 60) -> "InstanceProxy":
        return get_instance(name, namespace, timeout)


def _grace_seconds(opts: InvokeOptions) -> int:
    """Seconds ``__yr_shutdown__`` may take: ``custom_extensions["GRACEFUL_SHUTDOWN_TIME"]``
    (default 30, as in yr)."""
    raw = opts.custom_extensions.get("GRACEFUL_SHUTDOWN_TIME", DEFAULT_GRACE_S)
    try:
        grace = int(raw)
    except (TypeError, ValueError):
        grace = -1
    if grace < 0 or isinstance(raw, bool):
        raise YRValueError('custom_extensions["GRACEFUL_SHUTDOWN_TIME"] must be a whole number '
                           f'of seconds >= 0, got {raw!r}')
    return grace


class InstanceProxy:
    """A handle to an instance: ``h.method.invoke(...)``; picklable, usable anywhere."""

    def __init__(self, instance_id: str, meta: bytes, runtime: Any) -> None:
        from yrdask.serialization import loads

        self.instance_id = instance_id
        self._meta = meta
        info = loads(meta)
        self._cls_name: str = info["name"]
        self._methods: dict = info["methods"]
        self._redeliveries: dict = info.get("redeliveries", {})
        self._unordered: bool = info.get("unordered", False)
        self._concurrency: int = info.get("concurrency", 1)
        self._untraced = frozenset(info.get("untraced", ()))
        self._invocation: dict = info.get("invocation", _NONE)
        self._rt = runtime
        self._terminated = False
        runtime.on_loop(runtime.router.incref, instance_id)

    def __del__(self) -> None:
        rt = self.__dict__.get("_rt")  # absent if __init__ failed
        if rt is not None and not rt.closed:
            try:
                rt.on_loop(rt.router.decref, self.instance_id)
            except Exception:
                pass

    def __getattr__(self, name: str) -> "MethodProxy":
        methods = self.__dict__.get("_methods")
        if methods is not None and name not in methods:
            # h.state / h.status() unless the class has methods of those names.
            if name == "state":
                return self._status()["state"]
            if name == "status":
                return self._status
        if methods is None or name not in methods:
            cls_name = self.__dict__.get("_cls_name", "instance")
            raise AttributeError(f"'{cls_name}' object has no attribute '{name}'")
        nret, sig = methods[name]
        return MethodProxy(self, name, nret, sig)

    def __reduce__(self):
        from yrdask.runtime.context import is_checkpointing

        if is_checkpointing():
            return (_rebuild_handle, (self.instance_id, self._meta, None))
        rt = self._rt
        token = rt.new_id()
        rt.on_loop(rt.router.transit, self.instance_id, token)
        return (_rebuild_handle, (self.instance_id, self._meta, token))

    def __repr__(self) -> str:
        return f"InstanceProxy({self._cls_name}, id={self.instance_id!r})"

    def _repr_html_(self) -> str:
        """Jupyter: class, id, name (if this handle was made with one), and a dashboard link."""
        from html import escape

        rows = [("class", self._cls_name), ("id", self.instance_id),
                ("name", self.__dict__.get("_name") or ""),
                ("handle", "terminated" if self._terminated else "active")]
        cells = "".join(f"<tr><th style='text-align:left'>{k}</th><td><code>{escape(v)}</code>"
                        f"</td></tr>" for k, v in rows if v)
        dashboard = getattr(getattr(self._rt, "connector", None), "dashboard", None)
        if dashboard:  # "http://host:port/status" -> the instances page filtered to this one
            url = escape(f"{dashboard.rsplit('/', 1)[0]}/yr-instances?name={self.instance_id}")
            cells += (f"<tr><th style='text-align:left'>dashboard</th><td><a href='{url}' "
                      f"target='_blank'>{url}</a></td></tr>")
        return f"<div><strong>yr instance</strong><table>{cells}</table></div>"

    def _status(self) -> dict:
        """``{"state", "worker", "restarts", "reason", "waiting"}`` of the instance, from the
        scheduler.  ``waiting`` says why a PENDING one is not placed yet (what it needs, what
        each worker lacks, which instances hold it, how to fix it), "" otherwise."""
        return self._rt.scheduler_call(P.INSTANCE_STATUS, instance_id=self.instance_id)

    def is_activate(self) -> bool:
        """False once this handle terminated the instance."""
        return not self._terminated

    @property
    def real_id(self) -> str:
        """The id of the instance this handle reaches: for a named creation that bound an
        existing instance, that instance's id (``instance_id`` is the alias).  Waits up to
        30 s while the instance is being placed, as in yr."""
        import asyncio

        rt = self._rt
        try:
            return rt.run_sync(asyncio.wait_for(rt.connector.scheduler_rpc(
                P.LOCATE_INSTANCE, instance_id=self.instance_id), REAL_ID_WAIT_S))[3]
        except (asyncio.TimeoutError, TimeoutError):
            raise YRTimeoutError(f"real_id of {self.instance_id}: the instance was not placed "
                                 f"within {REAL_ID_WAIT_S} s") from None

    def terminate(self, is_sync: bool = False) -> None:
        """End the instance (and its non-detached children); later calls raise RuntimeError."""
        if not isinstance(is_sync, bool):
            raise YRTypeError(f"terminate: is_sync must be a bool, got {is_sync!r}")
        if self._terminated:
            return
        self._terminated = True
        if not self._rt.closed:  # else yr.finalize() already ended it
            _kill(self._rt, self.instance_id, is_sync)


class MethodProxy:
    """One method of an instance handle: ``.invoke(*args)`` and ``.options(opts)``."""

    def __init__(self, handle: InstanceProxy, name: str, nret: int, sig: Any,
                 events: bool | None = None) -> None:
        self._handle, self._name, self._nret, self._sig = handle, name, nret, sig
        # False: its calls leave no record; None: as the class says (_EVENTS)
        self._events = name not in handle._untraced if events is None else events

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise YRRuntimeError(f"instance methods cannot be called directly: use "
                             f"handle.{self._name}.invoke(...)")

    def options(self, invoke_options: InvokeOptions) -> "MethodProxy":
        check_invoke_options(invoke_options)
        return self

    def invoke(self, *args: Any, **kwargs: Any) -> Any:
        h = self._handle
        if h._terminated or h._rt.closed:
            raise YRRuntimeError(f"this instance is terminated ({h._cls_name} {h.instance_id})"
                                 + (": its yr runtime was finalized" if h._rt.closed else ""))
        if self._sig is not None:
            try:
                check_call(self._sig, args, kwargs)
            except TypeError as e:
                raise TypeError(f"{h._cls_name}.{self._name}.invoke(): {e}") from None
        refs = h._rt.call_method(h.instance_id, self._name, args, kwargs, self._nret,
                                 h._redeliveries.get(self._name), h._unordered,
                                 h._concurrency, self._events)
        if self._nret == 0:
            return None
        if self._nret == P.STREAMING:
            return ObjectRefGenerator(refs[0])
        return refs[0] if self._nret == 1 else refs


def _rebuild_handle(instance_id: str, meta: bytes, token: str | None) -> InstanceProxy:
    rt = current_runtime()
    handle = InstanceProxy(instance_id, meta, rt)
    if token is not None:  # None: restored from a checkpoint, nothing was in transit
        rt.on_loop(rt.router.arrived, instance_id, token)
    return handle


def _kill(rt: Any, instance_id: str, is_sync: bool) -> None:
    if is_sync:
        rt.scheduler_call(P.KILL_INSTANCE, instance_id=instance_id, reason="terminated")
    else:
        async def kill() -> None:
            try:
                await rt.connector.scheduler_rpc(P.KILL_INSTANCE, instance_id=instance_id,
                                                 reason="terminated")
            except Exception:
                pass

        rt.on_loop(lambda: rt.loop.create_task(kill()))


def instance(*args: Any, invoke_options: InvokeOptions | None = None, **ignored: Any) -> Any:
    """Decorate a class as a yr stateful instance class: ``@yr.instance`` or ``(invoke_options=)``."""

    def make(cls: Any) -> InstanceCreator:
        if not inspect.isclass(cls):
            raise YRRuntimeError("@yr.instance decorator must be applied to a class, "
                                 f"got {type(cls).__name__}")
        opts = check_invoke_options(invoke_options).copy() if invoke_options is not None \
            else InvokeOptions()
        return InstanceCreator(cls, opts)

    _no_unknown("@yr.instance", ignored, ())
    if invoke_options is not None:  # checked here too, so @yr.instance(...) itself fails
        check_invoke_options(invoke_options)
    if len(args) == 1 and inspect.isclass(args[0]) and invoke_options is None:
        return make(args[0])
    if args:
        raise YRRuntimeError("@yr.instance takes only the keyword argument invoke_options=")
    return make


def get_instance(name: str, namespace: str = "", timeout: int = 60) -> InstanceProxy:
    """A handle to the named instance; waits up to ``timeout`` s while it is being created."""
    if not isinstance(name, str) or not isinstance(namespace, str):
        raise YRTypeError("yr.get_instance: name and namespace must be str")
    if not name:
        raise YRValueError("yr.get_instance: name must not be empty")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
        raise YRTypeError(f"yr.get_instance: timeout must be a number >= 0, got {timeout!r}")
    rt = current_runtime()
    iid, where, meta = rt.scheduler_call(P.GET_NAMED, name=name, namespace=namespace,
                                         timeout=timeout)
    if iid is None:
        if meta == "timeout":
            raise YRTimeoutError(where)
        raise YRRuntimeError(where)
    handle = InstanceProxy(iid, meta, rt)
    handle._name = name  # for _repr_html_
    return handle


def list_named_instances(all_namespaces: bool = False) -> list:
    """Names of the named instances (in the default namespace, or all as dicts)."""
    if not isinstance(all_namespaces, bool):
        raise YRTypeError("yr.list_named_instances: all_namespaces must be a bool, "
                          f"got {all_namespaces!r}")
    rt = current_runtime()
    pairs = rt.scheduler_call(P.LIST_NAMED, all_namespaces=all_namespaces)
    if all_namespaces:
        return [{"name": n, "namespace": ns} for ns, n in pairs]
    return [n for _ns, n in pairs]


def kill_instance(instance_id: str) -> None:
    """Terminate an instance by id, waiting until it has stopped."""
    if not isinstance(instance_id, str):
        raise YRTypeError(f"yr.kill_instance: instance_id must be str, got {type(instance_id).__name__}")
    _kill(current_runtime(), instance_id, True)


class InstanceExited(BaseException):
    """Raised by ``yr.exit()`` in the method that called it, after the instance has stopped:
    it unwinds the method (a ``BaseException``, so ``except Exception`` does not keep it)."""


def exit() -> None:  # noqa: A001 - yr's name
    """End the instance whose method calls this (as ``terminate()`` would) and leave the method.

    The call that ran ``yr.exit()`` and those queued behind it fail with ``InstanceDiedError``
    ("exited by yr.exit()").  Outside an instance method: ``YRRuntimeError``.
    """
    exit_with("exited by yr.exit()")


def exit_with(reason: str) -> None:
    """:func:`exit` with the ``reason`` the instance's callers are told (the Ray surface's
    ``exit_actor()`` names itself, as Ray's error does)."""
    from yrdask.runtime.context import current_owner

    rt = current_runtime()
    iid = current_owner()
    agent = rt.agent
    if agent is None or not iid or iid not in agent.instances:
        raise YRRuntimeError("yr.exit() can only be called inside a method of an instance "
                             "(use handle.terminate() or yr.kill_instance(id) from elsewhere)")
    rt.scheduler_call(P.KILL_INSTANCE, instance_id=iid, reason=reason)
    raise InstanceExited(iid)


def get_namespace() -> str:
    """The default namespace of named instances.  yrdask has no job-wide default namespace
    (``Config.ns`` is refused, docs/options.md), so it is always ``""``: names without a
    ``namespace`` live there.  Kept for yr code that reads it (``yr.apis.get_namespace``)."""
    rt = current_runtime()
    conf = getattr(rt, "conf", None)
    return getattr(conf, "ns", "") or ""


__all__ = ["method", "instance", "get_instance", "list_named_instances", "kill_instance",
           "InstanceCreator", "InstanceProxy", "MethodProxy", "ObjectRef", "exit",
           "get_namespace", "InstanceExited"]
