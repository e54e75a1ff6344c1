"""``ray.dag.input_node``: the DAG's input, given to ``execute``, and parts of it.

``with InputNode() as inp:`` marks where the input of ``dag.execute(...)`` goes: ``inp``
itself is the input (one positional argument) or a :class:`DAGInputData` of all of them;
``inp[0]``, ``inp["key"]`` and ``inp.attr`` are one part of it.
"""

from __future__ import annotations

from typing import Any

from yrdask.errors import YRTypeError, YRValueError
from yrdask.ray.dag.dag_node import DAGNode

__all__ = ["DAGInputData", "InputAttributeNode", "InputNode"]

_IN_WITH = "__in_context_manager__"


class DAGInputData:
    """The input of an ``execute`` given as several arguments: ``[i]`` reads the i-th
    positional one, ``["name"]`` a keyword one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._args = list(args)
        self._kwargs = kwargs

    def __getitem__(self, key: int | str) -> Any:
        if isinstance(key, int):
            return self._args[key]
        if isinstance(key, str):
            return self._kwargs[key]
        raise YRValueError("Please only use int index or str as first-level key to access "
                           f"fields of dag input, got {key!r}")


class InputNode(DAGNode):
    """The DAG's input: use it inside ``with InputNode() as inp:`` and bind ``inp`` (or
    ``inp[i]``, ``inp["key"]``, ``inp.attr``) as arguments."""

    _is_input = True

    def __init__(self, *args: Any, input_type: Any = None, **kwargs: Any) -> None:
        if args or kwargs:
            raise YRValueError("InputNode should not take any args or kwargs: the input is "
                               "given to dag.execute(...)")
        self.__dict__["_parts"] = {}
        self.__dict__["input_type"] = input_type
        super().__init__((), {}, {}, {})

    def __enter__(self) -> "InputNode":
        self._bound_other_args_to_resolve[_IN_WITH] = True
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def _execute_impl(self, run: Any, args: tuple, kwargs: dict, other: dict) -> Any:
        if not other.get(_IN_WITH):
            raise YRValueError("InputNode is a singleton instance that should be only used in "
                               "context manager for dag building and execution: write "
                               "`with InputNode() as inp:` and bind inp inside the block")
        if len(run.args) == 1 and not run.kwargs:
            return run.args[0]
        return DAGInputData(*run.args, **run.kwargs)

    def _part(self, key: int | str, accessor: str) -> "InputAttributeNode":
        part = self._parts.get((key, accessor))
        if part is None:
            part = self._parts[(key, accessor)] = InputAttributeNode(self, key, accessor)
        return part

    def __getattr__(self, key: str) -> "InputAttributeNode":
        if key.startswith("__") or key in ("_parts", "input_type") or key in ("bind", "remote"):
            return super().__getattr__(key)
        return self._part(key, "__getattr__")

    def __getitem__(self, key: int | str) -> "InputAttributeNode":
        if not isinstance(key, (int, str)) or isinstance(key, bool):
            raise YRTypeError("Please only use int index or str as first-level key to access "
                              f"fields of dag input, got {key!r}")
        return self._part(key, "__getitem__")


class InputAttributeNode(DAGNode):
    """One part of the DAG's input: ``inp[0]``, ``inp["key"]`` or ``inp.attr``."""

    def __init__(self, dag_input_node: InputNode, key: int | str, accessor_method: str) -> None:
        self._key = key
        self._accessor_method = accessor_method
        super().__init__((), {}, {}, {"dag_input_node": dag_input_node})

    @property
    def key(self) -> int | str:
        return self._key

    def _execute_impl(self, run: Any, args: tuple, kwargs: dict, other: dict) -> Any:
        value = other["dag_input_node"]
        if isinstance(value, DAGInputData) or isinstance(self._key, int) or \
                self._accessor_method == "__getitem__":
            return value[self._key]
        return getattr(value, self._key)
