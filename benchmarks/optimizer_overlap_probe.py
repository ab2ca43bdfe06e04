"""Issue 36, item 2: how much of the optimizer step could hide behind the next step's forward on one GPU?

At micro-batch 1 the AdamW update (bound by memory: it reads and writes every parameter, gradient and moment) is
about a quarter of the step, and it runs alone between the backward and the next forward. A forward is bound by
its GEMMs, so the two could share the GPU. This measures the room before building anything: the real Trainer
(any overrides), warmed up, then with CUDA events, medians of ``--reps``:

  forward     one micro-batch's forward with the graph built (its backward runs untimed after it)
  update      ``optimizer.step()`` alone, on the gradients of the last backward
  together    ``optimizer.step()`` launched on a side stream and the same forward on the main stream at once
              (the parameters change under the forward: a timing only, its values are not used)

and prints ``forward + update - together``: what a step would save if every update ran beside the forward that
follows it (an upper bound: a real overlap must update each layer before its forward starts).

    python benchmarks/optimizer_overlap_probe.py [--reps 10] experiment=qwen3_30b_a3b_1gpu train.precision=bf16 \
        kernels.compile=true output_dir=/tmp/probe checkpoint.export_hf=false
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from moe_tune.cli.train import compose, to_config


def timed(fn, stream=None) -> float:
    """Milliseconds of ``fn()``'s device work, from events on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    from moe_tune.train import Trainer

    trainer = Trainer(to_config(compose(args.overrides)))
    for step in range(4):  # compile, warm up the allocator and the kernels' autotuning
        trainer.train_step(step)
    ids, labels, pos = trainer._micro_batch(4, 0)
    model, opt = trainer.model, trainer.optimizer
    side = torch.cuda.Stream()
    out = {}

    def forward():
        out["o"] = model(ids, labels=labels, position_ids=pos)

    def backward():
        out.pop("o").ce_loss.backward()

    def together():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            opt.step()
        forward()
        torch.cuda.current_stream().wait_stream(side)

    rows = {"forward": [], "update": [], "together": []}
    for _ in range(args.reps):
        rows["forward"].append(timed(forward))
        backward()
        rows["update"].append(timed(opt.step))
        rows["together"].append(timed(together))
        backward()
    med = {k: statistics.median(v) for k, v in rows.items()}
    med["saved_ms"] = med["forward"] + med["update"] - med["together"]
    print(json.dumps({k: round(v, 2) for k, v in med.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
