"""``yr.init``, ``yr.finalize`` and ``yr.is_initialized``: the driver's session.

``init`` checks the config, picks the cluster (the one at ``server_address``, or an embedded
one that the composition root :mod:`yrdask.deploy.embedded` builds), and installs the
driver's runtime as this process's runtime.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import sys
import threading
import time
from typing import Any, Callable

from yrdask.errors import YRRuntimeError, YRValueError
from yrdask.options import Config, check_config
from yrdask.runtime import context, heap
from yrdask.runtime.dask_objects import close_dask_client
from yrdask.runtime.driver import ClientInfo, DriverRuntime

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
        freeze = heap.freeze_enabled()  # checked before anything starts
        # the submitter reads these once the cluster is starting, the instance creations
        # later, the embedded cluster's workers (node labels) as they register: a bad one is
        # refused here
        from yrdask.config import (light_instances, node_labels, pipeline_settings,
                                   spare_processes, warm_zygotes)

        pipeline_settings()
        light_instances()
        spare_processes()
        warm_zygotes()  # the embedded cluster's scheduler's
        node_labels()
        if conf.env_file:
            _load_env_file(conf.env_file)
        _apply_log_level(conf.log_level)
        _forward_logs(conf.logger)
        cluster = None
        if not conf.server_address:
            from yrdask.deploy.embedded import EmbeddedCluster

            cluster = EmbeddedCluster(conf.num_cpus, num_gpus=conf.num_gpus,
                                      resources=conf.resources)
        rt = DriverRuntime(conf, cluster)
        if conf.log_to_driver:
            rt.output_sink = _Printer(conf.dedup_logs, rt.loop_runner.loop)
        try:
            rt.info = rt.loop_runner.run(rt.start())
        except BaseException:
            try:
                rt.loop_runner.run(rt.close(), 30)
            except Exception:
                pass
            rt.loop_runner.stop()
            _forward_logs(None)
            raise
        context.install(rt)
        # the libraries' objects: collections in bursts skip them (heap.py)
        rt.heap_frozen = freeze and heap.freeze()
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
            close_dask_client(rt)  # the Dask client yrdask.dask opened, if any
            rt.loop_runner.run(rt.close(), 60)
            if isinstance(rt.output_sink, _Printer):
                rt.loop_runner.loop.call_soon_threadsafe(rt.output_sink.expire, True)
        except Exception:
            logger.exception("yr.finalize did not close cleanly")
        finally:
            rt.loop_runner.stop()
            _forward_logs(None)
            if rt.heap_frozen:
                heap.unfreeze()


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


class _Forward(logging.Handler):
    """Hands yrdask's log records to the user's ``Config.logger``."""

    def __init__(self, target: logging.Logger) -> None:
        super().__init__(logging.NOTSET)
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        self.target.handle(record)


_forward: _Forward | None = None


def _forward_logs(target: logging.Logger | None) -> None:
    """``Config.logger``: yrdask's records go to ``target`` (instead of up to the root logger)."""
    global _forward
    yl = logging.getLogger("yrdask")
    if _forward is not None:
        yl.removeHandler(_forward)
        yl.propagate = True
        _forward = None
    if target is not None:
        _forward = _Forward(target)
        yl.addHandler(_forward)
        yl.propagate = False


def _load_env_file(path: str) -> None:
    """``Config.env_file``: ``KEY=VALUE`` lines (``#`` comments, optional ``export``) set in
    this driver's ``os.environ``, as openYuanrong does."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise YRValueError(f"Config.env_file {path!r} cannot be read: {e.strerror or e}") from None
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):].lstrip()
        key, sep, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise YRValueError(f"Config.env_file {path!r} line {n} is not KEY=VALUE: {line!r}")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        os.environ[key] = value


DEDUP_WINDOW_S = 5.0  # as Ray's RAY_DEDUP_LOGS_AGG_WINDOW_S


def _process(source: str) -> str:
    """``"pid=12, node=tcp://..."`` of a source ``"square pid=12, node=tcp://..."``."""
    return source.rpartition(" pid=")[2]


#: Lines of the job's output that start with one of these prefixes go to its handler, as
#: ``handler(source, line)`` on the driver's loop thread, instead of to this driver's
#: stdout/stderr: state that work sends its driver as printed lines (``ray.experimental
#: .tqdm_ray``'s progress bars, as Ray sends them).
LINE_HANDLERS: dict[str, Callable[[str, str], None]] = {}


class _Printer:
    """``Config(log_to_driver=True)``: prints of the job's tasks and methods, written to this
    driver's stdout/stderr, each line prefixed with where it ran: ``(square pid=12,
    node=tcp://...) hello``.

    With ``dedup_logs`` (the default), a line that another process printed in the last
    :data:`DEDUP_WINDOW_S` seconds is held back, and when the window ends one line says how
    often it repeated: ``(square pid=13, node=...) hello [repeated 3x across cluster]``.
    Repeats from the same process are all printed.  Runs on the driver's loop thread.
    """

    def __init__(self, dedup: bool, loop: asyncio.AbstractEventLoop) -> None:
        self.dedup = dedup
        self.loop = loop
        # (stream, line) -> [first seen (monotonic), first source, repeats held, last source]
        self.seen: dict[tuple[str, str], list] = {}
        self.timer: asyncio.TimerHandle | None = None

    def __call__(self, records: list) -> None:
        now = time.monotonic()
        out: dict[str, list[str]] = {"stdout": [], "stderr": []}
        handled = tuple(LINE_HANDLERS)
        for source, stream, text in records:
            lines = out["stderr" if stream == "stderr" else "stdout"]
            for line in text.splitlines():
                if handled and line.startswith(handled):
                    self._handle(source, line)
                    continue
                if self.dedup and self._held(stream, line, source, now):
                    continue
                lines.append(f"({source}) {line}\n")
        self._write(out)
        if self.dedup and self.seen and self.timer is None:
            self.timer = self.loop.call_later(DEDUP_WINDOW_S, self.expire)

    @staticmethod
    def _handle(source: str, line: str) -> None:
        for prefix, handler in list(LINE_HANDLERS.items()):
            if line.startswith(prefix):
                try:
                    handler(source, line)
                except Exception:  # noqa: BLE001 - a bad line must not stop the job's prints
                    logger.exception("yrdask: the handler of %r failed on a line of %s",
                                     prefix, source)
                return

    def _held(self, stream: str, line: str, source: str, now: float) -> bool:
        entry = self.seen.get((stream, line))
        if entry is None or now - entry[0] >= DEDUP_WINDOW_S:
            if entry is not None:
                self._summary(stream, line, entry)
            self.seen[(stream, line)] = [now, source, 0, source]
            return False
        if _process(source) == _process(entry[1]):  # repeats of one process all print
            return False
        entry[2] += 1
        entry[3] = source
        return True

    def _summary(self, stream: str, line: str, entry: list) -> None:
        if entry[2]:
            self._write({stream: [f"({entry[3]}) {line} [repeated {entry[2]}x across cluster]\n"]})

    def expire(self, everything: bool = False) -> None:
        """Print the repeat counts of the lines whose window ended (all, at finalize)."""
        self.timer = None
        now = time.monotonic()
        for key, entry in list(self.seen.items()):
            if everything or now - entry[0] >= DEDUP_WINDOW_S:
                del self.seen[key]
                self._summary(key[0], key[1], entry)
        if self.seen:
            self.timer = self.loop.call_later(DEDUP_WINDOW_S, self.expire)

    @staticmethod
    def _write(out: dict[str, list[str]]) -> None:
        for stream, lines in out.items():
            if lines:
                target = sys.stderr if stream == "stderr" else sys.stdout
                try:
                    target.write("".join(lines))
                    target.flush()
                except (OSError, ValueError):  # a closed stream: nothing to print to
                    pass
