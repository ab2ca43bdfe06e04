"""The trainer: a model from an injected builder, ``train_step`` (one optimizer step), and a loop of a few lines.

The loop calls small objects: ``Cadence`` (which steps log, evaluate, draw, save and synchronize), ``NonFiniteGuard``
(skipped steps), ``StopSignal`` (agreed by all ranks), the profiler, ``StepTimer`` and ``MetricsWriter`` (a metrics
row per step), ``evaluate``, the experiment ``Logger`` (moe_tune.loggers) and moe_tune.checkpoint.

Host syncs: only at the cadence's sync steps (every ``train.log_every``-th, every ``train.eval_every``-th when
there is a validation set, every ``logger.expert_load_image_every``-th, every ``checkpoint.every``-th and the
last): the timer's synchronize, the dispatchers' checks, the guard's counts, the metrics rows of the steps since
the last such step (with the validation loss), the expert-load image, the signal agreement, a failed background save.
Other steps queue their work on the device and go on.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import asdict

import torch
import torch.distributed as dist

from moe_tune import checkpoint as ckpt
from moe_tune.build import Built, build_training_model, check_model_source
from moe_tune.config import Config, resolved, validate
from moe_tune.config.unused import unused_settings
from moe_tune.distributed.dims import BatchLayout
from moe_tune.env import require_backends
from moe_tune.loggers import build_logger, require_logger
from moe_tune.loggers.heatmap import log_expert_load
from moe_tune.metrics import MetricsWriter, StepTimer
from moe_tune.models.base_model import discard_set_aside_base_model
from moe_tune.moe.stats import MoEStats
from moe_tune.run_record import setup_logging, trained_what, write_config, write_run_summary
from moe_tune.train.cadence import Cadence
from moe_tune.train.evaluate import evaluate
from moe_tune.train.guard import Diverged, NonFiniteGuard
from moe_tune.train.lock import check_output_dir, init_run_lock
from moe_tune.train.profile import build_profiler
from moe_tune.train.progress import Progress
from moe_tune.train.rows import metrics_rows
from moe_tune.train.signals import StopSignal

log = logging.getLogger("moe_tune")


class Trainer:
    """``builder(cfg, env) -> Built`` makes the model on its mesh (default: moe_tune's own); the trainer adds the
    optimizer, data, metrics and the loop. It is the one owner of its state: checkpointing takes its components
    (``checkpoint_state``) and a resume returns the step and batch layout, which the trainer applies."""

    def __init__(
        self,
        cfg: Config,
        builder: Callable[[Config, object], Built] = build_training_model,
        write_run_files: bool = True,
    ):
        from moe_tune.data import build_datasets
        from moe_tune.distributed.process_group import init_distributed

        cfg = resolved(cfg)  # automatic values decided: the run applies and records them
        self.cfg, t = cfg, cfg.train
        self.check_config(cfg)  # before any process group exists
        self.env = init_distributed()
        self.rank, self.world, self.device = self.env.rank, self.env.world_size, self.env.device
        torch.manual_seed(t.seed)
        setup_logging(self.rank)
        # Before anything is written to output_dir; every rank raises if another run holds it.
        self.run_lock = init_run_lock(cfg.output_dir, self.rank) if write_run_files else None
        if write_run_files:
            ckpt.check_start(cfg.output_dir, cfg.checkpoint.resume, t.steps, self.rank, cfg)  # no finished run lost
        self.built = built = builder(cfg, self.env)
        self.model, self.mesh, self.source, self.tokenizer = built.model, built.mesh, built.source, built.tokenizer
        self.moe_layers, self.flops_per_token = built.moe_layers, built.flops_per_token
        # Every rank is a data-parallel rank (EP borrows its ranks from dp_shard).
        self.layout = BatchLayout.from_config(t, dp_size=self.world)
        self.optimizer, self.scheduler = self.build_optimizer()
        vocab_size = self.model.config.vocab_size
        self.data, self.val_data = build_datasets(cfg.data, self.tokenizer, t.seq_len, t.seed, vocab_size=vocab_size)
        self.metrics = MetricsWriter(cfg.output_dir, self.rank == 0 and write_run_files, t.warmup_steps_excluded)
        self.cadence = Cadence(
            t.steps,
            t.log_every,
            cfg.checkpoint.every if built.checkpointable else 0,
            eval_every=None if self.val_data is None else t.eval_every,
            image_every=cfg.logger.expert_load_image_every if self.moe_layers and cfg.logger.name != "none" else 0,
        )
        self.guard = NonFiniteGuard(t.max_nonfinite_steps, self.device, warn=self.rank == 0)
        self.saver = ckpt.CheckpointSaver(cfg.checkpoint.async_save, self.device)  # one save in flight at most
        self.step = 0
        if built.checkpointable:
            self.saver.group()  # made while the launcher's store is up: a save on the launcher's death needs none
            self._resume()
        if self.rank == 0 and write_run_files:
            write_config(cfg)  # only once the config, model, data and checkpoint are known to be usable
        # Last: a tracker's run starts only once everything else could be built.
        rank = self.rank if write_run_files else -1
        self.logger = build_logger(cfg.logger, cfg.output_dir, rank, asdict(cfg), start_step=self.step)
        if self.rank == 0 and write_run_files:  # the run starts: the base_model/ it rebuilt is its own
            discard_set_aside_base_model(cfg.output_dir)

    @staticmethod
    def check_config(cfg: Config) -> None:
        """Cross-group checks and the named backends' availability, before any process group exists (the CLI runs
        it too, before Hydra creates the run directory)."""
        from moe_tune.data import check_data_sources

        validate(cfg)
        check_output_dir(cfg.output_dir)
        check_model_source(cfg)
        ckpt.check_resumed_base(cfg)  # before base_model/ is drawn again over the one a LoRA checkpoint fits
        check_data_sources(cfg)
        require_backends(cfg)
        require_logger(cfg.logger)

    # -- building ----------------------------------------------------------------------------------
    def checkpoint_state(self) -> ckpt.RunState:
        """What a checkpoint saves and loads into: the components, the batch layout and the run's identity."""
        template, rows = self.data.chat_template, self.data.identity()
        return ckpt.RunState(
            self.model, self.optimizer, self.scheduler, self.cfg, self.layout, self.rank, self.source, template, rows
        )

    def _resume(self) -> None:
        """``checkpoint.resume``'s checkpoint loads into the model, optimizer and scheduler; the step and batch
        layout it gives are the trainer's to apply; metrics rows and checkpoints of later steps (replaced) go."""
        resumed = ckpt.maybe_resume(self.checkpoint_state(), self.cfg.checkpoint.resume)
        if resumed is not None:
            self.step, self.layout = resumed.step, resumed.layout
        self.metrics.drop_after(self.step)
        ckpt.set_aside_later(self.cfg.output_dir, self.step, self.cfg.checkpoint.resume, self.metrics.enabled)

    def build_optimizer(self):
        from moe_tune.optim import build_optimizer, build_scheduler, report_rounding

        t, optim = self.cfg.train, self.cfg.optim
        if self.rank == 0:
            report_rounding(t.precision, optim.stochastic_rounding)
            # the run goes on: a note
            for line in unused_settings(self.cfg, self.device.type, self.world, bool(self.moe_layers)):
                log.info("note: %s", line)
            log.info("trains %s", trained_what(self.cfg, bool(self.moe_layers)))
        # Ranks are (dp_replicate, dp_shard) row-major: replicas of one shard share rank % dp_shard and so draw the
        # same stochastic-rounding bits (they must stay equal); without a moe_tune mesh (the NeMo peer): every rank.
        dp_shard = self.mesh.dims.dp_shard if self.mesh is not None else self.world
        opt = build_optimizer(self.model.named_parameters(), optim, t.lr, t.seed, self.rank % dp_shard)
        return opt, build_scheduler(opt, optim, t.steps)

    # -- one optimizer step ------------------------------------------------------------------------
    def train_step(self, step: int) -> dict:
        """Every micro-batch of ``step``, then one optimizer update. Returns the step's mean loss over its label
        tokens and the global gradient norm, as device tensors (nothing here waits for the device), and the
        learning rate the update applied."""
        model, layout = self.model, self.layout
        # Dropout's masks (LoRA's, a model's own) drawn from (seed, step, rank): a resumed step draws what the
        # uninterrupted run drew, with no generator state in the checkpoint (stochastic rounding's bits likewise).
        torch.manual_seed(step_seed(self.cfg.train.seed, step, self.rank))
        tokens = self.data.step_tokens(step, layout)  # all ranks'
        batches = [self._micro_batch(step, m) for m in range(layout.accum)]
        normalizer = self._loss_normalizer(batches)
        ce_sum = torch.zeros((), device=self.device)
        load_LE = None  # rows per expert of every bias-corrected router, summed over the step's micro-batches
        for m, (ids, labels, pos) in enumerate(batches):
            if hasattr(model, "set_requires_gradient_sync"):  # an FSDP2 root: reduce on the last micro-batch
                model.set_requires_gradient_sync(m == layout.accum - 1)
            with self._autocast():
                out = model(ids, labels=labels, position_ids=pos, loss_normalizer=normalizer)
            extra = (out.loss - out.ce_loss) / layout.accum  # balancing losses, averaged over micro-batches
            (out.ce_loss + extra).backward()
            ce_sum += out.ce_loss.detach()
            load_LE = self._add_expert_load(load_LE, out.moe_stats)
        grad_norm = self._clip_grad_norm()
        # A NaN/inf gradient anywhere makes the global norm non-finite on every rank (it is all-reduced): the
        # optimizer then skips the update on the device; the guard counts skipped steps, also on the device.
        self.optimizer.found_inf = (~torch.isfinite(grad_norm)).float()
        lr = self.scheduler.get_last_lr()[0]  # this update's; the scheduler then moves on to the next step's
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if load_LE is not None:
            self._update_expert_bias(load_LE)
        if dist.is_initialized():
            dist.all_reduce(ce_sum)  # mesh: all ranks; per-rank sums of token losses / (global / dp)
        # moe_stats: the routing statistics of the step's last micro-batch (its loads, for the metrics).
        loss = ce_sum / layout.dp_size
        return {"loss": loss, "grad_norm": grad_norm, "tokens": tokens, "lr": lr, "moe_stats": out.moe_stats}

    def _micro_batch(self, step: int, micro: int):
        return self.data.micro_batch(step, micro, self.layout, self.rank, self.device)

    def _loss_normalizer(self, batches) -> torch.Tensor:
        """The loss is a mean over every label token of the step on all ranks: count them first. FSDP averages
        gradients over the dp ranks, so each rank divides its token sum by global / dp."""
        total = sum((labels[:, 1:] != -100).sum() for _, labels, _ in batches).float()
        if dist.is_initialized():
            dist.all_reduce(total)  # mesh: all ranks (every rank is data parallel)
        return total.clamp(min=1) / self.layout.dp_size

    def _autocast(self):
        if self.cfg.train.precision == "amp_bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _clip_grad_norm(self) -> torch.Tensor:
        if self.built.clip_grad_norm is not None:
            return self.built.clip_grad_norm()
        from moe_tune.distributed.clip import clip_divisor, global_grad_norm

        norm = global_grad_norm(self.model, self.mesh)
        if self.cfg.optim.max_grad_norm > 0:  # clipped inside the optimizer's kernel (clip_divisor)
            self.optimizer.grad_scale = clip_divisor(norm, self.cfg.optim.max_grad_norm)
        return norm

    @functools.cached_property
    def _biased_layers(self) -> list[int]:
        """The decoder layers whose router's correction bias the run updates (train.bias_update_rate > 0)."""
        if self.cfg.train.bias_update_rate <= 0:
            return []
        return [m.layer_idx for m in self.moe_layers if m.router.e_score_correction_bias is not None]

    def _add_expert_load(self, load_LE: torch.Tensor | None, stats: MoEStats) -> torch.Tensor | None:
        """``load_LE`` plus a micro-batch's rows per expert (its forward's ``MoEStats``) of the biased layers."""
        if not self._biased_layers:
            return None
        loads = stats.counts_LE(self._biased_layers)
        return loads if load_LE is None else load_LE + loads

    def _update_expert_bias(self, load_LE: torch.Tensor) -> None:
        """Aux-loss-free balancing, once per optimizer step, from the whole step's loads on every rank."""
        from moe_tune.moe.router import update_expert_bias

        # mesh: dp (all ranks): every rank applies the same update from everyone's counts
        routers = [m.router for m in self.moe_layers if m.layer_idx in self._biased_layers]
        update_expert_bias(routers, load_LE, self.cfg.train.bias_update_rate, self.mesh.group("dp"))

    # -- the loop ----------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train to ``train.steps``, export, write summary.json. After an agreed signal: a checkpoint of that
        step and exit 128 + signal; after too many non-finite steps in a row: exit 1."""
        cfg = self.cfg
        progress = Progress(self.rank, cfg.train.steps, self.step)
        profiler = build_profiler(cfg.train.profile, self.rank, cfg.output_dir, self.step, cfg.train.steps)
        with StopSignal(cfg.checkpoint.save_on_signal) as stop:
            try:
                stopped = self._loop(stop, profiler, progress)
                self.saver.wait()  # the last background save is complete (a signal stop waits after its own)
            finally:
                progress.close()
                profiler.stop()
                self.logger.close()
            if stopped:  # saved under the stop's handlers: a second SIGTERM (Slurm's and a script's) cannot cut it
                self._stop_for_signal(stop.signum)
        if cfg.checkpoint.export_hf and self.built.checkpointable:
            self.export(os.path.join(cfg.output_dir, "hf"))
        summary = self.write_summary(finished=True)
        if self.metrics.enabled:  # rank 0 of a run that writes its files
            log.info("outputs in %s", os.path.abspath(cfg.output_dir))
        if self.run_lock is not None:  # a finished run frees output_dir (a Python caller may train again into it)
            self.run_lock.release()
        return summary

    def _loop(self, stop: StopSignal, profiler, progress: Progress) -> bool:
        """Train to ``train.steps``; True if every rank agreed to stop early on a signal."""
        timer = StepTimer(self.device)
        timer.start()
        pending = []  # (step, lr, train_step's device tensors) of the steps without a metrics row yet
        while self.step < self.cfg.train.steps:
            out = self.train_step(self.step)
            self.step += 1
            self.guard.record(out["grad_norm"], self.step)  # on the device
            timer.tick()
            profiler.step()  # after the step's time: writing the trace is the next step's (profile.py)
            pending.append((self.step, out["lr"], out))
            alone_and_signalled = self.world == 1 and stop.received  # no rank to agree on a later step with
            if not self.cadence.syncs(self.step) and not alone_and_signalled:
                continue  # no host sync: the next step queues behind this one
            timer.pause()  # host sync: the queued steps' work is done
            if self._sync_step(pending, timer, progress, stop):
                return True
            pending = []
            timer.start()
        return False

    def _sync_step(self, pending: list, timer: StepTimer, progress: Progress, stop: StopSignal) -> bool:
        """Checks, metrics rows and checkpoint of a sync step (the same steps on every rank); True to stop early
        on a signal that any rank got."""
        for dispatcher in self._dispatchers:
            dispatcher.check()  # after the sync: every rank sees the same device-side verdicts
        self.saver.raise_failure()  # now, not at the next save: nothing trained after it could be saved
        diverged = self.guard.check(self.step)
        # The last training step's routing statistics (its last micro-batch's): an evaluation's forwards have their own.
        moe_stats = pending[-1][2]["moe_stats"] if self.moe_layers else None
        if self.cadence.draws(self.step) and self.rank == 0 and moe_stats is not None:
            log_expert_load(self.logger, self.step, moe_stats)
        # a stop agreed here skips this step's validation: a grace period covers steps and the save, not a val pass
        stopping = stop.agreed(self.device) and self.step < self.cfg.train.steps
        val_loss = None  # a stop agreed during a pass (None) ends it; the last step's pass is the run's: never cut
        if self.cadence.evals(self.step) and not stopping:
            stopping = (val_loss := self._evaluate(stop if self.step < self.cfg.train.steps else None)) is None
        rows, layers = metrics_rows(
            pending,
            timer.take(),
            positions=self.cfg.train.seq_len * self.layout.rows_per_step,
            skipped=self.guard.skipped,
            world=self.world,
            flops_per_token=self.flops_per_token,
            device=self.device,
            val_loss=val_loss,
            moe_stats=moe_stats,
        )
        for row in rows:
            self.metrics.log(row)
            self.logger.log(row["step"], {**row, **layers} if row is rows[-1] else row)
        if diverged or self.cadence.logs(self.step):
            progress.report(rows[-1])
        if diverged:
            self._stop_diverged(diverged)  # before any save: no checkpoint after the limit was passed
        if self.cadence.checkpoint_every:  # the first sync step: the host copy is allocated while training
            ckpt.prepare_save(self.checkpoint_state(), self.saver)
        if self.cadence.saves(self.step):
            self.save(wait=False)
        return stopping

    @functools.cached_property
    def _dispatchers(self) -> list:
        """Each distinct dispatcher once (the build made them with ``checked_after_step``: the loop checks)."""
        return list({id(m.dispatcher): m.dispatcher for m in self.moe_layers}.values())

    def _evaluate(self, stop: StopSignal | None = None) -> torch.Tensor | None:
        """The held-out loss over every rank's validation set (a device tensor, no host sync); None: ``stop`` cut it."""
        batches = self.val_data.batches(self.layout, self.rank, self.device)
        stopped = None if stop is None else functools.partial(stop.agreed, self.device)
        return evaluate(self.model, batches, self.device, self._autocast, stopped)

    def _stop_diverged(self, diverged: Diverged) -> None:
        if self.rank == 0:
            log.error("%s", diverged.message(self.step, self.cfg.train.max_nonfinite_steps))
        self.saver.wait()  # a background save of an earlier step finishes: the resume point
        self.write_summary()
        raise SystemExit(1)

    def _stop_for_signal(self, signum: int) -> None:
        path = self._checkpoint_path()
        if not self.built.checkpointable:
            saved = "nothing (this model has no moe_tune checkpoint)"
        else:
            saved = f"{path} (checkpoint.resume=auto continues from it)"
            if not self.cadence.saves(self.step):  # else the loop saved this step already; same on every rank
                self.save()  # complete before the line says so
        self.write_summary()
        if self.rank == 0:  # one line per job: every rank saved the same step
            log.warning(
                "stopped by signal %d after step %d of %d; saved %s", signum, self.step, self.cfg.train.steps, saved
            )
        raise SystemExit(128 + signum)

    # -- outputs -----------------------------------------------------------------------------------
    def _checkpoint_path(self) -> str:
        return os.path.join(self.cfg.output_dir, "checkpoints", f"step_{self.step}")

    def save(self, wait: bool = True) -> None:
        """A checkpoint of this step; ``wait=False`` (the loop's) returns while a background write goes on."""
        ckpt.save(self.checkpoint_state(), self.step, self._checkpoint_path(), self.saver)
        if wait:
            self.saver.wait()

    def export(self, out_dir: str) -> None:
        from moe_tune.models.hf_export import export_hf

        dtype = None if self.cfg.model.dtype == "source" else self.cfg.model.dtype
        with ckpt.safe.export_disk_full_exits(out_dir, self.cfg.output_dir, self.step, self.rank):  # exit 1
            export_hf(self.model, out_dir, self.mesh, dtype=dtype, chat_template=self.data.chat_template)

    def write_summary(self, finished: bool = False) -> dict:
        """``finished``: the run trained to train.steps, its outputs written (not a stop on a signal or on
        non-finite steps)."""
        val_stats = None if self.val_data is None else self.val_data.stats
        return write_run_summary(
            self.cfg,
            self.rank,
            self.world,
            self.device,
            self.flops_per_token,
            self.metrics,
            data_stats={"train": self.data.stats, "val": val_stats},
            final_step=self.step,
            finished=finished,
            **self.built.describe,
        )


__all__ = ["Trainer"]


def step_seed(seed: int, step: int, rank: int) -> int:
    """The global generator's seed for one rank's training step: another for each step and rank of a run."""
    return ((seed * 1_000_003 + step) * 65_537 + rank) % (1 << 63)
