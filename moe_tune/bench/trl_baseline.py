"""The TRL row of ``moe-tune-bench`` (``--baselines trl``): TRL's ``SFTTrainer`` as its users fine-tune a
Transformers model on chat data, on moe_tune's workload.

The same as moe_tune's rows: the Hugging Face model of the workload's config with the weights the other rows start
from (``build_hf_model``'s), experts_implementation="grouped_mm" as the Transformers baseline; the records of
data.path, tokenized and loss-masked by moe_tune's data pipeline (data.train_on: the assistant turns of chat
records, the completion of prompt/completion records), each cut at train.seq_len as moe_tune's packer cuts it and
handed to TRL as a processed dataset (``input_ids`` + ``labels``, which TRL keeps); train.steps, micro-batch,
gradient accumulation, lr with moe_tune's schedule (warm-up, then cosine), optim.betas / eps / weight_decay /
max_grad_norm, train.aux_loss_coef as TRL's ``router_aux_loss_coef``, the seed. The optimizer is PyTorch's fused
AdamW, as TRL's users run it (``optim="adamw_torch_fused"``), without moe_tune's stochastic rounding.
TRL's own: best-fit-decreasing packing at ``max_length=train.seq_len`` (``packing_strategy="bfd"``), padding-free
micro-batches (its rows back to back in one sequence, position ids restarting per sample), its data order, its
loss (fused LM head). Attention: ``--attn``; ``auto`` picks flex_attention on a GPU at micro-batch 1 (its block
mask follows the packed samples) and SDPA otherwise (a dense mask built from the position ids; flex_attention at
larger micro-batches did not finish a step on an H200, see benchmarks/README.md), and logs its choice.

Metrics are moe_tune's (``moe_tune.metrics``: a metrics.jsonl row per step, summary.json), so the benchmark reads
this row as any other:
- tokens: the non-padding tokens of the packed rows TRL fed the step, counted as its collator batches them; row
  positions: those rows x train.seq_len, so ``row_fill`` is bfd's fill. Padding-free computes the real tokens
  only, so ``tflops_per_gpu`` counts those.
- loss: cross-entropy per label token, TRL's logged loss less train.aux_loss_coef x its logged balancing loss
  (moe_tune logs the cross-entropy alone); ``trl_loss`` keeps TRL's.
- time: per optimizer step, from the end of TRL's logging of the last step (every step: the per-step loss needs
  logging_steps=1) to the end of this step's optimizer update, on CUDA events; peak memory per step.
One process on one GPU (the first visible), or the CPU. No checkpoints or export.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import replace

import torch
from transformers import TrainerCallback

from moe_tune.bench.plans import TRL_ATTENTION, TRL_INSTALL, workload_problem
from moe_tune.config import Config, ConfigError, UserError
from moe_tune.data.packing import IGNORE
from moe_tune.distributed.dims import BatchLayout
from moe_tune.metrics import MetricsWriter, StepTimer, step_row

log = logging.getLogger("moe_tune")
TALLY_KEY = "moe_tune_tally"  # in a collated batch: (real tokens, label tokens, row positions); popped before the model


def require_trl():
    try:
        import trl
    except ImportError as e:
        raise ConfigError(f"--baselines trl needs TRL, which is not importable here ({e}): {TRL_INSTALL}") from None
    return trl


def check_config(cfg: Config) -> None:
    """The workload as the other rows check it, then ``workload_problem``, before anything is built."""
    from moe_tune.bench.baseline import check_workload
    from moe_tune.config import world_size_from_env

    check_workload(cfg)
    problem = workload_problem(cfg, world_size_from_env())
    if problem:
        raise ConfigError(problem)


def choose_attention(attn: str, micro_batch_size: int, cuda: bool) -> str:
    if attn != "auto":
        return attn
    chosen = "flex_attention" if cuda and micro_batch_size == 1 else "sdpa"
    where = "a GPU" if cuda else "the CPU"
    log.info("TRL row: --attn auto chose %s (micro-batch %d on %s)", chosen, micro_batch_size, where)
    return chosen


def build_model(cfg: Config, device: torch.device, attn: str):
    """(the plain transformers model on ``device`` with the other rows' starting weights, its tokenizer, FLOPs/token)."""
    from moe_tune.bench.baseline import hf_flops_per_token, hf_model_on_meta, load_weights
    from moe_tune.build import build_source, build_tokenizer
    from moe_tune.models.families import get_family
    from moe_tune.models.model import materialize

    source, hf_config = build_source(cfg, 0)
    family = get_family(hf_config.model_type, getattr(hf_config, "architectures", None))
    model = hf_model_on_meta(cfg, hf_config, family, "grouped_mm", attn)
    materialize(model, device)
    load_weights(model, source, hf_config, family, cfg.train.seed)
    model.train()
    return model, build_tokenizer(source), hf_flops_per_token(model, cfg.train.seq_len)


def encoded_records(cfg: Config, tokenizer) -> tuple[list[tuple[list[int], list[int]]], dict]:
    """moe_tune's (token ids, labels) of the records of data.path, as its own rows read them (less a
    data.val_fraction held out), each cut at train.seq_len; and the data stats."""
    from moe_tune.data.encode import Encoder
    from moe_tune.data.loader import record_sources, split_val
    from moe_tune.data.pipeline import Tally, encode_all, parsed

    d, seq_len, seed = cfg.data, cfg.train.seq_len, cfg.train.seed
    tally = Tally(d.on_bad_record, seq_len)
    items = list(parsed(record_sources(d, d.path, seed), d, tally))
    if d.val_fraction > 0:
        items, held = split_val(items, d.val_fraction, seed)
        tally.stats["records_read"] -= len(held)
    samples = encode_all(items, d, Encoder(tokenizer, d, seq_len), tally)
    return [(ids[:seq_len], labels[:seq_len]) for ids, labels in samples], tally.stats


class CountingCollator:
    """TRL's collator, adding under TALLY_KEY what the micro-batch holds: the tokens of its packed rows (none of them
    padding), its label tokens as collated, and its row positions (rows x seq_len)."""

    def __init__(self, collate, seq_len: int):
        self.collate, self.seq_len = collate, seq_len

    def __call__(self, examples: list[dict]) -> dict:
        batch = self.collate(examples)
        real = sum(len(e["input_ids"]) for e in examples)
        labels = int((batch["labels"] != IGNORE).sum())  # a CPU tensor here: no device sync
        batch[TALLY_KEY] = (real, labels, len(examples) * self.seq_len)
        return batch


class StepMeter(TrainerCallback):
    """A metrics.jsonl row per optimizer step, from the micro-batches' tallies and TRL's log of the step."""

    def __init__(self, metrics: MetricsWriter, device: torch.device, flops_per_token: float, aux_loss_coef: float):
        self.metrics, self.flops_per_token, self.aux_loss_coef = metrics, flops_per_token, aux_loss_coef
        self.timer = StepTimer(device)
        self.tallies: list[tuple[int, int, int]] = []  # this step's micro-batches'

    def on_train_begin(self, args, state, control, **kwargs):
        self.timer.start()

    def on_step_end(self, args, state, control, **kwargs):
        self.timer.tick()  # after the optimizer update, before TRL logs

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" not in (logs or {}):  # the closing summary of train()
            return
        self.timer.pause()
        ((seconds, peak),) = self.timer.take()  # logging_steps=1: exactly this step
        real, labels, positions = (sum(x) for x in zip(*self.tallies))
        self.tallies.clear()
        aux = logs.get("aux_loss")
        ce = logs["loss"] - self.aux_loss_coef * aux if aux is not None else logs["loss"]
        tokens = (real, labels, positions)
        extra = {"real_tokens": real, "row_positions": positions, "trl_loss": logs["loss"], "aux_loss": aux}
        row = step_row(state.global_step, ce, logs.get("grad_norm"), logs["learning_rate"], tokens, seconds, 1,
                       self.flops_per_token, peak, **extra)  # fmt: skip
        row["tflops_per_gpu"] = real / seconds * self.flops_per_token / 1e12  # padding-free: real tokens computed
        self.metrics.log(row)
        log.info("step %d | loss %.4f | %s tok/s | fill %.3f", row["step"], ce, f"{row['tokens_per_s']:,.0f}",
                 row["row_fill"])  # fmt: skip
        self.timer.start()


def _trainer_class():
    from trl import SFTTrainer

    class CountingSFTTrainer(SFTTrainer):
        """SFTTrainer whose collator tallies each micro-batch for ``meter``; the tally leaves the batch here."""

        def __init__(self, *args, meter: StepMeter, **kwargs):
            super().__init__(*args, callbacks=[meter], **kwargs)
            self.meter = meter
            self.data_collator = CountingCollator(self.data_collator, self.args.max_length)

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.meter.tallies.append(inputs.pop(TALLY_KEY))
            return super().training_step(model, inputs, num_items_in_batch)

    return CountingSFTTrainer


def build_trainer(cfg: Config, model, tokenizer, samples: list, meter: StepMeter, device: torch.device):
    import datasets
    from trl import SFTConfig

    from moe_tune.optim import build_optimizer, build_scheduler

    t, o = cfg.train, cfg.optim
    args = SFTConfig(
        output_dir=os.path.join(cfg.output_dir, "trl"),
        max_steps=t.steps,
        per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=BatchLayout.from_config(t, dp_size=1).accum,  # one process
        learning_rate=t.lr,
        max_grad_norm=o.max_grad_norm,
        bf16=t.precision != "fp32",
        use_cpu=device.type == "cpu",
        gradient_checkpointing=cfg.parallel.activation_checkpointing == "full",  # TRL's default is on
        gradient_checkpointing_kwargs={"use_reentrant": False},
        packing=True,
        packing_strategy="bfd",
        padding_free=True,
        max_length=t.seq_len,
        router_aux_loss_coef=t.aux_loss_coef,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=t.seed,
        data_seed=t.seed,
    )
    fused = replace(o, compiled=False, stochastic_rounding=False)  # torch.optim.AdamW(fused=True)
    optimizer = build_optimizer(model.parameters(), fused, t.lr)
    dataset = datasets.Dataset.from_dict({"input_ids": [s[0] for s in samples], "labels": [s[1] for s in samples]})
    return _trainer_class()(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        optimizers=(optimizer, build_scheduler(optimizer, o, t.steps)),
        meter=meter,
    )


def run(cfg: Config, attn: str = "auto"):
    """Train ``cfg``'s workload with TRL's SFTTrainer; write metrics.jsonl and summary.json to cfg.output_dir.
    Returns the trainer (its ``train_dataset``: the rows TRL packed)."""
    from moe_tune.config import resolved
    from moe_tune.data.pipeline import report_stats
    from moe_tune.run_record import setup_logging, write_run_summary

    trl = require_trl()
    cfg = resolved(cfg)
    check_config(cfg)
    setup_logging(0)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(cfg.train.seed)
    attn = choose_attention(attn, cfg.train.micro_batch_size, device.type == "cuda")
    model, tokenizer, flops = build_model(cfg, device, attn)
    samples, stats = encoded_records(cfg, tokenizer)
    metrics = MetricsWriter(cfg.output_dir, True, cfg.train.warmup_steps_excluded)
    meter = StepMeter(metrics, device, flops, cfg.train.aux_loss_coef)
    trainer = build_trainer(cfg, model, tokenizer, samples, meter, device)
    packed = trainer.train_dataset
    stats["rows"] = len(packed)
    stats["row_fill"] = stats["tokens"] / max(1, len(packed) * cfg.train.seq_len)
    report_stats("data (train, TRL bfd rows)", stats)
    trainer.train()
    describe = {
        "kernels": f"trl {trl.__version__} SFTTrainer attn={attn}",
        "experts": model.config._experts_implementation,
        "fsdp": "none",
        "packing": "bfd, padding-free",
        "optimizer": "torch AdamW fused",
    }
    write_run_summary(cfg, 0, 1, device, flops, metrics, data_stats={"train": stats, "val": None}, trl=trl.__version__,
                      experts_implementation=model.config._experts_implementation, attn_implementation=attn,
                      bench_config=describe)  # fmt: skip
    return trainer


def _one_gpu() -> None:
    """Before CUDA starts: the first visible GPU only (transformers' Trainer would wrap the model in DataParallel
    over every GPU it sees)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = "0" if visible is None else visible.split(",")[0]


def main(argv: list[str] | None = None) -> int:
    from moe_tune.cli.train import compose, precheck, to_config

    parser = argparse.ArgumentParser(prog="python -m moe_tune.bench.trl_baseline", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--attn", default="auto", choices=TRL_ATTENTION, help="attention implementation (auto: see above)"
    )
    parser.add_argument("overrides", nargs="*", help="moe_tune Hydra overrides (the workload, output_dir=...)")
    args = parser.parse_args(argv)
    precheck(args.overrides)  # a bad override: one line, exit 2
    _one_gpu()
    try:
        run(to_config(compose(args.overrides)), args.attn)
    except UserError as e:
        print(f"moe-tune-bench trl: error: {e}", file=sys.stderr)
        return 2
    return 0


__all__ = [
    "CountingCollator",
    "StepMeter",
    "build_trainer",
    "check_config",
    "choose_attention",
    "encoded_records",
    "main",
    "run",
    "workload_problem",
]

if __name__ == "__main__":
    sys.exit(main())
