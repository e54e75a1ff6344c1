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
  and sets its environment and directory.  A child runs a small Dask ``Server`` on loopback
  (Dask's comms, no networking of its own) and hosts the instance with the same
  :class:`~yrdask.worker.hosting.HostedInstance` code (:class:`~yrdask.protocol.StartIsolated`,
  then ``CALL_METHOD`` / ``TASK_DONE`` on one call channel from the agent), or runs tasks
  (:class:`~yrdask.protocol.RunIsolated`, :class:`ProcessPool`).
* Callers still send their calls to the worker: the agent forwards them on that one comm
  (:class:`IsolatedInstance`), so routing, redelivery and the scheduler are unchanged.
  Results come back as values; the agent keeps large ones in its own store, as for
  in-process work, so they outlive the child.
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
  ``__init__``); the calls not answered are delivered again in order, except that the
  oldest ``concurrency`` of them (those that may have been running) are charged a crash by
  the one rule of ``runtime/call_order.py`` (``charge_crash``); without, it stops the
  instance, and its calls fail with ``InstanceDiedError`` naming the exit code or the
  signal.  What is decided (pending, waiting, died, restart, charge) is
  :class:`~yrdask.worker.isolated_calls.IsolatedCalls`, which the simulation drives too;
  :class:`IsolatedInstance` does the I/O.
"""

START_TIMEOUT_S = 60.0  # a process (or its instance) not up by then failed to start
