"""``yr.init``, ``yr.finalize`` and ``yr.is_initialized``: the driver's session.

``init`` checks the config, picks the cluster (the one at ``server_address``, or an embedded
one that the composition root :mod:`yrdask.deploy.embedded` builds), and installs the
driver's runtime as this process's runtime.
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Any

from yrdask.errors import YRRuntimeError, YRValueError
from yrdask.options import Config, check_config
from yrdask.runtime import context
from yrdask.runtime.runtime import ClientInfo, DriverRuntime

logger = logging.getLogger("yrdask")

_init_lock = threading.Lock()
_atexit_registered = False


def init(conf: Config | None = None) -> ClientInfo:
    """Connect to a cluster (``server_address``) or start an embedded one; returns ClientInfo."""
    global _atexit_registered
    with _init_lock:
        if context.installed_runtime() is not None:
            raise YRRuntimeError("yr.init cannot be called twice; call yr.finalize() first")
        conf = check_config(conf)
        _apply_log_level(conf.log_level)
        cluster = None
        if not conf.server_address:
            from yrdask.deploy.embedded import EmbeddedCluster

            cluster = EmbeddedCluster(conf.num_cpus)
        rt = DriverRuntime(conf, cluster)
        try:
            rt.info = rt.loop_runner.run(rt.start())
        except BaseException:
            try:
                rt.loop_runner.run(rt.close(), 30)
            except Exception:
                pass
            rt.loop_runner.stop()
            raise
        context.install(rt)
        if not _atexit_registered:
            atexit.register(finalize)
            _atexit_registered = True
        if rt.info.dashboard_link:
            logger.info("yrdask dashboard: %s", rt.info.dashboard_link)
        return rt.info


def finalize() -> None:
    """End the job: its leases return, its channels close, an embedded cluster stops."""
    with _init_lock:
        rt = context.installed_runtime()
        if not isinstance(rt, DriverRuntime):
            return
        context.install(None)
        try:
            rt.loop_runner.run(rt.close(), 60)
        except Exception:
            logger.exception("yr.finalize did not close cleanly")
        finally:
            rt.loop_runner.stop()


def is_initialized() -> bool:
    """True between ``yr.init`` and ``yr.finalize`` (always True inside tasks)."""
    return context.installed_runtime() is not None


def _apply_log_level(level: Any) -> None:
    if isinstance(level, str) and level:
        level = level.upper()
    try:
        logging.getLogger("yrdask").setLevel(level or "WARNING")
    except (ValueError, TypeError):
        raise YRValueError(f"Config.log_level {level!r} is not a logging level") from None
