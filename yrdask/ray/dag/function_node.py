"""``ray.dag.function_node.FunctionNode``: a task bound with ``f.bind(...)``."""

from __future__ import annotations

from typing import Any

from yrdask.ray.dag.dag_node import DAGNode

__all__ = ["FunctionNode"]


class FunctionNode(DAGNode):
    """``f.bind(*args, **kwargs)``: each ``execute`` submits ``f.remote(...)`` with the bound
    arguments (upstream nodes replaced by their refs) and gives its ``ObjectRef``."""

    def __init__(self, remote_function: Any, args: tuple, kwargs: dict,
                 other_args_to_resolve: dict | None = None) -> None:
        self._body = remote_function  # the @ray.remote function, with its options
        super().__init__(args, kwargs, remote_function._options, other_args_to_resolve)

    def _execute_impl(self, run: Any, args: tuple, kwargs: dict, other: dict) -> Any:
        return self._body.remote(*args, **kwargs)

    def __str__(self) -> str:
        return f"FunctionNode({getattr(self._body, '__qualname__', self._body)})"
