"""Where the step synchronizes the host: torch.cuda sync debug mode, each warning's stack (moe_tune/torch frames)
counted. Usage: python syncs.py <moe-tune overrides>."""

import collections
import sys
import traceback
import warnings

import torch

SITES = collections.Counter()


def show(message, category, filename, lineno, file=None, line=None):
    if "synchroniz" not in str(message):
        return
    frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
    keep = [
        f"{f.filename.split('site-packages/')[-1].split('/work/')[-1]}:{f.lineno}:{f.name}"
        for f in frames
        if "moe_tune" in f.filename or "torch/" in f.filename
    ][-6:]
    SITES[" <- ".join(reversed(keep))] += 1


warnings.showwarning = show
warnings.simplefilter("always")
torch.cuda.set_sync_debug_mode("warn")
from moe_tune.cli import main  # noqa: E402

sys.argv = ["moe-tune", *sys.argv[1:]]
try:
    main()
finally:
    print("=== sync sites (count over the run) ===")
    for site, n in SITES.most_common(30):
        print(f"{n:6d}  {site}")
