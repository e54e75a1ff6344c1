"""``python -m yrdask.worker.isolated``: the worker's zygote (:func:`~.zygote.zygote_main`)."""
from yrdask.worker.isolated.zygote import zygote_main

if __name__ == "__main__":
    zygote_main()
