"""Who is running: the job's namespace and id, the task or actor, as the ray layer sees them.

A driver keeps its session here (set by ``ray.init``).  Work on workers carries the context
of the driver that submitted it: task bodies set it for their thread while they run, actor
classes hold it as a class attribute (``__ray_ctx__``), so ``ray.get_actor`` inside them
looks in the job's namespace, as on Ray.
"""

from __future__ import annotations

import contextvars
import threading
from typing import Any

from yrdask.runtime.context import current_lease, current_owner, installed_runtime

try:  # optional: without it a task's process keeps its title
    from setproctitle import getproctitle, setproctitle
except ImportError:  # pragma: no cover - installed with yrdask
    getproctitle = setproctitle = None  # type: ignore[assignment]


_local = threading.local()  # .ctx: the context of the task this thread runs
#: ``[Class.method, module.Class.method, task id or None]`` of the actor method running now
#: (set by the host class's wrappers; the id is made when first asked for).
current_method: contextvars.ContextVar = contextvars.ContextVar("ray_method", default=None)


class Session:
    """The driver's ray session: the namespace, whether ``ray.init`` started yr, the alias."""

    def __init__(self, namespace: str, job_id: str, owns_runtime: bool, runtime: Any,
                 job_env: dict | None = None) -> None:
        self.namespace = namespace
        self.job_id = job_id
        self.owns_runtime = owns_runtime
        self.runtime = runtime
        self.job_env = job_env or {}
        self.alias = False  # True when this process runs under ``python -m yrdask.ray``
        self.default_lifetime: str | None = None  # JobConfig(default_actor_lifetime=)
        self.code_search_path: list[str] = []  # JobConfig(code_search_path=), for workers
        # the cluster's session name (Ray's get_session_name), as its scheduler told
        connector = getattr(runtime, "connector", None)
        self.session_name: str = getattr(connector, "session", None) or ""

    def ctx(self, resources: dict | None = None) -> dict:
        """The context that work submitted now carries to its workers."""
        ctx = {"namespace": self.namespace, "job_id": self.job_id, "alias": self.alias,
               "resources": dict(resources or {}), "session_name": self.session_name}
        if self.code_search_path:  # workers put them on sys.path (_alias.prepare_imports)
            ctx["code_search_path"] = self.code_search_path
        return ctx


class _State:
    """The process's ray state, one object so that modules import it by name (see below)."""

    session: Session | None = None


#: ``STATE.session``: the driver's session.  Submodules of yrdask.ray import names
#: (``from yrdask.ray._context import STATE``), never ``import yrdask.ray._context as ...``:
#: that form waits for the package ``yrdask.ray`` to finish initialising, and a thread that
#: unpickles a task body (importing a submodule) while another imports the package then
#: deadlocks with it (Python hands one of them a half-initialised module).
STATE = _State()


def set_task_ctx(ctx: dict | None) -> Any:
    """Make ``ctx`` this thread's context; returns the previous one (to restore)."""
    prev = getattr(_local, "ctx", None)
    _local.ctx = ctx
    return prev


def hosted_instance() -> Any:
    """The instance whose method this thread runs (a yr HostedInstance), or None."""
    rt = installed_runtime()
    iid = current_owner()
    if rt is None or rt.agent is None or iid is None or current_lease() != iid:
        return None
    return rt.agent.instances.get(iid)


def current_ctx() -> dict:
    """The context of the code running now: a task's, an actor's, or the driver session's."""
    ctx = getattr(_local, "ctx", None)
    if ctx is not None:
        return ctx
    inst = hosted_instance()
    if inst is not None and inst.obj is not None:
        found = getattr(type(inst.obj), "__ray_ctx__", None)
        if found is not None:
            return found
    if STATE.session is not None:
        return STATE.session.ctx()
    return {"namespace": "", "job_id": "", "alias": False, "resources": {},
            "session_name": ""}


def speaks_ray() -> bool:
    """Whether the code running now is Ray code: a Ray task, a Ray actor's method, or a
    driver after ``ray.init`` (yr tasks and instances in the same process are not)."""
    if STATE.session is not None or getattr(_local, "ctx", None) is not None:
        return True  # a driver hosts no instances: its session decides
    inst = hosted_instance()
    return inst is not None and getattr(type(inst.obj), "__ray_ctx__", None) is not None


class _Titles:
    """The process title while Ray tasks run here: ``ray::<task name>`` of the latest one
    started, as on Ray (``psutil.Process().cmdline()[0]``); the process's own title once
    none runs.  A worker process runs several tasks at once, where a Ray worker runs one."""

    lock = threading.Lock()
    running: list = []  # titles of the tasks running now, in the order they started
    idle: str | None = None  # the process's own title, read once


def title_begin(name: str) -> str | None:
    """A Ray task called ``name`` starts in this thread: the process says so."""
    if setproctitle is None:
        return None
    title = f"ray::{name}"
    with _Titles.lock:
        if _Titles.idle is None:
            _Titles.idle = getproctitle()
        _Titles.running.append(title)
        setproctitle(title)
    return title


def title_end(title: str | None) -> None:
    """The task of :func:`title_begin` ended: the title is the latest running one's."""
    if title is None:
        return
    with _Titles.lock:
        running = _Titles.running
        running.remove(title)
        setproctitle(running[-1] if running else _Titles.idle)
