"""The words each API speaks, in one table: yr's and Ray's for the same situation.

yrdask's scheduler and runtime explain themselves in yr's words: options are
``InvokeOptions(cpu=..., memory=...)``, CPU is in millicores and memory in MB
(``{CPU: 1500, Memory: 512}``), stateful workers are *instances*, capacity comes from
``yr.init(Config(num_cpus=...))``.  A Ray program must see Ray's words only: ``num_cpus=``,
``resources=``, ``memory`` in bytes, resource dicts as Ray prints them (``{'CPU': 1.5}``),
*actors*, ``ray.init(num_cpus=...)``, ``max_retries``.  :data:`RAY_WORDS` is the one table
that maps every yr phrase a Ray program could meet (an error's message, a wait's explanation,
a warning) to Ray's; :func:`in_ray_words` applies it.  The Ray facade (``ray.get``'s errors,
``yrdask.ray.exceptions.from_yr_error``) and the scheduler's waits (for a Ray job) both go
through it, and ``tests/ray_surface/test_ray_words.py`` walks every row.  yr programs keep
yr's words: nothing here touches their text.  Pure functions, no imports of yrdask.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

#: yr's remedy, ending every "cannot be placed" explanation for a yr job.
FIX_HINT = ("To place it: ask for less with InvokeOptions(cpu=..., memory=...) (cpu in "
            "millicores, 1000 = one core; memory in MB), end instances that hold what it "
            "needs, or add capacity: yr.init(Config(num_cpus=...)) for the embedded cluster, "
            "or more or larger workers.")

#: Ray's remedy for the same.
RAY_FIX_HINT = ("To place it: ask for less with .options(num_cpus=..., num_gpus=..., "
                "resources={...}) (or in @ray.remote), end actors that hold what it needs "
                "(ray.kill), or add capacity: ray.init(num_cpus=...) for a local cluster, or "
                "more or larger workers.")

#: words of yr's API that a Ray program must never see (the walk of the table checks them).
YR_ONLY = ("InvokeOptions", "millicore", "Config(", "yr.init", "yr.get", "yr.wait",
           "retry_times", "max-task-crashes", "instance", "Memory:", "CPU: ",
           "schedule_timeout_ms", "own bound")


def ray_resources(shape: dict[str, float]) -> str:
    """yr's amounts as Ray prints a resource dict: ``{"CPU": 1500, "Memory": 512}`` ->
    ``"{'CPU': 1.5, 'memory': 536870912.0}"`` (memory left out when 0, as Ray's requests)."""
    out: dict[str, float] = {}
    for name, amount in shape.items():
        if name == "CPU":
            out["CPU"] = amount / 1000
        elif name == "Memory":
            if amount:
                out["memory"] = float(amount * 2**20)
        else:
            out[name] = float(amount)
    return repr(out)


def ray_shape(shape: dict[str, float]) -> str:
    """``{"CPU": 1500, "Memory": 0, "GPU": 1}`` -> ``"num_cpus=1.5, num_gpus=1"`` (Ray's
    arguments; custom tags as ``resources={...}``; memory only when asked for, in bytes)."""
    parts = []
    if shape.get("CPU"):
        parts.append(f"num_cpus={shape['CPU'] / 1000:g}")
    if shape.get("GPU"):
        parts.append(f"num_gpus={shape['GPU']:g}")
    if shape.get("Memory"):
        parts.append(f"memory={shape['Memory'] * 2**20:.0f}")
    custom = {r: a for r, a in sorted(shape.items()) if r not in ("CPU", "GPU", "Memory")}
    if custom:
        parts.append("resources={" + ", ".join(f"{r!r}: {a:g}" for r, a in custom.items())
                     + "}")
    return ", ".join(parts) or "nothing"


_AMOUNT = re.compile(r"^(?P<name>[^'\"{}]+): (?P<amount>-?\d+(?:\.\d+)?(?:e[+-]?\d+)?)$")


def _yr_shape(m: re.Match) -> str:
    """A yr shape (``{CPU: 1500, Memory: 0, x: 1}``, as ``format_shape`` writes it) in Ray's
    form; anything else in braces is left as it is."""
    shape = {}
    for piece in m.group(1).split(", "):
        found = _AMOUNT.match(piece)
        if found is None:
            return m.group(0)
        shape[found["name"]] = float(found["amount"])
    if not {"CPU", "Memory"} & shape.keys():
        return m.group(0)
    return ray_resources(shape)


def _offer(m: re.Match) -> str:
    """``CPU=64000 (largest offer: 2000)`` -> ``num_cpus=64 (largest offer: 2)``."""
    name, need, most = m.group(1), float(m.group(2)), float(m.group(3))
    if name == "CPU":
        return f"num_cpus={need / 1000:g} (largest offer: {most / 1000:g})"
    return f"memory={need * 2**20:.0f} (largest offer: {most * 2**20:.0f})"


def _cpus(m: re.Match) -> str:
    need, free, cap = (float(x) / 1000 for x in m.groups())
    return f"needs {need:g} CPU, {free:g} of {cap:g} free"


@dataclass(frozen=True)
class Row:
    """One situation: the yr phrase (a pattern) and what a Ray program reads instead."""

    situation: str
    yr: re.Pattern
    ray: str | Callable[[re.Match], str]


def _row(situation: str, yr: str, ray: str | Callable[[re.Match], str]) -> Row:
    return Row(situation, re.compile(yr), ray)


#: yr phrase -> Ray phrase, applied in order (earlier rows first: the remedy before the
#: word "instances" in it, shapes before their amounts).
RAY_WORDS: tuple[Row, ...] = (
    _row("remedy of a request that cannot be placed", re.escape(FIX_HINT), RAY_FIX_HINT),
    _row("an argument of the session's start",
         r"\bConfig\.(num_cpus|num_gpus|resources|object_store_memory|log_level)\b",
         r"ray.init(\1=...)"),
    _row("options that ask for less", r"InvokeOptions\(cpu=\.\.\., memory=\.\.\.\)",
         ".options(num_cpus=..., memory=...)"),
    _row("amounts of a request or an offer",
         r"\{([^{}'\"]+: -?[\d.e+-]+(?:, [^{}'\"]+: -?[\d.e+-]+)*)\}", _yr_shape),
    _row("what no worker offers", r"\b(CPU|Memory)=([\d.]+) \(largest offer: ([\d.]+)\)",
         _offer),
    _row("what a waiting request lacks on a worker",
         r"needs CPU ([\d.]+), free ([\d.-]+) of ([\d.]+) millicores", _cpus),
    _row("the kind of work waiting", r"task lease request", "Ray task request"),
    _row("a stateful worker", r"\b([Ii])nstances?\b",
         lambda m: ("A" if m.group(1) == "I" else "a") + "ctor" + m.group(0)[8:]),
    _row("reruns after lost workers", r"its own bound of (\d+) reruns", r"max_retries=\1"),
    _row("reruns after the task's own crash",
         r"retry_times=(\d+) allows \(InvokeOptions\.retry_times reruns a task whose process "
         r"crashed\)", r"max_retries=\1 allows"),
    _row("a get that ran out of time", r"yr\.get", "ray.get"),
    _row("waiting forever", r"timeout=-1", "timeout=None"),
)


def in_ray_words(text: str) -> str:
    """``text`` (yr's words) as a Ray program should read it: every row of
    :data:`RAY_WORDS` applied."""
    for row in RAY_WORDS:
        text = row.yr.sub(row.ray, text)
    return text
