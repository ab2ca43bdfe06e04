"""The plain Transformers baseline of ``moe-tune-bench``: the Hugging Face model as published, trained the way
a user of transformers + FSDP2 would, on exactly moe_tune's workload.

Run as its own process group (``torchrun ... -m moe_tune.bench.baseline --experts grouped_mm <overrides>``,
or one process without torchrun); the overrides are moe_tune's Hydra overrides and are composed the same way.

What is the Hugging Face model's own:
  ``AutoModelForCausalLM.from_config(config, attn_implementation=<family's, sdpa>, experts_implementation=
  grouped_mm|eager)``; its forward computes the full logits and cross-entropy (``labels=``); its router,
  experts and auxiliary loss (``output_router_logits``, when ``train.aux_loss_coef`` > 0, with that coefficient).
What is moe_tune's, so that only the model code differs: the ``Trainer`` itself, given ``build_hf_model`` as its
builder (``HFCausalLM`` adapts the model's forward to the step's call), so the step, loop, metrics.jsonl /
summary.json fields, timing and FLOP formula are the trainer's; and
  - weights: the same random init (``init_random`` draws each tensor by its name) or the same checkpoint;
  - data: ``build_dataset``, the trainer's micro-batches; position ids passed only for packed rows;
  - loss: label-token sum / global label tokens of the step (``num_items_in_batch``), averaged by FSDP over ranks;
  - FSDP2 ``fully_shard`` per decoder layer and the root over all ranks, moe_tune's MixedPrecisionPolicy for
    ``train.precision`` and ``parallel.reshard_after_forward``;
  - optimizer, schedule and clipping: the Trainer's, with PyTorch's fused AdamW (``optim.compiled=false``: what
    a transformers user runs; ``peer_optimizer``), clipping by its ``grad_scale``;
  - activation checkpointing: ``full`` is Hugging Face's ``gradient_checkpointing_enable``; ``selective`` (which
    transformers lacks) wraps each layer's attention with moe_tune's ``apply_ac``;
  - forced balanced routing (``train.force_balanced_routing``): the softmax top-k routers pick experts
    t*k .. t*k+k-1 mod E for token t, as moe_tune's router does.
No checkpoints or Hugging Face export (moe_tune's are for its own model).
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from dataclasses import replace

import torch
from torch import nn

from moe_tune.build import Built
from moe_tune.config import CommConfig, Config, ConfigError, KernelsConfig, UserError, rounds_stochastically, validate
from moe_tune.env import require_backends
from moe_tune.train import Trainer

log = logging.getLogger("moe_tune.bench")
EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "eager")


def hf_flops_per_token(model: nn.Module, seq_len: int, frozen_base: bool = False) -> float:
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
    return flops_per_token(model, seq_len, frozen_base) + (4.0 if frozen_base else 6.0) * extra


def _balanced_router_forward(self, real_forward, hidden_states: torch.Tensor):
    """A softmax top-k router (transformers v5: returns logits, gates, expert ids) with forced balanced routing:
    token t takes experts t*k .. t*k+k-1 mod E, gated by their softmax scores (fp32 island), renormalised where the
    family renormalises (``norm_topk_prob``; Mixtral always does), in the dtype the family returns its gates.
    ``real_forward``: the router's own forward, which gives the logits."""
    logits_TE, gates_TK, _ = real_forward(hidden_states)
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
        r.forward = functools.partial(_balanced_router_forward, r, r.forward)
    if not routers:
        raise ConfigError("train.force_balanced_routing=true: no top-k router found in the Hugging Face model")
    return len(routers)


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM behind moe_tune's model interface, so that the Trainer's own step trains it.

    ``forward(input_ids, labels=, position_ids=, loss_normalizer=)`` passes the normalizer to transformers as
    ``num_items_in_batch`` (its loss: label-token sum / that), and returns ``.loss`` (transformers' loss, with
    ``router_aux_loss_coef`` x its aux loss added when the router logits are output) and ``.ce_loss`` (the
    cross-entropy alone, logged), as moe_tune's ``CausalLMOutput``."""

    def __init__(self, hf_model: nn.Module, aux_loss_coef: float):
        super().__init__()
        self.hf, self.aux_loss_coef = hf_model, aux_loss_coef

    @property
    def config(self):
        return self.hf.config

    def forward(self, input_ids, labels=None, position_ids=None, loss_normalizer=None, return_logits=None):
        from moe_tune.models.model import CausalLMOutput

        out = self.hf(input_ids=input_ids, labels=labels, position_ids=position_ids, num_items_in_batch=loss_normalizer)
        # transformers adds router_aux_loss_coef * aux_loss to its loss; split it off to log the CE alone.
        aux = getattr(out, "aux_loss", None)
        ce = out.loss - self.aux_loss_coef * aux if aux is not None else out.loss
        return CausalLMOutput(loss=out.loss, ce_loss=ce, aux_loss=aux)

    def set_requires_gradient_sync(self, requires: bool) -> None:
        """An FSDP2 root reduces gradients only on the step's last micro-batch; a plain model has nothing to do."""
        if hasattr(self.hf, "set_requires_gradient_sync"):
            self.hf.set_requires_gradient_sync(requires)


def build_hf_model(
    cfg: Config, env, experts_implementation: str = "grouped_mm", fsdp: bool = True, bnb4: bool = False
) -> Built:
    """The Trainer's builder for the baseline: the Hugging Face model of ``cfg``'s checkpoint or preset, with
    moe_tune's weights (the same checkpoint, or ``init_random``'s draw by tensor name), wrapped in ``HFCausalLM``;
    for ``peft=lora``, PEFT's LoRA model around it (``moe_tune.bench.peft_baseline``), its linears first in
    bitsandbytes 4-bit with ``bnb4`` (QLoRA as a Transformers + PEFT user runs it).
    Not checkpointable (moe_tune's checkpoints and export are for moe_tune's model)."""
    from moe_tune.bench.peft_baseline import apply_peft, quantize_linears_4bit
    from moe_tune.build import build_source, build_tokenizer
    from moe_tune.models.families import get_family
    from moe_tune.models.model import materialize

    source, hf_config = build_source(cfg, env.rank)
    family = get_family(hf_config.model_type, getattr(hf_config, "architectures", None))
    lora = cfg.peft.name == "lora"
    model = hf_model_on_meta(cfg, hf_config, family, experts_implementation)
    mesh = _mesh(env)
    if fsdp and not lora:
        _shard(model, mesh, cfg, env)
    materialize(model, env.device)
    load_weights(model, source, hf_config, family, cfg.train.seed)
    flops = hf_flops_per_token(model, cfg.train.seq_len, frozen_base=lora)
    quantized = quantize_linears_4bit(model, env.device) if bnb4 else 0
    if lora:  # PEFT wraps the loaded model; FSDP2 then shards it (mixed frozen and trainable parameters)
        model = apply_peft(model, cfg, family.block_attr, bnb4)
        if fsdp:
            _shard(model, mesh, cfg, env)
    model.train()
    return Built(
        model=HFCausalLM(model, cfg.train.aux_loss_coef),
        mesh=mesh,
        source=source,
        tokenizer=build_tokenizer(source),
        flops_per_token=flops,
        checkpointable=False,
        describe=describe(model, fsdp, quantized),
    )


def load_weights(model: nn.Module, source: str | None, hf_config, family, seed: int) -> None:
    """The weights every row starts from: the checkpoint's, or for a preset ``init_random``'s draw by tensor name."""
    from moe_tune.models.hf_io import load_state
    from moe_tune.models.init import init_random

    if source is not None:
        load_state(model, source, family)
    else:
        init_random(model, seed=seed, num_experts=_num_experts(hf_config))


def hf_model_on_meta(
    cfg: Config, hf_config, family, experts_implementation: str, attn_implementation: str | None = None
) -> nn.Module:
    """The transformers model on the meta device, with forced routing and activation checkpointing as asked;
    attention the family's unless ``attn_implementation`` names one."""
    from transformers import AutoModelForCausalLM

    from moe_tune.bench.peft_baseline import base_dtype
    from moe_tune.distributed.activation_checkpoint import apply_ac

    aux = cfg.train.aux_loss_coef if cfg.peft.name == "none" or cfg.peft.train_router else 0.0
    if hasattr(hf_config, "output_router_logits"):
        hf_config.output_router_logits = aux > 0
        hf_config.router_aux_loss_coef = aux
    hf_config.use_cache = False
    param_dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    if cfg.peft.name == "lora":
        param_dtype = base_dtype(cfg)  # the frozen base, as a PEFT user loads it
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            hf_config,
            dtype=param_dtype,
            attn_implementation=attn_implementation or family.attn_implementation,
            experts_implementation=experts_implementation,
        )
    if cfg.train.force_balanced_routing:
        apply_forced_balanced_routing(model)
    ac = cfg.parallel.activation_checkpointing
    if ac == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif ac == "selective":
        apply_ac(model.model, "selective")  # transformers has no selective mode: attention only, as moe_tune
    return model


def _mesh(env):
    from moe_tune.distributed.dims import ParallelDims
    from moe_tune.distributed.mesh import build_mesh

    world = env.world_size
    return build_mesh(ParallelDims(dp_replicate=1, dp_shard=world, ep=1, world_size=world), env.device.type)


def _shard(model: nn.Module, mesh, cfg: Config, env) -> None:
    """FSDP2 per decoder layer and at the root over all ranks."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from moe_tune.bench.peft_baseline import decoder_layers
    from moe_tune.distributed.fsdp import mixed_precision_policy

    mp = mixed_precision_policy(cfg.train.precision)
    reshard = cfg.parallel.reshard_after_forward
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh["dp_shard"], mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh["dp_shard"], mp_policy=mp)
    if env.device.type == "cpu":  # gloo has no PREMUL_SUM: reduce with SUM and divide separately
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)


def _num_experts(hf_config) -> int | None:
    keys = ("num_experts", "n_routed_experts", "num_local_experts")
    return next((getattr(hf_config, k) for k in keys if hasattr(hf_config, k)), None)


def describe(model: nn.Module, fsdp: bool, quantized_4bit: int = 0) -> dict:
    """What this row actually ran, for summary.json (``bench_config`` updates the row's config)."""
    c = model.config
    bench = {"experts": c._experts_implementation, "fsdp": "per layer + root" if fsdp else "none"}
    if quantized_4bit:
        import bitsandbytes

        bench["quantized"] = (
            f"bitsandbytes {bitsandbytes.__version__} NF4 on the nn.Linear layers ({quantized_4bit:,} weights); the "
            "fused experts bf16"
        )
    peft_config = getattr(model, "peft_config", {}).get("default")
    if peft_config is not None:
        import peft

        bench["peft"] = f"peft {peft.__version__} LoRA r={peft_config.r} (experts: target_parameters)"
    return {
        "experts_implementation": c._experts_implementation,
        "attn_implementation": c._attn_implementation,
        "bench_config": bench,
    }


def check_workload(cfg: Config, fsdp: bool = True, bnb4: bool = False) -> None:
    """The baseline's (and the peer's) config check, before any process group exists: they have no moe_tune
    expert parallelism, dispatcher or kernel choice, so the rest of the workload is checked. Without FSDP, a
    model that trains every weight holds them in their compute dtype; LoRA's base is bf16 whatever the precision
    (PEFT keeps its adapters fp32)."""
    from moe_tune.config import world_size_from_env

    checked = replace(cfg, parallel=replace(cfg.parallel, ep=1), comm=CommConfig(), kernels=KernelsConfig())
    validate(checked)
    require_backends(checked)
    world = world_size_from_env()
    if bnb4 and (cfg.peft.name != "lora" or world > 1):
        raise ConfigError(
            f"--bnb4 (QLoRA through bitsandbytes) runs peft=lora on one process, without FSDP (got peft="
            f"{cfg.peft.name}, {world} processes); add peft=lora and run one process"
        )
    fp32_params = cfg.train.precision == "bf16_fp32_master" and cfg.peft.name != "lora"
    if not fsdp and (world > 1 or fp32_params):
        raise ConfigError(
            f"--no-fsdp (plain model on one GPU) needs 1 process (got {world}) and train.precision bf16, fp32 "
            f"or amp_bf16 (got {cfg.train.precision}): bf16 compute on fp32 parameters is FSDP's MixedPrecisionPolicy"
        )


def peer_optimizer(cfg: Config) -> Config:
    """The baseline's and the peer's optimizer: PyTorch's fused AdamW, as their users run it, not moe_tune's
    compiled update. Stochastic rounding (moe_tune's own; automatic for bf16 parameters) keeps its Triton kernel,
    so a bf16 table compares the stacks under one optimizer."""
    if rounds_stochastically(cfg.train.precision, cfg.optim.stochastic_rounding):
        return cfg
    return replace(cfg, optim=replace(cfg.optim, compiled=False))


class Baseline(Trainer):
    """moe_tune's Trainer (its step, loop, metrics and summary) on the Hugging Face model (``build_hf_model``),
    sharded with FSDP2 or, on one GPU, plain."""

    def __init__(self, cfg: Config, experts_implementation: str = "grouped_mm", fsdp: bool = True, bnb4: bool = False):
        if experts_implementation not in EXPERTS_IMPLEMENTATIONS:
            raise ConfigError(
                f"--experts {experts_implementation!r} is not one of {', '.join(EXPERTS_IMPLEMENTATIONS)}"
            )
        self.experts_implementation, self.fsdp, self.bnb4 = experts_implementation, fsdp and not bnb4, bnb4
        builder = functools.partial(
            build_hf_model, experts_implementation=experts_implementation, fsdp=self.fsdp, bnb4=bnb4
        )
        super().__init__(peer_optimizer(cfg), builder=builder)

    def check_config(self, cfg: Config) -> None:
        check_workload(cfg, self.fsdp, self.bnb4)

    def describe(self) -> dict:
        return self.built.describe


def main(argv: list[str] | None = None) -> int:
    from moe_tune.cli.train import compose, precheck, to_config

    parser = argparse.ArgumentParser(prog="python -m moe_tune.bench.baseline", description=__doc__.splitlines()[0])
    parser.add_argument("--experts", default="grouped_mm", choices=EXPERTS_IMPLEMENTATIONS)
    parser.add_argument("--no-fsdp", action="store_true", help="the plain model on one GPU, as run without FSDP")
    parser.add_argument(
        "--bnb4", action="store_true", help="peft=lora on linears in bitsandbytes 4-bit NF4 (QLoRA), one GPU, no FSDP"
    )
    parser.add_argument(
        "overrides", nargs="*", help="moe_tune Hydra overrides (model=..., train.seq_len=..., output_dir=...)"
    )
    args = parser.parse_args(argv)
    precheck(args.overrides)  # a bad override: one line, exit 2
    try:
        cfg = to_config(compose(args.overrides))
        Baseline(cfg, args.experts, fsdp=not args.no_fsdp, bnb4=args.bnb4).fit()
    except UserError as e:
        print(f"moe-tune-bench baseline: error: {e}", file=sys.stderr)
        return 2
    finally:
        from moe_tune.distributed.process_group import destroy_distributed

        destroy_distributed()
    return 0


__all__ = [
    "Baseline",
    "HFCausalLM",
    "apply_forced_balanced_routing",
    "build_hf_model",
    "check_workload",
    "hf_flops_per_token",
    "hf_model_on_meta",
    "load_weights",
    "main",
    "peer_optimizer",
]

if __name__ == "__main__":
    sys.exit(main())
