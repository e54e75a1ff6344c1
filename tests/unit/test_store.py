"""The node's shared-memory object store (yrdask/runtime/store.py), with real processes.

Each test uses a node of its own (``YRDASK_NODE_ID``), so it sees only its own files; the
reader and writer processes are plain ``python -c`` children, no cluster.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import numpy as np
import pytest

from yrdask.runtime import store as S
from yrdask.serialization import dumps_value, loads

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def node(monkeypatch):
    """A fresh node id for this test; its store is gone at the end."""
    S.close_node_store()
    name = f"t-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("YRDASK_NODE_ID", name)
    yield name
    S.close_node_store()
    wait_gone(S.store_dir(name), S.spill_dir(name))


def wait_gone(*paths: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while any(os.path.exists(p) for p in paths):
        assert time.monotonic() < deadline, f"still there after {timeout} s: " + ", ".join(
            p for p in paths if os.path.exists(p))
        time.sleep(0.05)


def child(code: str, **kw) -> subprocess.Popen:
    """A python child on this test's node running ``code`` (stdout piped)."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=os.environ.copy(),
                            stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True, **kw)


def array(mb: int = 4, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random(mb * 2**20 // 8)


def test_another_process_maps_the_value_read_only_without_a_copy(node):
    a = array()
    S.node_store().put("v1", dumps_value(a))
    p = child("""
        import sys
        from yrdask.runtime.store import node_store, store_dir
        from yrdask.serialization import loads
        v = loads(node_store().get("v1"))
        mapped = any(store_dir() in line and line.rstrip().endswith("/objects/v1")
                     for line in open("/proc/self/maps"))
        print(v.flags.writeable, v.flags.owndata, mapped, float(v.sum()))
    """)
    out, _ = p.communicate(timeout=30)
    writeable, owndata, mapped, total = out.split()
    assert (writeable, owndata, mapped) == ("False", "False", "True")  # a view of the file
    assert float(total) == pytest.approx(float(a.sum()))
    v = loads(S.node_store().get("v1"))  # the same in this process
    assert not v.flags.writeable and np.array_equal(v, a)
    with pytest.raises(ValueError):
        v[0] = 1.0  # read-only, as on Ray


def test_a_crashed_reader_leaves_the_value_readable_and_its_pages_reusable(node):
    a = array()
    st = S.node_store()
    st.put("v1", dumps_value(a))
    p = child("""
        import os, signal
        from yrdask.runtime.store import node_store
        from yrdask.serialization import loads
        v = loads(node_store().get("v1"))
        print(float(v[0]), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == -signal.SIGKILL and float(out) == a[0]
    assert np.array_equal(loads(st.get("v1")), a)
    st.delete("v1")  # nobody maps it now (the crash dropped the reader's lock): pooled
    assert len(os.listdir(os.path.join(st.dir, "free"))) == 1
    assert st.get("v1") is None


def test_pages_are_never_reused_while_a_reader_maps_them(node):
    st = S.node_store()
    a, b = array(seed=1), array(seed=2)
    st.put("a", dumps_value(a))
    view = loads(st.get("a"))
    st.delete("a")  # mapped here: it waits in "dying", not in the pool
    assert os.listdir(os.path.join(st.dir, "free")) == []
    st.put("b", dumps_value(b))  # same size: would reuse a's pages if they were free
    assert np.array_equal(view, a) and np.array_equal(loads(st.get("b")), b)
    del view
    st.delete("b")  # nobody maps a nor b now: both go to the pool
    assert os.listdir(os.path.join(st.dir, "dying")) == []
    assert len(os.listdir(os.path.join(st.dir, "free"))) == 2
    c = array(seed=3)
    st.put("c", dumps_value(c))  # takes one of them
    assert len(os.listdir(os.path.join(st.dir, "free"))) == 1
    assert np.array_equal(loads(st.get("c")), c)


def test_the_store_is_removed_when_its_last_process_is_killed(node):
    d, spill = S.store_dir(node), S.spill_dir(node)
    p = child("""
        import sys, numpy as np
        from yrdask.runtime import store
        from yrdask.serialization import dumps_value
        store.set_capacity(6 * 2**20)  # two 4 MiB values: the second spills to disk
        for i in range(2):
            store.node_store().put(f"v{i}", dumps_value(np.ones(2**19)))
        print("ready", flush=True)
        sys.stdin.read()
    """)
    assert p.stdout.readline().strip() == "ready"
    assert os.listdir(os.path.join(d, "objects")) and os.listdir(spill)
    p.kill()
    p.wait(10)
    wait_gone(d, spill)


def test_the_last_process_to_leave_removes_the_store(node):
    st = S.node_store()
    st.put("v", dumps_value(array(1)))
    p = child("""
        import sys
        from yrdask.runtime import store
        store.node_store().ensure_attached()
        print("in", flush=True)
        sys.stdin.readline()
        store.close_node_store()
    """)
    assert p.stdout.readline().strip() == "in"
    S.close_node_store()  # the child is still registered: the store stays
    assert os.path.exists(os.path.join(st.dir, "objects", "v"))
    p.stdin.write("go\n")
    p.stdin.flush()
    p.wait(10)
    assert not os.path.exists(st.dir)  # removed by the child, the last one, at once


def test_values_beyond_the_capacity_spill_to_disk_and_read_back(node):
    S.set_capacity(10 * 2**20)
    st = S.node_store()
    values = {f"v{i}": array(4, seed=i) for i in range(5)}  # 20 MiB into 10 MiB
    for oid, v in values.items():
        st.put(oid, dumps_value(v))
    assert st.used() <= 10 * 2**20
    assert len(os.listdir(st.spill)) >= 3  # the oldest went to disk
    for oid, v in values.items():  # spilled or not, a read maps it back
        assert np.array_equal(loads(st.get(oid)), v)
    for oid in values:
        st.delete(oid)
        assert not st.contains(oid)
    assert os.listdir(st.spill) == []


def test_a_value_larger_than_the_store_goes_to_disk(node):
    S.set_capacity(2**20)
    st = S.node_store()
    v = array(3)
    st.put("big", dumps_value(v))
    assert os.listdir(st.spill) == ["big"] and st.used() == 0
    assert np.array_equal(loads(st.get("big")), v)


def test_a_pull_fetches_once_for_the_whole_node(node):
    st = S.node_store()
    v = array(2)
    fetches = []

    def fetch():
        fetches.append(1)
        return dumps_value(v)

    out = []
    threads = [threading.Thread(target=lambda: out.append(loads(st.pull("p", fetch))))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(fetches) == 1 and len(out) == 4
    assert all(np.array_equal(o, v) for o in out)
    assert st.pull("small", lambda: b"tiny") == b"tiny" and not st.contains("small")


def test_bad_capacity_is_refused_naming_the_fix():
    from yrdask.errors import YRValueError

    with pytest.raises(YRValueError, match="positive number of bytes"):
        S.check_capacity(0, "object_store_memory")
    with pytest.raises(YRValueError, match="not a size"):
        S.check_capacity("lots", "object_store_memory")
    assert S.check_capacity("2MB", "x") == 2_000_000


def test_the_reaper_runs_as_its_own_module_without_site_or_yrdask(tmp_path):
    """``store_reaper.py`` is run as a file with ``-I -S`` (no site-packages, so no yrdask
    import): it removes a store once its registered processes have ended."""
    from yrdask.runtime import store_reaper

    d, spill = tmp_path / "store", tmp_path / "spill"
    (d / "pids").mkdir(parents=True)
    (d / "objects").mkdir()
    (d / "objects" / "x").write_bytes(b"v")
    (d / "lock").touch()
    spill.mkdir()
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    (d / "pids" / f"{ended.stdout.strip()}-1").touch()  # a registered process, now gone
    subprocess.run([sys.executable, "-I", "-S", store_reaper.__file__, str(d), str(spill),
                    "0.05"], check=True, timeout=30)
    wait_gone(str(d), str(spill))
    assert not store_reaper.alive(f"{ended.stdout.strip()}-1")
