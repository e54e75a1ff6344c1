"""``python -m benchmarks.init_timeline [--workers N]``: where ``yr.init`` spends its time.

One ``yr.init()`` of the embedded cluster until its first result, as ``init_s`` times it, with
the time of each step on the critical path (docs/changelog/performance-history.md,
"2026-11-26: Start-up with many worker processes"): the launcher's start, the driver's scheduler, the start order, each worker
process's fork and each yr worker's registration; then the CPU each process spent.
``--workers N`` starts N worker processes whatever the number of cores (each offering one CPU,
as ``num_cpus=N`` on an N-core host would): with more processes than cores it measures the
CPU start-up costs per process, not the wall time an N-core host would see.  Timing hooks are
wrapped around yrdask's functions in this process only; nothing in yrdask changes.
"""

import time

T0 = time.monotonic()  # first statement: the timeline counts from here, as init_s does
W0 = time.time()

import argparse  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402

EVENTS: list[tuple[float, str]] = []
SAMPLES: list[tuple[float, float, int]] = []


def mark(what: str) -> None:
    EVENTS.append((time.monotonic() - T0, what))


def _sample_launcher(pid: int) -> None:
    """The launcher's CPU time and number of children every 20 ms (when it imports, forks)."""
    import psutil

    try:
        p = psutil.Process(pid)
        while True:
            ct = p.cpu_times()
            SAMPLES.append((time.monotonic() - T0, ct.user + ct.system, len(p.children())))
            time.sleep(0.02)
    except psutil.Error:
        return


def _hook(workers: int | None) -> None:
    import yrdask.deploy.embedded as emb

    if workers is not None:
        emb.worker_layout = lambda num_cpus: (workers, [1000] * workers)
    cls = emb.EmbeddedCluster
    launch, start = cls.launch, cls.start

    def timed_launch(self) -> None:
        first = self.proc is None
        launch(self)
        if first:
            mark("launcher started (Popen returned)")
            threading.Thread(target=_sample_launcher, args=(self.proc.pid,), daemon=True).start()

    async def timed_start(self, *args, **kwargs) -> str:
        mark("driver: cluster.start (distributed imported)")
        import yrdask.deploy.preload as preload

        install = preload.install_scheduler

        def timed_install(scheduler):
            ext = install(scheduler)
            mark("driver: scheduler built, yr extension installed")
            add = ext._add_worker

            def timed_add(*args, **kwargs):
                add(*args, **kwargs)
                mark(f"driver: yr worker {len(ext.ledger.processes)} registered")

            ext._add_worker = timed_add
            return ext

        preload.install_scheduler = timed_install
        stdin = self.proc.stdin

        class TimedPipe:
            def write(self, data: bytes) -> int:
                mark("driver: start order sent to the launcher")
                return stdin.write(data)

            def __getattr__(self, name):
                return getattr(stdin, name)

        self.proc.stdin = TimedPipe()
        try:
            return await start(self, *args, **kwargs)
        finally:
            self.proc.stdin = stdin
            mark("driver: every worker and nanny up")

    cls.launch, cls.start = timed_launch, timed_start


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.init_timeline", description=__doc__)
    ap.add_argument("--workers", type=int, default=None, metavar="N",
                    help="worker processes to start (default: one per core, as yr.init())")
    ap.add_argument("--samples", action="store_true",
                    help="also print the launcher's CPU time and children every 20 ms")
    args = ap.parse_args(argv)
    if args.workers is not None and args.workers < 1:
        ap.error("--workers must be at least 1")
    _hook(args.workers)
    import psutil

    import yrdask as yr

    yr.init(yr.Config(num_cpus=args.workers))
    mark("yr.init returned")
    yr.get(yr.invoke(_one).invoke())
    mark("first result")
    from yrdask.runtime import context

    launcher = psutil.Process(context.installed_runtime().cluster.proc.pid)
    children = launcher.children(recursive=True)
    cpu = {p.pid: sum(p.cpu_times()[:2]) for p in [launcher, *children]}
    # psutil's start times have their own clock: place them by the launcher's start.
    offset = [t for t, what in EVENTS if what.startswith("launcher started")][0] \
        - (launcher.create_time() - W0)
    forks = sorted(p.create_time() - W0 + offset for p in children)
    driver_cpu = sum(psutil.Process().cpu_times()[:2])
    yr.finalize()
    for t, what in sorted(EVENTS + [(f, "launcher: worker process forked") for f in forks]):
        print(f"{t:7.3f} s  {what}")
    if args.samples:
        last = None
        for t, c, k in SAMPLES:
            if (round(c, 2), k) != last:
                print(f"   launcher at {t:6.3f} s: {c:5.2f} s CPU, {k} children")
            last = (round(c, 2), k)
    work = sorted(cpu[p.pid] for p in children)
    print(f"CPU: driver {driver_cpu:.2f} s (scheduler included), launcher "
          f"{cpu[launcher.pid]:.2f} s, {len(work)} workers {sum(work):.2f} s "
          f"(each {work[0]:.3f}-{work[-1]:.3f} s)")


def _one() -> int:
    return 1


if __name__ == "__main__":
    main(sys.argv[1:])
