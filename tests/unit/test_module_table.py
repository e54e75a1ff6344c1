"""docs/architecture.md's module table names every module under ``yrdask/`` and its one job."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\|\s*`(yrdask/[^`]+\.py)`\s*\|(.*)\|\s*$")


def table() -> dict[str, str]:
    """``{module path: job}`` from the rows of the table in docs/architecture.md."""
    rows: dict[str, str] = {}
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        m = ROW.match(line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} has two rows in docs/architecture.md"
            rows[m.group(1)] = m.group(2).strip()
    return rows


def test_every_module_has_a_row_naming_its_job():
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "yrdask").rglob("*.py")}
    rows = table()
    missing = sorted(modules - rows.keys())
    gone = sorted(rows.keys() - modules)
    assert not missing, f"add a row (module | its one job) to docs/architecture.md for {missing}"
    assert not gone, f"docs/architecture.md names modules that do not exist: {gone}"
    empty = sorted(m for m, job in rows.items() if not job)
    assert not empty, f"these rows name no job: {empty}"
