"""``ray.dag.DAGNode``: a call bound with ``.bind(...)`` and not yet made, and ``execute``.

A DAG is built from nodes that hold a call and its bound arguments; arguments may be other
nodes, also inside lists, tuples and dicts.  ``node.execute(*args, **kwargs)`` makes the
calls bottom-up with the ordinary ``.remote()`` of the functions and actors (Ray's
"interpreted" DAG): every node runs once per ``execute``, its value (an ``ObjectRef``, an
actor handle, the input) standing in for it wherever it is an argument, so a function node
gives the refs of its upstream tasks to its own task and an actor node made by ``bind``
creates a new actor on each ``execute``.  Compiled graphs (``experimental_compile``) are
not supported.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable

from yrdask.errors import YRValueError
from yrdask.ray.exceptions import UnsupportedOptionError

__all__ = ["DAGNode", "substitute"]


def substitute(value: Any, fn: Callable[["DAGNode"], Any]) -> Any:
    """``value`` with every node in it (also inside lists, tuples and dicts) replaced by
    ``fn(node)``; values without nodes come back as they are."""
    if isinstance(value, DAGNode):
        return fn(value)
    if isinstance(value, (list, tuple)):
        items = [substitute(v, fn) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return type(value)(items) if type(value) in (list, tuple) else type(value)(*items)
    if isinstance(value, dict):
        items = {k: substitute(v, fn) for k, v in value.items()}
        if all(items[k] is v for k, v in value.items()):
            return value
        return type(value)(items)
    return value


def nodes_in(value: Any) -> list["DAGNode"]:
    """The nodes in ``value`` (as :func:`substitute` finds them), each once, in order."""
    found: dict[int, DAGNode] = {}

    def note(node: DAGNode) -> DAGNode:
        found.setdefault(id(node), node)
        return node

    substitute(value, note)
    return list(found.values())


class _Run:
    """One ``execute``: each node's value, made once, bottom-up."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        self.args, self.kwargs = args, kwargs
        self.values: dict[str, Any] = {}
        self.input_node: str | None = None

    def value(self, node: "DAGNode") -> Any:
        key = node._stable_uuid
        if key not in self.values:
            if node._is_input:
                if self.input_node not in (None, key):
                    raise YRValueError("Each DAG should only have one unique InputNode: this "
                                       "DAG reads two; bind every input of one DAG to the "
                                       "node of one `with InputNode() as inp:` block")
                self.input_node = key
            args = substitute(node._bound_args, self.value)
            kwargs = substitute(node._bound_kwargs, self.value)
            other = substitute(node._bound_other_args_to_resolve, self.value)
            self.values[key] = node._execute_impl(self, args, kwargs, other)
        return self.values[key]


class DAGNode:
    """A bound call: its arguments (``get_args``/``get_kwargs``), its options
    (``get_options``) and the other nodes it depends on (``get_other_args_to_resolve``)."""

    _is_input = False  # the DAG's InputNode: one per DAG

    def __init__(self, args: Any, kwargs: dict | None, options: dict | None,
                 other_args_to_resolve: dict | None) -> None:
        self._bound_args = tuple(args or ())
        self._bound_kwargs = dict(kwargs or {})
        self._bound_options = dict(options or {})
        self._bound_other_args_to_resolve = dict(other_args_to_resolve or {})
        self._stable_uuid = uuid.uuid4().hex

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        """Make the DAG's calls; ``args``/``kwargs`` are the DAG's input (``InputNode``).
        Returns this node's value: an ``ObjectRef`` for a function or method node, a list
        of them for a ``MultiOutputNode``, an actor handle for a class node."""
        return _Run(args, kwargs).value(self)

    def experimental_compile(self, *args: Any, **kwargs: Any) -> Any:
        """Ray's compiled graphs: not supported (they need Ray's shared-memory channels and
        actors' dedicated execution loops)."""
        raise UnsupportedOptionError(
            "DAGNode.experimental_compile() (Ray Compiled Graphs) is not supported by "
            "yrdask.ray: it needs Ray's shared-memory channels between actors. Run the DAG "
            "with dag.execute(...) instead: the same calls, made as ordinary tasks and actor "
            "calls on each execute")

    def get_args(self) -> tuple:
        return self._bound_args

    def get_kwargs(self) -> dict:
        return dict(self._bound_kwargs)

    def get_options(self) -> dict:
        return dict(self._bound_options)

    def get_other_args_to_resolve(self) -> dict:
        return dict(self._bound_other_args_to_resolve)

    def get_stable_uuid(self) -> str:
        return self._stable_uuid

    def _execute_impl(self, run: _Run, args: tuple, kwargs: dict, other: dict) -> Any:
        """This node's value, its arguments already resolved by ``run``."""
        raise NotImplementedError

    def __getattr__(self, name: str) -> Any:
        if name == "bind":
            raise AttributeError(f".bind() cannot be used again on {type(self).__name__}")
        if name == "remote":
            raise AttributeError(f".remote() cannot be used on {type(self).__name__}. To "
                                 "execute the task graph for this node, use .execute().")
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
