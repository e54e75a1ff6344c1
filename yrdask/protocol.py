"""The wire vocabulary between the yr API, the scheduler extension and the worker agents.

Every message that crosses a process boundary is listed here, once, with who sends it, who
handles it and what comes back.  The extension and the worker agent build their Dask handler
tables from these lists, and a test checks that the live handler tables match them.

Messages are plain msgpack-able dicts ``{"op": OP, **fields}`` (Dask's comm format).  User
objects (functions, arguments, results, exceptions) travel as pickled ``bytes`` fields; the
envelope itself is msgpack only.

Channels
--------
``scheduler rpc``     request/response on Dask's pooled connections to the scheduler.
``job stream``        one long-lived comm from a driver to the scheduler, opened by
                      :data:`CONNECT_JOB`; both sides send batched one-way messages on it, and
                      its closing ends the driver's job.
``worker stream``     the worker's own Dask batched stream to the scheduler (the scheduler
                      handler gets ``worker=<address>`` injected).
``call channel``      one long-lived comm from a caller process (driver or worker) to a worker,
                      opened by :data:`OPEN_CHANNEL`; the hot path: task pushes go one way,
                      results come back on the same comm, no scheduler involved.
``owner rpc``         request/response to the process that owns an object (a worker, or the
                      driver's small owner server).
"""

from __future__ import annotations

PROTOCOL_VERSION = 1

# --- scheduler rpc (handled by yrdask.scheduler.extension) -------------------------------

CONNECT_JOB = "yr_connect_job"
"""driver -> scheduler, opens the *job stream*.  Fields: ``job_id``, ``owner_address`` (the
driver's owner server), ``protocol_version``.  The scheduler answers on the stream with
:data:`JOB_WELCOME` and keeps the comm until the driver leaves."""

REGISTER_WORKER = "yr_register_worker"
"""worker -> scheduler rpc.  Fields: ``address``, ``capacity`` ({resource: amount}),
``protocol_version``.  Reply: ``None``.  Makes the worker eligible for yr work."""

REQUEST_LEASE = "yr_request_lease"
"""submitter -> scheduler rpc.  Fields: ``owner`` (the submitter's owner address), ``shape``
({resource: amount}), ``timeout_ms`` (-1 = wait forever), ``local`` (the worker to prefer:
where the next task's large arguments live, else the submitter's own worker under local
first, else ``None``), ``affinity`` (:func:`yrdask.affinity.to_wire` form), ``queue``
(which of the submitter's task queues it is for: the scheduler never revokes an owner's
lease to serve the same queue), ``avoid`` (workers the submitter just lost its channel to:
never granted while it waits).  Reply: ``[lease_id, worker_address]``, or ``[None,
reason]`` when no worker could meet the request in time (the API raises
:class:`yrdask.errors.ScheduleError`)."""

CLUSTER_INFO = "yr_cluster_info"
"""any -> scheduler rpc.  Fields: ``instances`` (optional, default true; false leaves the
instance list empty, for callers that want only workers).  Reply: ``{"workers": {address: {"capacity": .., "held": ..}},
"dashboard": url-or-None, "counters": lease counters (granted, local, forwarded, timeouts),
"instances": [instance records], "placement": {kind: latency figures}, "scheduling":
{address: the worker's last heartbeat load report}}``.  Used by ``yr.resources()``, the
status command and the dashboard."""

CREATE_INSTANCE = "yr_create_instance"
"""creator -> scheduler rpc.  Fields: ``spec`` (dict: ``instance_id``, ``cls`` pickled class,
``cls_name``, ``args``, ``deps``, ``shape``, ``timeout_ms``, ``owner`` (job or instance id),
``holder`` (creator's address, first handle holder), ``name``, ``namespace``, ``detached``,
``concurrency``, ``is_async``, ``meta`` (method metadata for handles)).  Reply:
``[instance_id, worker, meta]`` once placed (a named instance that exists already answers
with the existing one), or ``[None, reason, None]`` when it cannot be placed in time."""

LOCATE_INSTANCE = "yr_locate_instance"
"""any -> scheduler rpc.  Fields: ``instance_id``, ``lost`` (optional: the worker the caller
just lost its channel to).  Reply: ``[state, worker, reason, instance_id]`` (the last is the
id a named creation's alias stands for); waits while the instance is being placed or
restarted, and, with ``lost``, until Dask has confirmed that worker gone (bounded)."""

INSTANCE_STATUS = "yr_instance_status"
"""any -> scheduler rpc.  Fields: ``instance_id``.  Reply: ``{"state", "worker", "restarts",
"reason"}`` at once (``handle.state``)."""

SAVE_STATE = "yr_save_state"
"""instance -> scheduler rpc (``yr.save_state()``).  Fields: ``instance_id``, ``state``
(the pickled instance object).  Reply ``None`` once kept; a restart resumes from it."""

LOAD_STATE = "yr_load_state"
"""instance -> scheduler rpc (``yr.load_state()``).  Fields: ``instance_id``.  Reply: the
last saved state (bytes) or ``None``."""

GET_NAMED = "yr_get_named"
"""any -> scheduler rpc.  Fields: ``name``, ``namespace``, ``timeout``.  Reply:
``[instance_id, worker, meta]`` once the named instance is alive, ``[None, reason, None]``
if there is none; waits up to ``timeout`` s for one still being created."""

LIST_NAMED = "yr_list_named"
"""any -> scheduler rpc.  Fields: ``all_namespaces``.  Reply: list of ``[namespace, name]``."""

KILL_INSTANCE = "yr_kill_instance"
"""any -> scheduler rpc.  Fields: ``instance_id``, ``reason``.  Reply once the instance (and
its non-detached descendants) are stopped."""

SCHEDULER_RPC = (CONNECT_JOB, REGISTER_WORKER, REQUEST_LEASE, CLUSTER_INFO, CREATE_INSTANCE,
                 LOCATE_INSTANCE, GET_NAMED, LIST_NAMED, KILL_INSTANCE, INSTANCE_STATUS,
                 SAVE_STATE, LOAD_STATE)

# --- job stream, driver -> scheduler ------------------------------------------------------

RETURN_LEASES = "yr_return_leases"
"""submitter -> scheduler (job stream or worker stream).  Fields: ``lease_ids``.  The
resources of those leases become free."""

# --- worker stream, worker -> scheduler ---------------------------------------------------

LEASE_BLOCKED = "yr_lease_blocked"
"""worker -> scheduler.  Fields: ``lease_id``.  The task running on the lease waits in
``yr.get``: its CPU is lent back to the cluster until :data:`LEASE_UNBLOCKED`."""

LEASE_UNBLOCKED = "yr_lease_unblocked"
"""worker -> scheduler.  Fields: ``lease_id``.  The task runs again and takes its CPU back
(briefly over capacity if it was lent out meanwhile)."""

HANDLE_REFS = "yr_handle_refs"
"""holder -> scheduler (job stream or worker stream).  Fields: ``deltas`` ({instance_id:
+1 | -1}, sent when this process's handle count for an instance goes 0 -> 1 or 1 -> 0),
``transit`` (tokens of pickled handles being registered, ``[[instance_id, token], ...]``)
and ``arrived`` (tokens whose handles this process has just unpickled).  An unnamed,
non-detached instance no process holds, with no handle in transit, ends."""

INSTANCE_STATE = "yr_instance_state"
"""worker -> scheduler.  Fields: ``instance_id``, ``state`` (``"ALIVE"`` after ``__init__``,
``"FAILED"`` if ``__init__`` raised, ``"EXITED"`` after it stopped), ``error`` (pickled
RemoteError or None)."""

SCHEDULER_STREAM = (RETURN_LEASES, LEASE_BLOCKED, LEASE_UNBLOCKED, HANDLE_REFS, INSTANCE_STATE)

# --- scheduler -> submitter (job stream, or worker rpc for worker submitters) -------------

JOB_WELCOME = "yr_job_welcome"
"""scheduler -> driver on the job stream.  Fields: ``protocol_version``, ``dashboard``."""

REVOKE_LEASES = "yr_revoke_leases"
"""scheduler -> submitter.  Fields: ``lease_ids``.  Others wait for these resources: return
the leases that are idle now, and the others as soon as their task ends."""

# --- worker rpc (handled by yrdask.worker.agent) ------------------------------------------

OPEN_CHANNEL = "yr_open_channel"
"""caller -> worker, opens a *call channel* on that comm.  Fields: ``caller`` (the caller's
owner address).  No reply: from then on both sides send batched messages."""

FETCH_OBJECT = "yr_fetch_object"
"""any -> owner (or the worker holding a large value) rpc.  Fields: ``object_id``,
``timeout`` (seconds, ``None`` = forever).  Reply: ``[kind, payload]`` where kind is
``"value"`` (payload = pickled bytes), ``"error"`` (payload = pickled RemoteError) or
``"location"`` (payload = address of the worker holding the value)."""

FREE_OBJECTS = "yr_free_objects"
"""owner -> worker holding large values (rpc, fire and forget).  Fields: ``object_ids``."""

START_INSTANCE = "yr_start_instance"
"""scheduler -> worker (worker stream).  Fields: the creation ``spec`` (see
:data:`CREATE_INSTANCE`; on a restart also ``incarnation`` (the restart count) and
``checkpoint`` (the last saved state, or ``None``)).  The worker builds the instance from
the checkpoint if there is one, else with ``__init__``; calls may arrive before it is
ready and wait behind it."""

STOP_INSTANCE = "yr_stop_instance"
"""scheduler -> worker rpc.  Fields: ``instance_id``, ``reason``.  Pending calls fail with
that reason; the reply comes once the instance is gone."""

WORKER_LOST = "yr_worker_lost"
"""scheduler -> every driver (job stream) and worker (worker stream).  Fields: ``worker``.
Dask removed that worker (its stream closed, or it missed heartbeats for
``distributed.scheduler.worker-ttl``): channels to it are dead even if their socket is not,
so their unanswered calls are sent again or fail, and their tasks run elsewhere."""

WORKER_RPC = (OPEN_CHANNEL, FETCH_OBJECT, FREE_OBJECTS, STOP_INSTANCE)
WORKER_STREAM = (REVOKE_LEASES, START_INSTANCE, WORKER_LOST)
OWNER_RPC = (FETCH_OBJECT, REVOKE_LEASES)

# --- call channel -------------------------------------------------------------------------

RUN_TASK = "yr_run_task"
"""caller -> worker.  Fields: ``task_id``, ``lease_id``, ``fn_id``, ``fn`` (pickled function,
sent once per channel, else ``None``), ``args`` (pickled args/kwargs with top-level refs
replaced by placeholders), ``deps`` (list of ``[ref_id, kind, payload]`` as in
:data:`FETCH_OBJECT`), ``nret``, ``owner`` (the lifetime owner: a job id or an instance id),
``name`` (function name, for errors and the dashboard), ``slots`` (how many tasks of the
lease may run at once: more may be pushed, and wait in the worker's lease gate)."""

CANCEL_TASK = "yr_cancel_task"
"""caller -> worker.  Fields: ``task_id``.  Interrupts the task if it is still running."""

TASK_DONE = "yr_task_done"
"""worker -> caller.  Fields: ``task_id``, ``results`` (a list of ``[kind, payload]``, one per
return value, kinds as in :data:`FETCH_OBJECT`) or ``error`` (pickled RemoteError),
``retryable`` (``True`` when the error is a user exception that ``retry_times`` may rerun),
``took`` (seconds the task ran, for the submitter's pipelining rule); or ``requeue``
(``True``: a pipelined task that waited too long in the worker's lease gate is handed back
unrun, for the submitter to queue again)."""

CALL_METHOD = "yr_call_method"
"""caller -> worker.  Fields: ``task_id`` (the call id), ``instance_id``, ``method``,
``args``, ``deps``, ``nret``.  Answered by :data:`TASK_DONE`; calls from one channel to one
instance run in the order sent (concurrency 1)."""

CHANNEL_TO_WORKER = (RUN_TASK, CANCEL_TASK, CALL_METHOD)
CHANNEL_TO_CALLER = (TASK_DONE,)

# --- instance states ----------------------------------------------------------------------

PENDING = "PENDING"  # waiting for resources
ALIVE = "ALIVE"
RESTARTING = "RESTARTING"
DEAD = "DEAD"

# --- object kinds -------------------------------------------------------------------------

VALUE = "value"
ERROR = "error"
LOCATION = "location"
