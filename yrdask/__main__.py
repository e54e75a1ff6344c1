"""``python -m yrdask status [ADDRESS]``: the ``yrdask`` command (see :mod:`yrdask.cli`)."""

import sys

from yrdask.cli import main

sys.exit(main())
