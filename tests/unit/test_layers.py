"""The package keeps its layers: every import (inside functions too) goes to an allowed floor,
and no import cycle exists.  docs/architecture.md draws the same table."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import yrdask

ROOT = Path(yrdask.__file__).parent

#: base modules: import nothing of yrdask but other base modules.
BASE = {"protocol", "errors", "options", "field_specs", "affinity", "serialization", "config",
        "stream", "statemachine", "words"}

#: floor -> the floors it may import (besides itself and base).
ALLOWED: dict[str, set[str]] = {
    "base": set(),
    "runtime": set(),
    "scheduler": set(),
    "worker": {"runtime"},
    "dashboard": set(),
    "api": {"runtime", "deploy"},
    "deploy": {"runtime", "scheduler", "worker", "dashboard"},
    "ray": {"api", "runtime"},
    "dask": {"runtime"},  # yrdask/dask.py: yr objects in Dask graphs
    "decorator": {"api"},  # yrdask/decorator/: openYuanrong's module paths of the proxies
    "cli": set(),
    "top": {"api", "runtime", "deploy", "decorator"},  # yrdask/__init__.py: the public names
}


def floor_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "top"
    head = parts[1]
    if head in BASE:
        return "base"
    if head in ("__main__", "cli"):
        return "cli"
    return head


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The yrdask modules ``module`` imports, anywhere in its body."""
    found = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_pkg else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module and target != "yrdask":
                found.add(target)
                break
    return found


GRAPH = {m: imports(m, p, set(modules())) for m, p in modules().items()}


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_go_to_allowed_floors(module):
    floor = floor_of(module)
    allowed = ALLOWED[floor] | {floor, "base"}
    bad = sorted(t for t in GRAPH[module] if floor_of(t) not in allowed)
    assert not bad, (f"{module} ({floor}) imports {bad}; {floor} may import only "
                     f"{sorted(allowed)} (see docs/architecture.md, 'Layers')")


def test_no_import_cycle():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_scheduler_never_sees_the_worker_or_the_facade():
    for module, targets in GRAPH.items():
        if floor_of(module) == "scheduler":
            assert not {floor_of(t) for t in targets} & {"worker", "api", "deploy", "runtime"}
