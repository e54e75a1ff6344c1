"""A driver's runtime: the process that called ``yr.init`` (or ``ray.init``).

:class:`DriverRuntime` is the :class:`~yrdask.runtime.runtime.Runtime` of a driver: it owns
the yr event loop thread, joins the cluster at an address (TLS checked here) or starts the
embedded one, and answers :class:`ClientInfo`.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any, Callable

from yrdask.errors import YRRuntimeError, YRValueError
from yrdask.options import Config
from yrdask.runtime.security import resolve_security
from yrdask.runtime.runtime import Runtime
from yrdask.runtime.store import configure as configure_store


@dataclass
class ClientInfo:
    """What ``yr.init`` returns: the job id and where to watch it."""

    job_id: str
    dashboard_link: str | None = None
    scheduler_address: str = ""

    def __repr__(self) -> str:
        return (f"ClientInfo(job_id={self.job_id!r}, scheduler={self.scheduler_address!r}, "
                f"dashboard={self.dashboard_link!r})")

    def _repr_html_(self) -> str:
        link = (f'<a href="{self.dashboard_link}" target="_blank">{self.dashboard_link}</a>'
                if self.dashboard_link else "none")
        return (f"<div><strong>yrdask job</strong> <code>{self.job_id}</code><br>"
                f"scheduler: <code>{self.scheduler_address}</code><br>dashboard: {link}</div>")



class _LoopThread:
    """An asyncio loop in a daemon thread: the driver's yr event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name="yrdask-loop", daemon=True)
        self.thread.start()
        self.ready.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self.ready.set)
        self.loop.run_forever()
        self.loop.close()

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class DriverRuntime(Runtime):
    """A driver's runtime: owns the loop thread, and the embedded cluster if it started one."""

    def __init__(self, conf: Config, cluster: "LocalCluster | None" = None) -> None:
        if cluster is not None:
            cluster.launch()  # first: its launcher imports while this process builds the rest
        try:
            self.loop_runner = _LoopThread()
            # An embedded cluster's driver builds its submitter and router once the workers'
            # start order is sent (EmbeddedCluster.start): they import while the launcher forks.
            super().__init__(self.loop_runner.loop, conf.job_id,
                             defer_machines=cluster is not None)
        except BaseException:
            proc = getattr(cluster, "proc", None)
            if proc is not None:  # it only waits for an address: nothing else to stop
                proc.kill()
                proc.wait()
            raise
        self.loop_thread = self.loop_runner.thread.ident
        self.conf = conf
        self.cluster = cluster  # the embedded cluster to start (no server_address), if any
        self.heap_frozen = False  # yr.init froze the GC's heap; yr.finalize gives it back
        self.info: ClientInfo | None = None
        # Config.log_to_driver: TaskOutput from workers goes to output_sink(records).
        self.output_sink: Callable[[list], None] | None = None
        if conf.log_to_driver:
            self.output_target = lambda: self.address

    async def start(self) -> ClientInfo:
        conf = self.conf
        configure_store(conf.object_store_memory, "Config.object_store_memory")
        if self.cluster is not None:
            self.cluster.launch()  # its launcher imports distributed while this process does
        from distributed.utils import get_ip

        security = resolve_security(conf)  # Config.security, yr's TLS fields or Dask's config
        connection_args = security.get_connection_args("client")
        tls = connection_args["ssl_context"] is not None
        address = conf.server_address
        if address:
            if "://" not in address:
                address = f"{'tls' if tls or security.require_encryption else 'tcp'}://{address}"
            _check_scheme(address, tls, security.require_encryption)
            host = address.split("://", 1)[1].rsplit(":", 1)[0].strip("[]")
            listen_host = "127.0.0.1" if host in ("127.0.0.1", "localhost") else get_ip(host)
        else:
            self.cluster.security = security if tls else None
            address = await self.cluster.start(after_order=self.build_machines)
            listen_host = "127.0.0.1"
        from yrdask.runtime.transport import DriverConnector

        self.connector = DriverConnector(
            self, address, connection_args, security.get_listen_args("client"))
        try:
            self.address = await self.connector.start(self.job_id, listen_host)
        except OSError as e:  # unreachable, or refused by TLS (CommClosedError is an OSError)
            raise YRRuntimeError(f"cannot join the cluster at {address}: {e}") from e
        return ClientInfo(self.job_id, self.connector.dashboard, address)

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            if self.cluster is not None:
                await self.cluster.close()


def _check_scheme(address: str, tls: bool, required: bool) -> None:
    """A ``tls://`` address needs certificates; required encryption needs a ``tls://`` address."""
    if address.startswith("tls://") and not tls:
        raise YRValueError(
            f"server_address {address!r} is a TLS address but no TLS certificates are set: give "
            "Config(security=distributed.security.Security(tls_ca_file=..., tls_client_cert=..., "
            "tls_client_key=...)) or set distributed.comm.tls.* in the Dask config")
    if required and address.startswith("tcp://"):
        raise YRValueError(f"server_address {address!r} is a tcp:// address, but the TLS "
                           "settings require encryption: use tls://")
