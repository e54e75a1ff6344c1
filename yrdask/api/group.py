"""``yr.Group``: instances created together, all or none, and (by default) ending together.

An instance created with ``InvokeOptions(group_name=name)`` is not created at once: its
handle comes back, and the creation waits in this process until ``yr.Group(name, ...)``'s
:meth:`Group.invoke`.  That reserves one resource-group bundle per member (so either every
member fits or none is placed) and creates each member inside its bundle.  With
``GroupOptions(same_lifecycle=True)`` the scheduler ends every member when one ends, naming
it.  See ``docs/resource-groups.md``.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from yrdask.api.resource_groups import ResourceGroup, create_group, remove_resource_group
from yrdask.errors import YRRuntimeError, YRTimeoutError, YRTypeError, YRValueError
from yrdask.options import InvokeOptions, ResourceGroupOptions

__all__ = ["Group", "GroupOptions"]

_GROUP_STRATEGIES = ("", "PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass
class GroupOptions:
    """How a :class:`Group` is created.

    ``timeout`` seconds to wait for every member to be placed (-1: forever), ``same_lifecycle``
    members end together, ``strategy`` how members spread over workers (resource-group
    strategies; ``""`` = ``"PACK"``).
    """

    timeout: int = -1
    same_lifecycle: bool = True
    strategy: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, int):
            raise YRTypeError(f"GroupOptions.timeout must be an int (seconds, -1 = forever), "
                              f"got {self.timeout!r}")
        if self.timeout < -1 or self.timeout == 0:
            raise YRValueError(f"GroupOptions.timeout must be -1 (forever) or > 0 seconds, "
                               f"got {self.timeout}")
        if not isinstance(self.same_lifecycle, bool):
            raise YRTypeError(f"GroupOptions.same_lifecycle must be a bool, got "
                              f"{self.same_lifecycle!r}")
        if self.strategy not in _GROUP_STRATEGIES:
            raise YRValueError(f"GroupOptions.strategy must be one of {_GROUP_STRATEGIES}, got "
                               f"{self.strategy!r}")


@dataclass
class _Member:
    options: InvokeOptions
    create: Callable[[InvokeOptions], Any]  # creates the instance with these options
    instance_id: str


_members: dict[str, list[_Member]] = {}  # group name -> creations waiting for Group.invoke
_lock = threading.Lock()


def add_group_member(options: InvokeOptions, instance_id: str,
                     create: Callable[[InvokeOptions], Any]) -> None:
    """Keep an instance creation with ``options.group_name`` until its group is invoked
    (called by ``InstanceCreator.invoke``).  Detached instances cannot join a group."""
    if options.is_detached:
        raise YRValueError(
            f"InvokeOptions.group_name={options.group_name!r} cannot be used with a detached "
            "instance (custom_extensions lifecycle=detached): group members share the group's "
            "lifetime; create the detached instance without group_name")
    with _lock:
        _members.setdefault(options.group_name, []).append(
            _Member(options, create, instance_id))


class Group:
    """Instances created together: ``yr.Group(name, yr.GroupOptions(...))`` (module docstring).

    Create members with ``C.options(yr.InvokeOptions(group_name=name)).invoke()``, then call
    :meth:`invoke`; :meth:`wait` blocks until all are placed, :meth:`terminate` ends them.
    """

    def __init__(self, group_name: str, group_opts: GroupOptions | None = None) -> None:
        if not isinstance(group_name, str) or not group_name:
            raise YRTypeError(f"Group name must be a non-empty str, got {group_name!r}")
        if group_opts is None:
            group_opts = GroupOptions()
        if not isinstance(group_opts, GroupOptions):
            raise YRTypeError(f"group_opts must be a yr.GroupOptions, got "
                              f"{type(group_opts).__name__}")
        self.group_name = group_name
        self.group_opts = group_opts
        self._rg: ResourceGroup | None = None
        self.instance_ids: list[str] = []

    def invoke(self) -> None:
        """Create every instance that named this group since the last invoke, together: one
        bundle each, reserved all at once; returns at once (use :meth:`wait`)."""
        if self._rg is not None:
            raise YRRuntimeError(f"Group {self.group_name!r} was invoked already; create a new "
                                 "yr.Group for new members")
        with _lock:
            members = _members.pop(self.group_name, [])
        if not members:
            raise YRValueError(
                f"Group {self.group_name!r} has no members: create instances with "
                f"InvokeOptions(group_name={self.group_name!r}) before Group.invoke()")
        bundles = [dict(m.options.resource_shape()) for m in members]
        name = f"group-{self.group_name}-{uuid.uuid4().hex[:8]}"
        self._rg = create_group(bundles, name, self.group_opts.strategy or "PACK",
                                fate_sharing=self.group_opts.same_lifecycle)
        timeout_ms = -1 if self.group_opts.timeout < 0 else self.group_opts.timeout * 1000
        for i, m in enumerate(members):
            opts = m.options.copy()
            opts.group_name = ""
            opts.resource_group_options = ResourceGroupOptions(name, i)
            opts.schedule_timeout_ms = timeout_ms
            m.create(opts)
            self.instance_ids.append(m.instance_id)

    def wait(self) -> None:
        """Block until every member is placed; ``YRTimeoutError`` after
        ``GroupOptions.timeout`` naming what does not fit, ``YRRuntimeError`` if the group
        ended (a member died under ``same_lifecycle``, or it was terminated)."""
        if self._rg is None:
            raise YRRuntimeError(f"Group {self.group_name!r} was not invoked; call "
                                 "group.invoke() first")
        try:
            self._rg.wait(self.group_opts.timeout)
        except YRTimeoutError as e:
            raise YRTimeoutError(f"yr.Group {self.group_name!r} ({self._rg.bundle_count} "
                                 f"members) was not placed: {e}") from None

    def terminate(self) -> None:
        """End every member and free the group's reservation."""
        if self._rg is not None:
            remove_resource_group(self._rg)

    def suspend(self) -> None:
        raise YRRuntimeError(
            "Group.suspend() is not supported by yrdask: instances cannot be paused with their "
            "resources kept; use group.terminate() and invoke a new yr.Group later")

    def resume(self) -> None:
        raise YRRuntimeError(
            "Group.resume() is not supported by yrdask (there is no suspend); create and "
            "invoke a new yr.Group instead")

    def __repr__(self) -> str:
        return f"Group({self.group_name!r}, {self.group_opts!r})"
