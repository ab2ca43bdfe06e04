"""The trainer: ``build_*`` helpers, then ``train_step`` (one optimizer step) in a plain loop."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict

import torch
import torch.distributed as dist

from moe_tune import checkpoint as ckpt
from moe_tune.build import Built, build_training_model
from moe_tune.config import Config, validate
from moe_tune.env import require_backends
from moe_tune.metrics import MetricsWriter, step_row

log = logging.getLogger("moe_tune")


class Trainer:
    def __init__(
        self,
        cfg: Config,
        builder: Callable[[Config, object], Built] = build_training_model,
        write_run_files: bool = True,
    ):
        self.cfg = cfg
        validate(cfg)  # before any process group exists
        require_backends(cfg)
        from moe_tune.dist.env import init_distributed

        self.env = init_distributed()
        self.rank, self.world = self.env.rank, self.env.world_size
        self.device = self.env.device
        torch.manual_seed(cfg.train.seed)
        _setup_logging(self.rank)
        if self.rank == 0 and write_run_files:
            os.makedirs(cfg.output_dir, exist_ok=True)
            write_json(os.path.join(cfg.output_dir, "config.json"), asdict(cfg))
        built = builder(cfg, self.env)
        self.model, self.mesh, self.source, self.tokenizer = built.model, built.mesh, built.source, built.tokenizer
        self.dp_size, self.accum = self._batch_layout()
        self.optimizer, self.scheduler = self.build_optimizer()
        self.skipped_steps = self.nonfinite_in_a_row = 0  # steps skipped for a non-finite gradient norm
        from moe_tune.data import build_dataset

        self.data = build_dataset(
            cfg.data, self.tokenizer, cfg.train.seq_len, cfg.train.seed, vocab_size=self.model.config.vocab_size
        )
        self.metrics = MetricsWriter(
            cfg.output_dir, self.rank == 0 and write_run_files, cfg.train.warmup_steps_excluded
        )
        self.flops_per_token = built.flops_per_token
        self.step = ckpt.maybe_resume(self, cfg.checkpoint.resume)

    # -- building ----------------------------------------------------------------------------------
    def _batch_layout(self) -> tuple[int, int]:
        t = self.cfg.train
        dp = self.world  # every rank is a data-parallel rank (EP borrows its ranks from dp_shard)
        per_micro = t.micro_batch_size * dp
        accum = 1 if t.global_batch_size == -1 else t.global_batch_size // per_micro
        return dp, accum

    def build_optimizer(self):
        from moe_tune.optim import build_optimizer, build_scheduler

        if self.cfg.train.precision == "bf16" and not self.cfg.optim.stochastic_rounding and self.rank == 0:
            log.warning(
                "train.precision=bf16 rounds every AdamW update to the nearest bf16 value, and updates below half "
                "a bf16 step are lost (on an H200 the loss stalled at lr 3e-5); add optim.stochastic_rounding=true"
            )
        # Ranks are (dp_replicate, dp_shard) row-major: replicas of one shard share rank % dp_shard, and so draw
        # the same stochastic-rounding bits (their parameters must stay equal).
        shard_index = self.rank % self.mesh.dims.dp_shard
        opt = build_optimizer(
            self.model.parameters(), self.cfg.optim, self.cfg.train.lr, self.cfg.train.seed, shard_index
        )
        return opt, build_scheduler(opt, self.cfg.optim, self.cfg.train.steps)

    # -- one optimizer step ------------------------------------------------------------------------
    def train_step(self, step: int) -> dict:
        from moe_tune.parallel import clip_grad_norm_

        cfg, model = self.cfg, self.model
        batches = [self._micro_batch(step, m) for m in range(self.accum)]
        # The loss is a mean over every label token of the step on all ranks: count them first.
        # FSDP averages gradients over the dp ranks, so each rank divides its token sum by global / dp.
        local = sum((labels[:, 1:] != -100).sum() for _, labels, _ in batches).float()
        total = local.clone()
        if dist.is_initialized():
            dist.all_reduce(total)  # mesh: all ranks (every rank is data parallel)
        normalizer = total.clamp(min=1) / self.dp_size
        ce_sum = torch.zeros((), device=self.device)
        load_LE = None  # rows per expert of every bias-corrected router, summed over the step's micro-batches
        autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if cfg.train.precision == "amp_bf16"
            else contextlib.nullcontext()
        )
        for m, (ids, labels, pos) in enumerate(batches):
            if hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(m == self.accum - 1)
            with autocast:
                out = model(ids, labels=labels, position_ids=pos, loss_normalizer=normalizer)
            extra = (out.loss - out.ce_loss) / self.accum  # balancing losses, averaged over micro-batches
            (out.ce_loss + extra).backward()
            ce_sum += out.ce_loss.detach()
            load_LE = self._expert_load() if load_LE is None else load_LE + self._expert_load()
        grad_norm = clip_grad_norm_(model, cfg.optim.max_grad_norm, self.mesh)
        # A NaN/inf gradient anywhere makes the global norm non-finite on every rank (it is all-reduced): the
        # optimizer then skips the update on the device, without a host sync; _loop counts skipped steps.
        self.optimizer.found_inf = (~torch.isfinite(grad_norm)).float()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if cfg.train.bias_update_rate > 0 and load_LE is not None and load_LE.numel():
            self._update_expert_bias(load_LE)
        if dist.is_initialized():
            dist.all_reduce(ce_sum)  # mesh: all ranks; per-rank sums of token losses / (global / dp)
        return {"loss": ce_sum / self.dp_size, "grad_norm": grad_norm}

    def _micro_batch(self, step: int, micro: int):
        t = self.cfg.train
        return self.data.micro_batch(step, micro, t.micro_batch_size, self.accum, self.rank, self.dp_size, self.device)

    @functools.cached_property
    def _dispatchers(self) -> list:
        unique = {id(m.dispatcher): m.dispatcher for m in self.model.moe_layers()}
        return list(unique.values())

    def _biased_moes(self) -> list:
        return [m for m in self.model.moe_layers() if m.router.e_score_correction_bias is not None]

    def _expert_load(self) -> torch.Tensor | None:
        if self.cfg.train.bias_update_rate <= 0:
            return None
        moes = self._biased_moes()
        return torch.stack([m.counts_E for m in moes]) if moes else torch.zeros(0, device=self.device)

    def _update_expert_bias(self, load_LE: torch.Tensor) -> None:
        """Aux-loss-free balancing, once per optimizer step, from the whole step's loads on every rank."""
        from moe_tune.moe.router import update_expert_bias

        # mesh: dp (all ranks): every rank applies the same update from everyone's counts
        rate = self.cfg.train.bias_update_rate
        update_expert_bias([m.router for m in self._biased_moes()], load_LE, rate, self.mesh.group("dp"))

    # -- the loop ----------------------------------------------------------------------------------
    def fit(self) -> dict:
        cfg = self.cfg
        tokens_per_step = cfg.train.seq_len * cfg.train.micro_batch_size * self.accum * self.dp_size
        bar = _progress(self.rank, cfg.train.steps, self.step)
        profiler = _profiler(self.rank, cfg.output_dir)
        stop = StopSignal(cfg.checkpoint.save_on_signal)
        try:
            stopped_early = self._loop(tokens_per_step, bar, profiler, stop)
        finally:
            stop.restore()
        if bar is not None:
            bar.close()
        if profiler is not None:
            profiler.stop()
        if stopped_early:
            self._stop_for_signal(stop.signum)
        if cfg.checkpoint.export_hf:
            self.export(os.path.join(cfg.output_dir, "hf"))
        summary = self.write_summary()
        return summary

    def _stop_for_signal(self, signum: int) -> None:
        path = os.path.join(self.cfg.output_dir, "checkpoints", f"step_{self.step}")
        every = self.cfg.checkpoint.every
        if not (every and self.step % every == 0):  # the loop saved this step already; same answer on every rank
            ckpt.save(self, path)
        self.write_summary()
        log.warning(
            "stopped by signal %d after step %d of %d; saved %s (checkpoint.resume=auto continues from it)",
            signum,
            self.step,
            self.cfg.train.steps,
            path,
        )
        raise SystemExit(128 + signum)

    def _loop(self, tokens_per_step: int, bar, profiler, stop: StopSignal) -> bool:
        """Train to ``train.steps``; True if every rank agreed to stop early on a signal."""
        cfg = self.cfg
        while self.step < cfg.train.steps:
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            t0 = time.perf_counter()
            out = self.train_step(self.step)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # host sync: time the whole step
            dt = time.perf_counter() - t0
            for dispatcher in self._dispatchers:
                dispatcher.check()  # after the sync: every rank sees the same device-side verdicts
            self.step += 1
            if profiler is not None:
                profiler.step()
            diverged = self._count_nonfinite(out["grad_norm"])
            if diverged or self.step % cfg.train.log_every == 0 or self.step == cfg.train.steps:
                row = self._metrics_row(out, dt, tokens_per_step)
                self.metrics.log(row)
                _report(bar, row, self.rank)
            if diverged:
                self._stop_diverged()
            if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
                ckpt.save(self, os.path.join(cfg.output_dir, "checkpoints", f"step_{self.step}"))
            if stop.agreed(self.device) and self.step < cfg.train.steps:
                return True  # the same step on every rank
        return False

    def _count_nonfinite(self, grad_norm: torch.Tensor) -> bool:
        """Count a step skipped for a non-finite gradient norm; True once more than train.max_nonfinite_steps
        were skipped in a row. The same answer on every rank (the norm is global)."""
        norm = float(grad_norm)  # host sync: one scalar, after the step's own synchronize
        if math.isfinite(norm):
            self.nonfinite_in_a_row = 0
            return False
        self.nonfinite_in_a_row += 1
        self.skipped_steps += 1
        if self.rank == 0:
            log.warning(
                "step %d: gradient norm is %s; update skipped, weights unchanged (%d in a row, %d in this run)",
                self.step,
                norm,
                self.nonfinite_in_a_row,
                self.skipped_steps,
            )
        return self.nonfinite_in_a_row > self.cfg.train.max_nonfinite_steps

    def _stop_diverged(self) -> None:
        first, last = self.step - self.nonfinite_in_a_row + 1, self.step
        if self.rank == 0:
            log.error(
                "stopping: steps %d-%d all had a non-finite gradient norm (train.max_nonfinite_steps=%d); every one "
                "was skipped, so the weights are those after step %d (as in any checkpoint saved since). "
                "Lower train.lr or check the data of those steps; resume with checkpoint.resume=auto",
                first,
                last,
                self.cfg.train.max_nonfinite_steps,
                first - 1,
            )
        self.write_summary()
        raise SystemExit(1)

    def _metrics_row(self, out: dict, dt: float, tokens: int) -> dict:
        loads = torch.stack([m.counts_E.float() for m in self.model.moe_layers()])
        load_ratio = (loads.max(dim=1).values / loads.mean(dim=1).clamp(min=1)).mean()
        # host sync: one .item() batch per logged step for the metrics line
        vals = torch.stack([out["loss"].float(), out["grad_norm"].float().to(self.device), load_ratio.to(self.device)])
        loss, grad_norm, load = vals.tolist()
        lr = self.scheduler.get_last_lr()[0]
        return step_row(
            self.step,
            loss,
            grad_norm,
            lr,
            tokens,
            dt,
            self.world,
            self.flops_per_token,
            self.device,
            expert_load_max_over_mean=load,
            skipped_steps=self.skipped_steps,
        )

    def export(self, out_dir: str) -> None:
        from moe_tune.parallel import export_hf

        export_hf(
            self.model, out_dir, self.mesh, dtype=None if self.cfg.model.dtype == "source" else self.cfg.model.dtype
        )

    def write_summary(self) -> dict:
        return write_run_summary(self.cfg, self.rank, self.world, self.device, self.flops_per_token, self.metrics)


class StopSignal:
    """SIGTERM and SIGUSR1 set a flag instead of killing the process; ``agreed`` tells every rank, after the
    same step, whether any rank got one (a MAX all-reduce of one int per step, over all ranks)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, enabled: bool):
        self.signum: int | None = None  # the agreed signal (any rank's), once every rank has seen it
        self._received = 0  # this rank's, set by the handler and never cleared
        self.enabled = enabled
        self._previous = {}
        if enabled:
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self._received = signum
        log.warning("signal %d received: stopping after this step", signum)

    def agreed(self, device) -> bool:
        if not self.enabled:
            return False
        got = self._received  # a signal landing after this read is counted at the next step, on every rank
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([got], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # mesh: all ranks
            got = int(flag.item())  # host sync: the step already ended with one
        if got:
            self.signum = got
        return bool(got)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def write_run_summary(cfg: Config, rank: int, world: int, device, flops_per_token: float, metrics, **extra) -> dict:
    """summary.json (CONTRACT.md): resolved config, versions, hardware, commit, then the metrics' aggregates.
    Shared by the trainer and the benchmark's Transformers baseline, so both report the same fields."""
    from moe_tune.env import versions

    summary = {
        "config": asdict(cfg),
        "versions": versions(),
        "hardware": hardware_name(world, device),
        "num_gpus": world if device.type == "cuda" else 0,
        "world_size": world,
        "commit": git_commit(),
        "flops_per_token": flops_per_token,
        "routing": "forced_balanced" if cfg.train.force_balanced_routing else "real",
        **extra,
        **metrics.summary(),
    }
    if rank == 0:
        write_json(os.path.join(cfg.output_dir, "summary.json"), summary)
    return summary


def hardware_name(world: int, device: torch.device) -> str:
    """'2 x NVIDIA H200', or 'cpu (2 cores)'."""
    if device.type == "cuda":
        return f"{world} x {torch.cuda.get_device_name(device)}"
    return f"cpu ({os.cpu_count()} cores) x {world} processes"


def _profiler(rank: int, output_dir: str):
    """``MOE_TUNE_PROFILE=1``: torch.profiler over steps 6-8 on rank 0; writes the top kernels by device
    time to ``profile_rank0.txt`` and a Chrome trace to ``trace_rank0.json`` in the run directory."""
    if rank != 0 or os.environ.get("MOE_TUNE_PROFILE") != "1":
        return None
    from torch.profiler import ProfilerActivity, profile, schedule

    def on_ready(prof):
        table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=60)
        with open(os.path.join(output_dir, "profile_rank0.txt"), "w") as f:
            f.write(table)
        prof.export_chrome_trace(os.path.join(output_dir, "trace_rank0.json"))

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(
        activities=activities, schedule=schedule(wait=5, warmup=1, active=3, repeat=1), on_trace_ready=on_ready
    )
    prof.start()
    return prof


def git_commit() -> str:
    import subprocess

    if os.environ.get("MOE_TUNE_COMMIT"):
        return os.environ["MOE_TUNE_COMMIT"]
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return (
            subprocess.run(
                ["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
            ).stdout.strip()
            or "unknown"
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=str)
    os.replace(tmp, path)


def _setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


def _progress(rank: int, total: int, initial: int):
    import sys

    if rank != 0 or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True)


def _report(bar, row: dict, rank: int) -> None:
    text = f"loss {row['loss']:.4f} | {row['tokens_per_s']:,.0f} tok/s | {row['peak_mem_gib']:.1f} GiB"
    if bar is not None:
        bar.set_postfix_str(text)
        bar.update(row["step"] - bar.n)
    elif rank == 0:
        log.info("step %d | %s | grad_norm %.3f | lr %.2e", row["step"], text, row["grad_norm"], row["lr"])


__all__ = ["Trainer"]
