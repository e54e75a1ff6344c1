"""``ray.dag.output_node.MultiOutputNode``: a DAG with several outputs."""

from __future__ import annotations

from typing import Any

from yrdask.errors import YRValueError
from yrdask.ray.dag.dag_node import DAGNode

__all__ = ["MultiOutputNode"]


class MultiOutputNode(DAGNode):
    """``MultiOutputNode([node, ...])``: ``execute`` returns the list of their values (the
    refs of their calls), in order."""

    def __init__(self, args: list | tuple, other_args_to_resolve: dict | None = None) -> None:
        if not isinstance(args, (list, tuple)):
            raise YRValueError(f"Invalid input type for `args`, {type(args)}: MultiOutputNode "
                               "takes a list of the DAG's output nodes")
        super().__init__(list(args), {}, {}, other_args_to_resolve)

    def _execute_impl(self, run: Any, args: tuple, kwargs: dict, other: dict) -> Any:
        return list(args)
