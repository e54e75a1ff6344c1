"""The shape every yr state machine has: typed events in, typed instructions out, a story.

yr's scheduling and ownership rules (the submitter's queues and leases, the scheduler's lease
queue, a worker's lease gate, the instance call router, the instance lifecycle) are each a
class with no I/O, no threads, no clocks and no asyncio, modelled on distributed's
``worker_state_machine.py``:

* an *event* is a frozen dataclass deriving from :class:`Event`; it carries a
  ``stimulus_id`` (who caused it, for the story) and, where time matters, ``now`` (seconds on
  any monotonic clock the caller chooses; the machines never read a clock);
* ``machine.handle(event)`` updates the machine's state and returns a list of
  *instructions* (dataclasses deriving from :class:`Instruction`) for the adapter to carry
  out: send this message, start that timer, settle that object;
* ``machine.story(*keys)`` returns the log entries that mention any of the keys, so "what
  happened to task X?" has an answer in a failing test or a live cluster.

The Dask adapters (``runtime/runtime.py``, ``scheduler/extension.py``, ``worker/agent.py``)
only translate wire messages into events and instructions into I/O; the deterministic
simulation in ``tests/sim`` drives the same machines through thousands of interleavings.
"""

from __future__ import annotations

from collections import deque
import dataclasses
from dataclasses import dataclass, fields
from typing import Any, Iterable


@dataclass(frozen=True)
class Event:
    """Something that happened, as one machine is told it."""

    stimulus_id: str


@dataclass(frozen=True)
class Instruction:
    """Something a machine asks its adapter to do."""

    stimulus_id: str


def fast_init(*classes: type) -> None:
    """Give frozen slotted event/instruction dataclasses a faster ``__init__``.

    A frozen dataclass sets each field through ``object.__setattr__``; the machines build
    several events and instructions per task, so the generated ``__init__`` writes the slots
    through their descriptors instead (same signature, same defaults, still immutable
    afterwards).  Classes with a ``__post_init__``, a default factory or a field that is not
    a slot keep their own ``__init__``.
    """
    for cls in classes:
        if not dataclasses.is_dataclass(cls) or hasattr(cls, "__post_init__"):
            continue
        flds = dataclasses.fields(cls)
        ns: dict[str, Any] = {}
        params, sets = [], []
        for f in flds:
            slot = next((c.__dict__[f.name] for c in cls.__mro__ if f.name in c.__dict__), None)
            if f.default_factory is not dataclasses.MISSING or not hasattr(slot, "__set__") \
                    or type(slot).__name__ != "member_descriptor":
                break
            ns[f"S_{f.name}"] = slot.__set__
            if f.default is dataclasses.MISSING:
                params.append(f.name)
            else:
                ns[f"D_{f.name}"] = f.default
                params.append(f"{f.name}=D_{f.name}")
            sets.append(f"    S_{f.name}(self, {f.name})\n")
        else:
            exec(f"def __init__(self, {', '.join(params)}):\n{''.join(sets) or '    pass'}\n",
                 ns)  # noqa: S102 - generated once per class from its own field names
            init = ns["__init__"]
            init.__qualname__ = f"{cls.__name__}.__init__"
            cls.__init__ = init


def remember(memory: dict, key: Any, value: Any, bound: int) -> None:
    """Set ``memory[key] = value``, forgetting the oldest entry once ``memory`` holds more
    than ``bound``: the machines' bounded memories of messages that overtook what they name
    (an early revoke of a lease not granted yet, a withdraw of a request not heard of yet)."""
    memory[key] = value
    if len(memory) > bound:
        del memory[next(iter(memory))]


def _describe(obj: Any) -> tuple:
    """``(ClassName, field=value, ...)`` of an event or instruction, for the story."""
    return (type(obj).__name__, *(f"{f.name}={getattr(obj, f.name)!r}"
                                  for f in fields(obj) if f.name != "stimulus_id"))


class Story:
    """A bounded log of ``(stimulus_id, what, keys)`` entries, searchable by key.

    Entries are cheap to keep, because every machine logs on its hot path: ``keys`` is a
    plain tuple (no set per entry), and an entry made only of strings and numbers leaves the
    garbage collector's lists after the first collection it survives.  A machine may append
    to :attr:`entries` itself, on its hot path: ``(stimulus_id, event_or_instruction, keys)``
    (the object as is, described only when asked), or the bare event or instruction; for an
    entry whose ``keys`` is ``None`` or a bare object, ``keys_of(obj)`` gives them when the
    story is read.  The cheapest entry is one flat tuple ``(stimulus_id, name, *ids)`` (its
    second item a string): ``what`` is ``(name, *ids)`` and it is found by its ids.  Made of
    strings, it costs one allocation and the collector stops tracking it, where an event
    object kept in the story stays tracked until it falls out.
    """

    def __init__(self, maxlen: int = 100_000, keys_of: Any = None) -> None:
        self.entries: deque[tuple[str, Any, tuple | None]] = deque(maxlen=maxlen)
        self.keys_of = keys_of

    def log(self, stimulus_id: str, what: Any, keys: Iterable[str]) -> None:
        if not isinstance(what, tuple):
            what = _describe(what)
        self.entries.append((stimulus_id, what, keys if type(keys) is tuple else tuple(keys)))

    def about(self, *keys: str) -> list[tuple[str, tuple]]:
        wanted = {k for k in keys if k}
        out = []
        for entry in self.entries:
            sid, what, ks = _unpack(entry)
            if ks is None:
                ks = self.keys_of(what)
            if not wanted.isdisjoint(ks):
                out.append((sid, what if type(what) is tuple else (what,)))
        return out

    def dump(self, *keys: str) -> str:
        """The story of ``keys`` (or everything) as text, one entry a line."""
        rows = self.about(*keys) if keys else [
            (s, w if type(w) is tuple else (w,)) for s, w, _ in map(_unpack, self.entries)]
        return "\n".join(f"{sid:>24}  {' '.join(map(str, what))}" for sid, what in rows)


def _unpack(entry: Any) -> tuple:
    """``(stimulus_id, what, keys)`` of a story entry (a bare event or instruction: no keys)."""
    if type(entry) is tuple:
        if type(entry[1]) is str:  # flat: (stimulus_id, name, *ids)
            return entry[0], entry[1:], entry[2:]
        return entry
    return entry.stimulus_id, entry, None
