"""``python -m tests.sim --seed N``: replay one seed and print its story."""

import sys

from tests.sim.replay import main

sys.exit(main())
