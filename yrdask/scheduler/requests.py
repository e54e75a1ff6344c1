"""A request for resources on one worker (a task lease or an instance), as the scheduler sees it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from yrdask.affinity import Wire
from yrdask.scheduler.resources import Shape


@dataclass(eq=False)
class LeaseRequest:
    """What a lease or an instance asks for; the extension turns it into a ``HoldRequested``.

    ``request_id`` is set by :meth:`YrSchedulerExtension.acquire` when the request enters the
    lease queue, so :meth:`YrSchedulerExtension.cancel_request` can name it.
    """

    owner: str
    shape: Shape
    kind: str = "lease"  # or "instance"
    local: str | None = None  # the requester's own worker (local first)
    holding_id: str | None = None  # instances hold under their own id
    queue: str = ""  # the submitter's queue the lease is for
    avoid: tuple[str, ...] = ()  # workers the requester cannot reach right now
    affinity: Wire = ()  # see yrdask.affinity
    labels: tuple[str, ...] = ()  # an instance's labels (targets of INSTANCE affinities)
    request_id: str = ""  # assigned by the extension's acquire()
    label: str = ""  # what it is for people (an instance's class name), in explanations
    own_id: str = ""  # the owner's own id of a lease request (named when it withdraws it)


def shape_of(shape: dict) -> Shape:
    """A shape as floats (msgpack may deliver ints)."""
    return {r: float(a) for r, a in shape.items()}


def freeze(value: Any) -> Any:
    """Lists (as msgpack delivers them) back to the tuples an affinity wire form is made of."""
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value
