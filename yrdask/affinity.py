"""Placement affinities (``InvokeOptions.schedule_affinities``), as in openYuanrong.

``Affinity(kind, type, [LabelOperator(op, key, values)])``:

* kind ``RESOURCE`` matches a worker's own labels: ``NODE_ID`` (its Dask address, what
  ``yr.get_node_id()`` returns), ``NODE_IP`` and each resource tag it offers (value: the
  amount, as a string); kind ``INSTANCE`` matches the ``labels`` of instances living there
  (``"key"`` or ``"key:value"``).
* The operators of one affinity are AND-ed; affinities of the same kind and type are OR-ed.
* ``REQUIRED`` / ``REQUIRED_ANTI`` are hard: a worker that does not (or does) match is never
  chosen.  ``PREFERRED`` / ``PREFERRED_ANTI`` are soft: they order the workers that fit.

The API turns affinities into a hashable wire form (:func:`to_wire`) that travels in lease
requests and instance specs; the scheduler's ledger evaluates it with :func:`evaluate`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping


class AffinityType(enum.IntEnum):
    PREFERRED = 1
    PREFERRED_ANTI = 2
    REQUIRED = 3
    REQUIRED_ANTI = 4


class AffinityKind(enum.IntEnum):
    RESOURCE = 10
    INSTANCE = 20


class AffinityScope(enum.IntEnum):
    POD = 1
    NODE = 2


class OperatorType(enum.IntEnum):
    LABEL_IN = 1
    LABEL_NOT_IN = 2
    LABEL_EXISTS = 3
    LABEL_NOT_EXISTS = 4


@dataclass
class LabelOperator:
    """One condition on a label: ``LabelOperator(OperatorType.LABEL_IN, "NODE_ID", [id])``."""

    operator_type: OperatorType
    key: str
    values: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        from yrdask.errors import YRTypeError, YRValueError

        try:
            self.operator_type = OperatorType(self.operator_type)
        except ValueError:
            raise YRValueError(f"LabelOperator: unknown operator_type {self.operator_type!r}") \
                from None
        if not isinstance(self.key, str) or not self.key:
            raise YRTypeError(f"LabelOperator: key must be a non-empty str, got {self.key!r}")
        self.values = list(self.values or [])
        if not all(isinstance(v, str) for v in self.values):
            raise YRTypeError(f"LabelOperator: values must be a list of str, got {self.values!r}")
        if self.operator_type in (OperatorType.LABEL_IN, OperatorType.LABEL_NOT_IN) \
                and not self.values:
            raise YRValueError(f"LabelOperator {self.operator_type.name} on {self.key!r} needs "
                               "values")


@dataclass
class Affinity:
    """``Affinity(AffinityKind.RESOURCE, AffinityType.REQUIRED, [LabelOperator(...)])``.

    ``label_operators`` may also be a single ``LabelOperator`` (as yr's docs write it); it is
    kept as a one-element list, so both forms schedule identically.
    """

    affinity_kind: AffinityKind
    affinity_type: AffinityType
    label_operators: list[LabelOperator]
    affinity_scope: AffinityScope | None = None

    def __post_init__(self) -> None:
        from yrdask.errors import YRTypeError, YRValueError

        if isinstance(self.label_operators, LabelOperator):
            self.label_operators = [self.label_operators]
        try:
            self.affinity_kind = AffinityKind(self.affinity_kind)
            self.affinity_type = AffinityType(self.affinity_type)
        except ValueError as e:
            raise YRValueError(f"Affinity: {e}") from None
        if not isinstance(self.label_operators, (list, tuple)) or not self.label_operators \
                or not all(isinstance(op, LabelOperator) for op in self.label_operators):
            raise YRTypeError("Affinity: label_operators must be a non-empty list of "
                              f"LabelOperator, got {self.label_operators!r}")


Wire = tuple  # ((kind, type, ((op, key, (values...)), ...)), ...)


def to_wire(affinities: Iterable[Affinity]) -> Wire:
    """The hashable, msgpack-able form of a list of affinities (``()`` for none)."""
    return tuple(
        (int(a.affinity_kind), int(a.affinity_type),
         tuple((int(op.operator_type), op.key, tuple(op.values)) for op in a.label_operators))
        for a in affinities)


def _op_holds(op: Any, labels: Mapping[str, set[str]]) -> bool:
    kind, key, values = op
    present = labels.get(key)
    if kind == OperatorType.LABEL_IN:
        return present is not None and bool(present & set(values))
    if kind == OperatorType.LABEL_NOT_IN:
        return present is None or not (present & set(values))
    if kind == OperatorType.LABEL_EXISTS:
        return present is not None
    return present is None  # LABEL_NOT_EXISTS


def evaluate(wire: Wire, labels_of: Mapping[int, Mapping[str, set[str]]]) -> tuple[bool, int]:
    """``(allowed, preference)`` of one worker whose labels by kind are ``labels_of``.

    ``allowed`` is False when a hard rule rejects the worker; ``preference`` counts the soft
    rules it satisfies (higher is better).
    """
    matched: dict[tuple[int, int], bool] = {}
    for kind, typ, ops in wire:
        ok = all(_op_holds(op, labels_of.get(kind, {})) for op in ops)
        matched[(kind, typ)] = matched.get((kind, typ), False) or ok
    allowed, preference = True, 0
    for (kind, typ), ok in matched.items():
        if typ == AffinityType.REQUIRED and not ok:
            allowed = False
        elif typ == AffinityType.REQUIRED_ANTI and ok:
            allowed = False
        elif typ == AffinityType.PREFERRED and ok:
            preference += 1
        elif typ == AffinityType.PREFERRED_ANTI and not ok:
            preference += 1
    return allowed, preference


def parse_labels(labels: Iterable[str]) -> dict[str, set[str]]:
    """Instance labels ``"key"`` / ``"key:value"`` as ``{key: {values}}``."""
    out: dict[str, set[str]] = {}
    for label in labels:
        key, _, value = label.partition(":")
        out.setdefault(key, set()).add(value)
    return out


def describe(wire: Wire) -> str:
    """A readable form for error messages."""
    parts = []
    for kind, typ, ops in wire:
        conds = " and ".join(
            f"{key} {OperatorType(op).name}" + (f" {list(values)}" if values else "")
            for op, key, values in ops)
        parts.append(f"{AffinityType(typ).name} {AffinityKind(kind).name}({conds})")
    return "; ".join(parts)
