"""Drive one pure state machine in a unit test: numbered stimulus ids, validate() after each."""

from __future__ import annotations

from typing import Any


class MachineHarness:
    """``h(EventType, *fields)`` feeds the machine ``h.m`` and returns its instructions."""

    def __init__(self, machine: Any) -> None:
        self.m = machine
        self.n = 0

    def __call__(self, event_type: type, *args: Any, **kwargs: Any) -> list:
        self.n += 1
        out = self.m.handle(event_type(f"s{self.n}", *args, **kwargs))
        self.m.validate()
        return out
