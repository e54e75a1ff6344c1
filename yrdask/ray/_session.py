"""The ray session of a driver: ``ray.init`` / ``shutdown`` / auto-init, and failed refs.

Kept below :mod:`yrdask.ray.worker` so that actors and remote functions can auto-init
without importing the module that imports them.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from typing import Any

import yrdask
from yrdask.errors import YRTypeError, YRValueError
from yrdask.runtime import context as _rtctx
from yrdask.runtime.objects import Entry, ObjectRef
from yrdask.ray._context import STATE, Session
from yrdask.ray.exceptions import UnsupportedOptionError
from yrdask.words import in_ray_words

_lock = threading.RLock()

__all__ = ["RayContext", "init", "shutdown", "is_initialized", "ensure_init", "failed_ref",
           "store"]


class RayContext(dict):
    """What ``ray.init`` returns: ``address_info``, ``dashboard_url`` (also as keys)."""

    def __init__(self, address: str, dashboard_url: str | None, namespace: str, job_id: str):
        super().__init__(address=address, dashboard_url=dashboard_url, namespace=namespace,
                         job_id=job_id)
        self.address_info = {"address": address, "gcs_address": address}
        self.dashboard_url = dashboard_url

    def __enter__(self) -> "RayContext":
        return self

    def __exit__(self, *exc: Any) -> None:
        shutdown()

    def disconnect(self) -> None:
        shutdown()


def _address(address: str | None) -> str:
    """yr's ``server_address`` for Ray's ``address`` ("" = start an embedded cluster)."""
    if address is None and os.environ.get("RAY_ADDRESS"):  # Ray joins it
        return _address(os.environ["RAY_ADDRESS"])
    if address in (None, "local"):
        return os.environ.get("YR_SERVER_ADDRESS", "") if address is None else ""
    if not isinstance(address, str):
        raise TypeError(f"address must be a str, got {type(address).__name__}")
    if address == "auto":
        found = next((v for v in (os.environ.get("RAY_ADDRESS"),
                                  os.environ.get("YR_SERVER_ADDRESS"))
                      if v and v not in ("auto", "local")), None)
        if not found:
            raise ConnectionError("Could not find any running yrdask cluster for address="
                                  "'auto': set RAY_ADDRESS or YR_SERVER_ADDRESS to its "
                                  "scheduler (tcp://HOST:8786), or call ray.init() to start one")
        return found
    if address.startswith("ray://"):
        raise UnsupportedOptionError(
            f"address={address!r}: Ray Client (ray://) is not supported; give the Dask "
            "scheduler's address, e.g. ray.init(address='tcp://HOST:8786')")
    return address


def init(address: str | None = None, *, num_cpus: int | None = None,
         num_gpus: int | None = None, resources: dict | None = None,
         namespace: str | None = None, ignore_reinit_error: bool = False,
         log_to_driver: bool = True, runtime_env: dict | None = None,
         logging_level: Any = None, include_dashboard: bool | None = None,
         object_store_memory: int | None = None, job_config: Any = None,
         **kwargs: Any) -> RayContext:
    """Start (or join) the cluster this process submits to, as ``ray.init`` does.

    ``address``: None or "local" start an embedded cluster (None joins ``YR_SERVER_ADDRESS``
    if set), "auto" joins ``RAY_ADDRESS``/``YR_SERVER_ADDRESS``, "tcp://HOST:PORT" joins that
    Dask scheduler.  If yrdask is already initialised (``yr.init``), the session attaches to
    it.  Unsupported keywords raise :class:`UnsupportedOptionError` naming them.
    """
    unsupported = {k: v for k, v in kwargs.items() if v is not None}
    if "_system_config" in unsupported:
        raise UnsupportedOptionError(_system_config_refusal(unsupported["_system_config"]))
    if unsupported:
        raise UnsupportedOptionError(
            f"ray.init({', '.join(sorted(unsupported))}=...) is not supported by yrdask.ray; "
            "supported: address, num_cpus, num_gpus, resources, object_store_memory, "
            "namespace, ignore_reinit_error, log_to_driver, job_config, "
            "runtime_env={'env_vars': ...}, logging_level, include_dashboard (the dashboard "
            "is built on its first visit, so False costs nothing either way)")
    if include_dashboard is not None and not isinstance(include_dashboard, bool):
        raise TypeError(f"include_dashboard must be None or a bool, got {include_dashboard!r}")
    if not isinstance(log_to_driver, bool):
        raise TypeError(f"log_to_driver must be a bool, got {log_to_driver!r}")
    if num_gpus is not None and (isinstance(num_gpus, bool) or not isinstance(num_gpus, int)
                                 or num_gpus < 0):
        raise TypeError(f"num_gpus must be None or an int >= 0, got {num_gpus!r}")
    if resources is not None:
        if not isinstance(resources, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                for k, v in resources.items()):
            raise TypeError(f"resources must be a dict of name -> number, got {resources!r}")
        for key in ("CPU", "GPU"):
            if key in resources:
                raise ValueError(f"Use the 'num_cpus' and 'num_gpus' keyword instead of "
                                 f"'{key}' in 'resources' keyword")
    if namespace is not None and (not isinstance(namespace, str) or not namespace):
        raise TypeError(f"namespace must be None or a non-empty str, got {namespace!r}")
    default_lifetime = None
    code_paths: list = []
    if job_config is not None:  # ray.job_config.JobConfig: namespace, env, actor lifetime
        from yrdask.ray.job_config import _apply

        job_config = _apply(job_config)
        namespace = namespace or job_config.ray_namespace
        runtime_env = {**(job_config.runtime_env or {}), **(runtime_env or {})}
        default_lifetime = job_config.default_actor_lifetime
        code_paths = [os.path.abspath(p) for p in job_config.code_search_path]
    job_env: dict = {}
    if runtime_env:
        from yrdask.ray._options import _runtime_env
        from yrdask.options import InvokeOptions

        probe = InvokeOptions()
        _runtime_env(runtime_env, probe, None)
        job_env = probe.env_vars
    with _lock:
        if STATE.session is not None and _rtctx.installed_runtime() is \
                STATE.session.runtime:
            if ignore_reinit_error:
                return _context_of(STATE.session)
            raise RuntimeError("Maybe you called ray.init twice by accident? This error can be "
                               "suppressed by passing in 'ignore_reinit_error=True' or by "
                               "calling 'ray.shutdown()' prior to 'ray.init()'.")
        STATE.session = None
        rt = _rtctx.installed_runtime()
        owns = rt is None
        if rt is None:
            if isinstance(logging_level, int):
                logging_level = logging.getLevelName(logging_level)
            conf_kwargs: dict = {"server_address": _address(address),
                                 "log_level": logging_level or "WARNING"}
            if num_cpus is not None:
                conf_kwargs["num_cpus"] = int(num_cpus)
            if num_gpus is not None:  # declared GPUs need no hardware (docs/nodes.md)
                conf_kwargs["num_gpus"] = num_gpus
            if resources:
                conf_kwargs["resources"] = {k: float(v) for k, v in resources.items()}
            if object_store_memory is not None:  # the node's shared-memory store size
                conf_kwargs["object_store_memory"] = object_store_memory
            if "log_to_driver" in yrdask.Config.__dataclass_fields__:
                conf_kwargs["log_to_driver"] = bool(log_to_driver)
            if conf_kwargs["server_address"]:
                _check_listening(conf_kwargs["server_address"])
            try:  # a bad value reads as ray.init's argument (yrdask/words.py), not Config's
                conf = yrdask.Config(**conf_kwargs)
            except (YRValueError, YRTypeError) as e:
                plain = ValueError if isinstance(e, YRValueError) else TypeError
                raise plain(in_ray_words(str(e))) from None
            _rtctx.set_driver_api("ray")  # the scheduler explains waits in Ray's words
            yrdask.init(conf)
            rt = _rtctx.installed_runtime()
        elif num_cpus is not None or num_gpus is not None or resources or \
                object_store_memory is not None or address not in (None, "auto"):
            raise ValueError("When connecting to an existing cluster, num_cpus, num_gpus, "
                             "resources, object_store_memory and address must not be provided "
                             "(yrdask is already initialised in this process by yr.init)")
        from yrdask.api.session import LINE_HANDLERS
        from yrdask.ray._alias import installed
        from yrdask.ray.experimental.tqdm_ray import LINE_PREFIX, handle_line

        LINE_HANDLERS[LINE_PREFIX] = handle_line  # bars of tasks and actors, drawn here

        sess = Session(namespace or f"anon-{uuid.uuid4().hex[:12]}",
                       getattr(rt, "job_id", ""), owns, rt, job_env)
        sess.alias = installed()
        sess.default_lifetime = default_lifetime
        sess.code_search_path = code_paths
        STATE.session = sess
        return _context_of(sess)


def _system_config_refusal(config: Any) -> str:
    """Why ``ray.init(_system_config=...)`` is refused, and what yrdask has instead."""
    keys = sorted(config) if isinstance(config, dict) else []
    text = (f"ray.init(_system_config={{{', '.join(repr(k) for k in keys)}}}) is not supported "
            "by yrdask.ray: it sets the internals of Ray's raylet and GCS, which yrdask does "
            "not have.")
    if any(k.startswith(("memory_usage_threshold", "memory_monitor", "min_memory_free"))
           for k in keys):
        text += (" Ray's memory monitor (memory_usage_threshold) kills the newest task or "
                 "actor when the node's memory use passes that fraction, failing it with "
                 "OutOfMemoryError; yrdask has no node-wide monitor. Memory is bounded per "
                 "worker process by Dask instead: `dask worker --memory-limit` and the Dask "
                 "keys distributed.worker.memory.target/spill/pause/terminate (past "
                 "'terminate', 95 % of the limit by default, the nanny restarts the worker, "
                 "and the tasks it ran fail with WorkerCrashedError or rerun within "
                 "max_retries); ask for memory with @ray.remote(memory=...) so that tasks are "
                 "placed where it is free.")
    return text + " Drop _system_config."


def _check_listening(address: str) -> None:
    """Ray's ``ConnectionError`` at once when nothing listens at ``address`` (one try of
    Dask's connector): a refused connection is an answer, where yr's join would try again
    for Dask's connect timeout (30 s).  Anything else (it listens, TLS, no answer yet) is
    left to the join."""
    import asyncio
    import concurrent.futures

    from distributed.comm import registry
    from distributed.comm.addressing import parse_address

    scheme, loc = parse_address(address if "://" in address else f"tcp://{address}")
    if scheme != "tcp":
        return

    async def refused() -> bool:
        try:
            comm = await asyncio.wait_for(
                registry.get_backend(scheme).get_connector().connect(loc, deserialize=False), 5)
        except OSError as e:  # Dask's CommClosedError, caused by the refusal
            while e is not None and not isinstance(e, ConnectionRefusedError):
                e = e.__cause__ or e.__context__
            return e is not None
        except asyncio.TimeoutError:
            return False
        await comm.close()
        return False

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the caller may run a loop
        is_refused = pool.submit(asyncio.run, refused()).result()
    if is_refused:
        raise ConnectionError(f"Could not connect to the cluster at {address}: the connection "
                              "was refused (no Dask scheduler listens there). Start one with "
                              "`dask scheduler --preload yrdask`, or call ray.init() to start "
                              "a local cluster")


def _context_of(sess: Session) -> RayContext:
    info = getattr(sess.runtime, "info", None)
    return RayContext(getattr(info, "scheduler_address", ""), getattr(info, "dashboard_link", None),
                      sess.namespace, sess.job_id)


def ensure_init() -> None:
    """Auto-init: start (or attach) a session on first use; workers already have a runtime."""
    rt = _rtctx.installed_runtime()
    try:
        if rt is not None and rt.agent is not None:
            return
    except Exception:  # noqa: BLE001 - an isolated process's stand-in runtime says why itself
        return
    sess = STATE.session
    if rt is not None and sess is not None and sess.runtime is rt:
        return
    with _lock:
        sess = STATE.session
        rt = _rtctx.installed_runtime()
        if rt is None or sess is None or sess.runtime is not rt:
            init()


def shutdown() -> None:
    """End the session; stops the yr runtime if ``ray.init`` started it (``yr.finalize``)."""
    with _lock:
        sess, STATE.session = STATE.session, None
        if sess is not None and sess.owns_runtime and _rtctx.installed_runtime() is sess.runtime:
            yrdask.finalize()
            _rtctx.set_driver_api("yr")


def is_initialized() -> bool:
    """True while a yr runtime is installed in this process (driver session or worker)."""
    return _rtctx.installed_runtime() is not None


def store(value: Any) -> ObjectRef:
    """``ray.put`` without the checks: any picklable value, ``None`` and empty bytes too."""
    rt = _rtctx.current_runtime()
    if isinstance(value, (bytearray, memoryview)):
        value = bytes(value)
    return rt.put_value(value, "ray.put")  # a snapshot; large ones in the node's store


def failed_ref(error: BaseException) -> ObjectRef:
    """A ref that is already failed with ``error`` (a call on a killed actor)."""
    rt = _rtctx.current_runtime()
    entry = Entry()
    entry.set_error(error)
    return rt.objects.new_ref(rt.new_id(), entry)


