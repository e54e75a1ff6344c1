"""Resource groups (yr's placement groups): reserve bundles of resources, then run work in them.

``yr.create_resource_group(bundles, name=None, strategy="PACK")`` returns a
:class:`ResourceGroup` at once; the scheduler reserves the bundles (all or none) and
``rg.wait()`` blocks until it has.  Calls and instances run inside a bundle with
``InvokeOptions(resource_group_options=yr.ResourceGroupOptions(name, bundle_index))``.
Semantics and differences from yr and Ray: ``docs/resource-groups.md``.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

from yrdask import protocol as P
from yrdask.errors import YRRuntimeError, YRTimeoutError, YRTypeError, YRValueError
from yrdask.options import InvokeOptions, ResourceGroupOptions
from yrdask.runtime.context import current_runtime

__all__ = ["ResourceGroup", "ResourceGroupOptions", "create_resource_group",
           "remove_resource_group"]

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD", "None")
DEFAULT_CPU = 300.0  # millicores, yr's default for a bundle without "CPU"
DEFAULT_MEMORY = 128.0  # MB, yr's default for a bundle without "Memory"

# Bundle counts of groups this process created or looked up, so a call can check its
# bundle_index without a round trip (the scheduler checks again).
_known: dict[str, int] = {}
_known_lock = threading.Lock()


class ResourceGroup:
    """A resource group the scheduler reserves (or already reserved); see module docstring.

    ``name`` / ``resource_group_name`` its name, ``request_id`` the id of the creation,
    ``bundles`` / ``bundle_specs`` the bundles as reserved (defaults filled in),
    ``bundle_count`` how many.
    """

    def __init__(self, name: str, bundles: list[dict[str, float]], request_id: str,
                 strategy: str = "PACK") -> None:
        self.name = name
        self.request_id = request_id
        self.bundles = bundles
        self.strategy = strategy

    @property
    def bundle_specs(self) -> list[dict[str, float]]:
        return [dict(b) for b in self.bundles]

    @property
    def bundle_count(self) -> int:
        return len(self.bundles)

    @property
    def resource_group_name(self) -> str:
        return self.name

    def wait(self, timeout_seconds: int | float | None = None) -> None:
        """Block until every bundle is reserved.

        ``None`` or ``-1`` waits forever.  Raises ``yr.YRTimeoutError`` naming the bundle that
        cannot be placed and why when ``timeout_seconds`` pass first, and ``YRRuntimeError``
        if the group was removed.
        """
        if timeout_seconds is None:
            timeout_seconds = -1
        if isinstance(timeout_seconds, bool) or not isinstance(timeout_seconds, (int, float)):
            raise YRTypeError(f"Parameter 'timeout_seconds' must be an int or None, got "
                              f"{timeout_seconds!r} ({type(timeout_seconds).__name__})")
        if timeout_seconds < -1:
            raise YRValueError(
                "Parameter 'timeout_seconds' should be greater than or equal to -1 (no timeout)")
        state, reason, _count = current_runtime().scheduler_call(
            P.WAIT_RESOURCE_GROUP, name=self.name, timeout=float(timeout_seconds))
        if state == P.RG_CREATED:
            return
        if state == P.RG_PENDING:
            raise YRTimeoutError(
                f"resource group {self.name!r} was not created within {timeout_seconds} s: "
                f"{reason}")
        raise YRRuntimeError(f"resource group {self.name!r} will never be created: {reason}")

    def __reduce__(self):
        return (ResourceGroup, (self.name, self.bundles, self.request_id, self.strategy))

    def __repr__(self) -> str:
        return (f"ResourceGroup(name={self.name!r}, strategy={self.strategy!r}, "
                f"bundles={self.bundles!r})")


def create_resource_group(bundles: list[dict[str, float]], name: str | None = None,
                          strategy: str = "PACK") -> ResourceGroup:
    """Reserve ``bundles`` ({"CPU": millicores, "Memory": MB, tag: amount} each) as one group.

    Returns at once; :meth:`ResourceGroup.wait` blocks until the scheduler has placed every
    bundle.  ``strategy``: ``"PACK"`` (default) / ``"SPREAD"`` prefer few / many workers,
    ``"STRICT_PACK"`` puts every bundle on one worker, ``"STRICT_SPREAD"`` each on its own
    worker, ``"None"`` no preference.  A bundle without ``"CPU"`` / ``"Memory"`` gets 300 /
    128; zero custom resources are dropped.  The group lives until
    :func:`remove_resource_group` or the end of the job.
    """
    return create_group(bundles, name, strategy, fate_sharing=False)


def create_group(bundles: Any, name: Any, strategy: Any, fate_sharing: bool,
                 detached: bool = False) -> ResourceGroup:
    """:func:`create_resource_group`, and for ``yr.Group``: ``fate_sharing`` ends every
    instance placed in the group when one of them ends; for Ray's placement groups:
    ``detached`` keeps the group after this job ends, until it is removed."""
    specs = _check_bundles(bundles)
    if name is None:
        name = f"rgroup-{uuid.uuid4().hex}"
    if not isinstance(name, str):
        raise YRTypeError(f"invalid name type, actual: {type(name).__name__}, expect: str")
    if name in ("", "primary"):
        raise YRValueError(f"invalid name {name!r}: the names '' and 'primary' are reserved; "
                           "give another name or leave name=None for a generated one")
    if not isinstance(strategy, str):
        raise YRTypeError(f"invalid strategy type, actual: {type(strategy).__name__}, "
                          "expect: str")
    if strategy not in STRATEGIES:
        raise YRValueError(f"invalid strategy {strategy!r}, expect one of: "
                           f"{', '.join(STRATEGIES)}")
    rt = current_runtime()
    problem = rt.scheduler_call(P.CREATE_RESOURCE_GROUP, owner=rt.address, name=name,
                                bundles=specs, strategy=strategy, fate_sharing=fate_sharing,
                                detached=detached)
    if problem:
        raise YRValueError(problem)
    with _known_lock:
        _known[name] = len(specs)
    return ResourceGroup(name, specs, f"rg-req-{uuid.uuid4().hex[:16]}", strategy)


def find_group(name: str) -> ResourceGroup | None:
    """The live group ``name`` as the scheduler holds it (any job's, or a detached one kept
    across a scheduler restart), or None.  For Ray's ``get_placement_group``: yr has no
    lookup by name."""
    found = current_runtime().scheduler_call(P.GET_RESOURCE_GROUP, name=name)
    if found is None:
        return None
    strategy, bundles = found
    with _known_lock:
        _known[name] = len(bundles)
    return ResourceGroup(name, [dict(b) for b in bundles], f"rg-req-{uuid.uuid4().hex[:16]}",
                         strategy)


def remove_resource_group(rg_or_name: ResourceGroup | str) -> None:
    """Free the group's reservations.  Instances placed in it are killed, calls waiting for
    it fail; tasks already running finish (their leases are revoked)."""
    if isinstance(rg_or_name, ResourceGroup):
        name = rg_or_name.name
    elif isinstance(rg_or_name, str):
        name = rg_or_name
    else:
        raise YRTypeError(f"invalid resource group type, actual: {type(rg_or_name).__name__}, "
                          "expect: str or yr.ResourceGroup")
    current_runtime().scheduler_call(P.REMOVE_RESOURCE_GROUP, name=name)
    with _known_lock:
        _known.pop(name, None)


def _check_bundles(bundles: Any) -> list[dict[str, float]]:
    """The bundles with yr's defaults filled in, or a typed error naming the bad one."""
    if not isinstance(bundles, list):
        raise YRTypeError(f"invalid bundles type, actual: {type(bundles).__name__}, "
                          "expect: list[dict[str, float]]")
    if len(bundles) == 0:
        raise YRValueError(f"invalid bundles number, actual: {len(bundles)}, expect: > 0.")
    specs = []
    for i, bundle in enumerate(bundles):
        if not isinstance(bundle, dict):
            raise YRTypeError(f"invalid bundle {i} type, actual: {type(bundle).__name__}, "
                              "expect: dict[str, float]")
        spec: dict[str, float] = {}
        for key, value in bundle.items():
            if not isinstance(key, str) or not key:
                raise YRTypeError(f"invalid resource name {key!r} in bundle {i}: expect a "
                                  'non-empty str ("CPU", "Memory" or a custom resource)')
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise YRTypeError(f"invalid value of {key!r} in bundle {i}, actual: "
                                  f"{type(value).__name__}, expect: int or float")
            if value < 0:
                raise YRValueError(f"invalid value of {key!r} in bundle {i}, actual: {value}, "
                                   "expect: >= 0")
            if value == 0 and key not in ("CPU", "Memory"):
                continue  # zero custom resources are filtered, as in yr
            spec[key] = float(value)
        spec.setdefault("CPU", DEFAULT_CPU)
        spec.setdefault("Memory", DEFAULT_MEMORY)
        specs.append(spec)
    return specs


def bundle_wire_of(opts: InvokeOptions) -> tuple:
    """The affinity wire entry that places calls of ``opts`` into their bundle (``()``
    without ``resource_group_options``)."""
    rgo = opts.resource_group_options
    if rgo is None or not rgo.resource_group_name:
        return ()
    return P.bundle_wire(rgo.resource_group_name, rgo.bundle_index)


def check_bundle_index(rt: Any, opts: InvokeOptions) -> None:
    """At the call: the group of ``opts`` exists and its ``bundle_index`` is in range
    (``YRValueError`` naming the valid range otherwise)."""
    rgo = opts.resource_group_options
    if rgo is None or not rgo.resource_group_name:
        return
    name = rgo.resource_group_name
    with _known_lock:
        count = _known.get(name)
    if count is None:
        state, reason, count = rt.scheduler_call(P.WAIT_RESOURCE_GROUP, name=name, timeout=0)
        if state in (P.RG_UNKNOWN, P.RG_REMOVED):
            raise YRValueError(
                f"ResourceGroupOptions.resource_group_name {name!r} names no resource group "
                f"({reason}); create it first with yr.create_resource_group(...)")
        with _known_lock:
            _known[name] = count
    if rgo.bundle_index >= count:
        raise YRValueError(
            f"ResourceGroupOptions.bundle_index {rgo.bundle_index} is out of range for "
            f"resource group {name!r} with {count} bundles: use -1 (any bundle) or "
            f"0..{count - 1}")
