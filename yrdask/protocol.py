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
({resource: amount}), ``timeout_ms`` (-1 = wait forever), ``local`` (worker address of the
submitter, or ``None``).  Reply: ``[lease_id, worker_address]``; raises
:class:`yrdask.errors.ScheduleError` when no worker could meet the shape in time."""

CLUSTER_INFO = "yr_cluster_info"
"""any -> scheduler rpc.  Reply: ``{"workers": {address: {"capacity": .., "held": ..}},
"dashboard": url-or-None}``.  Used by ``yr.resources()`` and the status command."""

SCHEDULER_RPC = (CONNECT_JOB, REGISTER_WORKER, REQUEST_LEASE, CLUSTER_INFO)

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

SCHEDULER_STREAM = (RETURN_LEASES, LEASE_BLOCKED, LEASE_UNBLOCKED)

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

WORKER_RPC = (OPEN_CHANNEL, FETCH_OBJECT, FREE_OBJECTS, REVOKE_LEASES)
OWNER_RPC = (FETCH_OBJECT, REVOKE_LEASES)

# --- call channel -------------------------------------------------------------------------

RUN_TASK = "yr_run_task"
"""caller -> worker.  Fields: ``task_id``, ``lease_id``, ``fn_id``, ``fn`` (pickled function,
sent once per channel, else ``None``), ``args`` (pickled args/kwargs with top-level refs
replaced by placeholders), ``deps`` (list of ``[ref_id, kind, payload]`` as in
:data:`FETCH_OBJECT`), ``nret``, ``owner`` (the lifetime owner: a job id or an instance id),
``name`` (function name, for errors and the dashboard)."""

CANCEL_TASK = "yr_cancel_task"
"""caller -> worker.  Fields: ``task_id``.  Interrupts the task if it is still running."""

TASK_DONE = "yr_task_done"
"""worker -> caller.  Fields: ``task_id``, ``results`` (a list of ``[kind, payload]``, one per
return value, kinds as in :data:`FETCH_OBJECT`) or ``error`` (pickled RemoteError),
``retryable`` (``True`` when the error is a user exception that ``retry_times`` may rerun)."""

CHANNEL_TO_WORKER = (RUN_TASK, CANCEL_TASK)
CHANNEL_TO_CALLER = (TASK_DONE,)

# --- object kinds -------------------------------------------------------------------------

VALUE = "value"
ERROR = "error"
LOCATION = "location"
