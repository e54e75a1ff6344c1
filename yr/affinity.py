"""``yr.affinity``: scheduling affinities (re-exported from yrdask.affinity)."""

from yrdask.affinity import (Affinity, AffinityKind, AffinityScope, AffinityType,  # noqa: F401
                             LabelOperator, OperatorType)

__all__ = ["Affinity", "AffinityKind", "AffinityScope", "AffinityType", "LabelOperator",
           "OperatorType"]
