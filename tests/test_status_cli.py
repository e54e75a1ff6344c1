"""``yrdask status [ADDRESS]`` (``python -m yrdask status``) against live clusters of both kinds.

The command runs as a real subprocess and asks the scheduler with the ``yr_cluster_info``
rpc; the tests read its terminal tables (workers, resources, instances by state) and its exit
codes for bad usage and an unreachable scheduler.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import sysconfig
import tomllib
import uuid

import pytest

import yrdask as yr
from conftest import ROOT, Greeter, pending_greeter, wait_until
from yrdask.runtime.context import current_runtime
from yrdask.cli import fetch_cluster_info, format_status

pytestmark = pytest.mark.timeout(120)

T = 60


def listed(address: str) -> set[str]:
    """Names of the instances the scheduler lists now (asked in-process: cheap to poll)."""
    return {i["name"] for i in asyncio.run(fetch_cluster_info(address, T))["instances"]}


def run_status(*args: str, env: dict | None = None,
               timeout: float = T) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "yrdask", "status", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)


@pytest.fixture
def keepers(yr_cluster):
    """A named ALIVE instance and a PENDING one (64 CPUs: more than any worker offers)."""
    tag = uuid.uuid4().hex[:6]
    names = {f"keep-{tag}", f"wait-{tag}"}
    alive = Greeter.options(yr.InvokeOptions(name=f"keep-{tag}", cpu=100, memory=0)).invoke()
    assert yr.get(alive.hello.invoke(), T) == 1
    waiting = pending_greeter(f"wait-{tag}")
    address = current_runtime().info.scheduler_address
    wait_until(lambda: names <= listed(address), T,
               lambda: f"the scheduler to list {names}; it lists {listed(address)}")
    yield address, f"keep-{tag}", f"wait-{tag}"
    alive.terminate()
    waiting.terminate()
    wait_until(lambda: not names & listed(address), T, f"the scheduler to forget {names}")


def test_status_prints_workers_resources_and_instances(keepers):
    address, alive, waiting = keepers
    done = run_status(address, "--limit", "0")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    info = json.loads(run_status(address, "--json").stdout)
    assert out.startswith(f"yrdask cluster {address}")
    assert f"Workers ({len(info['workers'])})" in out
    for worker in info["workers"]:
        assert worker in out
    assert "RESOURCE  CAPACITY" in out and "\n  CPU " in out
    lines = out.splitlines()
    row = next(line for line in lines if alive in line)
    assert "Greeter" in row and "ALIVE" in row and "CPU=100" in row
    row = next(line for line in lines if waiting in line)
    assert "PENDING" in row and "CPU=64000" in row
    states = [line.split()[3] for line in lines if line.startswith("  i-")]  # every row
    assert f"Instances ({len(states)}): " + ", ".join(
        f"{s} {states.count(s)}" for s in ("ALIVE", "PENDING", "RESTARTING", "DEAD")) in lines
    assert info["dashboard"] and f"dashboard: {info['dashboard']}" in out


def test_status_address_from_environment_and_limit(keepers):
    address, _, _ = keepers
    done = run_status("--limit", "1", env={"YR_SERVER_ADDRESS": address})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"yrdask cluster {address}")
    rows = [line for line in done.stdout.splitlines() if line.startswith("  i-")]
    assert len(rows) == 1, done.stdout  # the test's two instances, one shown
    assert "more (--limit 0 shows all)" in done.stdout


def test_status_usage_errors():
    env = {k: v for k, v in os.environ.items() if k != "YR_SERVER_ADDRESS"}
    done = subprocess.run([sys.executable, "-m", "yrdask", "status"], capture_output=True,
                          text=True, timeout=T, env=env, stdin=subprocess.DEVNULL)
    assert done.returncode == 2 and "YR_SERVER_ADDRESS" in done.stderr
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = run_status(f"tcp://127.0.0.1:{port}", "--timeout", "2")
    assert done.returncode == 1 and "cannot get the cluster state" in done.stderr
    done = subprocess.run([sys.executable, "-m", "yrdask"], capture_output=True, text=True,
                          timeout=T, stdin=subprocess.DEVNULL)
    assert done.returncode == 2 and "status" in done.stderr


def test_console_script_is_declared():
    project = tomllib.loads((pathlib.Path(ROOT) / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["yrdask"] == "yrdask.cli:main"
    try:
        importlib.metadata.distribution("yrdask")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("yrdask is not pip-installed, so it has no console script (CI installs it "
                    "with pip install -e '.[test]')")
    script = shutil.which("yrdask") or shutil.which("yrdask", path=sysconfig.get_path("scripts"))
    assert script, "yrdask is installed but its console script is nowhere to be found"
    done = subprocess.run([script, "status", "--help"], capture_output=True, text=True,
                          timeout=T, stdin=subprocess.DEVNULL)
    assert done.returncode == 0 and "YR_SERVER_ADDRESS" in done.stdout


def test_format_status_of_a_reply():
    info = {"dashboard": "http://h:8787/status", "counters": {"leases_granted": 3},
            "workers": {"tcp://h:1": {"capacity": {"CPU": 1000.0, "Memory": 100.0, "gpu": 1.0},
                                      "held": {"CPU": 250.0, "Memory": 0.0}}},
            "instances": [
                {"instance_id": "i-2", "name": "b", "namespace": "ns", "class": "C",
                 "state": "PENDING", "worker": None, "owner": "job-1", "restarts": 0,
                 "resources": {"CPU": 5000.0}, "created_at": 0},
                {"instance_id": "i-1", "name": "", "namespace": "", "class": "C",
                 "state": "ALIVE", "worker": "tcp://h:1", "owner": "job-1", "restarts": 2,
                 "resources": {"CPU": 250.0}, "created_at": 0}]}
    out = format_status("tcp://h:0", info).splitlines()
    assert out[1] == "dashboard: http://h:8787/status"
    assert out[5].split() == ["tcp://h:1", "250", "/", "1000", "0", "/", "100", "0", "/", "1"]
    assert ["CPU", "1000", "250", "750", "25%"] in [line.split() for line in out]
    assert "Instances (2): ALIVE 1, PENDING 1, RESTARTING 0, DEAD 0" in out
    rows = [line.split() for line in out if line.startswith("  i-")]
    assert rows[0][:4] == ["i-1", "-", "C", "ALIVE"] and rows[0][6] == "2"  # ALIVE first
    assert rows[1][:5] == ["i-2", "ns/b", "C", "PENDING", "-"]
    assert out[-1] == "Leases: leases_granted 3"
