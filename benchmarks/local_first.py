"""``python -m benchmarks.local_first``: yrdask's nested figures with local-first on and off.

Runs ``nested_task_ms`` (sequential nested round trip inside a task) and
``nested_tasks_1k_per_s`` (a task submitting 1000 tasks, then gathering them) for yrdask in
fresh processes (:mod:`benchmarks._one`), once with the Dask config key
``yrdask.scheduling.local-first`` set to True and once to False, through the environment
variable ``DASK_YRDASK__SCHEDULING__LOCAL_FIRST`` (the embedded cluster's workers inherit it).
Progress goes to stderr; stdout gets one JSON document with the medians per setting.

Each run also reports, from inside the outer task: the value of the key as the worker sees it
(``local_first_config``; the environment variable sets it even where yrdask ignores it),
whether the running yrdask's files mention the key at all (``local_first_in_yrdask``: when
False, both settings run the same code) and the fraction of inner tasks that ran in the outer
task's own process (``inner_same_process_fraction``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from benchmarks.figures import FIGURES
from benchmarks.run import machine_info, run_one

ENV_VAR = "DASK_YRDASK__SCHEDULING__LOCAL_FIRST"
FIGURE_NAMES = ("nested_task_ms", "nested_tasks_1k_per_s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.local_first",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="fresh-process runs per setting")
    ap.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    args = ap.parse_args(argv)

    out: dict = {"config_key": "yrdask.scheduling.local-first", "env_var": ENV_VAR,
                 "runs": args.runs, "quick": args.quick, "machine": machine_info(),
                 "figures": {}}
    failures = 0
    for name in FIGURE_NAMES:
        fig = FIGURES[name]
        params = {**fig.parameters(args.quick), "quick": args.quick}
        per_setting: dict = {}
        for run in range(args.runs):
            for setting in (True, False):  # interleaved, so drift of the machine hits both
                rec = run_one("yrdask", name, params, fig.timeout_s, env={ENV_VAR: str(setting)})
                slot = per_setting.setdefault(str(setting), {
                    "values": [], "seen_config": [], "key_in_yrdask": [],
                    "inner_same_process_fraction": [], "errors": []})
                if rec.get("value") is None:
                    failures += 1
                    slot["errors"].append(rec.get("error"))
                else:
                    extra = rec.get("extra", {})
                    slot["values"].append(rec["value"])
                    slot["seen_config"].append(extra.get("local_first_config"))
                    slot["key_in_yrdask"].append(extra.get("local_first_in_yrdask"))
                    slot["inner_same_process_fraction"].append(
                        extra.get("inner_same_process_fraction"))
                print(f"{name} local-first={setting} run {run + 1}: {rec.get('value')} "
                      f"{fig.unit} (config seen in task: "
                      f"{rec.get('extra', {}).get('local_first_config')!r})",
                      file=sys.stderr, flush=True)
        for slot in per_setting.values():
            slot["median"] = statistics.median(slot["values"]) if slot["values"] else None
        on, off = per_setting["True"]["median"], per_setting["False"]["median"]
        used = any(v for s in per_setting.values() for v in s["key_in_yrdask"])
        out["figures"][name] = {
            "unit": fig.unit, "params": params, "settings": per_setting,
            "ratio_on_over_off": on / off if on is not None and off else None,
            "key_in_yrdask": used,
            "note": None if used else (
                "this yrdask does not read yrdask.scheduling.local-first (its files never "
                "mention it): the workers saw the key only because the environment variable "
                "set it, and both settings ran the same code"),
        }
    out["summary"] = {name: {"local_first_on": f["settings"]["True"]["median"],
                             "local_first_off": f["settings"]["False"]["median"],
                             "unit": f["unit"], "key_in_yrdask": f["key_in_yrdask"]}
                      for name, f in out["figures"].items()}
    print(json.dumps(out, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
