"""The preload turned on by Dask configuration alone (docs/deploy.md).

`plugins/yrdask.yaml` is the configuration file we ship.  With ``DASK_CONFIG`` naming its
directory, plain ``dask scheduler`` and ``dask worker`` (no ``--preload`` flag) must start a
yrdask cluster that a driver can run tasks and instances on.  The same holds for the
environment-variable form of those keys, which the docs also give.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import yrdask as yr
from conftest import ROOT, STARTUP_TIMEOUT, _stop_process, _tail, wait_until

pytestmark = pytest.mark.timeout(180)

T = 60
PLUGINS = ROOT / "plugins"

MODES = {
    "yaml": {"DASK_CONFIG": str(PLUGINS)},
    "env": {"DASK_DISTRIBUTED__SCHEDULER__PRELOAD": '["yrdask"]',
            "DASK_DISTRIBUTED__WORKER__PRELOAD": '["yrdask"]'},
}


@yr.invoke
def tagged_node(x):
    return yr.get_node_id(), x * 2


@yr.instance
class Box:
    def __init__(self, v):
        self.v = v

    def get(self):
        return self.v


@pytest.fixture(params=list(MODES))
def config_cluster(request, cluster, tmp_path):
    """`dask scheduler` + one `dask worker`, with yrdask turned on only by configuration."""
    cluster.finalize()  # the session's runtime, if another module left one
    preload_keys = ("DASK_DISTRIBUTED__SCHEDULER__PRELOAD", "DASK_DISTRIBUTED__WORKER__PRELOAD")
    env = {k: v for k, v in os.environ.items() if not k.startswith(preload_keys)}
    env.pop("DASK_CONFIG", None)
    env.update(MODES[request.param])
    procs: list[tuple[subprocess.Popen, object]] = []

    def spawn(name: str, argv: list[str]) -> subprocess.Popen:
        log = tmp_path / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "dask", *argv], env=env, cwd=tmp_path,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        procs.append((proc, log))
        assert "--preload" not in argv
        return proc

    def logs() -> str:
        return "\n".join(f"--- {log.name} (rc={p.poll()})\n{_tail(log)}" for p, log in procs)

    sched_file = tmp_path / "sched.json"
    try:
        sched = spawn("scheduler", ["scheduler", "--host", "127.0.0.1", "--port", "0",
                                    "--dashboard-address", "127.0.0.1:0",
                                    "--scheduler-file", str(sched_file)])

        def address():
            assert sched.poll() is None, f"dask scheduler exited\n{logs()}"
            try:
                return json.loads(sched_file.read_text())["address"]
            except (OSError, ValueError, KeyError):
                return None

        addr = wait_until(address, STARTUP_TIMEOUT, lambda: f"the scheduler file\n{logs()}")
        spawn("worker", ["worker", addr, "--host", "127.0.0.1", "--nthreads", "1",
                         "--resources", "deploy_tag=1"])
        yield addr, tmp_path, logs
    finally:
        for proc, _ in reversed(procs):
            _stop_process(proc)


def test_config_alone_turns_the_preload_on(config_cluster):
    address, workdir, logs = config_cluster
    yr.init(yr.Config(server_address=address))
    try:
        nodes = wait_until(lambda: yr.resources(), STARTUP_TIMEOUT,
                           lambda: f"the worker registered with yr\n{logs()}")
        assert [n["capacity"].get("deploy_tag") for n in nodes] == [1.0]
        opts = yr.InvokeOptions(custom_resources={"deploy_tag": 1})
        node, doubled = yr.get(tagged_node.options(opts).invoke(21), T)
        assert (node, doubled) == (nodes[0]["id"], 42)
        box = Box.invoke("kept")
        assert yr.get(box.get.invoke(), T) == "kept"
    finally:
        yr.finalize()
    # Both processes ran the preload from configuration, not via a flag.
    assert "Run preload setup: yrdask" in (workdir / "scheduler.log").read_text()
    assert "Import preload module: yrdask" in (workdir / "worker.log").read_text()


def test_scheduler_without_yrdask_is_named_at_init(cluster, tmp_path):
    """A plain `dask scheduler` (no preload, no config): yr.init fails clearly, within the
    connect time-out, instead of waiting forever for a job stream nobody answers."""
    import dask

    cluster.finalize()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    sched_file = tmp_path / "sched.json"
    log = tmp_path / "scheduler.log"
    with open(log, "wb") as out:
        sched = subprocess.Popen(
            [sys.executable, "-m", "dask", "scheduler", "--host", "127.0.0.1", "--port", "0",
             "--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(sched_file)],
            env=env, cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        def address():
            assert sched.poll() is None, f"dask scheduler exited\n{_tail(log)}"
            try:
                return json.loads(sched_file.read_text())["address"]
            except (OSError, ValueError, KeyError):
                return None

        addr = wait_until(address, STARTUP_TIMEOUT, lambda: f"the scheduler file\n{_tail(log)}")
        with dask.config.set({"distributed.comm.timeouts.connect": "3s"}):
            with pytest.raises(yr.YRRuntimeError, match="--preload yrdask"):
                yr.init(yr.Config(server_address=addr))
        assert not yr.is_initialized()
    finally:
        _stop_process(sched)
