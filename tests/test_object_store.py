"""The object plane on real clusters: the node's shared-memory store (docs/objects.md).

Large ref arguments go by reference, a value moves to another node once, ``put`` is a
snapshot, a store capped below the data spills and still reads everything back, and a
SIGKILLed cluster leaves nothing in /dev/shm.  Each cluster here has a node id of its own
(``YRDASK_NODE_ID``), so its store is its own.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
import weakref

import numpy as np
import psutil
import pytest

import yrdask as yr
from yrdask import protocol as P
from yrdask.runtime import store as S

from conftest import CliCluster, wait_until

pytestmark = pytest.mark.timeout(180)

T = 60
MiB = 2**20
CAP = 16 * MiB  # the capped cluster's store


@yr.invoke
def read(x):
    return x.nbytes, bool(x.flags.writeable), float(x[0])


@yr.invoke
def read_nested(lst):
    return float(yr.get(lst[0], T)[0])


@yr.invoke
def first(x):
    return x[0]


@yr.invoke
def make(n, k):
    return np.full(n, float(k))


@yr.instance
class Holder:
    def __init__(self, x) -> None:
        self.first = float(x[0])

    def read(self, x):
        return self.first, float(x[0]), bool(x.flags.writeable), os.getpid()

    def big(self, k):
        return np.full(MiB, float(k))

    def bigs(self, n):
        for k in range(n):
            yield np.full(MiB, float(k))


def _own_node(monkeypatch, name: str) -> str:
    S.close_node_store()  # this process's handle follows the node id
    monkeypatch.setenv("YRDASK_NODE_ID", name)
    return name


def _wait_gone(*paths: str, timeout: float = 20) -> None:
    wait_until(lambda: not any(os.path.exists(p) for p in paths), timeout,
               lambda: f"the store's files to go: {[p for p in paths if os.path.exists(p)]}")


@pytest.fixture(scope="module")
def capped(cluster):
    """An embedded cluster on a node of its own, with a 16 MiB store; its files are gone
    after finalize."""
    cluster.close()  # no other runtime or cli processes meanwhile
    mp = pytest.MonkeyPatch()
    node = _own_node(mp, f"cap-{uuid.uuid4().hex[:8]}")
    sent: list[int] = []  # bytes of by-value ref arguments the driver pushed
    import yrdask.runtime.transport as transport

    real_wire = transport.wire

    def counting_wire(msg):
        out = real_wire(msg)
        if isinstance(out, dict) and out.get("op") == P.RUN_TASK:
            sent.extend(len(memoryview(_raw(p)).cast("B")) for _o, kind, p in out["deps"]
                        if kind == P.VALUE)
        return out

    mp.setattr(transport, "wire", counting_wire)
    yr.init(yr.Config(num_cpus=2, object_store_memory=CAP))
    try:
        yield node, sent
    finally:
        yr.finalize()
        mp.undo()
        S.close_node_store()
        _wait_gone(S.store_dir(node), S.spill_dir(node))


def _raw(payload):
    data = getattr(payload, "data", payload)  # a Serialize wrapper
    frames = getattr(data, "frames", None)
    return b"".join(bytes(f) for f in frames) if frames is not None else data


def test_a_large_argument_goes_by_reference(capped):
    _node, sent = capped
    a = np.ones(20 * MiB // 8)
    r = yr.put(a)
    sent.clear()
    out = yr.get([read.invoke(r) for _ in range(6)], T)
    assert out == [(a.nbytes, False, 1.0)] * 6  # each task mapped the node's copy (read-only)
    assert sum(sent) == 0  # no value in any push (6 x 20 MiB before)
    assert yr.get(read.invoke(yr.put(np.arange(10.0))), T) == (80, True, 0.0)  # a copy
    assert sum(sent) < 2048  # a small one still travels inline


def test_an_isolated_process_maps_large_arguments_from_the_store(capped):
    r1, r2 = yr.put(np.full(MiB, 1.0)), yr.put(np.full(MiB, 2.0))
    iso = yr.InvokeOptions(cpu=100, memory=10, env_vars={"YR_STORE_TEST": "1"})
    assert yr.get(read.options(iso).invoke(r1), T) == (8 * MiB, False, 1.0)
    h = Holder.options(iso).invoke(r1)
    try:
        first, second, writeable, pid = yr.get(h.read.invoke(r2), T)
        assert (first, second, writeable) == (1.0, 2.0, False)
        assert pid != os.getpid()
        # large results: the child writes them to the store itself, they outlive it
        assert yr.get(h.big.invoke(5), T)[0] == 5.0
        assert [v[0] for v in yr.get(list(h.bigs.invoke(2)), T)] == [0.0, 1.0]
        assert yr.get(make.options(iso).invoke(MiB, 6), T)[0] == 6.0
    finally:
        h.terminate()


def test_put_is_a_snapshot_in_driver_and_task(capped):
    big = np.zeros(MiB)  # 8 MiB: in the store
    small = [1, 2]
    rb, rs = yr.put(big), yr.put(small)
    big[0] = 99.0
    small.append(3)
    assert yr.get(rb, T)[0] == 0.0 and yr.get(first.invoke(rb), T) == 0.0
    assert yr.get(rs, T) == [1, 2] and yr.get(first.invoke(rs), T) == 1
    assert yr.get(read_nested.invoke([rb]), T) == 0.0  # a ref nested in an argument too
    seen = weakref.ref(big)
    del big
    gc.collect()
    assert seen() is None  # one copy: the store keeps the snapshot, not the original


def test_a_capped_store_spills_and_reads_every_value_back(capped):
    node, _sent = capped
    values = [np.full(4 * MiB // 8, float(k)) for k in range(8)]  # 32 MiB into 16 MiB
    refs = [yr.put(v) for v in values]
    results = [make.invoke(4 * MiB // 8, 100 + k) for k in range(4)]  # 16 MiB more
    assert yr.wait(results, len(results), T)[1] == []
    assert os.listdir(S.spill_dir(node))  # some went to disk
    assert S.node_store().used() <= CAP
    assert [yr.get(r, T)[0] for r in refs] == [float(k) for k in range(8)]
    assert [yr.get(read.invoke(r), T)[2] for r in refs] == [float(k) for k in range(8)]
    assert [yr.get(r, T)[0] for r in results] == [100.0, 101.0, 102.0, 103.0]
    ids = {r.id for r in refs + results}
    del refs, results
    gc.collect()

    def kept() -> set:
        return ids & set(os.listdir(S.spill_dir(node)) + os.listdir(
            os.path.join(S.store_dir(node), "objects")))

    wait_until(lambda: not kept(), T, lambda: f"freed values to leave the node: {kept()}")


def test_a_value_moves_to_another_node_once(cluster, monkeypatch, tmp_path):
    """Workers on node B read a put of the driver's node A: one pull for B, whatever the
    number of tasks and worker processes there."""
    cluster.close()
    fetched: list[str] = []
    from yrdask.runtime.runtime import Runtime

    real = Runtime.handle_fetch

    async def counting(self, object_id, timeout=None):
        fetched.append(object_id)
        return await real(self, object_id, timeout)

    monkeypatch.setattr(Runtime, "handle_fetch", counting)
    node_b = f"b-{uuid.uuid4().hex[:8]}"
    cli = CliCluster.start([{"node": node_b}, {"node": node_b}], tmp_path / "cli")
    try:
        node_a = _own_node(monkeypatch, f"a-{uuid.uuid4().hex[:8]}")
        yr.init(yr.Config(server_address=cli.address))
        try:
            r = yr.put(np.full(MiB, 7.0))
            out = yr.get([read.invoke(r) for _ in range(8)], T)
            assert out == [(8 * MiB, False, 7.0)] * 8
            assert fetched == [r.id]  # one transfer to node B, then its store served it
            assert os.listdir(os.path.join(S.store_dir(node_b), "objects")) == [r.id]
        finally:
            yr.finalize()
    finally:
        cli.stop()
        S.close_node_store()
    _wait_gone(S.store_dir(node_a), S.store_dir(node_b))


DRIVER = """
import sys, numpy as np, yrdask as yr
yr.init(yr.Config(num_cpus=2, object_store_memory=20 * 2**20))
@yr.invoke
def make(k):
    return np.full(2**20, float(k))
keep = [yr.put(np.ones(2**20)) for _ in range(3)] + [make.invoke(k) for k in range(3)]
yr.wait(keep, len(keep), 60)
print("ready", flush=True)
sys.stdin.read()
"""


def test_a_killed_cluster_leaves_no_store_behind(monkeypatch):
    node = _own_node(monkeypatch, f"kill-{uuid.uuid4().hex[:8]}")
    d, spill = S.store_dir(node), S.spill_dir(node)
    p = subprocess.Popen([sys.executable, "-c", DRIVER], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        assert os.listdir(os.path.join(d, "objects")) and os.listdir(spill)
        tree = [p.pid] + [c.pid for c in psutil.Process(p.pid).children(recursive=True)]
        for pid in tree:  # driver, launcher, nannies, workers: all at once
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait(10)
        _wait_gone(d, spill)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
