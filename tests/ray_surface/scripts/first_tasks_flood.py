"""Floods fresh workers with first tasks of both APIs at once; prints one line per failure.

``python first_tasks_flood.py ADDRESS|embedded ROUNDS``: each round starts a fresh runtime
(an embedded cluster, or joins ADDRESS, whose workers the caller started fresh) and submits,
all at once, Ray tasks of 24 different functions, a failing Ray task, Ray actors, yr
functions and yr instances.  Each is the first of its kind on its worker, so the worker's
threads unpickle them (importing yrdask.ray and its submodules) at the same moment.
"""

import sys

import yrdask as yr
import yrdask.ray as ray
import yrdask.ray.util.queue


def ray_function(i):
    def f(x):
        return x + i

    f.__name__ = f.__qualname__ = f"f{i}"
    return ray.remote(num_cpus=0.05)(f)


@ray.remote(num_cpus=0.05)
def raiser():
    raise ValueError("raised on purpose")


@ray.remote(num_cpus=0.05)
def type_name(value):
    return type(value).__name__


#: arguments whose classes live in submodules of yrdask.ray (unpickling imports them)
ARGUMENTS = [ray.exceptions.RayTaskError("f", "tb", ValueError()), ray.util.queue.Empty(),
             ray.exceptions.GetTimeoutError("late")]


@ray.remote(num_cpus=0)
class Pinger:
    def ping(self):
        return "pong"


@yr.invoke(invoke_options=yr.InvokeOptions(cpu=50, memory=0))
def yr_double(x):
    return 2 * x


@yr.instance(invoke_options=yr.InvokeOptions(cpu=50, memory=0))
class YrCounter:
    def get(self):
        return 7


def flood() -> list[str]:
    failures = []

    def check(what, ref, expected):
        try:
            got = ray.get(ref, timeout=60) if isinstance(ref, ray.ObjectRef) else ref()
            if got != expected:
                failures.append(f"{what}: {got!r} != {expected!r}")
        except BaseException as e:  # noqa: BLE001 - reported
            if what == "raiser" and isinstance(e, ValueError):
                return
            failures.append(f"{what}: {type(e).__name__}: {str(e)[-1500:]}")

    # interleaved, so that each worker gets first work of every kind at the same moment:
    # each kind's unpickle enters yrdask.ray by another submodule
    tasks, actors, args, yr_refs, counters = [], [], [], [], []
    for i in range(8):
        actors.append(Pinger.remote())
        tasks.append(ray_function(i).remote(1))
        args.append(type_name.remote(ARGUMENTS[i % len(ARGUMENTS)]))
        yr_refs.append(yr_double.invoke(i))
        counters.append(YrCounter.invoke())
    failing = raiser.remote()
    for i, ref in enumerate(tasks):
        check(f"task f{i}", ref, 1 + i)
    for i, ref in enumerate(args):
        check("task with a yrdask.ray argument", ref, type(ARGUMENTS[i % len(ARGUMENTS)]).__name__)
    check("raiser", failing, None)
    for actor in actors:
        check("actor", actor.ping.remote(), "pong")
    for i, ref in enumerate(yr_refs):
        check("yr function", lambda ref=ref: yr.get(ref, timeout=60), 2 * i)
    for c in counters:
        check("yr instance", lambda c=c: yr.get(c.get.invoke(), timeout=60), 7)
    return failures


def half_imported() -> list[str]:
    """On a worker: the modules of yrdask.ray's import that are missing or still importing."""
    return [name for name in ("yrdask.ray", "yrdask.ray.actor", "yrdask.ray.remote_function",
                              "yrdask.ray.exceptions", "yrdask.ray.util.queue")
            if getattr(getattr(sys.modules.get(name), "__spec__", None), "_initializing", True)]


def main(address: str, rounds: int) -> None:
    from distributed import Client

    for _ in range(rounds):
        info = ray.init(num_cpus=2) if address == "embedded" else ray.init(address=address)
        # before any work reaches them, the workers have imported yrdask.ray whole (Dask's
        # Client.run imports none of it)
        with Client(info["address"], set_as_default=False) as client:
            for worker, missing in client.run(half_imported).items():
                if missing:
                    print("FAILED", worker, "is ready for work with", missing, "not imported")
        for line in flood():
            print("FAILED", line.replace("\n", " | "), flush=True)
        ray.shutdown()
        yr.finalize()
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
