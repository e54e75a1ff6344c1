"""``ray.dag``: build a graph of task and actor calls with ``.bind(...)``, run it with
``dag.execute(...)`` (Ray's DAG API, without compiled graphs).  See
:mod:`yrdask.ray.dag.dag_node` for how an ``execute`` makes the calls."""

from yrdask.ray.dag.class_node import (PARENT_CLASS_NODE_KEY, PREV_CLASS_METHOD_CALL_KEY,
                                       ClassMethodNode, ClassNode)
from yrdask.ray.dag.dag_node import DAGNode
from yrdask.ray.dag.function_node import FunctionNode
from yrdask.ray.dag.input_node import DAGInputData, InputAttributeNode, InputNode
from yrdask.ray.dag.output_node import MultiOutputNode

__all__ = ["ClassMethodNode", "ClassNode", "DAGInputData", "DAGNode", "FunctionNode",
           "InputAttributeNode", "InputNode", "MultiOutputNode", "PARENT_CLASS_NODE_KEY",
           "PREV_CLASS_METHOD_CALL_KEY"]
