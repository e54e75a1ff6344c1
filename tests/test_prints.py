"""Prints of tasks and methods reach the driver (``Config(log_to_driver=True)``, docs/options.md).

On the embedded cluster and on a ``dask scheduler``/``dask worker`` cluster: each line of a
task's or method's stdout/stderr is written to the driver's stdout/stderr, prefixed
``(name pid=..., node=...)``; lines travel in batches; without ``log_to_driver`` they stay in
the worker's own stdout; ``dedup_logs`` collapses a line repeated by several processes.
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from typing import Any

import pytest

import yrdask as yr
from yrdask.runtime import context

from conftest import CLI_WORKERS, wait_until

pytestmark = pytest.mark.timeout(240)

T = 60
SMALL = yr.InvokeOptions(cpu=100, memory=10)


@yr.invoke(invoke_options=SMALL)
def loud(tag: str, lines: int = 1) -> tuple[int, str]:
    for i in range(lines):
        print(f"out-{tag}-{i}")
    print(f"err-{tag}", file=sys.stderr)
    return os.getpid(), yr.get_node_id()


@yr.invoke(invoke_options=SMALL)
def quiet_outer(tag: str) -> tuple[int, str]:
    return yr.get(loud.invoke(tag), T)


@yr.invoke(invoke_options=SMALL)
def flushed(tag: str) -> int:
    print(f"plain-{tag}", flush=True)
    return os.getpid()


@yr.instance(invoke_options=SMALL)
class Counter:
    def __init__(self, tag: str) -> None:
        print(f"init-{tag}")
        self.n = 0

    def inc(self, tag: str) -> tuple[int, str]:
        self.n += 1
        print(f"inc-{tag}-{self.n}")
        return os.getpid(), yr.get_node_id()


@yr.instance(invoke_options=SMALL)
class Loud:
    def loud(self, tag: str) -> tuple[int, str]:
        print(f"out-{tag}-0")
        return os.getpid(), yr.get_node_id()


@yr.instance(invoke_options=SMALL)
class AsyncTalker:
    async def say(self, tag: str) -> tuple[int, str]:
        await asyncio.sleep(0)
        print(f"async-{tag}")
        return os.getpid(), yr.get_node_id()


@pytest.fixture(scope="module", params=["embedded", "cli"])
def kind(request) -> str:
    return request.param


def _init(cluster, kind: str, **conf: Any) -> Any:
    cluster.finalize()
    if kind == "embedded":
        return yr.init(yr.Config(num_cpus=2, **conf))
    cli = cluster.cli_processes(CLI_WORKERS)
    return yr.init(yr.Config(server_address=cli.address, **conf))


@pytest.fixture
def printing(cluster, kind):
    """A driver with log_to_driver=True on ``kind`` (kept across the module's tests)."""
    rt = context.installed_runtime()
    conf = getattr(rt, "conf", None)
    if not (conf is not None and conf.log_to_driver and getattr(rt, "_print_kind", None) == kind):
        _init(cluster, kind, log_to_driver=True)
        context.installed_runtime()._print_kind = kind
    return kind


class Captured:
    """What the driver printed so far (capsys is read as lines arrive)."""

    def __init__(self, capsys: Any) -> None:
        self.capsys, self.out, self.err = capsys, "", ""

    def read(self) -> None:
        got = self.capsys.readouterr()
        self.out += got.out
        self.err += got.err

    def wait_for(self, line: str, stream: str = "out") -> None:
        def there() -> bool:
            self.read()
            return line in getattr(self, stream).splitlines()

        wait_until(there, T, lambda: f"driver {stream} line {line!r}; got:\n"
                   f"{getattr(self, stream)[-2000:]}")


def test_task_prints_reach_driver_stdout_and_stderr(printing, capsys):
    tag = uuid.uuid4().hex[:6]
    pid, node = yr.get(loud.invoke(tag), T)
    cap = Captured(capsys)
    cap.wait_for(f"(loud pid={pid}, node={node}) out-{tag}-0")
    cap.wait_for(f"(loud pid={pid}, node={node}) err-{tag}", "err")
    assert f"err-{tag}" not in cap.out and f"out-{tag}" not in cap.err


def test_method_and_init_prints_carry_the_class_name(printing, capsys):
    tag = uuid.uuid4().hex[:6]
    c = Counter.invoke(tag)
    pid, node = yr.get(c.inc.invoke(tag), T)
    yr.get(c.inc.invoke(tag), T)
    cap = Captured(capsys)
    prefix = f"(Counter pid={pid}, node={node})"
    cap.wait_for(f"{prefix} init-{tag}")
    cap.wait_for(f"{prefix} inc-{tag}-2")
    lines = [s for s in cap.out.splitlines() if tag in s]
    assert lines == [f"{prefix} init-{tag}", f"{prefix} inc-{tag}-1", f"{prefix} inc-{tag}-2"]
    c.terminate()


def test_async_method_prints(printing, capsys):
    tag = uuid.uuid4().hex[:6]
    a = AsyncTalker.invoke()
    pid, node = yr.get(a.say.invoke(tag), T)
    Captured(capsys).wait_for(f"(AsyncTalker pid={pid}, node={node}) async-{tag}")
    a.terminate()


@yr.invoke(invoke_options=yr.InvokeOptions(cpu=100, memory=10, env_vars={"YR_PRINTS": "1"}))
def isolated_loud(tag: str) -> int:
    print(f"iso-task-{tag}")  # runs in a child process of its worker (env_vars)
    return os.getpid()


@yr.instance(invoke_options=yr.InvokeOptions(cpu=100, memory=10, isolated=True))
class IsolatedTalker:
    def say(self, tag: str) -> int:
        print(f"iso-method-{tag}")
        return os.getpid()


def test_prints_of_isolated_processes_reach_the_driver(printing, capsys):
    tag = uuid.uuid4().hex[:6]
    task_pid = yr.get(isolated_loud.invoke(tag), T)
    talker = IsolatedTalker.invoke()
    method_pid = yr.get(talker.say.invoke(tag), T)
    nodes = {n["id"] for n in yr.resources()}
    cap = Captured(capsys)
    for name, pid, text in (("isolated_loud", task_pid, f"iso-task-{tag}"),
                            ("IsolatedTalker", method_pid, f"iso-method-{tag}")):
        def printed(name=name, pid=pid, text=text) -> list[str]:
            cap.read()
            return [line for line in cap.out.splitlines()
                    if line.startswith(f"({name} pid={pid}, node=") and line.endswith(text)]
        lines = wait_until(printed, T, lambda: f"{text} from pid {pid}; got:\n{cap.out[-2000:]}")
        node = lines[0].split("node=", 1)[1].split(")", 1)[0]
        assert node in nodes  # named by its worker, as the worker's own prints are
    talker.terminate()


def test_nested_task_prints_reach_the_job_driver(printing, capsys):
    tag = uuid.uuid4().hex[:6]
    pid, node = yr.get(quiet_outer.invoke(tag), T)
    Captured(capsys).wait_for(f"(loud pid={pid}, node={node}) out-{tag}-0")


def test_lines_travel_in_batches_and_in_order(printing, capsys):
    rt = context.installed_runtime()
    sink = rt.output_sink
    batches: list[int] = []

    def counting(records: list) -> None:
        batches.append(len(records))
        sink(records)

    rt.output_sink = counting
    try:
        tag = uuid.uuid4().hex[:6]
        pid, node = yr.get(loud.invoke(tag, 300), T)
        cap = Captured(capsys)
        cap.wait_for(f"(loud pid={pid}, node={node}) out-{tag}-299")
    finally:
        rt.output_sink = sink
    lines = [s.rsplit(" ", 1)[1] for s in cap.out.splitlines() if f"out-{tag}-" in s]
    assert lines == [f"out-{tag}-{i}" for i in range(300)]
    assert 1 <= len(batches) <= 10, batches  # 300 lines, a handful of messages


def test_without_log_to_driver_prints_stay_in_the_worker(cluster, kind, capsys):
    if kind == "embedded":
        pytest.skip("embedded workers share the driver's terminal; the cli run checks the logs")
    _init(cluster, kind)  # log_to_driver defaults to False, as in yr
    try:
        tag = uuid.uuid4().hex[:6]
        yr.get(flushed.invoke(tag), T)
        logs = [w.log for w in cluster.cli.workers]
        wait_until(lambda: any(f"plain-{tag}" in p.read_text(errors="replace") for p in logs),
                   T, "the line in a worker's own stdout")
        assert f"plain-{tag}" not in capsys.readouterr().out
    finally:
        cluster.finalize()


def test_dedup_collapses_a_line_printed_by_several_processes(printing, capsys):
    tag = uuid.uuid4().hex[:6]
    # Two instances of a whole CPU each: one in each of the two worker processes (one node
    # of two processes on the embedded cluster, two nodes on the cli one).
    # Light instances, pinned: the lines of process instances terminated right after the
    # call do not reach the driver's summary yet (an open issue, see the process model).
    talkers = [Loud.options(yr.InvokeOptions(cpu=1000, memory=10, light=True)).invoke()
               for _ in range(2)]
    done = yr.get([t.loud.invoke(tag) for t in talkers], T)
    for t in talkers:
        t.terminate()
    assert len({pid for pid, _ in done}) == 2
    cap = Captured(capsys)
    summary = [f"(Loud pid={pid}, node={node}) out-{tag}-0 [repeated 1x across cluster]"
               for pid, node in done]

    def summarised() -> bool:
        cap.read()
        return any(s in cap.out.splitlines() for s in summary)

    wait_until(summarised, T, lambda: f"a repeat summary; got:\n{cap.out[-2000:]}")
    printed = [s for s in cap.out.splitlines() if s.endswith(f") out-{tag}-0")]
    assert len(printed) == 1, printed
