"""The plain Transformers baseline of ``moe-tune-bench``: the Hugging Face model as published, trained the way
a user of transformers + FSDP2 would, on exactly moe_tune's workload.

Run as its own process group (``torchrun ... -m moe_tune.bench.baseline --experts grouped_mm <overrides>``,
or one process without torchrun); the overrides are moe_tune's Hydra overrides and are composed the same way.

What is the Hugging Face model's own:
  ``AutoModelForCausalLM.from_config(config, attn_implementation=<family's, sdpa>, experts_implementation=
  grouped_mm|eager)``; its forward computes the full logits and cross-entropy (``labels=``); its router,
  experts and auxiliary loss (``output_router_logits``, when ``train.aux_loss_coef`` > 0, with that coefficient).
What is mirrored from moe_tune's Trainer, so that only the model code differs:
  - weights: the same random init (``init_random`` draws each tensor by its name) or the same checkpoint;
  - data: ``build_dataset`` and ``PackedDataset.rows(step, micro, mbs, accum, rank, world)``; position ids passed
    only for packed rows, as the Trainer does;
  - loss: label-token sum / global label tokens of the step (``num_items_in_batch``), averaged by FSDP over ranks;
  - FSDP2 ``fully_shard`` per decoder layer and the root over all ranks, moe_tune's MixedPrecisionPolicy for
    ``train.precision`` and ``parallel.reshard_after_forward``;
  - optimizer, schedule and clipping: ``moe_tune.optim`` (PyTorch fused AdamW on CUDA) and ``clip_grad_norm_``;
  - activation checkpointing: ``full`` is Hugging Face's ``gradient_checkpointing_enable``; ``selective`` (which
    transformers lacks) wraps each layer's attention with moe_tune's ``apply_ac``;
  - forced balanced routing (``train.force_balanced_routing``): the softmax top-k routers pick experts
    t*k .. t*k+k-1 mod E for token t, as moe_tune's router does;
  - metrics: the same metrics.jsonl / summary.json fields, timing and FLOP formula.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import sys
import time
import types
from dataclasses import asdict, replace

import torch
import torch.distributed as dist
from torch import nn

from moe_tune.config import CommConfig, Config, ConfigError, KernelsConfig, validate
from moe_tune.env import require_backends

log = logging.getLogger("moe_tune.bench")
EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "eager")


def hf_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """``moe_tune.metrics.flops_per_token`` for a plain Hugging Face model.

    The shared formula counts ``nn.Linear`` modules (attention, dense and shared-expert MLPs, lm_head) and
    moe_tune's MoE layers; a Hugging Face sparse block instead holds stacked 3-D expert tensors and a router
    that is not an ``nn.Linear``. Their active parameters are added here: top_k experts' matrices per token
    (from the global, unsharded shapes) and the router's E x D.
    """
    from moe_tune.metrics import flops_per_token

    top_k = model.config.num_experts_per_tok
    extra = 0
    for block in model.modules():
        experts = getattr(block, "experts", None)
        if not isinstance(experts, nn.Module) or getattr(experts, "gate_up_proj", None) is None:
            continue
        per_expert = sum(
            torch.Size(p.shape[1:]).numel()
            for name, p in experts.named_parameters(recurse=False)
            if p.dim() == 3  # stacked (E, out, in) matrices; the biases of GPT-OSS are not matmuls
        )
        extra += top_k * per_expert
        router = getattr(block, "gate", None) or getattr(block, "router", None)
        if router is not None and not isinstance(router, nn.Linear) and getattr(router, "weight", None) is not None:
            extra += router.weight.shape.numel()
    return flops_per_token(model, seq_len) + 6.0 * extra


def _balanced_router_forward(self, hidden_states: torch.Tensor):
    """A softmax top-k router (transformers v5: returns logits, gates, expert ids) with forced balanced routing:
    token t takes experts t*k .. t*k+k-1 mod E, gated by their softmax scores (fp32 island), renormalised where the
    family renormalises (``norm_topk_prob``; Mixtral always does), in the dtype the family returns its gates."""
    logits_TE, gates_TK, _ = self._real_forward(hidden_states)
    scores_TE = torch.softmax(logits_TE, dtype=torch.float32, dim=-1)
    T, K = logits_TE.shape[0], self.top_k
    arange = functools.partial(torch.arange, device=logits_TE.device)
    ids_TK = (arange(T).unsqueeze(1) * K + arange(K)) % self.num_experts
    weights_TK = scores_TE.gather(1, ids_TK)
    if getattr(self, "norm_topk_prob", True):
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return logits_TE, weights_TK.to(gates_TK.dtype), ids_TK


def apply_forced_balanced_routing(model: nn.Module) -> int:
    """Patch every softmax top-k router of ``model``; returns how many. Other routers (sigmoid with a correction
    bias, biased logits) are refused rather than silently left on real routing."""
    routers = [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]
    for r in routers:
        plain = all(hasattr(r, a) for a in ("weight", "top_k", "num_experts"))
        if not plain or getattr(r, "bias", None) is not None or hasattr(r, "e_score_correction_bias"):
            raise ConfigError(
                f"train.force_balanced_routing=true: the baseline can force only plain softmax top-k routers, not "
                f"{type(r).__name__}; run this model with routing real (--routing real)"
            )
        r._real_forward = r.forward
        r.forward = types.MethodType(_balanced_router_forward, r)
    if not routers:
        raise ConfigError("train.force_balanced_routing=true: no top-k router found in the Hugging Face model")
    return len(routers)


class Baseline:
    """Build the Hugging Face model sharded with FSDP2 (or, on one GPU, plain), then train it like ``Trainer``."""

    def __init__(self, cfg: Config, experts_implementation: str = "grouped_mm", fsdp: bool = True):
        from moe_tune.build import build_source, build_tokenizer
        from moe_tune.data import build_dataset
        from moe_tune.dist.env import init_distributed
        from moe_tune.metrics import MetricsWriter
        from moe_tune.optim import build_optimizer, build_scheduler
        from moe_tune.train import _setup_logging, write_json

        if experts_implementation not in EXPERTS_IMPLEMENTATIONS:
            raise ConfigError(
                f"--experts {experts_implementation!r} is not one of {', '.join(EXPERTS_IMPLEMENTATIONS)}"
            )
        # The baseline has no expert parallelism, dispatcher or kernel choice: check the rest of the workload.
        checked = replace(cfg, parallel=replace(cfg.parallel, ep=1), comm=CommConfig(), kernels=KernelsConfig())
        validate(checked)
        require_backends(checked)
        self.cfg, self.experts_implementation, self.fsdp = cfg, experts_implementation, fsdp
        self.env = init_distributed()
        self.rank, self.world, self.device = self.env.rank, self.env.world_size, self.env.device
        if not fsdp and (self.world > 1 or cfg.train.precision == "bf16_fp32_master"):
            raise ConfigError(
                f"--no-fsdp (plain model on one GPU) needs 1 process (got {self.world}) and train.precision bf16, fp32 "
                f"or amp_bf16 (got {cfg.train.precision}): bf16 compute on fp32 parameters is FSDP's MixedPrecisionPolicy"
            )
        torch.manual_seed(cfg.train.seed)
        _setup_logging(self.rank)
        if self.rank == 0:
            os.makedirs(cfg.output_dir, exist_ok=True)
            write_json(os.path.join(cfg.output_dir, "config.json"), asdict(cfg))
        source, hf_config = build_source(cfg, self.rank)
        self.model, self.mesh = self.build_model(source, hf_config)
        t = cfg.train
        self.accum = 1 if t.global_batch_size == -1 else t.global_batch_size // (t.micro_batch_size * self.world)
        self.optimizer = build_optimizer(self.model.parameters(), cfg.optim, t.lr)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, t.steps)
        self.data = build_dataset(cfg.data, build_tokenizer(source), t.seq_len, t.seed, vocab_size=hf_config.vocab_size)
        self.metrics = MetricsWriter(cfg.output_dir, self.rank == 0, t.warmup_steps_excluded)
        self.flops_per_token = self.count_flops(hf_config)

    def build_model(self, source: str | None, hf_config) -> tuple[nn.Module, object]:
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from transformers import AutoModelForCausalLM

        from moe_tune.config import ParallelDims
        from moe_tune.dist.mesh import build_mesh
        from moe_tune.models.families import get_family
        from moe_tune.models.hf_io import load_state
        from moe_tune.models.init import init_random
        from moe_tune.models.model import materialize
        from moe_tune.parallel import apply_ac, mixed_precision_policy

        cfg = self.cfg
        family = get_family(hf_config.model_type, getattr(hf_config, "architectures", None))
        aux = cfg.train.aux_loss_coef
        if hasattr(hf_config, "output_router_logits"):
            hf_config.output_router_logits = aux > 0
            hf_config.router_aux_loss_coef = aux
        hf_config.use_cache = False
        param_dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                hf_config,
                dtype=param_dtype,
                attn_implementation=family.attn_implementation,
                experts_implementation=self.experts_implementation,
            )
        if cfg.train.force_balanced_routing:
            apply_forced_balanced_routing(model)
        ac = cfg.parallel.activation_checkpointing
        if ac == "full":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif ac == "selective":
            apply_ac(model.model, "selective")  # transformers has no selective mode: attention only, as moe_tune
        mesh = build_mesh(
            ParallelDims(dp_replicate=1, dp_shard=self.world, ep=1, world_size=self.world), self.device.type
        )
        mp = mixed_precision_policy(cfg.train.precision)
        reshard = cfg.parallel.reshard_after_forward
        for layer in model.model.layers if self.fsdp else ():
            fully_shard(layer, mesh=mesh["dp_shard"], mp_policy=mp, reshard_after_forward=reshard)
        if self.fsdp:
            fully_shard(model, mesh=mesh["dp_shard"], mp_policy=mp)
        if self.device.type == "cpu":  # gloo has no PREMUL_SUM: reduce with SUM and divide separately
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_force_sum_reduction_for_comms(True)
        materialize(model, self.device)
        num_experts = next(
            (
                getattr(hf_config, k)
                for k in ("num_experts", "n_routed_experts", "num_local_experts")
                if hasattr(hf_config, k)
            ),
            None,
        )
        if source is not None:
            load_state(model, source, family)
        else:
            init_random(model, seed=cfg.train.seed, num_experts=num_experts)
        model.train()
        return model, mesh

    def train_step(self, step: int) -> dict:
        """One optimizer step; the loss bookkeeping is the Trainer's, line for line."""
        cfg = self.cfg
        batches = [self.micro_batch(step, m) for m in range(self.accum)]
        total = sum((labels[:, 1:] != -100).sum() for _, labels, _ in batches).float()
        if dist.is_initialized():
            dist.all_reduce(total)  # all ranks: label tokens of the whole step
        normalizer = total.clamp(min=1) / self.world  # FSDP averages gradients over the world
        ce_sum = torch.zeros((), device=self.device)
        autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if cfg.train.precision == "amp_bf16"
            else contextlib.nullcontext()
        )
        for m, (ids, labels, pos) in enumerate(batches):
            if hasattr(self.model, "set_requires_gradient_sync"):  # an FSDP2 root: reduce on the last micro-batch
                self.model.set_requires_gradient_sync(m == self.accum - 1)
            with autocast:
                ce_sum += self.forward_backward(ids, labels, pos, normalizer)
        grad_norm = self.clip_grad_norm()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if dist.is_initialized():
            dist.all_reduce(ce_sum)  # all ranks: per-rank token-loss sums / (global / world)
        return {"loss": ce_sum / self.world, "grad_norm": grad_norm}

    def micro_batch(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """This rank's rows of a micro-batch, as the Trainer takes them: position ids only for packed rows (plain
        0..S-1 rows pass None, so transformers does not look for packed sequences on the device, a host sync)."""
        t = self.cfg.train
        return self.data.micro_batch(step, micro, t.micro_batch_size, self.accum, self.rank, self.world, self.device)

    def forward_backward(self, ids, labels, pos, normalizer: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns its detached cross-entropy (sum / normalizer)."""
        out = self.model(input_ids=ids, labels=labels, position_ids=pos, num_items_in_batch=normalizer)
        # transformers adds router_aux_loss_coef * aux_loss to its loss; split it off to log the CE alone.
        aux = getattr(out, "aux_loss", None)
        ce = out.loss - self.cfg.train.aux_loss_coef * aux if aux is not None else out.loss
        (ce + (out.loss - ce) / self.accum).backward()
        return ce.detach()

    def clip_grad_norm(self) -> torch.Tensor:
        from moe_tune.parallel import clip_grad_norm_

        return clip_grad_norm_(self.model, self.cfg.optim.max_grad_norm, self.mesh)

    def count_flops(self, hf_config) -> float:
        return hf_flops_per_token(self.model, self.cfg.train.seq_len)

    def describe(self) -> dict:
        """What this row actually ran, for summary.json (``bench_config`` updates the row's config)."""
        c = self.model.config
        return {
            "experts_implementation": c._experts_implementation,
            "attn_implementation": c._attn_implementation,
            "bench_config": {"experts": c._experts_implementation, "fsdp": "per layer + root" if self.fsdp else "none"},
        }

    def fit(self) -> dict:
        from moe_tune.metrics import step_row

        t = self.cfg.train
        tokens = t.seq_len * t.micro_batch_size * self.accum * self.world
        for step in range(t.steps):
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            t0 = time.perf_counter()
            out = self.train_step(step)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # host sync: time the whole step
            dt = time.perf_counter() - t0
            # host sync: one .tolist() per step for the metrics line
            loss, grad_norm = torch.stack([out["loss"].float(), out["grad_norm"].float().to(self.device)]).tolist()
            lr = self.scheduler.get_last_lr()[0]
            row = step_row(step + 1, loss, grad_norm, lr, tokens, dt, self.world, self.flops_per_token, self.device)
            self.metrics.log(row)
            if self.rank == 0:
                log.info(
                    f"step {step + 1} | loss {loss:.4f} | {row['tokens_per_s']:,.0f} tok/s | {row['peak_mem_gib']:.1f} GiB"
                )
        return self.write_summary()

    def write_summary(self) -> dict:
        from moe_tune.train import write_run_summary

        return write_run_summary(
            self.cfg, self.rank, self.world, self.device, self.flops_per_token, self.metrics, **self.describe()
        )


def main(argv: list[str] | None = None) -> int:
    from moe_tune.cli import compose, precheck, to_config

    parser = argparse.ArgumentParser(prog="python -m moe_tune.bench.baseline", description=__doc__.splitlines()[0])
    parser.add_argument("--experts", default="grouped_mm", choices=EXPERTS_IMPLEMENTATIONS)
    parser.add_argument("--no-fsdp", action="store_true", help="the plain model on one GPU, as run without FSDP")
    parser.add_argument(
        "overrides", nargs="*", help="moe_tune Hydra overrides (model=..., train.seq_len=..., output_dir=...)"
    )
    args = parser.parse_args(argv)
    precheck(args.overrides)  # a bad override: one line, exit 2
    try:
        cfg = to_config(compose(args.overrides))
        Baseline(cfg, args.experts, fsdp=not args.no_fsdp).fit()
    except ConfigError as e:
        print(f"moe-tune-bench baseline: error: {e}", file=sys.stderr)
        return 2
    finally:
        from moe_tune.dist.env import destroy_distributed

        destroy_distributed()
    return 0


__all__ = ["Baseline", "apply_forced_balanced_routing", "hf_flops_per_token", "main"]

if __name__ == "__main__":
    sys.exit(main())
