"""Which work runs in a process of its own, and how: the isolation a call's options ask for.

From the options a caller gave (``yrdask.options``, which only defines and checks them) this
derives the ``{"env", "cwd"}`` isolation of a function's tasks or an instance
(docs/isolation.md), and :class:`IsolatedFunction`, the form in which a function that asks
for one travels to its worker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from yrdask.config import light_instances

if TYPE_CHECKING:
    from yrdask.options import InvokeOptions


def isolation_spec(opts: "InvokeOptions") -> dict | None:
    """``{"env": ..., "cwd": ...}`` when ``opts`` asks for its own process, else ``None``.

    ``isolated=True``, ``env_vars`` or ``runtime_env`` env_vars/working_dir ask for it;
    ``env_vars`` wins over ``runtime_env["env_vars"]`` (as in yr).  An empty ``cwd`` means
    the job's ``Config.working_dir`` (filled in by the runtime), else the worker's.
    """
    renv = opts.runtime_env or {}
    if not (opts.isolated or opts.env_vars or renv.get("env_vars") or renv.get("working_dir")):
        return None
    return {"env": {**renv.get("env_vars", {}), **opts.env_vars},
            "cwd": renv.get("working_dir", "")}


def instance_isolation(opts: "InvokeOptions") -> dict | None:
    """An instance's :func:`isolation_spec`; a process instance that asks for nothing else
    gets a process of its own with the worker's environment (``{"env": {}, "cwd": ""}``),
    a light one ``None``.  ``light=None`` takes the job's default
    (``yrdask.instances.light``, read where the instance is created)."""
    iso = isolation_spec(opts)
    if iso is None and not (light_instances() if opts.light is None else opts.light):
        iso = {"env": {}, "cwd": ""}
    return iso


class IsolatedFunction:
    """A stateless function whose tasks run in a pooled child process of their worker, with
    ``isolation`` (``{"env", "cwd"}``, see :func:`isolation_spec`) applied there."""

    __slots__ = ("fn", "isolation")

    def __init__(self, fn: Callable, isolation: dict) -> None:
        self.fn = fn
        self.isolation = isolation

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> tuple:
        return (IsolatedFunction, (self.fn, self.isolation))
