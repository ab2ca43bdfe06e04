import sys

from moe_tune.bench import main

sys.exit(main())
