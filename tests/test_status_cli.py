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


def instance_section(out: str) -> str:
    """The instances part of the report (the Waiting and Ended sections list ids too)."""
    return out.split("\nWaiting for resources (")[0].split("\nEnded (")[0]


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
    states = [line.split()[3] for line in instance_section(out).splitlines()
              if line.startswith("  i-")]  # every row
    assert f"Instances ({len(states)}): " + ", ".join(
        f"{s} {states.count(s)}" for s in ("ALIVE", "PENDING", "RESTARTING", "DEAD")) in lines
    assert info["dashboard"] and f"dashboard: {info['dashboard']}" in out


def test_status_address_from_environment_and_limit(keepers):
    address, _, _ = keepers
    done = run_status("--limit", "1", env={"YR_SERVER_ADDRESS": address})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"yrdask cluster {address}")
    rows = [line for line in instance_section(done.stdout).splitlines()
            if line.startswith("  i-")]
    assert len(rows) == 1, done.stdout  # the test's two instances, one shown
    assert "more (--limit 0 shows all)" in done.stdout


def test_status_usage_errors():
    env = {k: v for k, v in os.environ.items() if k != "YR_SERVER_ADDRESS"}
    done = subprocess.run([sys.executable, "-m", "yrdask", "status"], capture_output=True,
                          text=True, timeout=T, env=env, stdin=subprocess.DEVNULL)
    assert done.returncode == 2 and "YR_SERVER_ADDRESS" in done.stderr
    with socket.socket() as s:  # bound and held, never listened on: connects are refused
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
    assert "Instances (2): ALIVE 1, PENDING 1, RESTARTING 0, DEAD 0" in out
    rows = [line.split() for line in instance_section("\n".join(out)).splitlines()
            if line.startswith("  i-")]
    assert rows[0][:4] == ["i-1", "-", "C", "ALIVE"] and rows[0][6] == "2"  # ALIVE first
    assert rows[1][:5] == ["i-2", "ns/b", "C", "PENDING", "-"]
    assert out[-1] == "Leases: leases_granted 3"
    assert ["CPU", "1000", "250", "750", "25%", "millicores", "(0.25", "of", "1", "cores)"] in [
        line.split() for line in out]
    assert ["Memory", "100", "0", "100", "0%", "MB"] in [line.split() for line in out]
    waiting = {"what": "C instance i-2", "kind": "instance", "job": "job-1",
               "needs": {"CPU": 5000.0}, "waited_s": 7.2,
               "reasons": ["can never run it: tcp://h:1 (offers {CPU: 1000})"],
               "fix": "To place it: ask for less with InvokeOptions(cpu=...)"}
    ended = {"instance_id": "i-0", "class": "C", "name": "x", "namespace": "", "job": "job-1",
             "worker": "tcp://h:1", "reason": "terminated", "created_at": 0, "ended_at": 1}
    out = format_status("tcp://h:0", {**info, "waiting": [waiting], "ended": [ended]})
    assert ("Waiting for resources (1)\n  C instance i-2, job job-1: needs CPU=5000, waiting "
            "7 s\n    can never run it: tcp://h:1 (offers {CPU: 1000})\n  To place it: ask "
            "for less with InvokeOptions(cpu=...)") in out
    row = next(line for line in out.split("Ended (1 kept, newest first)")[1].splitlines()
               if "i-0" in line)
    assert row.split()[:5] == ["i-0", "x", "C", "job-1", "tcp://h:1"] and "terminated" in row


# --------------------------------------------------------------------------- waits and ends


def free_slots(address: str, cpu: float) -> int:
    """How many ``cpu``-millicore instances the workers have room for now."""
    workers = asyncio.run(fetch_cluster_info(address, T))["workers"]
    return sum(int((w["capacity"].get("CPU", 0) - w["held"].get("CPU", 0)) // cpu)
               for w in workers.values())


def cpu_held_by_leases(address: str) -> float:
    """The CPU that task leases hold now: what the nodes hold less what instances hold (a
    lease an earlier test's tasks left idle goes back within seconds)."""
    info = asyncio.run(fetch_cluster_info(address, T))
    by_process: dict[str, float] = {}
    for i in info["instances"]:
        if i["state"] in ("ALIVE", "RESTARTING") and i.get("worker"):
            by_process[i["worker"]] = (by_process.get(i["worker"], 0)
                                       + (i.get("resources") or {}).get("CPU", 0))
    return sum(w["held"].get("CPU", 0) - sum(by_process.get(p, 0) for p in w["processes"])
               for w in info["workers"].values())


def test_a_full_cluster_explains_why_an_instance_waits_and_lists_ended_ones(
        yr_cluster, cluster_kind, caplog):
    """Instances of cpu=500 fill the workers; the next one waits, and h.status(), ``yrdask
    status`` and (embedded: same process) the scheduler's log say why: what it needs, what
    each worker lacks, which classes hold it, and how to fix it.  Once terminated, it is
    listed under "Ended" with its class and why it ended."""
    import dask
    import logging

    address = current_runtime().info.scheduler_address
    tag = uuid.uuid4().hex[:6]
    opts = dict(cpu=500, memory=0)
    # room held by a task lease now would be free again while the instance below waits
    wait_until(lambda: cpu_held_by_leases(address) <= 0, T,
               lambda: f"task leases to go back ({cpu_held_by_leases(address)} CPU held)")
    fill = [Greeter.options(yr.InvokeOptions(name=f"fill-{tag}-{i}", **opts)).invoke()
            for i in range(free_slots(address, 500))]
    assert yr.get([h.hello.invoke() for h in fill], T) == [1] * len(fill)
    caplog.set_level(logging.WARNING, logger="yrdask.scheduler")
    with dask.config.set({"yrdask.scheduling.wait-warning": "1s"}):  # embedded: in-process
        waiting = Greeter.options(yr.InvokeOptions(name=f"wait-{tag}", schedule_timeout_ms=120_000,
                                                   **opts)).invoke()
        why = wait_until(lambda: waiting.status()["waiting"], T, "the wait explained")
        assert waiting.status()["state"] == "PENDING"
        assert why.startswith(f"Greeter instance {waiting.instance_id} waits for "
                              "{CPU: 500, Memory: 0}"), why
        assert "needs CPU 500, free " in why and "millicores; held by " in why
        assert "Greeter instances (" in why or "Greeter instance " in why.split("held by")[1]
        assert "InvokeOptions(cpu=" in why and "Config(num_cpus=" in why
        done = run_status(address, "--limit", "0")
        assert done.returncode == 0, done.stderr
        assert "Waiting for resources (" in done.stdout, done.stdout
        section = done.stdout.split("Waiting for resources (", 1)[1]
        assert f"Greeter instance {waiting.instance_id}" in section
        assert "needs CPU=500" in section and "free " in section and "held by" in section
        if cluster_kind == "embedded":  # the scheduler runs in this process: its warning
            job = current_runtime().info.job_id
            wait_until(lambda: any(r.getMessage().startswith(
                f"yrdask: Greeter instance {waiting.instance_id} of job {job} waits for ")
                and "InvokeOptions(cpu=" in r.getMessage() for r in caplog.records), T,
                lambda: f"the scheduler's warning in {[r.getMessage() for r in caplog.records]}")
    waiting.terminate()
    wait_until(lambda: any(t["instance_id"] == waiting.instance_id for t in asyncio.run(
        fetch_cluster_info(address, T))["ended"]), T, "the terminated instance listed as ended")
    info = asyncio.run(fetch_cluster_info(address, T))
    tomb = next(t for t in info["ended"] if t["instance_id"] == waiting.instance_id)
    assert (tomb["class"], tomb["name"], tomb["worker"]) == ("Greeter", f"wait-{tag}", "")
    assert tomb["reason"] and tomb["job"] and tomb["ended_at"] >= tomb["created_at"] > 0
    assert not [w for w in info["waiting"] if w.get("holding_id") == waiting.instance_id]
    done = run_status(address, "--limit", "0")
    ended = done.stdout.split("\nEnded (", 1)[1]
    row = next(line for line in ended.splitlines() if waiting.instance_id in line)
    assert f"wait-{tag}" in row and "Greeter" in row and " ago" in row
    for h in fill:
        h.terminate()


def test_status_without_the_yr_preload_and_on_a_closed_port(tmp_path):
    """A plain ``dask scheduler`` (no --preload yrdask): exit 1 naming the fix; a closed port:
    exit 1 with "could not connect to ADDRESS: ...", never an empty error."""
    from conftest import STARTUP_TIMEOUT

    scheduler_file = tmp_path / "scheduler.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
         "--port", "0", "--dashboard-address", ":0", "--scheduler-file", str(scheduler_file)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        def written() -> str | None:  # the file may be read while it is half written
            try:
                return json.loads(scheduler_file.read_text())["address"]
            except (OSError, ValueError, KeyError):
                return None

        address = wait_until(written, STARTUP_TIMEOUT, "the plain dask scheduler to start")
        done = run_status(address, "--timeout", "20")
        assert done.returncode == 1, done
        assert "Traceback" not in done.stderr and "AttributeError" not in done.stderr
        assert f"cannot get the cluster state from {address}: the scheduler has no yrdask " \
               "extension: start it with `dask scheduler --preload yrdask`" in done.stderr
    finally:
        proc.terminate()
        proc.wait(30)
    # Bound and held, never listened on: connects are refused, and no other process can take
    # the port meanwhile (as it could once a probe socket closed it).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        done = run_status(f"tcp://127.0.0.1:{port}", "--timeout", "2")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"could not connect to tcp://127.0.0.1:{port}: " in done.stderr
    assert not done.stderr.rstrip().endswith(":"), done.stderr  # the reason is there
