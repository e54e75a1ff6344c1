"""The elastic program (tests/programs/elastic.py, SPEC §9) on real Dask deployers: Dask's
``LocalCluster``, dask-jobqueue's ``SLURMCluster`` on the one-host Slurm that ``.ci/slurm-up``
starts, and a dask-gateway server with its local backend, each made adaptive from zero.

The program runs once per deployer (a module fixture) and each of its parts is a test of its
own, ``test_elastic[<deployer>-<part>]``, failing with that part's message. A deployer skips
only where it cannot be had: Slurm's daemons are not running, or its Python package is missing.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest

import yrdask as yr
from conftest import _stop_process, _tail, wait_until
from programs import elastic

pytestmark = pytest.mark.timeout(240)

MAXIMUM = 2
#: one thread and a small memory per worker; Adaptive looks every 200 ms and retires a worker
#: after two looks that find it idle
WORKER_MEMORY = "1GiB"
ADAPT = {"interval": "200ms", "wait_count": 2, "target_duration": "1s"}
PRELOAD = ["--preload", "yrdask"]


def _count_from(client):
    return lambda: len(client.scheduler_info(n_workers=-1)["workers"])


def _adaptive_target(client) -> str:
    try:
        return f"Dask's adaptive_target {client.run_on_scheduler(_target)}"
    except Exception as exc:  # noqa: BLE001 -- only a diagnostic
        return f"adaptive_target unavailable ({exc!r:.100})"


def _target(dask_scheduler=None) -> int:
    return dask_scheduler.adaptive_target()


# -- deployers: each yields run(program) with the cluster up and closes it after -----------


def _node_per_worker_local_cluster(**kwargs):
    """A ``LocalCluster`` whose every worker plays a host of its own (``YRDASK_NODE_ID``), as
    each Slurm job and gateway worker here does: the one test machine stands for many hosts, so
    a STRICT_SPREAD group has to grow the cluster (docs/nodes.md)."""
    from distributed import LocalCluster

    class NodePerWorker(LocalCluster):
        def new_worker_spec(self):
            return {name: {**spec, "options": {**spec["options"],
                                               "env": {"YRDASK_NODE_ID": f"local-{name}"}}}
                    for name, spec in super().new_worker_spec().items()}

    return NodePerWorker(**kwargs)


def _local(tmp_path):
    from distributed import Client

    with _node_per_worker_local_cluster(n_workers=0, threads_per_worker=1, memory_limit=WORKER_MEMORY,
                      processes=True, dashboard_address=None, scheduler_port=0,
                      scheduler_kwargs={"preload": ["yrdask"]}, preload=["yrdask"],
                      local_directory=str(tmp_path)) as cluster, \
            Client(cluster, set_as_default=False) as client:
        yield elastic.run(
            adapt=lambda lo, hi: cluster.adapt(minimum=lo, maximum=hi, **ADAPT),
            workers=_count_from(client),
            config=yr.Config(server_address=cluster.scheduler_address),
            maximum=MAXIMUM, diagnose=lambda: _adaptive_target(client))


def _slurm_up() -> str | None:
    if shutil.which("sbatch") is None:
        return "sbatch is not installed (.ci/slurm-up installs and starts a one-host Slurm)"
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=20)
    if "is UP" not in ping.stdout:
        return f"Slurm's controller is not running (scontrol ping: {ping.stdout.strip() or ping.stderr.strip()}); run .ci/slurm-up"
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True, timeout=20)
    if not any(s.strip() in ("idle", "mix", "alloc") for s in nodes.stdout.splitlines()):
        return f"no Slurm node is up (sinfo: {nodes.stdout.strip()!r}); run .ci/slurm-up"
    return None


def _our_jobs(name: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i %T"], capture_output=True,
                         text=True, timeout=20)
    return [line for line in out.stdout.splitlines() if line.strip()]


def _slurm(tmp_path):
    pytest.importorskip("dask_jobqueue", reason="dask-jobqueue is not installed (the test extra)")
    reason = _slurm_up()
    if reason:
        pytest.skip(reason)
    from dask_jobqueue import SLURMCluster
    from distributed import Client

    job_name = f"yrdask-elastic-{os.getpid()}"
    cluster = SLURMCluster(
        cores=1, processes=1, memory=WORKER_MEMORY, walltime="00:10:00", job_name=job_name,
        python=sys.executable, log_directory=str(tmp_path / "slurm-logs"),
        local_directory=str(tmp_path), scheduler_options={"preload": ["yrdask"],
                                                          "dashboard_address": None},
        worker_extra_args=PRELOAD,
        job_script_prologue=[f"export PYTHONPATH={os.environ['PYTHONPATH']}", f"cd {tmp_path}",
                             "export YRDASK_NODE_ID=slurm-job-$SLURM_JOB_ID"],
    )
    try:
        with Client(cluster, set_as_default=False) as client:
            yield elastic.run(
                adapt=lambda lo, hi: cluster.adapt(minimum=lo, maximum=hi, **ADAPT),
                workers=_count_from(client),
                config=yr.Config(server_address=cluster.scheduler_address),
                maximum=MAXIMUM, timeouts=elastic.Timeouts(up=45, down=30, call=20),
                diagnose=lambda: f"{_adaptive_target(client)}; our jobs {_our_jobs(job_name)}")
    finally:
        cluster.close(timeout=30)
        wait_until(lambda: not _our_jobs(job_name), 30,
                   lambda: f"the cluster's Slurm jobs to end: {_our_jobs(job_name)}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: dask-gateway's configuration: the scheduler and worker commands name the yrdask preload on
#: their command line (the gateway adds ``--preload dask_gateway.scheduler_preload`` to the
#: scheduler's; click's repeated option keeps both). Each worker plays a host of its own.
GATEWAY_CONFIG = """
c.DaskGateway.address = "127.0.0.1:{api}"
c.Proxy.address = "127.0.0.1:{proxy}"
c.Proxy.tcp_address = "127.0.0.1:{tcp}"
c.DaskGateway.backend_class = "dask_gateway_server.backends.local.UnsafeLocalBackend"
c.DaskGateway.authenticator_class = "dask_gateway_server.auth.SimpleAuthenticator"
c.LocalBackend.clusters_directory = {clusters!r}
c.ClusterConfig.scheduler_cmd = [{python!r}, "-m", "distributed.cli.dask_scheduler", "--preload", "yrdask"]
c.ClusterConfig.worker_cmd = ["/bin/sh", "-c", 'YRDASK_NODE_ID="gateway-$$" exec "$0" "$@"',
                              {python!r}, "-m", "distributed.cli.dask_worker", "--preload", "yrdask"]
c.ClusterConfig.worker_cores = 1
c.ClusterConfig.worker_threads = 1
c.ClusterConfig.worker_memory = 1
c.ClusterConfig.adaptive_period = 0.2
c.ClusterConfig.idle_timeout = 0
"""


def _gateway(tmp_path):
    pytest.importorskip("dask_gateway_server", reason="dask-gateway-server is not installed (the test extra)")
    dask_gateway = pytest.importorskip("dask_gateway", reason="dask-gateway is not installed (the test extra)")
    from distributed.security import Security

    ports = {"api": _free_port(), "proxy": _free_port(), "tcp": _free_port()}
    config = tmp_path / "dask_gateway_config.py"
    config.write_text(GATEWAY_CONFIG.format(**ports, clusters=str(tmp_path / "clusters"),
                                            python=sys.executable))
    log = tmp_path / "gateway.log"
    with open(log, "wb") as out:
        server = subprocess.Popen([sys.executable, "-m", "dask_gateway_server", "-f", str(config)],
                                  stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                  cwd=tmp_path)
    try:
        url = f"http://127.0.0.1:{ports['proxy']}"  # the public address, proxied to the api
        wait_until(lambda: server.poll() is not None or _http_ok(f"{url}/api/health"), 60,
                   lambda: f"the gateway server at {url}:\n{_tail(log)}")
        assert server.poll() is None, f"the gateway server exited:\n{_tail(log)}"
        with dask_gateway.Gateway(url, proxy_address=f"gateway://127.0.0.1:{ports['tcp']}",
                                  auth=dask_gateway.BasicAuth("yrdask")) as gateway:
            cluster = gateway.new_cluster()
            try:
                client = cluster.get_client(set_as_default=False)
                sec = cluster.security
                yield elastic.run(
                    adapt=lambda lo, hi: cluster.adapt(minimum=lo, maximum=hi),
                    workers=_count_from(client),
                    config=yr.Config(server_address=cluster.scheduler_address, security=Security(
                        tls_ca_file=sec.tls_cert, tls_client_cert=sec.tls_cert,
                        tls_client_key=sec.tls_key, require_encryption=True)),
                    maximum=MAXIMUM, diagnose=lambda: _adaptive_target(client))
                client.close()
            finally:
                cluster.shutdown()
    finally:
        _stop_process(server)


def _http_ok(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


DEPLOYER_FIXTURES = {"local": _local, "slurm": _slurm, "gateway": _gateway}


@pytest.fixture(scope="module")
def outcomes(cluster, tmp_path_factory):
    """deployer -> its parts' verdicts (or the reason it was skipped); each deployer's program
    runs on first use. The suite's own runtime is finalised: the program joins the deployer."""
    cache: dict[str, dict[str, elastic.Part] | str] = {}

    def get(deployer: str):
        if deployer not in cache:
            cluster.finalize()
            gen = DEPLOYER_FIXTURES[deployer](tmp_path_factory.mktemp(deployer))
            try:
                cache[deployer] = next(gen)
            except pytest.skip.Exception as skip:
                cache[deployer] = f"skip: {skip.msg}"
            except Exception as exc:  # noqa: BLE001 -- every part's test reports it, once run
                cache[deployer] = exc
            finally:
                gen.close()
        return cache[deployer]

    return get


@pytest.mark.parametrize("part", elastic.PARTS)
@pytest.mark.parametrize("deployer", list(DEPLOYER_FIXTURES))
def test_elastic(outcomes, deployer, part):
    got = outcomes(deployer)
    if isinstance(got, str):
        pytest.skip(got)
    if isinstance(got, Exception):
        raise AssertionError(f"{deployer}: the program did not run to its end: {got!r}") from got
    verdict = got[part]
    if verdict.ok is None:
        pytest.skip(f"{deployer}: {verdict}")
    assert verdict.ok, f"{deployer}: {verdict}"
