"""Isolated work: an instance, or a pooled task process, in a child process of the worker.

One module per job: :mod:`.zygote` (forks the processes), :mod:`.supervisor` (the agent's
side of an isolated instance), :mod:`.pool` (pooled processes for stateless tasks),
:mod:`.child` (the isolated process), ``__main__`` (the zygote's entry point).

Why: native code that crashes (``os._exit``, a segfault) must take only its own process
down, not the worker and every neighbour on it; and work with ``env_vars`` or a
``working_dir`` needs a process whose ``os.environ`` and current directory are its own.

How (``docs/isolation.md``):

* Each worker keeps one :class:`Zygote` (``python -m yrdask.worker.isolated``, started on
  first use): a warm interpreter with Dask and yrdask imported that ``fork()``s every child
  and sets its environment and directory.  A child serves on a Dask comm endpoint on its
  worker's host (Dask's comms, no networking of its own) and hosts the instance with the
  same :class:`~yrdask.worker.hosting.HostedInstance` code (:class:`~yrdask.protocol.StartIsolated`),
  or runs tasks (:class:`~yrdask.protocol.RunIsolated`, :class:`ProcessPool`).
* Callers reach a process instance directly: the agent reports the child's endpoint to
  the scheduler (``InstanceState.address``), which answers it to creations and locates;
  callers open their call channels there.  The agent (:class:`IsolatedInstance`) only
  supervises: it starts the child, keeps a supervision channel (the child ends when it
  closes; large results the child wrote to the node's store come back on it as
  :class:`~yrdask.protocol.ResultsKept`, kept by the worker so they outlive the child),
  watches its exit, and stops, crashes or kills it.
* Nested calls (``docs/isolation.md#nested-calls``): the child's first nested call (or
  ref) starts a runtime of its own there (:class:`LazyRuntime`), which joins the scheduler
  as a client: the child owns what it creates, borrows the refs it was given, lends what it
  returns, and lends its holding's CPU while it waits (:class:`ChildLending`).  A pooled
  process with a runtime is kept (it may own objects others hold).
* No orphans: the agent kills its children on stop and on close; the zygote exits when its
  stdin closes (the agent closed it, or the worker died) and kills its children first; a
  child dies with the zygote (``PR_SET_PDEATHSIG``).
* When an instance's child dies, the agent tells the scheduler (``InstanceState``
  ``RESTARTING``), whose ``Lifecycle`` owns the instance's one restart budget
  (``recover_retry_times``, shared with worker losses, never reset): with restarts left it
  answers with a ``START_INSTANCE`` to this worker, and a new child is started (a fresh
  ``__init__``) at a new endpoint; without, it stops the instance.  Its callers lost their
  channels to the child: each locates the instance again and delivers its unanswered calls
  by its own ``CallOrder`` (the one crash-charging rule, ``charge_crash``, as for a lost
  worker).
"""

START_TIMEOUT_S = 60.0  # a process (or its instance) not up by then failed to start
