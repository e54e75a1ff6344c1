import time

T0 = time.monotonic()  # first line: init_s counts from here, before any library is imported

"""One measurement in a fresh interpreter: ``python -m benchmarks._one SYSTEM FIGURE PARAMS``.

Starts SYSTEM's 2-worker-process cluster, measures FIGURE with the JSON object PARAMS and
prints exactly one JSON line on stdout::

    {"system": ..., "figure": ..., "value": float | null, "extra": {...}, "error": str | null}

Exit code 0 on success, 1 when the figure raised (the traceback is in ``error``), 2 when the
system is not installed.
"""

import json  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402


def emit(system: str, figure: str, value, extra: dict, error: str | None = None) -> None:
    line = json.dumps({"system": system, "figure": figure, "value": value, "extra": extra,
                       "error": error})
    sys.stdout.write("\n" + line + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    system_name, figure, params = argv[0], argv[1], json.loads(argv[2]) if len(argv) > 2 else {}
    from benchmarks.registry import load

    system = load(system_name)
    missing = system.available()
    if missing:
        emit(system_name, figure, None, {}, missing)
        return 2
    extra: dict = {}
    started = False
    from benchmarks.figures import FIGURES

    fig = FIGURES.get(figure)
    if fig is not None and fig.own_cluster:  # it starts its own (benchmarks/elastic.py)
        return _own_cluster(system, system_name, figure, params)
    try:
        system.start()
        started = True
        extra["init_returned_s"] = time.monotonic() - T0
        system.trivial_call()
        init_s = time.monotonic() - T0
        if figure in ("init_s", "scale_init_s"):
            value = init_s
        elif figure == "idle_pss_mb":
            from benchmarks.common import tree_pss_mb

            time.sleep(float(params.get("settle_s", 2.0)))
            value, more = tree_pss_mb()
            extra.update(more)
        else:
            impl = system.figures().get(figure)
            if impl is None:
                emit(system_name, figure, None, extra, f"{system_name} has no {figure}")
                return 0
            value, more = impl(params)
            extra.update(more)
        extra["init_s"] = init_s
    except BaseException:
        emit(system_name, figure, None, extra, traceback.format_exc())
        _stop(system, started)
        return 1
    emit(system_name, figure, float(value), extra)
    _stop(system, started)
    return 0


def _own_cluster(system, system_name: str, figure: str, params: dict) -> int:
    impl = system.figures().get(figure)
    if impl is None:
        emit(system_name, figure, None, {}, f"{system_name} has no {figure}")
        return 0
    try:
        value, extra = impl(params)
    except BaseException:
        emit(system_name, figure, None, {}, traceback.format_exc())
        return 1
    emit(system_name, figure, float(value), extra)
    return 0


def _stop(system, started: bool) -> None:
    if not started:
        return
    try:
        system.stop()
    except Exception:
        traceback.print_exc()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
