"""Unit tests of yrdask.scheduler.durable: what a restarted scheduler reads back.

The pure part without I/O (what is recorded as the lifecycle and the KV store change, and the
lifecycle events and KV writes that bring a snapshot back, fed to a fresh ``Lifecycle`` with
``validate()`` after each step), and the SQLite store on a temporary file.
"""

from __future__ import annotations

import sqlite3
import types

import dask
import pytest

from .harness import MachineHarness
from .test_group_service import HALF, Edge, join
from .test_lifecycle import JOB, W1, W2, of, spec

from yrdask import protocol as P
from yrdask.scheduler import durable as D
from yrdask.scheduler import lifecycle as L
from yrdask.scheduler.group_adapter import GroupService
from yrdask.scheduler.lease_service import LeaseService
from yrdask.scheduler.kv import KVServer, KVStore

pytestmark = pytest.mark.timeout(30)


class Recorded(MachineHarness):
    """A Lifecycle whose changes a DurableControl over a MemoryStore records, as
    ``InstanceService`` reports them (creations, checkpoints, ends)."""

    def __init__(self) -> None:
        super().__init__(L.Lifecycle())
        self.store = D.MemoryStore()
        self.control = D.DurableControl(self.store)

    def __call__(self, event_type: type, *args, **kwargs) -> list:
        out = super().__call__(event_type, *args, **kwargs)
        if self.m.last_ended:
            self.control.instances_ended(self.m.last_ended)
        if event_type is L.Create:
            rec = self.m.instances.get(args[0]["instance_id"])
            if rec is not None:
                self.control.instance_created(rec)
        elif event_type is L.SaveState:
            self.control.instance_saved(self.m.instances[args[0]])
        return out

    def running(self, *args, worker=W1, **kwargs) -> None:
        self(L.Create, spec(*args, **kwargs), 1.0)
        self(L.Placed, args[0], worker)
        self(L.InstanceStarted, args[0], worker)

    @property
    def rows(self) -> dict:
        return self.store.load().instances


def test_only_detached_instances_are_kept_with_their_latest_checkpoint():
    h = Recorded()
    h.running("d1", detached=True, name="ctr")
    h.running("n1", name="named")  # named, not detached: ends with its job
    h.running("u1")
    assert set(h.rows) == {"d1"}
    row = h.rows["d1"]
    assert row.checkpoint is None and row.spec["name"] == "ctr"
    assert not set(D.VOLATILE_SPEC_FIELDS) & set(row.spec)  # no creator's address kept
    h(L.SaveState, "d1", b"one")
    h(L.SaveState, "n1", b"not kept")
    h(L.SaveState, "d1", b"two")
    assert h.rows["d1"].checkpoint == b"two" and set(h.rows) == {"d1"}


def test_a_named_creation_that_binds_the_kept_instance_adds_no_row():
    h = Recorded()
    h.running("d1", detached=True, name="ctr")
    batches = h.store.batches
    h(L.Create, spec("d2", detached=True, name="ctr"), 2.0)  # binds d1 (an alias)
    assert set(h.rows) == {"d1"} and h.store.batches == batches


def test_the_row_goes_when_the_instance_ends_but_not_while_it_restarts():
    h = Recorded()
    h.running("d1", detached=True, recover=1)
    h.running("d2", detached=True, worker=W2)
    h(L.WorkerLost, W1, 3.0)  # d1 restarts: kept
    assert h.m.instances["d1"].state == P.RESTARTING and set(h.rows) == {"d1", "d2"}
    h(L.OwnerGone, JOB, "its job ended")  # detached: not ended by its job
    assert set(h.rows) == {"d1", "d2"}
    h(L.Kill, "d2", "terminated")
    assert set(h.rows) == {"d1"}
    h(L.Placed, "d1", W2)
    h(L.WorkerLost, W2, 4.0)  # out of restarts: ends
    assert h.rows == {}


def test_nothing_is_written_once_the_scheduler_closes():
    h = Recorded()
    h.running("d1", detached=True)
    h.control.closing = True  # the workers it removes while closing end nothing kept
    h(L.WorkerLost, W1, 2.0)
    assert "d1" not in h.m.instances and set(h.rows) == {"d1"}


def test_read_back_brings_kept_instances_back_from_their_checkpoint():
    h = Recorded()
    h.running("d1", detached=True, name="ctr", namespace="ns", timeout_ms=5000)
    h.running("d2", detached=True)
    h(L.SaveState, "d1", b"state-3")
    snapshot = h.store.load()

    fresh = MachineHarness(L.Lifecycle())  # the restarted scheduler's lifecycle
    acquires = []
    for event in D.restore_events(snapshot):
        acquires += of(fresh.m.handle(event), L.AcquireResources)
        fresh.m.validate()
    # waiting for workers without a time-out: they come back after the scheduler
    assert sorted((a.instance_id, a.timeout_ms) for a in acquires) == [("d1", -1), ("d2", -1)]
    assert fresh.m.named("ns", "ctr").instance_id == "d1"
    assert fresh.m.instances["d1"].state == P.PENDING
    start = of(fresh(L.Placed, "d1", W2), L.StartInstance)[0]
    assert start.checkpoint == b"state-3" and start.spec["instance_id"] == "d1"
    start = of(fresh(L.Placed, "d2", W1), L.StartInstance)[0]
    assert start.checkpoint is None  # fresh __init__ with its creation arguments
    fresh(L.InstanceStarted, "d1", W2)
    assert fresh.m.status("d1")["state"] == P.ALIVE


def _group_edge(store: D.MemoryStore) -> Edge:
    """The group adapter over a recording edge, recording into ``store``."""
    e = Edge()
    e.leases = LeaseService(e)
    e.groups = GroupService(e, e.leases.leases)
    e.groups.durable = D.DurableControl(store)
    return e


def test_only_detached_groups_are_kept_until_they_are_removed():
    store = D.MemoryStore()
    e = _group_edge(store)
    join(e, W1)
    assert e.groups.create("d1", "pg", [HALF, {"CPU": 200.0}], "STRICT_SPREAD",
                           detached=True) == ""
    assert e.groups.create("d1", "job-group", [HALF]) == ""  # ends with its job
    assert store.load().groups == {"pg": D.GroupRow(
        "pg", "d1", ({"CPU": 500.0, "Memory": 100.0}, {"CPU": 200.0}),
        "STRICT_SPREAD")}
    batches = store.batches
    assert "already exists" in e.groups.create("d1", "pg", [HALF], detached=True)
    assert store.batches == batches  # a refused creation writes nothing
    e.groups.on_owner_gone("d1")  # its job ended: the detached group stays
    assert e.groups.machine.live("job-group") is None and set(store.load().groups) == {"pg"}
    e.groups.remove("pg")
    assert store.load().groups == {}


def test_read_back_brings_kept_groups_back_pending_until_workers_join():
    store = D.MemoryStore()
    e = _group_edge(store)
    join(e, W1)
    e.groups.create("d1", "pg", [HALF, HALF], "STRICT_SPREAD", detached=True)
    snapshot = store.load()

    fresh = _group_edge(D.MemoryStore())  # the restarted scheduler: no workers yet
    for event in D.restore_groups(snapshot):
        fresh.groups.do(fresh.groups.machine.handle(event))
    g = fresh.groups.machine.live("pg")
    assert g is not None and g.detached and g.state == P.RG_PENDING
    join(fresh, W1)
    assert g.state == P.RG_PENDING  # STRICT_SPREAD: two workers
    join(fresh, W2)
    assert g.state == P.RG_CREATED and sorted(b.worker for b in g.bundles) == [W1, W2]
    fresh.groups.on_owner_gone("d1")  # its old owner: nothing to end
    assert fresh.groups.machine.live("pg") is g


def test_kv_entries_are_kept_with_their_remaining_time_to_live():
    kv, state = KVStore(), D.DurableState()
    kv.put(["a", "b", "c"], [b"1", b"2", b"3"], now=100.0)
    kv.put(["t"], [b"ttl"], now=100.0, ttl=10.0, evictable=True)
    state.kv_written(kv, ["a", "b", "c", "t"], now=100.0, wall=5000.0)
    kv.delete(["b"], now=101.0)
    state.kv_written(kv, ["b"], now=101.0, wall=5001.0)
    store = D.MemoryStore()
    store.apply(state.take())
    snap = store.load()
    assert set(snap.kv) == {"a", "c", "t"}
    assert snap.kv["t"].expires_at == 5010.0 and snap.kv["t"].evictable

    back = KVStore()
    assert D.restore_kv(snap, back, now=7.0, wall=5004.0) == []
    assert back.get(["a", "c", "t"], 7.0) == ([b"1", b"3", b"ttl"], [])
    assert back.get(["t"], 13.0) == ([], ["t"])  # 6 s were left of its 10
    later = KVStore()
    D.restore_kv(snap, later, now=0.0, wall=5011.0)  # expired while the scheduler was down
    assert set(later.items) == {"a", "c"}


def test_kv_server_writes_through_puts_evictions_and_deletes():
    kv = KVServer(max_bytes=40)
    kv.durable = D.DurableControl(D.MemoryStore())
    assert kv.kv_put(["old"], [b"x" * 20], evictable=True) == ["ok", None]
    assert set(kv.durable.store.load().kv) == {"old"}
    assert kv.kv_put(["new"], [b"y" * 20]) == ["ok", None]  # evicts "old"
    assert set(kv.durable.store.load().kv) == {"new"}
    assert kv.kv_put(["new"], [b"z"], nx=True)[0] == "exists"  # refused: nothing written
    assert kv.durable.store.load().kv["new"].value == b"y" * 20
    kv.kv_del(["new", "never"])
    assert kv.durable.store.load().kv == {}


def test_kv_entries_that_no_longer_fit_are_reported():
    snap = D.Snapshot(kv={"big": D.KVRow("big", b"x" * 100)})
    assert D.restore_kv(snap, KVStore(max_bytes=10), now=0.0, wall=0.0) == ["big"]


# -- the SQLite store --------------------------------------------------------------------------


def _changes() -> D.Changes:
    return D.Changes(
        instances={"d1": D.InstanceRow("d1", {"instance_id": "d1", "cls": b"\x00"}, None),
                   "d2": D.InstanceRow("d2", {"instance_id": "d2"}, b"cp")},
        kv={"k": D.KVRow("k", b"v", 123.5, True), "k2": D.KVRow("k2", b"w")},
        groups={"pg": D.GroupRow("pg", "tcp://d:1", ({"CPU": 1000.0},), "PACK"),
                "pg2": D.GroupRow("pg2", "tcp://d:1", ({"CPU": 1.0}, {"GPU": 1.0}), "SPREAD")})


def test_sqlite_store_keeps_batches_across_reopening(tmp_path):
    path = str(tmp_path / "sub" / "state.sqlite")
    store = D.SqliteStore(path)
    store.apply(_changes())
    store.apply(D.Changes(instances={"d2": None}, checkpoints={"d1": b"saved"},
                          kv={"k2": None}, groups={"pg2": None}))
    store.close()
    snap = D.SqliteStore(path).load()
    assert snap.instances == {"d1": D.InstanceRow("d1", {"instance_id": "d1", "cls": b"\x00"},
                                                  b"saved")}
    assert snap.kv == {"k": D.KVRow("k", b"v", 123.5, True)}
    assert snap.groups == {"pg": D.GroupRow("pg", "tcp://d:1", ({"CPU": 1000.0},), "PACK")}


def test_sqlite_store_batch_is_all_or_nothing(tmp_path):
    store = D.SqliteStore(str(tmp_path / "state.sqlite"))
    store.apply(_changes())
    bad = D.Changes(instances={"d1": None}, kv={"k": D.KVRow("k", None)})  # NOT NULL
    with pytest.raises(sqlite3.IntegrityError):
        store.apply(bad)
    assert set(store.load().instances) == {"d1", "d2"}
    store.close()


def test_sqlite_store_refuses_a_file_it_cannot_use(tmp_path):
    path = tmp_path / "state.sqlite"
    store = D.SqliteStore(str(path))
    store.db.execute("UPDATE meta SET v='99' WHERE k='version'")
    store.close()
    with pytest.raises(D.StateStoreError, match="schema version 99.*yrdask.state.path"):
        D.SqliteStore(str(path))
    (tmp_path / "dir.sqlite").mkdir()
    with pytest.raises(D.StateStoreError, match="yrdask.state.path"):
        D.SqliteStore(str(tmp_path / "dir.sqlite"))


def test_state_path_from_the_config(tmp_path):
    def sched(start: str, address: str = "tcp://10.0.0.5:8786"):
        return types.SimpleNamespace(_start_address=[start], address=address)

    with dask.config.set({D.CONFIG_KEY: "auto", "temporary-directory": str(tmp_path)}):
        assert D.store_path(sched("tcp://:8786")) == str(
            tmp_path / "yrdask-state-10.0.0.5-8786.sqlite")
        assert D.store_path(sched("tcp://")) is None  # a random port never comes back
        assert D.store_path(sched("tcp://127.0.0.1:0")) is None
    with dask.config.set({D.CONFIG_KEY: str(tmp_path / "s.sqlite")}):
        assert D.store_path(sched("tcp://")) == str(tmp_path / "s.sqlite")
    for off in (False, "false", "", None):
        with dask.config.set({D.CONFIG_KEY: off}):
            assert D.store_path(sched("tcp://:8786")) is None
