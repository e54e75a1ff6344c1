"""``ray.dag.class_node``: actors and actor calls in a DAG.

``Actor.bind(...)`` is a :class:`ClassNode`: each ``execute`` creates the actor anew.
``node.method.bind(...)`` on it is a :class:`ClassMethodNode` that also depends on the call
bound before it on the same node, so an ``execute`` makes the calls bound on one actor node
in the order they were bound, even those that are not upstream of the output (Ray's rule).
``handle.method.bind(...)`` on an actor made with ``.remote()`` calls that actor on every
``execute``; it has no earlier call to depend on.
"""

from __future__ import annotations

from typing import Any

from yrdask.errors import YRValueError
from yrdask.ray.dag.dag_node import DAGNode, nodes_in
from yrdask.ray.dag.input_node import InputAttributeNode, InputNode

__all__ = ["ClassMethodNode", "ClassNode", "PARENT_CLASS_NODE_KEY",
           "PREV_CLASS_METHOD_CALL_KEY"]

PARENT_CLASS_NODE_KEY = "parent_class_node"
PREV_CLASS_METHOD_CALL_KEY = "prev_class_method_call"


class ClassNode(DAGNode):
    """``Actor.bind(*args, **kwargs)``: the actor an ``execute`` creates (its handle)."""

    def __init__(self, actor_class: Any, args: tuple, kwargs: dict,
                 other_args_to_resolve: dict | None = None) -> None:
        self._body = actor_class  # the @ray.remote class, with its options
        self._last_call: ClassMethodNode | None = None
        super().__init__(args, kwargs, actor_class._options, other_args_to_resolve)
        if any(isinstance(n, (InputNode, InputAttributeNode))
               for n in nodes_in([self._bound_args, self._bound_kwargs])):
            raise YRValueError("InputNode handles user dynamic input the DAG, and cannot be "
                               "used as args, kwargs, or other_args_to_resolve in ClassNode "
                               "constructor because it is not available at class "
                               "construction or binding time: pass it to a method's .bind()")

    def _execute_impl(self, run: Any, args: tuple, kwargs: dict, other: dict) -> Any:
        return self._body.remote(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("bind", "remote"):
            return super().__getattr__(name)
        cls = self.__dict__["_body"]._cls
        if not callable(getattr(cls, name, None)):
            raise AttributeError(f"actor class {cls.__name__} has no method '{name}'")
        return _UnboundClassMethodNode(self, name, {})

    def __str__(self) -> str:
        return f"ClassNode({self._body.__qualname__})"


class _UnboundClassMethodNode:
    """``actor_node.method``: ``.bind(...)`` makes the call node, ``.options(...)`` sets its
    options first."""

    def __init__(self, actor: ClassNode, method_name: str, options: dict) -> None:
        self._actor, self._method_name, self._options = actor, method_name, options

    def bind(self, *args: Any, **kwargs: Any) -> "ClassMethodNode":
        node = ClassMethodNode(self._method_name, args, kwargs, self._options,
                               {PARENT_CLASS_NODE_KEY: self._actor,
                                PREV_CLASS_METHOD_CALL_KEY: self._actor._last_call})
        self._actor._last_call = node
        return node

    def options(self, **options: Any) -> "_UnboundClassMethodNode":
        return _UnboundClassMethodNode(self._actor, self._method_name,
                                       {**self._options, **options})

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        raise AttributeError(".remote() cannot be used on ClassMethodNodes. Use .bind() "
                             "instead to express an symbolic actor call.")


class ClassMethodNode(DAGNode):
    """An actor call in a DAG: ``execute`` calls the method on the actor (the class node's
    actor of this run, or the handle it was bound on) and gives its ``ObjectRef``."""

    def __init__(self, method_name: str, args: tuple, kwargs: dict, options: dict,
                 other_args_to_resolve: dict, method: Any = None) -> None:
        self._method_name = method_name
        self._method = method  # bound on a handle: its method, options already applied
        super().__init__(args, kwargs, options, other_args_to_resolve)

    def get_method_name(self) -> str:
        return self._method_name

    def _execute_impl(self, run: Any, args: tuple, kwargs: dict, other: dict) -> Any:
        method = self._method
        if method is None:
            method = getattr(other[PARENT_CLASS_NODE_KEY], self._method_name)
            if self._bound_options:
                method = method.options(**self._bound_options)
        return method.remote(*args, **kwargs)

    def __str__(self) -> str:
        return f"ClassMethodNode({self._method_name}())"
