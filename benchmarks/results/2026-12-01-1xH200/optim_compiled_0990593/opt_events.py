"""GPU time of the optimizer step inside a training run (CUDA events around optimizer.step), and of the rest."""

import statistics
import sys

import torch

from moe_tune.train import trainer as tr

marks = []
orig_step = tr.Trainer.train_step


def train_step(self, step):
    a = torch.cuda.Event(enable_timing=True)
    a.record()
    opt = self.optimizer
    inner = type(opt).step
    b, c = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(*args, **kw):
        b.record()
        out = inner(opt, *args, **kw)
        c.record()
        return out

    opt.step = timed
    out = orig_step(self, step)
    del opt.step
    marks.append((a, b, c))
    return out


tr.Trainer.train_step = train_step
from moe_tune.cli import main  # noqa: E402

sys.argv = ["moe-tune", *sys.argv[1:]]
try:
    main()
finally:
    torch.cuda.synchronize()
    rest = [a.elapsed_time(b) for a, b, _ in marks[3:]]
    optim = [b.elapsed_time(c) for _, b, c in marks[3:]]
    print(f"OPT_EVENTS fwd+bwd {statistics.median(rest):.1f} ms, optimizer {statistics.median(optim):.1f} ms")
