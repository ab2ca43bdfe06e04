"""``python -m moe_tune.env``: the same as ``moe-tune-env``."""

import sys

from moe_tune.cli.env import main

sys.exit(main())
