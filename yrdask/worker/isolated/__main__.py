"""``python -m yrdask.worker.isolated --zygote [--spares N] [--listen JSON]``: the worker's
zygote (:func:`~.zygote.zygote_main`), keeping ``N`` spare children (default 1) that listen
where ``JSON`` (``{"host": ..., "tls": {...}}``) says."""
import json
import sys

from yrdask.worker.isolated.zygote import zygote_main

if __name__ == "__main__":
    args = sys.argv[1:]
    zygote_main(int(args[args.index("--spares") + 1]) if "--spares" in args else 1,
                json.loads(args[args.index("--listen") + 1]) if "--listen" in args else {})
