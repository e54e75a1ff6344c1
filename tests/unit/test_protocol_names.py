"""Every ``typing.Protocol`` class under ``yrdask/`` has a name of its own (an edge protocol
is named for its decisions class: docs/state-machines.md, "Names")."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "yrdask"


def _protocols() -> dict[str, list[str]]:
    """``{class name: [module, ...]}`` of the classes that derive from ``Protocol``."""
    found: dict[str, list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    (isinstance(b, ast.Name) and b.id == "Protocol")
                    or (isinstance(b, ast.Attribute) and b.attr == "Protocol")
                    for b in node.bases):
                found.setdefault(node.name, []).append(str(path.relative_to(ROOT.parent)))
    return found


def test_protocol_class_names_are_unique():
    found = _protocols()
    assert "SubmitterEdge" in found and "TaskSideEdge" in found  # the walk finds them
    twice = {name: where for name, where in found.items() if len(where) > 1}
    assert not twice, f"Protocol classes sharing a name (rename one): {twice}"


def test_edge_protocols_are_named_for_their_decisions_class():
    classes: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        classes[str(path.relative_to(ROOT.parent))] = {
            node.name for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef)}
    off = {name: where[0] for name, where in _protocols().items()
           if name.endswith("Edge") and name[:-len("Edge")] not in classes[where[0]]}
    assert not off, ("an edge protocol is its decisions class's name + 'Edge', in that "
                     f"class's module (docs/state-machines.md, 'Names'): {off}")


def test_no_class_inherits_a_decisions_class():
    """Production edges hold their decisions class (composition): none subclasses one."""
    decisions = {name[:-len("Edge")] for name in _protocols() if name.endswith("Edge")}
    assert {"Submitter", "CallRouter", "LeaseService"} <= decisions
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")
                         for b in node.bases}
                found += [f"{path.name}: {node.name}({b})" for b in bases & decisions]
    assert not found, f"hold the decisions class instead of inheriting it: {found}"
