"""Ray's DAG API (``ray.dag``) on a real embedded cluster: ``.bind`` builds the graph,
``execute`` makes its calls as ordinary tasks and actor calls.

What Ray does and these tests hold: every node runs once per ``execute`` (a node used twice
is one call), an actor bound with ``Actor.bind`` is created anew by each ``execute`` and runs
the calls bound on it in the order they were bound, even those the output does not depend on;
a handle made with ``.remote()`` is the same actor on every ``execute``; ``InputNode`` is the
execute's input (whole, or ``[i]``, ``["key"]``, ``.attr``); nodes inside lists reach tasks as
refs.  Misuse fails at the call that made it, with Ray's message.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest

import yrdask.ray as ray
from yrdask.ray.dag import InputNode, MultiOutputNode
from yrdask.ray.dag.class_node import ClassMethodNode, ClassNode
from yrdask.ray.dag.function_node import FunctionNode

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import us

pytestmark = pytest.mark.timeout(120)


@ray.remote
def add(a, b=0):
    return a + b


@ray.remote
def peek(items):
    """What a task receives for a list holding an upstream node: a ref, and its value."""
    return type(items[0]).__name__, ray.get(items[0]) + items[1]


@ray.remote
class Counter:
    def __init__(self, start=0):
        self.n = start
        self.calls = []

    def inc(self, k=1):
        self.n += k
        self.calls.append(k)
        return self.n

    def history(self):
        return list(self.calls)


def test_function_nodes_chain_and_run_once_per_execute(ray_env):
    a = add.bind(1, b=2)
    assert isinstance(a, FunctionNode) and a.get_args() == (1,) and a.get_kwargs() == {"b": 2}
    b = add.bind(a, b=3)
    c = add.bind(b, b=a)  # `a` twice in the graph: one task per execute
    assert ray.get(c.execute()) == 9
    assert ray.get(a.execute()) == 3
    assert ray.get(peek.bind([add.bind(3, 4), 1]).execute()) == ("ObjectRef", 8)
    assert ray.get(add.options(name="named").bind(2, 5).execute()) == 7


def test_actor_nodes_are_new_per_execute_and_keep_bind_order(ray_env):
    c1 = Counter.bind(10)
    assert isinstance(c1, ClassNode)
    first = c1.inc.bind(1)
    assert isinstance(first, ClassMethodNode) and first.get_method_name() == "inc"
    assert ray.get(first.execute()) == 11
    assert ray.get(first.execute()) == 11  # a fresh actor each time
    c1.inc.bind(2)  # bound, not upstream of the output: still runs, in order
    c1.inc.bind(4)
    c2 = Counter.bind(100)
    out = MultiOutputNode([c1.history.bind(), c2.inc.bind(5), add.bind(c1.inc.bind(0), 1)])
    hist, c2_val, plus_one = ray.get(out.execute())
    assert hist == [1, 2, 4]  # history() was bound after inc(4): it runs after it
    assert c2_val == 105 and plus_one == 18


def test_a_handle_made_with_remote_is_reused_by_every_execute(ray_env):
    counter = Counter.remote(0)
    with InputNode() as inp:
        dag = MultiOutputNode([counter.inc.bind(inp)])
    assert ray.get(dag.execute(1)) == [1]
    assert ray.get(dag.execute(2)) == [3]
    assert ray.get(counter.history.remote()) == [1, 2]
    handle = Counter.bind(7).execute()
    assert isinstance(handle, ray.actor.ActorHandle)
    assert ray.get(handle.inc.remote(1)) == 8


def test_input_node_whole_indexed_keyed_and_attribute(ray_env):
    with InputNode() as inp:
        whole = add.bind(inp, 1)
        parts = add.bind(inp[0], inp.y)
        keyed = MultiOutputNode([add.bind(inp["x"], 1), add.bind(inp["y"], 1)])
    assert ray.get(whole.execute(2)) == 3
    assert ray.get(whole.execute(3)) == 4
    assert ray.get(parts.execute(1, y=2)) == 3
    assert ray.get(keyed.execute({"x": 1, "y": 2})) == [2, 3]

    class Point:
        y = 5

    with InputNode() as inp:
        attr = add.bind(inp.y, 1)
    assert ray.get(attr.execute(Point())) == 6


def test_misuse_fails_where_it_happens(ray_env):
    outside = InputNode()
    with pytest.raises(ValueError, match="context manager"):
        add.bind(outside, 1).execute(1)
    with InputNode() as i1:
        pass
    with InputNode() as i2:
        pass
    with pytest.raises(ValueError, match="only have one unique InputNode"):
        add.bind(i1, i2).execute(1)
    with pytest.raises(ValueError, match="ClassNode constructor"):
        Counter.bind(i1[0])
    with pytest.raises(ValueError, match="InputNode should not take any args"):
        InputNode(1)
    with pytest.raises(ValueError, match="Invalid input type"):
        MultiOutputNode(add.bind(1))
    node = add.bind(1)
    with pytest.raises(AttributeError, match=r"\.bind\(\) cannot be used again"):
        node.bind(2)
    with pytest.raises(AttributeError, match=r"use \.execute\(\)"):
        node.remote()
    with pytest.raises(AttributeError, match="no method 'nope'"):
        Counter.bind().nope
    with pytest.raises(TypeError, match=r"Counter\.inc\.bind\(\): too many"):
        Counter.remote().inc.bind(1, 2, 3)
    with pytest.raises(ray.exceptions.UnsupportedOptionError, match="Compiled Graphs"):
        node.experimental_compile()
