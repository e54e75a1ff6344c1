"""Durable control state: what a restarted scheduler reads back (docs/faults.md, "Scheduler
restart").

Ray's GCS keeps its tables in Redis, openYuanrong its in etcd; yrdask keeps the part of the
scheduler's state that must outlive the scheduler process in a :class:`StateStore`, written
through on each change:

* detached instances (``lifecycle: detached``, named or not): their creation spec and their
  latest ``yr.save_state()`` checkpoint; the row goes when the instance ends;
* detached resource groups (Ray's ``placement_group(lifetime="detached")``): their name,
  bundles and strategy; the row goes when the group is removed;
* the KV store's entries (with their expiry as a wall-clock time, and eviction mark).

Nothing else is kept: non-detached instances and groups end with their owner's job, and a
driver's job ends with the scheduler it was connected to; leases and waiting requests belong
to drivers and workers that reconnect anew.

Three parts, each testable alone:

* :class:`DurableState` (pure, no I/O): turns lifecycle, group and KV changes into
  :class:`Changes`, and a loaded :class:`Snapshot` into the lifecycle events
  (:func:`restore_events`), group events (:func:`restore_groups`) and KV writes
  (:func:`restore_kv`) that bring it back.
* :class:`SqliteStore`: the default :class:`StateStore`, an SQLite file (WAL journal; every
  batch one transaction).  An external store (etcd, Redis, a database) implements the same
  three methods: ``load`` reads every row, ``apply`` writes one batch atomically, ``close``.
* :class:`DurableControl`: the Dask adapter, installed by the composition root
  (:func:`open_store` picks the file from the Dask config ``yrdask.state.path``).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import sqlite3
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol

from distributed.diagnostics.plugin import SchedulerPlugin

from yrdask.errors import StateStoreError
from yrdask.scheduler import groups as G
from yrdask.scheduler import lifecycle as L

logger = logging.getLogger("yrdask.scheduler")

CONFIG_KEY = "yrdask.state.path"
SCHEMA_VERSION = 1
# Fields of an instance spec that name the processes of one scheduler's lifetime (the
# creator's handle, where its prints go) or a restart's extras: not kept.
VOLATILE_SPEC_FIELDS = ("holder", "log_to", "checkpoint", "incarnation", "devices", "cpus")


@dataclass(frozen=True)
class InstanceRow:
    """A detached instance: its creation spec and its latest checkpoint (or None)."""

    instance_id: str
    spec: dict
    checkpoint: bytes | None = None


@dataclass(frozen=True)
class GroupRow:
    """A detached resource group: what its creation asked for (``bundles``: validated
    shapes); where its bundles were placed is not kept (the workers come back anew)."""

    name: str
    owner: str
    bundles: tuple
    strategy: str


@dataclass(frozen=True)
class KVRow:
    """A KV entry; ``expires_at``: wall-clock time (``time.time()``) it expires, or None."""

    key: str
    value: bytes
    expires_at: float | None = None
    evictable: bool = False


@dataclass
class Snapshot:
    """Everything a store holds."""

    instances: dict[str, InstanceRow] = field(default_factory=dict)
    kv: dict[str, KVRow] = field(default_factory=dict)
    groups: dict[str, GroupRow] = field(default_factory=dict)


@dataclass
class Changes:
    """One batch of writes: a row, or None to delete it.  ``checkpoints`` update the
    checkpoint of an instance row already written (in this batch or before)."""

    instances: dict[str, InstanceRow | None] = field(default_factory=dict)
    checkpoints: dict[str, bytes] = field(default_factory=dict)
    kv: dict[str, KVRow | None] = field(default_factory=dict)
    groups: dict[str, GroupRow | None] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.instances or self.checkpoints or self.kv or self.groups)


class StateStore(Protocol):
    """Where the durable state lives (see module docstring)."""

    def load(self) -> Snapshot:
        """Every row, as written by the last :meth:`apply` that returned."""

    def apply(self, changes: Changes) -> None:
        """Write one batch, all of it or none."""

    def close(self) -> None:
        """Release the store (the rows stay)."""


# -- the pure part ---------------------------------------------------------------------------


class DurableState:
    """Collects what must be written (see module docstring); :meth:`take` hands it over."""

    def __init__(self) -> None:
        self.pending = Changes()
        self.kept: set[str] = set()  # instance ids with a row
        self.kept_groups: set[str] = set()  # group names with a row

    def take(self) -> Changes:
        """The changes collected since the last call."""
        out, self.pending = self.pending, Changes()
        return out

    def instance_created(self, rec: L.InstanceRecord) -> None:
        """A creation the lifecycle accepted: detached ones are kept."""
        if rec.detached and rec.instance_id not in self.kept:
            self.kept.add(rec.instance_id)
            spec = {k: v for k, v in rec.spec.items() if k not in VOLATILE_SPEC_FIELDS}
            self.pending.instances[rec.instance_id] = InstanceRow(
                rec.instance_id, spec, rec.checkpoint)

    def instance_saved(self, rec: L.InstanceRecord) -> None:
        """``yr.save_state()`` of a live instance."""
        if rec.instance_id in self.kept and rec.checkpoint is not None:
            self.pending.checkpoints[rec.instance_id] = rec.checkpoint

    def instances_ended(self, recs: Iterable[L.InstanceRecord]) -> None:
        """Instances the last lifecycle event ended: their rows go."""
        for rec in recs:
            if rec.instance_id in self.kept:
                self.kept.discard(rec.instance_id)
                self.pending.instances[rec.instance_id] = None
                self.pending.checkpoints.pop(rec.instance_id, None)

    def group_created(self, g: G.Group) -> None:
        """A group the group machine accepted: detached ones are kept."""
        if g.detached and g.name not in self.kept_groups:
            self.kept_groups.add(g.name)
            self.pending.groups[g.name] = GroupRow(
                g.name, g.owner, tuple(dict(b.shape) for b in g.bundles), g.strategy)

    def group_removed(self, name: str) -> None:
        """Group ``name`` was removed: its row goes."""
        if name in self.kept_groups:
            self.kept_groups.discard(name)
            self.pending.groups[name] = None

    def kv_written(self, store: Any, keys: Iterable[str], now: float, wall: float) -> None:
        """KV ``keys`` changed in ``store`` (a :class:`~yrdask.scheduler.kv.KVStore` on the
        clock ``now``): present ones are (re)written, absent ones deleted.  ``wall``: the
        wall clock at ``now``, for the expiry."""
        for key in keys:
            item = store.items.get(key)
            if item is None:
                self.pending.kv[key] = None
            else:
                expires = None if item.expires_at is None else wall + (item.expires_at - now)
                self.pending.kv[key] = KVRow(key, item.value, expires, item.evictable)


def restore_events(snapshot: Snapshot) -> list[L.Event]:
    """The lifecycle events that bring the kept instances back: a ``Create`` each (waiting
    for a worker without a time-out: the workers come back after the scheduler), and a
    ``SaveState`` for those with a checkpoint, so they start from it."""
    events: list[L.Event] = []
    for row in snapshot.instances.values():
        spec = {**row.spec, "timeout_ms": -1}
        events.append(L.Create(f"restore-{row.instance_id}", spec, time.time()))
        if row.checkpoint is not None:
            events.append(L.SaveState(f"restore-state-{row.instance_id}", row.instance_id,
                                      row.checkpoint))
    return events


def restore_groups(snapshot: Snapshot) -> list[G.GroupRequested]:
    """The group machine events that bring the kept groups back, pending (their bundles are
    placed as workers join).  Fed before :func:`restore_events`: a kept instance placed in a
    kept group asks for its bundle, which must exist by then."""
    return [G.GroupRequested(f"restore-group-{row.name}", row.name, row.owner,
                             tuple(dict(b) for b in row.bundles), row.strategy,
                             detached=True)
            for row in snapshot.groups.values()]


def restore_kv(snapshot: Snapshot, store: Any, now: float, wall: float) -> list[str]:
    """Write the kept entries into ``store`` (a ``KVStore``) with their remaining time to
    live; expired ones are skipped.  Returns the keys that did not fit (logged by the
    caller: the bound ``yrdask.kv.max-bytes`` was lowered meanwhile)."""
    refused = []
    for row in snapshot.kv.values():
        ttl = 0.0
        if row.expires_at is not None:
            ttl = row.expires_at - wall
            if ttl <= 0:
                continue
        try:
            store.put([row.key], [row.value], now, ttl=ttl, evictable=row.evictable)
        except Exception:
            refused.append(row.key)
    return refused


# -- stores ----------------------------------------------------------------------------------


class MemoryStore:
    """:class:`StateStore` in this process's memory: the reference behaviour of a store, for
    tests and the simulation (it does not outlive the process)."""

    def __init__(self) -> None:
        self.rows = Snapshot()
        self.batches = 0

    def load(self) -> Snapshot:
        return Snapshot(dict(self.rows.instances), dict(self.rows.kv), dict(self.rows.groups))

    def apply(self, changes: Changes) -> None:
        rows = self.rows
        for iid, row in changes.instances.items():
            if row is None:
                rows.instances.pop(iid, None)
            else:
                rows.instances[iid] = row
        for iid, checkpoint in changes.checkpoints.items():
            row = rows.instances.get(iid)
            if row is not None:
                rows.instances[iid] = InstanceRow(iid, row.spec, checkpoint)
        for key, kv in changes.kv.items():
            if kv is None:
                rows.kv.pop(key, None)
            else:
                rows.kv[key] = kv
        for name, group in changes.groups.items():
            if group is None:
                rows.groups.pop(name, None)
            else:
                rows.groups[name] = group
        self.batches += 1

    def close(self) -> None:
        pass


class SqliteStore:
    """:class:`StateStore` in one SQLite file (WAL journal, ``synchronous=NORMAL``: a batch
    that returned survives the scheduler process being killed; a power loss may take the
    last batches)."""

    def __init__(self, path: str) -> None:
        self.path = path
        folder = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(folder, exist_ok=True)
            # pickled classes and arguments that workers will run: the owner's alone
            os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
            self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            db = self.db
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT)")
            db.execute("CREATE TABLE IF NOT EXISTS instances (id TEXT PRIMARY KEY, "
                       "spec BLOB NOT NULL, checkpoint BLOB)")
            db.execute("CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value BLOB NOT "
                       "NULL, expires_at REAL, evictable INTEGER NOT NULL)")
            # (added after version 1's first tables: a file without it gets it here)
            db.execute("CREATE TABLE IF NOT EXISTS groups (name TEXT PRIMARY KEY, "
                       "spec TEXT NOT NULL)")
            row = db.execute("SELECT v FROM meta WHERE k='version'").fetchone()
            if row is None:
                db.execute("INSERT INTO meta VALUES ('version', ?)", (str(SCHEMA_VERSION),))
            elif row[0] != str(SCHEMA_VERSION):
                raise StateStoreError(
                    f"the yrdask state file {path} has schema version {row[0]}, this yrdask "
                    f"writes {SCHEMA_VERSION}: move it away, or set {CONFIG_KEY} to another "
                    "file")
        except (sqlite3.Error, OSError) as e:
            raise StateStoreError(f"cannot use the yrdask state file {path} ({e}): set "
                                  f"{CONFIG_KEY} to a writable file, or false") from e

    def load(self) -> Snapshot:
        snap = Snapshot()
        for iid, spec, checkpoint in self.db.execute(
                "SELECT id, spec, checkpoint FROM instances"):
            snap.instances[iid] = InstanceRow(iid, pickle.loads(spec), checkpoint)
        for key, value, expires_at, evictable in self.db.execute(
                "SELECT key, value, expires_at, evictable FROM kv"):
            snap.kv[key] = KVRow(key, value, expires_at, bool(evictable))
        for name, spec in self.db.execute("SELECT name, spec FROM groups"):
            d = json.loads(spec)
            snap.groups[name] = GroupRow(name, d["owner"], tuple(d["bundles"]), d["strategy"])
        return snap

    def apply(self, changes: Changes) -> None:
        db = self.db
        db.execute("BEGIN")
        try:
            for iid, row in changes.instances.items():
                if row is None:
                    db.execute("DELETE FROM instances WHERE id=?", (iid,))
                else:
                    db.execute("INSERT OR REPLACE INTO instances VALUES (?, ?, ?)",
                               (iid, pickle.dumps(row.spec), row.checkpoint))
            for iid, checkpoint in changes.checkpoints.items():
                db.execute("UPDATE instances SET checkpoint=? WHERE id=?", (checkpoint, iid))
            for key, kv in changes.kv.items():
                if kv is None:
                    db.execute("DELETE FROM kv WHERE key=?", (key,))
                else:
                    db.execute("INSERT OR REPLACE INTO kv VALUES (?, ?, ?, ?)",
                               (key, kv.value, kv.expires_at, int(kv.evictable)))
            for name, group in changes.groups.items():
                if group is None:
                    db.execute("DELETE FROM groups WHERE name=?", (name,))
                else:
                    spec = {"owner": group.owner, "bundles": list(group.bundles),
                            "strategy": group.strategy}
                    db.execute("INSERT OR REPLACE INTO groups VALUES (?, ?)",
                               (name, json.dumps(spec)))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self.db.close()


def store_path(scheduler: Any) -> str | None:
    """The state file of ``scheduler`` per ``yrdask.state.path`` (see ``yrdask.yaml``), or
    None when nothing is kept."""
    import tempfile

    import dask
    from distributed.comm import parse_address, parse_host_port

    value = dask.config.get(CONFIG_KEY, "auto")
    if value in (False, None, "", "false", "False"):
        return None
    if value != "auto":
        return os.path.expanduser(str(value))
    asked = [str(a) for a in getattr(scheduler, "_start_address", None) or ()]
    ports = []
    for address in asked:
        try:
            ports.append(parse_host_port(parse_address(address)[1], 0)[1])
        except (ValueError, TypeError):
            ports.append(0)
    if not ports or 0 in ports:  # a random port: no restart can come back to it
        return None
    host, port = parse_host_port(parse_address(scheduler.address)[1])
    folder = dask.config.get("temporary-directory", None) or tempfile.gettempdir()
    return os.path.join(folder, f"yrdask-state-{host}-{port}.sqlite")


def open_store(scheduler: Any) -> SqliteStore | None:
    """The composition root's store for ``scheduler`` (None: ``yrdask.state.path`` says
    nothing is kept)."""
    path = store_path(scheduler)
    if path is None:
        return None
    logger.info("yrdask: keeping detached instances and groups and the KV store in %s (%s)",
                path, CONFIG_KEY)
    return SqliteStore(path)


# -- the Dask adapter ------------------------------------------------------------------------


class DurableControl:
    """Records the extension's durable state in a :class:`StateStore` and reads it back at
    start (see module docstring).  Writes stop once the scheduler begins to close: the
    workers it removes while closing do not end the instances it keeps."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self.state = DurableState()
        self.closing = False

    def attach(self, ext: Any) -> None:
        """Read the state back into ``ext`` (the scheduler extension, on its loop) and record
        its changes from now on."""
        snapshot = self.store.load()
        kv = ext.kv
        refused = restore_kv(snapshot, kv.store, kv._now(), time.time())
        if refused:
            logger.warning("yrdask: %d KV entries kept before the restart do not fit the KV "
                           "store's bound (yrdask.kv.max-bytes) and are dropped: %s",
                           len(refused), refused[:10])
        groups = ext.rgroups.service
        for group_event in restore_groups(snapshot):  # first: kept instances may sit in them
            groups.do(groups.machine.handle(group_event))
        self.state.kept_groups.update(snapshot.groups)
        service = ext.instances.service
        for event in restore_events(snapshot):
            service.feed(event)
        lifecycle = ext.instances.lifecycle
        for iid in snapshot.instances:
            if lifecycle.is_live(iid):
                self.state.kept.add(iid)
            else:  # (not re-created: its row would come back at every restart)
                self.state.pending.instances[iid] = None
        self.state.pending.kv.update(dict.fromkeys(refused))
        if snapshot.instances or snapshot.kv or snapshot.groups:
            logger.info("yrdask: read back %d detached instances, %d detached groups and %d "
                        "KV entries from %s", len(self.state.kept), len(snapshot.groups),
                        len(snapshot.kv) - len(refused), getattr(self.store, "path", self.store))
        self.flush()
        service.durable = self
        groups.durable = self
        kv.durable = self
        ext.scheduler.add_plugin(_ClosingHook(self), name="yrdask-durable")

    def flush(self) -> None:
        """Write what was collected, in one batch."""
        changes = self.state.take()
        if changes and not self.closing:
            self.store.apply(changes)

    # -- hooks (instance manager, KV server) -----------------------------------------------

    def instance_created(self, rec: L.InstanceRecord) -> None:
        if rec.detached:
            self.state.instance_created(rec)
            self.flush()

    def instance_saved(self, rec: L.InstanceRecord) -> None:
        if rec.instance_id in self.state.kept:
            self.state.instance_saved(rec)
            self.flush()

    def instances_ended(self, recs: list[L.InstanceRecord]) -> None:
        if not self.closing and any(r.instance_id in self.state.kept for r in recs):
            self.state.instances_ended(recs)
            self.flush()

    def group_created(self, g: G.Group) -> None:
        if g.detached:
            self.state.group_created(g)
            self.flush()

    def group_removed(self, name: str) -> None:
        if name in self.state.kept_groups:
            self.state.group_removed(name)
            self.flush()

    def kv_written(self, store: Any, keys: Iterable[str], now: float) -> None:
        self.state.kv_written(store, keys, now, time.time())
        self.flush()


class _ClosingHook(SchedulerPlugin):
    """Stops the writes when the scheduler begins to close, and closes the store after."""

    def __init__(self, control: DurableControl) -> None:
        self.control = control

    async def before_close(self) -> None:
        self.control.closing = True

    async def close(self) -> None:
        self.control.store.close()
