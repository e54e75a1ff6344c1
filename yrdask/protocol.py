"""The wire vocabulary between the yr API, the scheduler extension and the worker agents.

Every message that crosses a process boundary is defined here, once, as a frozen dataclass
saying who sends it, who handles it, its fields and (for a request) what comes back.  The
single table :data:`MESSAGES` maps each op to its class; the channel groupings
(:data:`SCHEDULER_RPC`, ...) are derived from it, handler tables are built from them with
:func:`handlers`, and a test checks that the live handler tables of the scheduler and the
workers match them.

On the wire a message is a plain msgpack-able dict ``{"op": OP, **fields}`` (Dask's comm
format): build it with ``Message.to_msg()`` and read it back with ``Cls.from_msg(d)`` or
:func:`decode`; a request goes out with :func:`request`.  User objects (functions,
arguments, results, exceptions) travel as pickled ``bytes`` fields; the envelope itself is
msgpack only.  The op-name constants (``RUN_TASK`` ...) stay for code that matches on ops.

Channels
--------
``scheduler rpc``     request/response on Dask's pooled connections to the scheduler.
``job stream``        one long-lived comm from a driver to the scheduler, opened by
                      :class:`ConnectJob`; both sides send batched one-way messages on it, and
                      its closing ends the driver's job.
``worker stream``     the worker's own Dask batched stream to the scheduler (the scheduler
                      handler gets ``worker=<address>`` injected).
``call channel``      one long-lived comm from a caller process (driver or worker) to a worker,
                      opened by :class:`OpenChannel`; the hot path: task pushes go one way,
                      results come back on the same comm, no scheduler involved.
``owner rpc``         request/response to the process that owns an object (a worker, or the
                      driver's small owner server).
``supervision``       the comm a worker agent builds its isolated process's instance on, once
                      built (:class:`OpenChannel` with the worker's address): a call channel
                      that also carries the agent's requests (:class:`AgentRequest`, answered
                      by :class:`AgentReply`) and the process's reports to its agent.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Iterable, Literal, Mapping, Sequence, TypedDict, Union

PROTOCOL_VERSION = 2  # 2: worker processes' server ids (lease replies, instance locations,
#                       OpenChannel, WorkerLost/Joined/Exit)

# --- instance states ----------------------------------------------------------------------

PENDING = "PENDING"  # waiting for resources
ALIVE = "ALIVE"
RESTARTING = "RESTARTING"
DEAD = "DEAD"

# --- object kinds -------------------------------------------------------------------------

VALUE = "value"
ERROR = "error"
LOCATION = "location"
STORED = "stored"  # agent -> its isolated child only: the value is in their node's store

# --- channel tags (what ``Message.channels`` holds) ---------------------------------------

ON_SCHEDULER_RPC = "scheduler rpc"
ON_SCHEDULER_STREAM = "worker stream -> scheduler"
ON_JOB_STREAM = "job stream -> scheduler"
ON_DRIVER_STREAM = "job stream -> driver"
ON_WORKER_RPC = "worker rpc"
ON_WORKER_STREAM = "scheduler stream -> worker"
ON_OWNER_RPC = "owner rpc"
ON_CHANNEL_TO_WORKER = "call channel -> worker (or a process instance)"
ON_CHANNEL_TO_CALLER = "call channel -> caller"
ON_ISOLATED_RPC = "worker agent (or caller) -> isolated process rpc"
ON_ISOLATED_TO_AGENT = "isolated process -> its worker agent (supervision channel)"
ON_SUPERVISION = "worker agent -> its isolated process (supervision channel)"


# --- reply types --------------------------------------------------------------------------
# Dask's msgpack reads every array back as a tuple (``use_list=False``): a handler that returns
# a list is read as the tuple below, and so are the list fields of a message that arrives.

ObjectKind = Literal["value", "error", "location"]

FetchReply = Union[tuple[Literal["value"], bytes], tuple[Literal["error"], bytes],
                   tuple[Literal["location"], str]]
"""``[kind, payload]``: ``"value"`` with the pickled bytes, ``"error"`` with a pickled
RemoteError, or ``"location"`` with the address of the worker holding the value."""

LeaseReply = Union[tuple[str, str, str], tuple[None, str]]
"""``[lease_id, worker_address, server_id]`` (``server_id``: the worker process's Dask
``server_id``, see ``runtime/worker_processes.py``; ``""`` if the scheduler no longer lists
it), or
``[None, reason]`` when no worker could meet the request in time (the API raises
:class:`yrdask.errors.ScheduleError`)."""

InstanceReply = Union[tuple[str, str, dict, str], tuple[None, str, Union[str, None]]]
"""``[instance_id, worker, meta, server_id]`` once placed or alive (``server_id``: which
worker process, its Dask ``server_id``: ``runtime/worker_processes.py``),
``[None, reason, None]``
when it cannot be placed or does not exist, ``[None, reason, "timeout"]`` when waiting timed
out."""

LocateReply = tuple[str, Union[str, None], str, str, str]
"""``[state, worker, reason, instance_id, server_id]``; ``instance_id`` is the id a named
creation's alias stands for, ``server_id`` which process at ``worker`` (``""``: none)."""

ListNamedReply = list[tuple[str, str]]
"""``[[namespace, name], ...]``."""


class WorkerSnapshot(TypedDict):
    capacity: dict[str, float]
    held: dict[str, float]


class ClusterInfoReply(TypedDict):
    """The scheduler's view of the cluster (``yr.resources()``, status command, dashboard)."""

    workers: dict[str, WorkerSnapshot]
    dashboard: str | None
    counters: dict[str, int]  # leases granted, local, forwarded, timeouts
    instances: list[dict[str, Any]]  # instance records; empty with ``instances=False``
    placement: dict[str, Any]  # {kind: latency figures}
    scheduling: dict[str, Any]  # {address: the worker's last heartbeat load report}
    waiting: list[dict[str, Any]]  # why requests wait (WaitWatch.rows); [] with instances=False
    ended: list[dict[str, Any]]  # tombstones of ended instances, newest first; [] likewise
    resource_groups: list[dict[str, Any]]  # name, owner, strategy, state, reason, bundles


class InstanceStatusReply(TypedDict):
    state: str
    worker: str | None
    restarts: int
    reason: str
    waiting: str  # why it is not placed yet ("" when it is not waiting)


class InstanceSpec(TypedDict, total=False):
    """What :class:`CreateInstance` and :class:`StartInstance` carry about an instance."""

    instance_id: str
    cls: bytes  # the pickled class
    cls_name: str
    args: bytes
    deps: list
    shape: dict[str, float]
    timeout_ms: int
    owner: str  # job or instance id
    holder: str  # the creator's address, first handle holder
    log_to: str | None  # the driver that gets the instance's prints (log_to_driver)
    name: str | None
    namespace: str | None
    detached: bool
    concurrency: int
    is_async: bool
    meta: dict  # method metadata for handles
    incarnation: int  # on a restart: the restart count
    checkpoint: bytes | None  # on a restart: the last saved state
    grace_s: int  # how long __yr_shutdown__ may take when the instance is stopped (default 30)
    isolation: dict | None  # {"env": {...}, "cwd": str}: host it in its own process


# --- the message base and the table -------------------------------------------------------

MESSAGES: dict[str, type[Message]] = {}
"""op -> message class, every message of the protocol, in definition order."""


class UnknownMessage(LookupError):
    """:func:`dispatch` got an op its table has no handler for."""


class Message:
    """Base of every wire message: a frozen, slotted dataclass with class-level metadata.

    ``op`` the op name; ``channels`` the channel tags it travels on; ``handler`` the name of
    the method that handles it on the receiving object (default: the op without ``yr_``);
    ``reply_type`` what a request answers (``None`` for one-way messages and for ``None``
    replies, see the class docstring); ``opens_stream`` true for the messages that turn
    their comm into a stream (sent with Dask's ``reply=False``).
    """

    __slots__ = ()
    op: ClassVar[str]
    channels: ClassVar[tuple[str, ...]]
    handler: ClassVar[str]
    reply_type: ClassVar[Any] = None
    opens_stream: ClassVar[bool] = False

    def to_msg(self) -> dict[str, Any]:  # replaced per class by _message
        raise NotImplementedError

    @classmethod
    def from_msg(cls, msg: Mapping[str, Any]) -> Message:  # replaced per class by _message
        raise NotImplementedError

    @classmethod
    def wire(cls, *args: Any, **fields: Any) -> dict[str, Any]:  # replaced per class by _message
        """The wire dict of ``cls(*args, **fields)``, built without the message object (the
        fields at their defaults left out)."""
        raise NotImplementedError


def _message(cls: type) -> type:
    """Make ``cls`` a frozen slots dataclass, generate its fast ``to_msg``/``from_msg``/
    ``__init__`` and register it in :data:`MESSAGES`.

    The generated code names each field (no ``dataclasses.asdict``, which deep-copies every
    payload): these run once per task on the ~1 ms round-trip path.
    """
    cls = dataclasses.dataclass(frozen=True, slots=True)(cls)
    if "handler" not in cls.__dict__:
        cls.handler = cls.op.removeprefix("yr_")
    fields = dataclasses.fields(cls)
    items = [f"{f.name!r}: self.{f.name}" for f in fields]
    # wire() leaves out the fields at their defaults (from_msg reads them back as such):
    # fewer keys to pack and unpack on the hot paths
    required = [f"{f.name!r}: self.{f.name}" for f in fields
                if f.default is dataclasses.MISSING]
    if cls.opens_stream:
        items.append("'reply': False")
        required.append("'reply': False")
    # Frozen dataclasses set each field through object.__setattr__; writing the slots
    # through their descriptors instead halves the cost of building a message.
    ns: dict[str, Any] = {"OP": cls.op, "new": object.__new__}
    params, reads, sets, init_sets, optional = [], [], [], [], []
    for f in fields:
        if f.default_factory is not dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{f.name}: use an immutable default, not a factory")
        ns[f"S_{f.name}"] = getattr(cls, f.name).__set__
        if f.default is dataclasses.MISSING:
            params.append(f.name)
            reads.append(f"m[{f.name!r}]")
        else:
            ns[f"D_{f.name}"] = f.default
            params.append(f"{f.name}=D_{f.name}")
            reads.append(f"m.get({f.name!r}, D_{f.name})")
            same = "is not" if f.default is None or type(f.default) is bool else "!="
            optional.append(f"    if {f.name} {same} D_{f.name}:\n"
                            f"        m[{f.name!r}] = {f.name}\n")
        sets.append(f"    S_{f.name}(o, {reads[-1]})\n")
        init_sets.append(f"    S_{f.name}(self, {f.name})\n")
    src = ("def to_msg(self):\n"
           f"    return {{'op': OP{''.join(', ' + i for i in items)}}}\n"
           "def from_msg(cls, m):\n"
           "    o = new(cls)\n"
           f"{''.join(sets)}"
           "    return o\n"
           f"def __init__(self, {', '.join(params)}):\n"
           f"{''.join(init_sets) or '    pass' + chr(10)}"
           f"def wire(cls, {', '.join(params)}):\n"
           f"    m = {{'op': OP{''.join(', ' + i.replace('self.', '') for i in required)}}}\n"
           f"{''.join(optional)}"
           "    return m\n")
    exec(src, ns)  # noqa: S102 - generated once per class from its own field names
    to_msg, from_msg, init, wire = ns["to_msg"], ns["from_msg"], ns["__init__"], ns["wire"]
    to_msg.__qualname__ = f"{cls.__name__}.to_msg"
    to_msg.__doc__ = "The wire dict ``{'op': op, **fields}``."
    from_msg.__qualname__ = f"{cls.__name__}.from_msg"
    from_msg.__doc__ = "Read the message back from its wire dict (extra keys are ignored)."
    init.__qualname__ = f"{cls.__name__}.__init__"
    init.__annotations__ = {f.name: f.type for f in fields} | {"return": "None"}
    cls.__init__ = init
    cls.to_msg = to_msg
    cls.from_msg = classmethod(from_msg)
    wire.__qualname__ = f"{cls.__name__}.wire"
    wire.__doc__ = ("``cls(...).to_msg()`` without the message object, for the hot paths; "
                    "fields at their defaults are left out (``from_msg`` reads them back).")
    cls.wire = classmethod(wire)
    if cls.op in MESSAGES:
        raise TypeError(f"op {cls.op} defined twice: {MESSAGES[cls.op].__name__}, {cls.__name__}")
    MESSAGES[cls.op] = cls
    return cls


# --- scheduler rpc (handled by yrdask.scheduler.extension) -------------------------------

CONNECT_JOB = "yr_connect_job"
REGISTER_WORKER = "yr_register_worker"
REQUEST_LEASE = "yr_request_lease"
CLUSTER_INFO = "yr_cluster_info"
OWNER_ALIVE = "yr_owner_alive"
CREATE_INSTANCE = "yr_create_instance"
LOCATE_INSTANCE = "yr_locate_instance"
INSTANCE_STATUS = "yr_instance_status"
SAVE_STATE = "yr_save_state"
LOAD_STATE = "yr_load_state"
GET_NAMED = "yr_get_named"
LIST_NAMED = "yr_list_named"
KILL_INSTANCE = "yr_kill_instance"


@_message
class JobWelcome(Message):
    """scheduler -> driver, the first message on a new job stream (the reply to
    :class:`ConnectJob`).  ``error`` is set, and the stream closed, on a protocol mismatch.
    ``session``: the cluster's session name (Ray's ``get_session_name()``)."""

    op: ClassVar[str] = "yr_job_welcome"
    channels: ClassVar[tuple[str, ...]] = ()  # read by ConnectJob's sender, no handler
    protocol_version: int | None = None
    dashboard: str | None = None
    error: str | None = None
    session: str | None = None


JOB_WELCOME = JobWelcome.op


@_message
class ConnectJob(Message):
    """driver -> scheduler, opens the *job stream*.  ``owner_address`` is the driver's owner
    server.  Reply: :class:`JobWelcome`, as the first message on the stream; the scheduler
    keeps the comm until the driver leaves."""

    op: ClassVar[str] = CONNECT_JOB
    channels: ClassVar[tuple[str, ...]] = (ON_SCHEDULER_RPC,)
    reply_type: ClassVar[Any] = JobWelcome
    opens_stream: ClassVar[bool] = True
    job_id: str
    owner_address: str
    protocol_version: int
    api: str = "yr"  # "ray" for a yrdask.ray driver: messages to it use Ray's words


@_message
class RegisterWorker(Message):
    """worker -> scheduler rpc.  ``capacity`` is {resource: amount}.  Reply: ``None``.
    Makes the worker eligible for yr work.  ``node`` the node (host) whose pool it joins
    (``""``: its address is a node of its own), ``gpus`` the device ids it can run work on
    (GPUs as ``"0"``, Ascend NPUs as ``"NPU:0"``),
    ``shared`` node-wide amounts that do not add up over the node's processes, ``labels``
    the node's labels ``{key: value}`` (Ray's node labels; docs/nodes.md)."""

    op: ClassVar[str] = REGISTER_WORKER
    channels: ClassVar[tuple[str, ...]] = (ON_SCHEDULER_RPC,)
    address: str
    capacity: dict[str, float]
    protocol_version: int
    node: str = ""
    gpus: tuple = ()
    shared: Any = None
    labels: Any = None


#: A lease that holds GPUs or NPUs names its device ids after this mark: ``"L7#GPU=0,1"``,
#: ``"L8#GPU=NPU:0"`` (the mark keeps its name; the ids say the kind).  The
#: submitter treats lease ids as opaque, so the ids reach the worker with every push of the
#: lease at no cost to other leases (:func:`lease_devices`).
DEVICES_MARK = "#GPU="

#: A lease that holds devices, or at least 2 whole CPUs, ends with its cores after this mark
#: (``"L9#CPU=4"``, ``"L7#GPU=0,1#CPU=2"``): the worker sizes the work's thread pools from it
#: (``worker/threads.py``); a lease of one CPU or less has no mark and costs nothing.
CPUS_MARK = "#CPU="


def mark_lease(lease_id: str, gpu_ids: Any, cpus: float = 1.0) -> str:
    """The id of a lease that holds the devices ``gpu_ids`` and ``cpus`` cores."""
    if gpu_ids:
        return (f"{lease_id}{DEVICES_MARK}{','.join(str(g) for g in gpu_ids)}"
                f"{CPUS_MARK}{cpus:g}")
    if cpus >= 2:
        return f"{lease_id}{CPUS_MARK}{int(cpus)}"
    return lease_id


def lease_devices(lease_id: str) -> tuple[str, float]:
    """``(device ids, cores)`` of a lease (``"0,NPU:1"``); ``("", 0)`` if it holds no GPU or NPU."""
    i = lease_id.find(DEVICES_MARK)
    if i < 0:
        return "", 0.0
    devices, _, cpus = lease_id[i + len(DEVICES_MARK):].partition(CPUS_MARK)
    return devices, float(cpus or 1)


def lease_cpus(lease_id: str) -> float:
    """The cores a lease holds as its id says (:data:`CPUS_MARK`); 0 if it has no mark (one
    CPU or less)."""
    i = lease_id.rfind(CPUS_MARK)
    return float(lease_id[i + len(CPUS_MARK):]) if i >= 0 else 0.0


@_message
class RequestLease(Message):
    """submitter -> scheduler rpc.  ``owner`` the submitter's owner address, ``shape``
    {resource: amount}, ``timeout_ms`` (-1 = wait forever), ``local`` the worker to prefer
    (where the next task's large arguments live, else the submitter's own worker under local
    first, else ``None``), ``affinity`` (:func:`yrdask.affinity.to_wire` form), ``queue``
    (which of the submitter's task queues it is for: the scheduler never revokes an owner's
    lease to serve the same queue), ``avoid`` (workers the submitter just lost its channel
    to: never granted while it waits), ``request_id`` (the submitter's own id of the
    request, named by a later :class:`WithdrawLeaseRequests`; empty: never withdrawn).
    Reply: :data:`LeaseReply`."""

    op: ClassVar[str] = REQUEST_LEASE
    channels: ClassVar[tuple[str, ...]] = (ON_SCHEDULER_RPC,)
    reply_type: ClassVar[Any] = LeaseReply
    owner: str
    shape: dict[str, float]
    timeout_ms: int
    local: str | None = None
    queue: str = ""
    avoid: Sequence[str] = ()
    affinity: Sequence[Any] | None = None
    request_id: str = ""


@_message
class ClusterInfo(Message):
    """any -> scheduler rpc.  ``instances`` false leaves the instance list empty, for callers
    that want only workers.  Reply: :class:`ClusterInfoReply`.  Used by ``yr.resources()``,
    the status command and the dashboard."""

    op: ClassVar[str] = CLUSTER_INFO
    channels: ClassVar[tuple[str, ...]] = (ON_SCHEDULER_RPC,)
    reply_type: ClassVar[Any] = ClusterInfoReply
    instances: bool = True


@_message
class OwnerAlive(Message):
    """reader -> scheduler rpc, when connecting to the owner of a borrowed object fails at
    first: is ``address`` still a worker or a job's owner server the scheduler knows?  Reply:
    ``bool``; ``False`` lets the reader fail with ``OwnerDiedError`` at once instead of
    retrying the connect for ``distributed.comm.timeouts.connect`` (docs/faults.md)."""

    op: ClassVar[str] = OWNER_ALIVE
    channels: ClassVar[tuple[str, ...]] = (ON_SCHEDULER_RPC,)
    reply_type: ClassVar[Any] = bool
    address: str


@_message
class CreateInstance(Message):
    """creator -> scheduler rpc.  ``spec``: see :class:`InstanceSpec` (no ``incarnation`` or
    ``checkpoint``).  Reply: :data:`InstanceReply` once placed (a named instance that exists
    already answers with the existing one)."""

    op: ClassVar[str] = CREATE_INSTANCE
    channels: ClassVar[tuple[str, ...]] = (ON_SCHEDULER_RPC,)
    reply_type: ClassVar[Any] = InstanceReply
    spec: InstanceSpec


@_message
class LocateInstance(Message):
    """any -> scheduler rpc.  ``lost``: the worker the caller just lost its channel to;
    ``lost_server_id``: the server id of the process it lost there (``""``: not known).
    Reply: :data:`LocateReply`; waits while the instance is being placed or restarted, and,
    with ``lost``, until Dask has confirmed that worker gone (bounded): at once if another
    process than ``lost_server_id`` is registered at ``lost`` now (the lost one was removed
    already; the instance may run again on the new one)."""

    op: ClassVar[str] = LOCATE_INSTANCE
    channels: ClassVar[tuple[str, ...]] = (ON_SCHEDULER_RPC,)
    reply_type: ClassVar[Any] = LocateReply
    instance_id: str
    lost: str | None = None
    lost_server_id: str = ""


@_message
class InstanceStatus(Message):
    """any -> scheduler rpc.  Reply: :class:`InstanceStatusReply` at once
    (``handle.state``)."""

    op: ClassVar[str] = INSTANCE_STATUS
    channels: ClassVar[tuple[str, ...]] = (ON_SCHEDULER_RPC,)
    reply_type: ClassVar[Any] = InstanceStatusReply
    instance_id: str


@_message
class SaveState(Message):
    """instance -> scheduler rpc (``yr.save_state()``).  ``state`` is the pickled instance
    object.  Reply ``None`` once kept; a restart resumes from it."""

    op: ClassVar[str] = SAVE_STATE
    channels: ClassVar[tuple[str, ...]] = (ON_SCHEDULER_RPC,)
    instance_id: str
    state: bytes


@_message
class LoadState(Message):
    """instance -> scheduler rpc (``yr.load_state()``).  Reply: the last saved state (bytes)
    or ``None``."""

    op: ClassVar[str] = LOAD_STATE
    channels: ClassVar[tuple[str, ...]] = (ON_SCHEDULER_RPC,)
    reply_type: ClassVar[Any] = Union[bytes, None]
    instance_id: str


@_message
class GetNamed(Message):
    """any -> scheduler rpc.  Reply: :data:`InstanceReply` once the named instance is alive,
    ``[None, reason, None]`` if there is none; waits up to ``timeout`` s for one still being
    created."""

    op: ClassVar[str] = GET_NAMED
    channels: ClassVar[tuple[str, ...]] = (ON_SCHEDULER_RPC,)
    reply_type: ClassVar[Any] = InstanceReply
    name: str
    namespace: str
    timeout: float


@_message
class ListNamed(Message):
    """any -> scheduler rpc.  Names in ``namespace``, or in all of them.  Reply:
    :data:`ListNamedReply`."""

    op: ClassVar[str] = LIST_NAMED
    channels: ClassVar[tuple[str, ...]] = (ON_SCHEDULER_RPC,)
    reply_type: ClassVar[Any] = ListNamedReply
    all_namespaces: bool = False
    namespace: str = ""


@_message
class KillInstance(Message):
    """any -> scheduler rpc.  Reply ``None`` once the instance (and its non-detached
    descendants) are stopped.  ``restart`` (Ray's ``ray.kill(actor, no_restart=False)``):
    its process is killed as if it crashed instead (:class:`CrashInstance`), so it restarts
    while it has restarts left; the reply comes once that kill is sent.  ``force`` (Ray's
    ``ray.kill(actor)``): it ends without its shutdown hook and, in a process of its own,
    without its atexit handlers (:class:`StopInstance`); its descendants end as usual."""

    op: ClassVar[str] = KILL_INSTANCE
    channels: ClassVar[tuple[str, ...]] = (ON_SCHEDULER_RPC,)
    instance_id: str
    reason: str = "terminated"
    restart: bool = False
    force: bool = False


STATE_RECORDS = "yr_state_records"


class StateRecordsReply(TypedDict, total=False):
    """What :class:`StateRecords` answers (``yrdask/scheduler/state_view.py``)."""

    processes: dict[str, dict[str, Any]]  # worker address -> {"node", "host", "pid"}
    jobs: dict[str, str]  # connected driver's owner address -> its job id
    rows: list[Any]  # the records of the kind asked for
    kept: int  # tasks: records the Task Stream buffer holds
    total: int  # tasks: records it ever took (older ones fell out)
    classes: list[str]  # tasks: the classes of the instances the scheduler knows
    now: list[Any]  # tasks: [name, task_id, started, job, worker] of the tasks there now
    running: dict[str, dict[str, int]]  # tasks: worker -> {name: calls running there}
    queued: dict[str, dict[str, int]]  # tasks: worker -> {name: tasks waiting for a thread}


@_message
class StateRecords(Message):
    """any -> scheduler rpc: the scheduler's records of one ``kind`` ("tasks", "instances",
    "groups", "nodes", "workers"), for Ray's state API and ``ray.timeline()``; ``limit``
    bounds the task rows (the newest; ``-1``: all kept).  Reply: :class:`StateRecordsReply`."""

    op: ClassVar[str] = STATE_RECORDS
    channels: ClassVar[tuple[str, ...]] = (ON_SCHEDULER_RPC,)
    reply_type: ClassVar[Any] = StateRecordsReply
    kind: str
    limit: int = -1


# --- resource groups (scheduler rpc, handled by yrdask.scheduler.group_adapter) -----------

CREATE_RESOURCE_GROUP = "yr_create_resource_group"
REMOVE_RESOURCE_GROUP = "yr_remove_resource_group"
WAIT_RESOURCE_GROUP = "yr_wait_resource_group"
GET_RESOURCE_GROUP = "yr_get_resource_group"

RG_CREATED = "CREATED"  # every bundle holds its reservation
RG_PENDING = "PENDING"  # some bundle waits for room
RG_REMOVED = "REMOVED"  # removed (by the user, or its job ended)
RG_UNKNOWN = "UNKNOWN"  # no group of that name

ResourceGroupReply = tuple[str, str, int]
"""``[state, reason, bundle_count]``: ``state`` one of ``RG_*``; ``reason`` says why a
``PENDING`` group waits (which bundle cannot be placed and why) or why it was removed."""

#: Kind tag of the affinity wire entry that names a resource-group bundle.  The entry rides
#: in the ``affinity`` field of lease requests and instance specs (so every path that carries
#: affinities carries it); its affinity type 0 makes :func:`yrdask.affinity.evaluate` ignore
#: it, and the scheduler's lease queue fits the request into the bundle instead.
RESOURCE_GROUP_AFFINITY = 30


def bundle_wire(group: str, bundle_index: int) -> tuple:
    """The affinity wire entry placing a request into bundle ``bundle_index`` (-1: any) of
    resource group ``group``."""
    return ((RESOURCE_GROUP_AFFINITY, 0, ((3, group, (str(bundle_index),)),)),)


def bundle_target(wire: Any) -> tuple[str, int] | None:
    """``(group, bundle_index)`` named by an affinity wire, or ``None``."""
    for entry in wire or ():
        if entry[0] == RESOURCE_GROUP_AFFINITY:
            _op, group, (index,) = entry[2][0]
            return group, int(index)
    return None


@_message
class CreateResourceGroup(Message):
    """driver -> scheduler rpc.  Reserve ``bundles`` ([{resource: amount}], already
    validated) under ``name`` with ``strategy`` (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD,
    None) for ``owner`` (its job ends → the group is removed).  ``fate_sharing`` (a
    ``yr.Group`` with ``same_lifecycle``): when one instance placed in it ends, the group is
    removed and the others are killed.  ``detached`` (Ray's ``lifetime="detached"``): the
    group outlives its owner's job, until it is removed.  Reply: ``""`` once accepted
    (placement goes on in the scheduler), or the reason it is refused (the name is taken)."""

    op: ClassVar[str] = CREATE_RESOURCE_GROUP
    channels: ClassVar[tuple[str, ...]] = (ON_SCHEDULER_RPC,)
    reply_type: ClassVar[Any] = str
    owner: str
    name: str
    bundles: Sequence[Mapping[str, float]]
    strategy: str = "PACK"
    fate_sharing: bool = False
    detached: bool = False


@_message
class RemoveResourceGroup(Message):
    """driver -> scheduler rpc.  Free the group's reservations; instances placed in it are
    killed and requests waiting for it refused.  Reply: ``True`` if it existed."""

    op: ClassVar[str] = REMOVE_RESOURCE_GROUP
    channels: ClassVar[tuple[str, ...]] = (ON_SCHEDULER_RPC,)
    reply_type: ClassVar[Any] = bool
    name: str


@_message
class WaitResourceGroup(Message):
    """driver -> scheduler rpc.  Wait up to ``timeout`` s (``< 0`` forever, ``0`` just look)
    until every bundle of ``name`` is placed.  Reply: :data:`ResourceGroupReply`."""

    op: ClassVar[str] = WAIT_RESOURCE_GROUP
    channels: ClassVar[tuple[str, ...]] = (ON_SCHEDULER_RPC,)
    reply_type: ClassVar[Any] = ResourceGroupReply
    name: str
    timeout: float = -1


@_message
class GetResourceGroup(Message):
    """driver -> scheduler rpc.  Look a group up by name (Ray's ``get_placement_group``).
    Reply: ``None`` if no live group has that name, else ``[strategy, bundles]`` (the bundles
    as :class:`CreateResourceGroup` reserved them)."""

    op: ClassVar[str] = GET_RESOURCE_GROUP
    channels: ClassVar[tuple[str, ...]] = (ON_SCHEDULER_RPC,)
    reply_type: ClassVar[Any] = Union[tuple[str, list], None]
    name: str


# --- KV store (scheduler rpc, handled by yrdask.scheduler.kv) -----------------------------
# yr.kv_write / kv_read / kv_del ...: a small key -> bytes store the scheduler keeps for the
# cluster's lifetime.  Replies are ``[status, payload]`` (:data:`KVReply`) so the API can raise
# a typed error naming the problem; the store's rules are in yrdask/scheduler/kv.py.

KV_PUT = "yr_kv_put"
KV_GET = "yr_kv_get"
KV_DEL = "yr_kv_del"

KVReply = tuple[str, Any]
"""``[status, payload]``: ``["ok", None]`` (put), ``["ok", [value, ...]]`` (get), ``["ok", n]``
(del: keys deleted); ``["exists", [key, ...]]`` (an ``nx`` put found them), ``["full", reason]``
(the put would exceed ``yrdask.kv.max-bytes``), ``["missing", [key, ...]]`` (a get timed out)."""


@_message
class KVPut(Message):
    """any -> scheduler rpc (``yr.kv_write``, ``kv_set``, ``kv_m_write_tx``).  Writes every
    ``keys[i] = values[i]`` or none: ``nx`` refuses keys that exist, ``ttl_s`` > 0 expires
    them after that many seconds, ``evictable`` lets a later write that needs room drop them
    (``WriteMode.NONE_L2_CACHE_EVICT``).  Reply: :data:`KVReply`."""

    op: ClassVar[str] = KV_PUT
    channels: ClassVar[tuple[str, ...]] = (ON_SCHEDULER_RPC,)
    reply_type: ClassVar[Any] = KVReply
    keys: Sequence[str]
    values: Sequence[bytes]
    nx: bool = False
    ttl_s: float = 0.0
    evictable: bool = False


@_message
class KVGet(Message):
    """any -> scheduler rpc (``yr.kv_read``, ``kv_get``).  Waits until every key is present,
    at most ``timeout`` s (``None`` = forever, ``0`` = answer at once).  Reply:
    :data:`KVReply` (the values in key order, or the keys still missing)."""

    op: ClassVar[str] = KV_GET
    channels: ClassVar[tuple[str, ...]] = (ON_SCHEDULER_RPC,)
    reply_type: ClassVar[Any] = KVReply
    keys: Sequence[str]
    timeout: float | None = None


@_message
class KVDel(Message):
    """any -> scheduler rpc (``yr.kv_del``).  Absent keys are ignored.  Reply:
    :data:`KVReply` with the number of keys deleted."""

    op: ClassVar[str] = KV_DEL
    channels: ClassVar[tuple[str, ...]] = (ON_SCHEDULER_RPC,)
    reply_type: ClassVar[Any] = KVReply
    keys: Sequence[str]


KV_RPC = (KV_PUT, KV_GET, KV_DEL)  # the KV store's group (all on the scheduler rpc)


# --- job stream / worker stream, -> scheduler ---------------------------------------------

RETURN_LEASES = "yr_return_leases"
WITHDRAW_LEASE_REQUESTS = "yr_withdraw_lease_requests"
LEASE_BLOCKED = "yr_lease_blocked"
LEASE_UNBLOCKED = "yr_lease_unblocked"
HANDLE_REFS = "yr_handle_refs"
INSTANCE_STATE = "yr_instance_state"
TASK_RECORDS = "yr_task_records"
CLOSE_STREAM = "close-stream"


@_message
class ReturnLeases(Message):
    """submitter -> scheduler (job stream or worker stream).  The resources of those leases
    become free."""

    op: ClassVar[str] = RETURN_LEASES
    channels: ClassVar[tuple[str, ...]] = (ON_JOB_STREAM, ON_SCHEDULER_STREAM)
    lease_ids: list[str]


@_message
class WithdrawLeaseRequests(Message):
    """submitter -> scheduler (job stream or worker stream).  ``owner``'s queue drained:
    its waiting lease requests (the submitter's own ``request_id`` of each
    :class:`RequestLease`) are withdrawn, each answered ``[None, reason]``.  One already
    granted or unknown is left alone (a grant that crossed it is returned as unwanted)."""

    op: ClassVar[str] = WITHDRAW_LEASE_REQUESTS
    channels: ClassVar[tuple[str, ...]] = (ON_JOB_STREAM, ON_SCHEDULER_STREAM)
    owner: str
    request_ids: list[str]


@_message
class LeaseBlocked(Message):
    """worker -> scheduler (or an isolated process's own job stream, for the holding of the
    work it runs).  The task running on the lease waits in ``yr.get``: its CPU is lent back
    to the cluster until :class:`LeaseUnblocked`."""

    op: ClassVar[str] = LEASE_BLOCKED
    channels: ClassVar[tuple[str, ...]] = (ON_SCHEDULER_STREAM, ON_JOB_STREAM)
    lease_id: str


@_message
class LeaseUnblocked(Message):
    """worker -> scheduler.  The task runs again and takes its CPU back (briefly over
    capacity if it was lent out meanwhile)."""

    op: ClassVar[str] = LEASE_UNBLOCKED
    channels: ClassVar[tuple[str, ...]] = (ON_SCHEDULER_STREAM, ON_JOB_STREAM)
    lease_id: str


@_message
class HandleRefs(Message):
    """holder -> scheduler (job stream or worker stream).  ``deltas`` ({instance_id: +1 | -1},
    sent when this process's handle count for an instance goes 0 -> 1 or 1 -> 0),
    ``transit`` (tokens of pickled handles being registered, ``[[instance_id, token], ...]``)
    and ``arrived`` (tokens whose handles this process has just unpickled).  An unnamed,
    non-detached instance no process holds, with no handle in transit, ends."""

    op: ClassVar[str] = HANDLE_REFS
    channels: ClassVar[tuple[str, ...]] = (ON_JOB_STREAM, ON_SCHEDULER_STREAM)
    deltas: dict[str, int]
    transit: Sequence[Sequence[str]] = ()
    arrived: Sequence[Sequence[str]] = ()


@_message
class InstanceState(Message):
    """worker -> scheduler.  ``state`` is ``"ALIVE"`` after ``__init__``, ``"FAILED"`` if
    ``__init__`` raised, ``"EXITED"`` after it stopped, ``"RESTARTING"`` when its isolated
    process died (the scheduler answers with a ``START_INSTANCE`` to the same worker while
    ``recover_retry_times`` is left, else a stop); ``error`` a pickled RemoteError or
    ``None``; ``reason`` why it exited or died (the exit code or signal); ``incarnation``:
    for a process instance, the restart its reporting process runs (``-1``: not said; an
    ALIVE from a process restarted since is stale, and ignored).  ``address``: a
    process instance's own endpoint (docs/isolation.md): with ALIVE where its callers send
    their calls from now on, with RESTARTING the one that died (the scheduler tells every
    driver and worker how it ended, :class:`WorkerExit`); ``""`` for a light instance."""

    op: ClassVar[str] = INSTANCE_STATE
    channels: ClassVar[tuple[str, ...]] = (ON_SCHEDULER_STREAM,)
    instance_id: str
    state: str
    error: bytes | None = None
    reason: str = ""
    incarnation: int = -1
    address: str = ""


@_message
class TaskRecords(Message):
    """worker -> scheduler, a few times a second while yr work runs there: what Dask's
    Task Stream, Progress and Profile show of it (docs/monitoring.md, "yr work in Dask's
    panels").  ``records``: one ``[name, id, start, stop, thread, ok]`` per task or method
    call that ended (wall-clock seconds, the thread ident that ran it); ``running`` and
    ``queued``: ``{name: count}`` now (replaces the worker's previous counts); ``tasks``: the
    tasks there now, ``[name, task_id, started, owner]`` (every running one, the first
    queued ones), for Ray's ``list_tasks``."""

    op: ClassVar[str] = TASK_RECORDS
    channels: ClassVar[tuple[str, ...]] = (ON_SCHEDULER_STREAM,)
    records: Sequence[Sequence[Any]]
    running: Mapping[str, int]
    queued: Mapping[str, int]
    tasks: Sequence[Sequence[Any]] = ()


@_message
class CloseStream(Message):
    """driver -> scheduler, the last message on the job stream (Dask's own end-of-stream
    op): the reader stops there.  In no handler table."""

    op: ClassVar[str] = CLOSE_STREAM
    channels: ClassVar[tuple[str, ...]] = ()
    handler: ClassVar[str] = "close_stream"


# --- scheduler -> submitter (job stream, or worker stream for worker submitters) ----------

REVOKE_LEASES = "yr_revoke_leases"
WORKER_LOST = "yr_worker_lost"
WAIT_WARNING = "yr_wait_warning"
WORKER_EXITED = "yr_worker_exited"
WORKER_EXIT = "yr_worker_exit"
WORKER_JOINED = "yr_worker_joined"


@_message
class RevokeLeases(Message):
    """scheduler -> submitter.  Others wait for these resources: return the leases that are
    idle now, and the others as soon as their task ends; with ``keep`` (the waiter's queue
    runs already) a busy lease may first run its queue's backlog for a while
    (``runtime/submit_queue.py`` rule 4)."""

    op: ClassVar[str] = REVOKE_LEASES
    channels: ClassVar[tuple[str, ...]] = (ON_DRIVER_STREAM, ON_WORKER_STREAM)
    lease_ids: list[str]
    keep: bool = False


@_message
class WorkerLost(Message):
    """scheduler -> every driver (job stream) and worker (worker stream).  Dask removed
    ``worker`` (its stream closed, or it missed heartbeats for
    ``distributed.scheduler.worker-ttl``): channels to it are dead even if their socket is
    not, so their unanswered calls are sent again or fail, and their tasks run elsewhere.
    ``server_id``: which process it was (its Dask ``server_id``): a process already dealing
    with a newer one at that address keeps it (``runtime/worker_processes.py``)."""

    op: ClassVar[str] = WORKER_LOST
    channels: ClassVar[tuple[str, ...]] = (ON_DRIVER_STREAM, ON_WORKER_STREAM)
    worker: str
    server_id: str = ""


@_message
class WorkerExited(Message):
    """nanny -> scheduler (rpc).  The worker process of the nanny at ``nanny`` exited with
    ``exitcode`` (negative: killed by that signal).  The scheduler knows which worker that
    nanny ran last (the nanny may not: a worker that dies before it reported its address
    leaves the nanny with the previous one).  ``pid``: the exited process's (0: unknown), which
    ties a report that arrives after the next process registered to the one that exited.
    Reply: ``None``."""

    op: ClassVar[str] = WORKER_EXITED
    channels: ClassVar[tuple[str, ...]] = (ON_SCHEDULER_RPC,)
    reply_type: ClassVar[Any] = type(None)
    nanny: str
    exitcode: int
    pid: int = 0


@_message
class WorkerExit(Message):
    """scheduler -> every driver (job stream) and worker (worker stream): how the process of
    ``worker`` ended (``how``: "exited with code 3", "was killed by signal 9 (SIGKILL)"), so
    errors about work lost with it can say so.  ``server_id``: which process at that
    address ended (``""``: unknown); a report about one that a new process replaced already
    is not kept for the new one."""

    op: ClassVar[str] = WORKER_EXIT
    channels: ClassVar[tuple[str, ...]] = (ON_DRIVER_STREAM, ON_WORKER_STREAM)
    worker: str
    how: str
    server_id: str = ""


@_message
class WorkerJoined(Message):
    """scheduler -> every driver and worker that was told :class:`WorkerLost` of
    ``worker``: a new process registered at that same address (a nanny restarted its worker
    at a fixed ``--worker-port``, or the kernel handed the dead one's port out again).  What
    a process remembers of the dead one's death (unreachable owner, workers to avoid) must
    not keep it from the new one; sent after the ``WorkerLost`` on the same stream.
    ``server_id``: the new process's Dask ``server_id``."""

    op: ClassVar[str] = WORKER_JOINED
    channels: ClassVar[tuple[str, ...]] = (ON_DRIVER_STREAM, ON_WORKER_STREAM)
    worker: str
    server_id: str = ""


@_message
class WaitWarning(Message):
    """scheduler -> the driver of a job one of whose requests has waited longer than
    ``yrdask.scheduling.wait-warning``: ``text`` says what it needs, what each worker lacks,
    who holds it and how to fix it.  The driver logs it (once per request)."""

    op: ClassVar[str] = WAIT_WARNING
    channels: ClassVar[tuple[str, ...]] = (ON_DRIVER_STREAM,)
    text: str


# --- worker rpc and stream (handled by yrdask.worker.agent) -------------------------------

OPEN_CHANNEL = "yr_open_channel"
FETCH_OBJECT = "yr_fetch_object"
FREE_OBJECTS = "yr_free_objects"
TASK_OUTPUT = "yr_task_output"
START_INSTANCE = "yr_start_instance"
STOP_INSTANCE = "yr_stop_instance"
CRASH_INSTANCE = "yr_crash_instance"
WARM_ZYGOTE = "yr_warm_zygote"


@_message
class OpenChannel(Message):
    """caller -> worker (or a process instance's own process), opens a *call channel* on
    that comm.  ``caller`` is the caller's owner address (the worker agent opening one to its
    isolated process: its supervision channel, which the process outlives by nothing).  No
    reply: from then on both sides send batched messages.  ``expect``:
    the worker process (its Dask ``server_id``) the caller means; another process at
    that address closes the comm at once (the caller then treats the channel as lost), so a
    channel is always to the process the caller thinks (``""``: any)."""

    op: ClassVar[str] = OPEN_CHANNEL
    channels: ClassVar[tuple[str, ...]] = (ON_WORKER_RPC, ON_ISOLATED_RPC)
    opens_stream: ClassVar[bool] = True
    caller: str
    expect: str = ""


@_message
class FetchObject(Message):
    """any -> owner (or the worker holding a large value) rpc.  ``timeout`` in seconds,
    ``None`` = forever.  Reply: :data:`FetchReply`."""

    op: ClassVar[str] = FETCH_OBJECT
    channels: ClassVar[tuple[str, ...]] = (ON_WORKER_RPC, ON_OWNER_RPC)
    reply_type: ClassVar[Any] = FetchReply
    object_id: str
    timeout: float | None = None


@_message
class TaskOutput(Message):
    """worker -> driver owner server (rpc, fire and forget), when the driver's job has
    ``Config(log_to_driver=True)``.  ``records``: ``[[source, stream, text], ...]``, what yr
    tasks and methods wrote to ``stdout``/``stderr``, batched per flush; ``source`` names
    where it ran (``"square pid=12, node=tcp://..."``).  Reply ``None``."""

    op: ClassVar[str] = TASK_OUTPUT
    channels: ClassVar[tuple[str, ...]] = (ON_OWNER_RPC,)
    records: Sequence[Sequence[str]]


@_message
class FreeObjects(Message):
    """owner -> worker holding large values (rpc, fire and forget).  Reply ``None``."""

    op: ClassVar[str] = FREE_OBJECTS
    channels: ClassVar[tuple[str, ...]] = (ON_WORKER_RPC,)
    object_ids: list[str]


WAIT_REFS_REMOVED = "yr_wait_refs_removed"
REFS_REMOVED = "yr_refs_removed"
ADD_BORROWER = "yr_add_borrower"


@_message
class WaitRefsRemoved(Message):
    """owner -> borrower (rpc, fire and forget; batched per borrower and loop pass): tell me
    when you hold these objects no longer.  ``items``: ``[[object_id, seq, via], ...]``;
    ``via`` an object of the borrower's whose value holds the ref (a result sent to it), or
    ``None``.  ``sender`` the owner's address.  Answered by :class:`RefsRemoved` with the same
    ``seq`` (Ray's ``WaitForRefRemoved``; docs/objects.md).  Reply ``None``."""

    op: ClassVar[str] = WAIT_REFS_REMOVED
    channels: ClassVar[tuple[str, ...]] = (ON_WORKER_RPC, ON_OWNER_RPC)
    sender: str
    items: list


@_message
class RefsRemoved(Message):
    """borrower -> owner (rpc, fire and forget; batched): the answer to
    :class:`WaitRefsRemoved`, once per poll.  ``items``: ``[[object_id, seq], ...]``.
    Reply ``None``."""

    op: ClassVar[str] = REFS_REMOVED
    channels: ClassVar[tuple[str, ...]] = (ON_WORKER_RPC, ON_OWNER_RPC)
    sender: str
    items: list


@_message
class AddBorrower(Message):
    """borrower or reader -> owner rpc (batched per owner): ``items``
    ``[[object_id, borrower, via], ...]``: ``borrower`` holds the object (through its object
    ``via``, or ``None``).  Sent by a borrower that lent a ref on (it keeps holding the ref
    until the reply), and by a reader that unpickled refs out of a borrowed value (before it
    hands the value on).  ``borrower`` ``""`` pins the object (a ref pickled where nothing
    counts it).  Reply: the ids the owner no longer knows (freed, or not its own)."""

    op: ClassVar[str] = ADD_BORROWER
    channels: ClassVar[tuple[str, ...]] = (ON_WORKER_RPC, ON_OWNER_RPC)
    reply_type: ClassVar[Any] = list
    items: list


CANCEL_OWNED = "yr_cancel_owned"


@_message
class CancelOwned(Message):
    """borrower -> owner rpc: cancel the tasks whose results ``object_ids`` are (the owner
    submitted them; ``force`` as in :class:`CancelTask`).  A cancel of a borrowed ref goes
    to its owner, as Ray's does.  Reply ``None``."""

    op: ClassVar[str] = CANCEL_OWNED
    channels: ClassVar[tuple[str, ...]] = (ON_WORKER_RPC, ON_OWNER_RPC)
    object_ids: list
    force: bool = False
    recursive: bool = False


@_message
class StartInstance(Message):
    """scheduler -> worker (worker stream).  ``spec`` is the creation spec (see
    :class:`CreateInstance`; on a restart also ``incarnation`` (the restart count) and
    ``checkpoint`` (the last saved state, or ``None``)).  The worker builds the instance from
    the checkpoint if there is one, else with ``__init__``; calls may arrive before it is
    ready and wait behind it."""

    op: ClassVar[str] = START_INSTANCE
    channels: ClassVar[tuple[str, ...]] = (ON_WORKER_STREAM,)
    spec: InstanceSpec


@_message
class CrashInstance(Message):
    """scheduler -> worker (worker stream, so it comes before the ``START_INSTANCE`` of the
    restart it causes).  Kill the process of the instance's ``incarnation`` as if it crashed
    (an isolated one's child is SIGKILLed; a light one's object is dropped, its calls
    answered with ``reason``) and report the death as ``RESTARTING``, as any crash."""

    op: ClassVar[str] = CRASH_INSTANCE
    channels: ClassVar[tuple[str, ...]] = (ON_WORKER_STREAM,)
    instance_id: str
    reason: str
    incarnation: int


@_message
class WarmZygote(Message):
    """scheduler -> worker (worker stream), once per worker process, from the first placement
    of a process instance in the cluster on (and to each worker that registers after): start
    this worker's zygote now, in the background, so that its first process instance is handed
    a spare instead of waiting for the zygote's start (``yrdask.instances.warm-zygotes``,
    docs/isolation.md "Process start").  Idempotent; a failed start leaves the start on first
    use as it is."""

    op: ClassVar[str] = WARM_ZYGOTE
    channels: ClassVar[tuple[str, ...]] = (ON_WORKER_STREAM,)


@_message
class StopInstance(Message):
    """scheduler -> worker rpc.  Pending calls fail with ``reason``; the reply (``None``)
    comes once the instance is gone.  ``force``: no ``__yr_shutdown__`` (nor, in a process
    of its own, atexit handlers): its process is killed at once (Ray's ``ray.kill``)."""

    op: ClassVar[str] = STOP_INSTANCE
    channels: ClassVar[tuple[str, ...]] = (ON_WORKER_RPC,)
    instance_id: str
    reason: str
    force: bool = False


ASSIGN_ISOLATED = "yr_assign_isolated"


@_message
class AssignIsolated(Message):
    """worker agent -> a spare of its zygote (rpc, the first message on the comm the agent
    opened to it when it began to listen): become the process of ``request`` (``env`` and
    ``unset``: its environment as it differs from the one the zygote started with; ``cwd``;
    the worker's ``info``: ``zygote.child_info``), applied before any user code runs, then
    do ``then`` (the wire dict of its first work, :class:`StartIsolated` or
    :class:`RunIsolated`; one message and one dispatch for both).  Replies: the process's
    pid once the request is applied (the agent then knows that this process took it), then
    ``then``'s reply; without ``then``, the pid only."""

    op: ClassVar[str] = ASSIGN_ISOLATED
    channels: ClassVar[tuple[str, ...]] = (ON_ISOLATED_RPC,)
    reply_type: ClassVar[Any] = int
    request: dict
    then: dict | None = None


START_ISOLATED = "yr_start_isolated"


@_message
class StartIsolated(Message):
    """worker agent -> its isolated process (``yrdask.worker.isolated``) rpc: build the
    instance of ``spec`` (its ``deps`` already resolved to values).  Reply: the pickled
    RemoteError of a failed ``__init__``, or ``None``, once ``__init__`` has run.  The
    callers then open their call channels (:class:`OpenChannel`) to the process itself."""

    op: ClassVar[str] = START_ISOLATED
    channels: ClassVar[tuple[str, ...]] = (ON_ISOLATED_RPC,)
    reply_type: ClassVar[Any] = bytes | None
    spec: InstanceSpec


STOP_ISOLATED = "yr_stop_isolated"


@_message
class StopIsolated(Message):
    """worker agent -> its isolated instance's process, in an :class:`AgentRequest` (rpc
    only while the instance's ``__init__`` runs: no supervision channel yet): the instance
    ends with ``reason``; its ``__yr_shutdown__(grace)`` runs (bounded by ``grace_s``), then
    its atexit handlers, before the reply (``None``).  The agent then kills the process."""

    op: ClassVar[str] = STOP_ISOLATED
    channels: ClassVar[tuple[str, ...]] = (ON_ISOLATED_RPC, ON_SUPERVISION)
    reason: str


DRAIN_INSTANCE = "yr_drain_instance"


@_message
class DrainInstance(Message):
    """scheduler -> worker rpc (scale-down, ``scheduler/drain.py``): hold the instance's new
    calls (kept unrun), let the running ones finish, then pickle its current state.  Reply:
    the checkpoint (``bytes``), or ``None`` if it cannot be taken within ``timeout_s`` (the
    instance is not hosted here, its ``__init__`` failed, a call still runs, or its state
    does not pickle); the calls are held until :class:`InstanceMoved` either way.  The
    worker passes it on to a process instance's process in an :class:`AgentRequest`."""

    op: ClassVar[str] = DRAIN_INSTANCE
    channels: ClassVar[tuple[str, ...]] = (ON_WORKER_RPC, ON_SUPERVISION)
    reply_type: ClassVar[Any] = bytes | None
    instance_id: str
    timeout_s: float = 30.0


INSTANCE_MOVED = "yr_instance_moved"


@_message
class InstanceMoved(Message):
    """scheduler -> worker rpc, after :class:`DrainInstance`.  ``to`` a worker: the instance
    now runs there; it ends here, and its held calls and any that still come are answered
    with ``InstanceMovedError`` (unrun: the caller sends them again to ``to``).  ``to``
    empty: the move was given up; the held calls go to the instance here, in order.  Reply:
    ``None``.  The worker passes it on to a process instance's process in an
    :class:`AgentRequest`."""

    op: ClassVar[str] = INSTANCE_MOVED
    channels: ClassVar[tuple[str, ...]] = (ON_WORKER_RPC, ON_SUPERVISION)
    instance_id: str
    to: str = ""


END_PROCESSES = "yr_end_processes"


@_message
class EndProcesses(Message):
    """scheduler -> worker rpc (scale-down, ``scheduler/drain.py``), just before the worker
    retires: end the own processes of these instances now (they restart elsewhere once it
    is gone), unreported, so that none answers a call after Dask removed the worker.  Their
    callers lose their channels and locate them again.  Reply: the ids whose processes
    ended (light instances, and those not hosted here, are left out)."""

    op: ClassVar[str] = END_PROCESSES
    channels: ClassVar[tuple[str, ...]] = (ON_WORKER_RPC,)
    reply_type: ClassVar[Any] = list
    instance_ids: list


CHECKPOINT_ISOLATED = "yr_checkpoint_isolated"


@_message
class CheckpointIsolated(Message):
    """worker agent -> its isolated instance's process (rpc, :class:`DrainInstance`): the
    pickled instance object as it is now (no call runs).  Reply: ``bytes``."""

    op: ClassVar[str] = CHECKPOINT_ISOLATED
    channels: ClassVar[tuple[str, ...]] = (ON_ISOLATED_RPC,)
    reply_type: ClassVar[Any] = bytes


RESULTS_KEPT = "yr_results_kept"


@_message
class ResultsKept(Message):
    """isolated process -> its worker agent, on the agent's supervision channel: the
    process wrote these large results (or generator items) to the node's store and
    answered their callers with the worker's address; the worker keeps them for their
    owners from now on (as its own, ``FreeObjects``, scale-down), so they outlive the
    process."""

    op: ClassVar[str] = RESULTS_KEPT
    channels: ClassVar[tuple[str, ...]] = (ON_ISOLATED_TO_AGENT,)
    object_ids: list


AGENT_REQUEST = "yr_agent_request"


@_message
class AgentRequest(Message):
    """worker agent -> its isolated instance's process, on the supervision channel: one
    request, ``request`` the wire dict of a :class:`StopIsolated`, :class:`DrainInstance` or
    :class:`InstanceMoved` (dispatched from :data:`SUPERVISION`), answered on the same
    channel by the :class:`AgentReply` of ``request_id`` (the agent's own count), so the
    agent opens no connection per request.  If the channel closes first, the request fails
    (the process ends with it)."""

    op: ClassVar[str] = AGENT_REQUEST
    channels: ClassVar[tuple[str, ...]] = (ON_SUPERVISION,)
    request_id: int
    request: dict


AGENT_REPLY = "yr_agent_reply"


@_message
class AgentReply(Message):
    """isolated process -> its worker agent, on the supervision channel: the answer to
    :class:`AgentRequest` ``request_id``: ``result`` (of the request's ``reply_type``), or
    ``error``, the pickled RemoteError of a request that raised."""

    op: ClassVar[str] = AGENT_REPLY
    channels: ClassVar[tuple[str, ...]] = (ON_ISOLATED_TO_AGENT,)
    request_id: int
    result: Any = None
    error: bytes | None = None


CALL_RECORDS = "yr_call_records"


@_message
class CallRecords(Message):
    """isolated process -> its worker agent, on the supervision channel: its instance's
    calls that ended since the last batch, ``(name, call_id, start, stop, thread, ok)`` as
    a worker records its own, how many run now by name, and how many it has answered and not.  The agent adds them to its
    batch for Dask's Task Stream and Progress (``worker/dask_panels.py``), so a process
    instance's calls show there, in ``ray.util.state.list_tasks`` and ``ray.timeline()``
    as a light instance's do."""

    op: ClassVar[str] = CALL_RECORDS
    channels: ClassVar[tuple[str, ...]] = (ON_ISOLATED_TO_AGENT,)
    records: list
    running: dict
    pending: int = 0  # its calls not answered yet
    done: int = 0  # its calls answered so far (its instance's, in this process)


KEPT_OBJECTS = "yr_kept_objects"


@_message
class KeptObjects(Message):
    """scheduler -> worker rpc (scale-down): the ids of the large values this worker keeps
    for their owners (results written to its node's store).  Reply: ``list[str]``."""

    op: ClassVar[str] = KEPT_OBJECTS
    channels: ClassVar[tuple[str, ...]] = (ON_WORKER_RPC,)
    reply_type: ClassVar[Any] = list


ADOPT_OBJECTS = "yr_adopt_objects"


@_message
class AdoptObjects(Message):
    """scheduler -> worker rpc (scale-down): keep ``object_ids`` from now on in place of
    ``source``, which retires.  A value already in this worker's node store (same node) is
    only recorded; others are pulled from ``source`` once (``FETCH_OBJECT``).  Reply: the
    ids kept here now (one that ``source`` no longer has is left out)."""

    op: ClassVar[str] = ADOPT_OBJECTS
    channels: ClassVar[tuple[str, ...]] = (ON_WORKER_RPC,)
    reply_type: ClassVar[Any] = list
    source: str
    object_ids: list


OBJECTS_MOVED = "yr_objects_moved"


@_message
class ObjectsMoved(Message):
    """scheduler -> every driver (job stream) and worker (worker stream), before ``worker``
    retires: the large values ``object_ids`` that ``worker`` kept are kept by ``to`` now;
    owners and borrowers that recorded ``worker`` for one of them record ``to``.  Sent
    before the retired worker's :class:`WorkerLost` on the same streams."""

    op: ClassVar[str] = OBJECTS_MOVED
    channels: ClassVar[tuple[str, ...]] = (ON_DRIVER_STREAM, ON_WORKER_STREAM)
    worker: str
    to: str
    object_ids: list


RUN_ISOLATED = "yr_run_isolated"


@_message
class RunIsolated(Message):
    """worker agent -> a pooled isolated process (rpc): run one stateless task there.
    Fields as in :class:`RunTask` (``fn`` always sent, ``deps`` resolved to values);
    ``caller`` the submitter's address (refs nested in the results are lent to it).
    Reply: ``[done, owner]``: a :class:`TaskDone` wire dict, and whether the process has a
    runtime of its own (a nested call started it: it may own objects others hold, so the
    agent keeps the process, docs/isolation.md)."""

    op: ClassVar[str] = RUN_ISOLATED
    channels: ClassVar[tuple[str, ...]] = (ON_ISOLATED_RPC,)
    reply_type: ClassVar[Any] = tuple[dict, bool]
    task_id: str
    lease_id: str
    fn_id: str
    fn: bytes
    args: bytes
    deps: list
    nret: int
    owner: str
    log_to: str | None = None  # where its prints go (RunTask.log_to)
    name: str = ""  # the function's name, for the prints' prefix
    caller: str = ""  # the submitter's address (TaskDone.refs)


# --- call channel -------------------------------------------------------------------------

RUN_TASK = "yr_run_task"
CANCEL_TASK = "yr_cancel_task"
#: The exit code of a worker process ended by a forced cancel (``CancelTask(force=True)``).
FORCED_CANCEL_EXIT = 77
TASK_DONE = "yr_task_done"
CALL_METHOD = "yr_call_method"


@_message
class RunTask(Message):
    """caller -> worker.  ``fn`` the pickled function, sent once per channel, else ``None``;
    ``args`` pickled args/kwargs with top-level refs replaced by placeholders; ``deps`` a list
    of ``[ref_id, kind, payload]`` as in :data:`FetchReply`; ``owner`` the lifetime owner (a
    job id or an instance id); ``name`` the function name, for errors and the dashboard;
    ``slots`` how many tasks of the lease may run at once (more may be pushed, and wait in
    the worker's lease gate); ``events`` False: the task leaves no record (Dask's panels,
    Ray's ``list_tasks`` and ``timeline``: Ray's ``enable_task_events=False``).  Answered by
    :class:`TaskDone`."""

    op: ClassVar[str] = RUN_TASK
    channels: ClassVar[tuple[str, ...]] = (ON_CHANNEL_TO_WORKER,)
    task_id: str
    lease_id: str
    fn_id: str
    fn: bytes | None
    args: bytes
    deps: list
    nret: int
    owner: str
    name: str
    slots: int = 1
    log_to: str | None = None  # the driver that gets the task's prints (log_to_driver)
    events: bool = True


@_message
class CancelTask(Message):
    """caller -> worker.  Interrupts the task if it is still running; ``force``: ends the
    worker process running it instead (Ray's ``cancel(force=True)``: code blocked in C).
    For a method call (Ray's cancel of an actor task): one not started is answered unrun, a
    running ``async def`` one is cancelled, a running sync one sees ``is_canceled()``.
    ``recursive``: the tasks a running task submitted are cancelled too (by this worker, their
    owner, with the same flags: Ray's ``cancel(recursive=True)``)."""

    op: ClassVar[str] = CANCEL_TASK
    channels: ClassVar[tuple[str, ...]] = (ON_CHANNEL_TO_WORKER,)
    task_id: str
    force: bool = False
    recursive: bool = False


@_message
class TaskDone(Message):
    """worker -> caller.  ``results`` (a list of ``[kind, payload]``, one per return value,
    kinds as in :data:`FetchReply`) or ``error`` (pickled RemoteError), ``retryable``
    (``True`` when the error is a user exception that ``retry_times`` may rerun), ``took``
    (seconds the task ran, for the submitter's pipelining rule); or ``requeue`` (``True``: a
    pipelined task that waited too long in the worker's lease gate is handed back unrun, for
    the submitter to queue again).  ``refs`` (borrowing, docs/objects.md; ``None`` when the
    call met no counted refs, the hot path): ``[holder, borrowed, nested]``, ``borrowed`` the
    ids of the refs the worker ``holder`` unpickled from the arguments and may still hold,
    ``nested`` ``[[result_id, [[object_id, owner], ...]], ...]`` the refs nested in each result
    (the caller keeps them alive while that result lives)."""

    op: ClassVar[str] = TASK_DONE
    channels: ClassVar[tuple[str, ...]] = (ON_CHANNEL_TO_CALLER,)
    task_id: str
    results: list | None = None
    error: bytes | None = None
    retryable: bool = False
    took: float | None = None
    requeue: bool = False
    refs: list | None = None  # [holder, borrowed, nested] (see the class docstring)


PLAIN_TASK_DONE = frozenset(("op", "task_id", "results", "took"))
"""The keys of a *plain* :class:`TaskDone` on the wire: results (and how long it ran) and
nothing else, no error, requeue or refs report, as ``TaskDone.wire(task_id, results=...,
took=...)`` writes it (``wire`` leaves fields at their defaults out; ``to_msg`` writes them
all, so its dicts are never plain).  A caller settles an answer with
``PLAIN_TASK_DONE.issuperset(msg)`` straight from its dict, the hot path; any other
``TASK_DONE`` is read with ``TaskDone.from_msg``."""


@_message
class CallMethod(Message):
    """caller -> worker, or a process instance's own process (docs/isolation.md).
    ``task_id`` is the call id.  Answered by :class:`TaskDone`; calls from one channel to one
    instance run in the order sent (concurrency 1).  Refs nested in the results are lent to
    the channel's caller (:class:`OpenChannel`).  ``events`` False: the call leaves no record
    (as :class:`RunTask`)."""

    op: ClassVar[str] = CALL_METHOD
    channels: ClassVar[tuple[str, ...]] = (ON_CHANNEL_TO_WORKER,)
    task_id: str
    instance_id: str
    method: str
    args: bytes
    deps: list
    nret: int
    events: bool = True
    #: tries its caller has charged it before this delivery (runs cut short by its host's
    #: death, reruns after an exception, :class:`CallRetried`): Ray's ``max_task_retries``
    #: is one budget for both, so a rerun after an exception counts the crashes too
    tries: int = 0


STREAMING = -1
"""The ``nret`` of a :class:`RunTask` / :class:`CallMethod` whose function is a generator:
its values come back one by one as :class:`GeneratorItem`, then its :class:`TaskDone`."""

GENERATOR_ITEM = "yr_generator_item"


@_message
class GeneratorItem(Message):
    """worker -> caller.  One value a generator task or method (``nret`` :data:`STREAMING`)
    yielded: ``index`` 0, 1, ... and ``result`` ``[kind, payload]`` stored like a
    :class:`TaskDone` result (object id ``<task_id>.<index>``).  A call's items come in order,
    before its ``TaskDone``, which ends the stream: ``results`` ``[[value, item count]]``, or
    ``error`` (the item after the last one fails with it).  ``refs`` ``[[id, owner], ...]``:
    refs nested in the item that its producer lent to the caller via the item (the caller
    holds them while it holds the item, as a :class:`TaskDone` result's nested refs);
    ``None``: none (or pinned by the producer)."""

    op: ClassVar[str] = GENERATOR_ITEM
    channels: ClassVar[tuple[str, ...]] = (ON_CHANNEL_TO_CALLER,)
    task_id: str
    index: int
    result: list
    refs: list | None = None


CALL_RETRIED = "yr_call_retried"


@_message
class CallRetried(Message):
    """worker (or a process instance's process) -> caller.  Method call ``task_id`` failed
    with an exception its method reruns after (Ray's ``retry_exceptions``), and runs again
    now: its caller charges it one try of its bound, the bound its crashes count against
    too (Ray's one ``max_task_retries``).  Sent before the rerun starts, so a rerun that
    ends the process is charged with it."""

    op: ClassVar[str] = CALL_RETRIED
    channels: ClassVar[tuple[str, ...]] = (ON_CHANNEL_TO_CALLER,)
    task_id: str


# --- channel groupings, derived from the table --------------------------------------------

def ops_on(channel: str) -> tuple[str, ...]:
    """The ops that travel on ``channel`` (an ``ON_*`` tag), in table order."""
    return tuple(op for op, cls in MESSAGES.items() if channel in cls.channels)


SCHEDULER_RPC = ops_on(ON_SCHEDULER_RPC)  # Scheduler.handlers
SCHEDULER_STREAM = ops_on(ON_SCHEDULER_STREAM)  # Scheduler.stream_handlers
JOB_STREAM = ops_on(ON_JOB_STREAM)  # the extension's job stream reader (+ CloseStream)
DRIVER_STREAM = ops_on(ON_DRIVER_STREAM)  # the driver's job stream reader
WORKER_RPC = ops_on(ON_WORKER_RPC)  # Worker.handlers
WORKER_STREAM = ops_on(ON_WORKER_STREAM)  # Worker.stream_handlers
OWNER_RPC = ops_on(ON_OWNER_RPC)  # the driver's owner server
CHANNEL_TO_WORKER = ops_on(ON_CHANNEL_TO_WORKER)  # the agent's call channel reader
CHANNEL_TO_CALLER = ops_on(ON_CHANNEL_TO_CALLER)  # the caller's call channel reader
ISOLATED_RPC = ops_on(ON_ISOLATED_RPC)  # an isolated process's endpoint
ISOLATED_TO_AGENT = ops_on(ON_ISOLATED_TO_AGENT)  # the agent's supervision channel reader
SUPERVISION = ops_on(ON_SUPERVISION)  # the process's supervision channel reader (AgentRequest)


# --- building handler tables, dispatching and sending -------------------------------------

def handlers(ops: Iterable[str], *targets: Any) -> dict[str, Callable[..., Any]]:
    """A Dask-style handler table for ``ops``: each op maps to the method named by its
    message class's ``handler``, taken from the first of ``targets`` that has it.

    >>> scheduler.handlers.update(handlers(SCHEDULER_RPC, extension, extension.instances))
    """
    table: dict[str, Callable[..., Any]] = {}
    for op in ops:
        name = MESSAGES[op].handler
        for target in targets:
            fn = getattr(target, name, None)
            if fn is not None:
                table[op] = fn
                break
        else:
            raise LookupError(f"no {name}() to handle {op} on any of {targets!r}")
    return table


def dispatch(table: Mapping[str, Callable[..., Any]], msg: Mapping[str, Any], *args: Any) -> Any:
    """Call the handler of ``msg``'s op in ``table`` as ``handler(*args, **fields)``.

    ``msg`` is not changed (a local channel hands the sender's own dict over).  Raises
    :class:`UnknownMessage` if the table has no handler for the op.
    """
    fields = dict(msg)
    op = fields.pop("op", None)
    try:
        handler = table[op]
    except KeyError:
        raise UnknownMessage(op) from None
    return handler(*args, **fields)


def decode(msg: Mapping[str, Any]) -> Message:
    """The typed message for a wire dict (raises :class:`UnknownMessage` for a foreign op)."""
    try:
        cls = MESSAGES[msg["op"]]
    except KeyError:
        raise UnknownMessage(msg.get("op")) from None
    return cls.from_msg(msg)


async def request(remote: Any, msg: Message) -> Any:
    """Send a request on a Dask rpc (``rpc(addr)``, ``pool(addr)``, ``worker.scheduler``)
    and return its reply (of ``type(msg).reply_type``)."""
    fields = msg.to_msg()
    del fields["op"]
    return await getattr(remote, msg.op)(**fields)
