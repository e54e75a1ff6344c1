"""The ``yrdask`` command: ``yrdask status [ADDRESS]`` prints a yr cluster in the terminal.

It asks the scheduler with the ``yr_cluster_info`` rpc (:class:`yrdask.protocol.ClusterInfo`)
and prints its workers (capacity and held per resource), the totals per resource (CPU in
millicores, 1000 = one core; Memory in MB), the instances (counts by state, then a table),
why requests wait for resources, and the instances that ended recently (newest first).  ADDRESS defaults to ``$YR_SERVER_ADDRESS``; TLS
settings come from Dask's config (``distributed.comm.tls.*``), as for any Dask client.
Also ``python -m yrdask status``.  Exit codes: 0 ok, 1 the scheduler could not be asked,
2 bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any, Sequence

from yrdask import protocol as P

STATE_ORDER = {P.ALIVE: 0, P.PENDING: 1, P.RESTARTING: 2, P.DEAD: 3}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``yrdask`` console script; returns the exit code."""
    parser = argparse.ArgumentParser(prog="yrdask", description="yrdask cluster tools")
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="print the workers, resources and instances",
                            description=__doc__.split("\n\n")[0])
    status.add_argument("address", nargs="?", default=None,
                        help="scheduler address (default: $YR_SERVER_ADDRESS)")
    status.add_argument("--limit", type=int, default=50,
                        help="instance rows to print (default 50; 0 = all)")
    status.add_argument("--json", action="store_true", help="print the raw reply as JSON")
    status.add_argument("--timeout", type=float, default=10.0,
                        help="seconds to wait for the scheduler (default 10)")
    args = parser.parse_args(argv)
    address = args.address or os.environ.get("YR_SERVER_ADDRESS")
    if not address:
        print("yrdask status: no scheduler address; pass one (yrdask status "
              "tcp://HOST:8786) or set YR_SERVER_ADDRESS", file=sys.stderr)
        return 2
    try:
        info = asyncio.run(fetch_cluster_info(address, args.timeout))
    except NoYrExtension as e:
        print(f"yrdask status: cannot get the cluster state from {address}: {e}",
              file=sys.stderr)
        return 1
    except (OSError, asyncio.TimeoutError) as e:  # nothing listens there, or no answer
        why = str(e) or f"{type(e).__name__}: no answer within {args.timeout:g} s"
        print(f"yrdask status: cannot get the cluster state: could not connect to "
              f"{address}: {why}", file=sys.stderr)
        return 1
    except Exception as e:  # anything else the scheduler or the comm raised
        hint = (f"; {NO_YR}" if "yr_cluster_info" in str(e) else "")
        print(f"yrdask status: cannot get the cluster state from {address}: "
              f"{type(e).__name__}: {e}{hint}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True, default=str))
    else:
        print(format_status(address, info, args.limit))
    return 0


NO_YR = ("the scheduler has no yrdask extension: start it with `dask scheduler --preload "
         "yrdask` (or the Dask config in plugins/yrdask.yaml)")


class NoYrExtension(RuntimeError):
    """The scheduler answered, but yrdask is not installed on it."""


async def fetch_cluster_info(address: str, timeout: float) -> P.ClusterInfoReply:
    """The scheduler's ``yr_cluster_info`` reply.

    Raises :class:`NoYrExtension` when the scheduler has no yr extension (Dask answers an
    unknown op with nothing), ``OSError`` / ``asyncio.TimeoutError`` when it cannot be
    reached.
    """
    from distributed.core import rpc
    from distributed.security import Security

    args = Security().get_connection_args("client")
    async with rpc(address, timeout=timeout, connection_args=args) as scheduler:
        info = await asyncio.wait_for(P.request(scheduler, P.ClusterInfo()), timeout)
    if not isinstance(info, dict) or "workers" not in info:
        raise NoYrExtension(NO_YR)
    return info


def format_status(address: str, info: dict[str, Any], limit: int = 50) -> str:
    """The terminal report of a ``yr_cluster_info`` reply (see module docstring)."""
    workers: dict[str, dict] = info.get("workers") or {}
    instances: list[dict] = info.get("instances") or []
    resources = sorted({r for w in workers.values() for r in (*w["capacity"], *w["held"])},
                       key=lambda r: (r not in ("CPU", "Memory"), r))
    out = [f"yrdask cluster {address}", f"dashboard: {info.get('dashboard') or 'none'}", ""]
    out.append(f"Workers ({len(workers)})  held / capacity (CPU in millicores: 1000 = one "
               "core; Memory in MB)")
    out.append(table(["WORKER", *resources], [
        [addr, *(f"{w['held'].get(r, 0):g} / {w['capacity'].get(r, 0):g}" for r in resources)]
        for addr, w in sorted(workers.items())]))
    out += ["", "Resources"]
    rows = []
    for r in resources:
        cap = sum(w["capacity"].get(r, 0) for w in workers.values())
        held = sum(w["held"].get(r, 0) for w in workers.values())
        rows.append([r, f"{cap:g}", f"{held:g}", f"{cap - held:g}",
                     f"{100 * held / cap:.0f}%" if cap else "-", _unit(r, held, cap)])
    out.append(table(["RESOURCE", "CAPACITY", "HELD", "FREE", "USED", "UNIT"], rows))
    counts = {s: 0 for s in STATE_ORDER}
    for inst in instances:
        counts[inst["state"]] = counts.get(inst["state"], 0) + 1
    out += ["", f"Instances ({len(instances)}): "
            + ", ".join(f"{s} {n}" for s, n in counts.items())]
    if instances:
        ordered = sorted(instances, key=lambda i: (STATE_ORDER.get(i["state"], 9),
                                                   i.get("created_at") or 0))
        shown = ordered if limit <= 0 else ordered[:limit]
        now = time.time()
        out.append(table(
            ["ID", "NAME", "CLASS", "STATE", "WORKER", "OWNER", "RESTARTS", "RESOURCES", "AGE"],
            [[i["instance_id"], _name(i), i.get("class") or "", i["state"], i.get("worker") or "-",
              i.get("owner") or "", str(i.get("restarts", 0)), _shape(i.get("resources")),
              _age(now - (i.get("created_at") or now))] for i in shown]))
        if len(shown) < len(ordered):
            out.append(f"... {len(ordered) - len(shown)} more (--limit 0 shows all)")
    rows: list[dict] = info.get("waiting") or []
    waiting = [w for w in rows if w.get("problem", True)]  # queueing is only counted
    if len(rows) > len(waiting):
        out += ["", f"Queued behind their own job's work: {len(rows) - len(waiting)} "
                    "requests (normal: they run as that work ends)"]
    if waiting:
        out += ["", f"Waiting for resources ({len(waiting)})"]
        for w in waiting:
            job = f", job {w['job']}" if w.get("job") else ""
            why = f" ({w['problem']})" if w.get("problem") else ""
            out.append(f"  {w['what']}{job}: needs {_shape(w.get('needs'))}, waiting "
                       f"{w.get('waited_s') or 0:.0f} s{why}")
            out += [f"    {reason}" for reason in w.get("reasons") or ()]
        out.append(f"  {waiting[0].get('fix', '')}")
    if "ended" in info:
        ended: list[dict] = info.get("ended") or []
        shown_ended = ended if limit <= 0 else ended[:limit]
        out += ["", f"Ended ({len(ended)} kept, newest first)"]
        now = time.time()
        out.append(table(
            ["ID", "NAME", "CLASS", "JOB", "WORKER", "ENDED", "WHY"],
            [[t["instance_id"], _name(t), t.get("class") or "", t.get("job") or "",
              t.get("worker") or "-", _age(now - (t.get("ended_at") or now)) + " ago",
              t.get("reason") or ""] for t in shown_ended]))
        if len(shown_ended) < len(ended):
            out.append(f"... {len(ended) - len(shown_ended)} more (--limit 0 shows all)")
    counters = info.get("counters") or {}
    if counters:
        out += ["", "Leases: " + ", ".join(f"{k} {v}" for k, v in sorted(counters.items()))]
    placement = info.get("placement") or {}
    if placement:
        out.append("Placement: " + "; ".join(
            f"{kind} {p['count']} (p50 {p['p50_ms']:.2f} ms, p99 {p['p99_ms']:.2f} ms)"
            for kind, p in sorted(placement.items())))
    return "\n".join(out)


def table(headers: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns separated by two spaces, under an upper-case header."""
    if not rows:
        return "  (none)"
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    return "\n".join("  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
                     for r in [headers, *rows])


def _name(inst: dict) -> str:
    name, ns = inst.get("name") or "", inst.get("namespace") or ""
    return f"{ns}/{name}" if ns and name else name or "-"


def _unit(resource: str, held: float, capacity: float) -> str:
    if resource == "CPU":
        return f"millicores ({held / 1000:g} of {capacity / 1000:g} cores)"
    return {"Memory": "MB"}.get(resource, "")


def _shape(shape: dict | None) -> str:
    return ", ".join(f"{r}={a:g}" for r, a in sorted((shape or {}).items())) or "-"


def _age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h"


if __name__ == "__main__":
    sys.exit(main())
