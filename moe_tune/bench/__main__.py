"""``python -m moe_tune.bench`` = ``moe-tune-bench``."""

import sys

from moe_tune.cli.bench import main

sys.exit(main())
