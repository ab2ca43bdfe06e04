"""The NeMo AutoModel row of ``moe-tune-bench`` (``--peer automodel``): ``NeMoAutoModelForCausalLM`` with expert
parallelism and FSDP2, trained on moe_tune's workload by moe_tune's Trainer (its step and loop), as the
Transformers baseline is: ``build_nemo_model`` is the trainer's builder.

Written against nemo_automodel 0.7.0 (its ``recipes/llm/train_ft.py`` step): ``DistributedSetup.build(strategy=
FSDP2Config(mp_policy), parallelism_sizes=ParallelismSizes(ep_size), moe_parallel_config, activation_checkpointing)``,
``BackendConfig`` for attention / linear / experts / dispatcher, its ``MaskedCrossEntropy`` on full logits, and its
``scale_grads_and_clip_grad_norm`` (which also rescales expert gradients for EP). Mapped from moe_tune's choices:
  - precision: moe_tune's MixedPrecisionPolicy for ``train.precision`` (fp32 parameters for ``bf16_fp32_master``);
  - ``parallel.activation_checkpointing`` none|full|selective -> False|"full"|"selective";
  - ``train.force_balanced_routing`` -> ``BackendConfig(fake_balanced_gate=True)`` (its balanced gate, which is not
    moe_tune's assignment but balances the same way);
  - ``train.aux_loss_coef`` -> the config's ``router_aux_loss_coef``;
  - the optimizer: PyTorch's fused AdamW (``peer_optimizer``), as the Transformers baseline's;
  - ``--dispatcher torch|deepep`` and ``--backend k=v,...`` (default attn=sdpa, linear=torch, experts=torch_mm,
    rope_fusion=False: no TransformerEngine), ``--ep`` (default parallel.ep if > 1, else every rank).
It starts from the same weights as the other rows: the checkpoint, or for a random preset the same draw written
as a Hugging Face checkpoint first (``_preset_checkpoint``), loaded through NeMo's state-dict adapter. FLOPs per
token are counted on the Hugging Face model of the same config.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_tune.bench.baseline import check_workload, hf_flops_per_token, peer_optimizer
from moe_tune.build import Built
from moe_tune.config import Config, ConfigError, UserError
from moe_tune.distributed.dims import BatchLayout
from moe_tune.train import Trainer

DEFAULT_BACKEND = {"attn": "sdpa", "linear": "torch", "experts": "torch_mm", "rope_fusion": False}


def parse_backend(text: str, dispatcher: str) -> dict:
    """``'attn=te,linear=te'`` -> BackendConfig kwargs over DEFAULT_BACKEND (``true``/``false`` become bools)."""
    kwargs: dict = {**DEFAULT_BACKEND, "dispatcher": dispatcher}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--backend item {item!r} is not key=value; e.g. --backend attn=te,linear=te")
        kwargs[key] = {"true": True, "false": False}.get(value.lower(), value)
    return kwargs


class NeMoCausalLM(nn.Module):
    """NeMo AutoModel's model behind moe_tune's model interface, so that the Trainer's own step trains it: its
    logits, its ``MaskedCrossEntropy`` (sum) over the labels / ``loss_normalizer``. Its balancing loss is not in
    ``.loss``: NeMo adds its gradient in backward (``MoEAuxLossAutoScaler``), scaled by 1 / micro-batches."""

    def __init__(self, nemo_model: nn.Module, accum: int):
        from nemo_automodel.components.loss.masked_ce import MaskedCrossEntropy

        super().__init__()
        self.nemo, self.loss_fn = nemo_model, MaskedCrossEntropy(reduction="sum")
        self.aux_scale = torch.tensor(1.0 / accum)

    @property
    def config(self):
        return self.nemo.config

    def forward(self, input_ids, labels=None, position_ids=None, loss_normalizer=None, return_logits=None):
        from nemo_automodel.components.moe.megatron.moe_utils import MoEAuxLossAutoScaler

        from moe_tune.models.model import CausalLMOutput

        # Its recipe: balancing-loss gradients averaged over the step's micro-batches.
        MoEAuxLossAutoScaler.main_loss_backward_scale = self.aux_scale
        logits = self.nemo(input_ids=input_ids, position_ids=position_ids).logits
        shifted = F.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()  # aligned with input_ids, as for the others
        ce = self.loss_fn(logits, shifted) / loss_normalizer  # fp32 island: MaskedCrossEntropy upcasts the logits
        return CausalLMOutput(loss=ce, ce_loss=ce)

    def set_requires_gradient_sync(self, requires: bool) -> None:
        if hasattr(self.nemo, "set_requires_gradient_sync"):
            self.nemo.set_requires_gradient_sync(requires)


def build_nemo_model(cfg: Config, env, backend_kwargs: dict, requested_ep: int | None = None) -> Built:
    """The Trainer's builder for the peer: ``NeMoAutoModelForCausalLM`` with its EP and FSDP2 setup, wrapped in
    ``NeMoCausalLM``, with NeMo's own gradient clipping. Not checkpointable."""
    from nemo_automodel import NeMoAutoModelForCausalLM
    from nemo_automodel.components.models.common.utils import BackendConfig

    from moe_tune.build import build_source, build_tokenizer

    source, hf_config = build_source(cfg, env.rank)
    ep = requested_ep or (cfg.parallel.ep if cfg.parallel.ep > 1 else env.world_size)
    setup = _distributed_setup(cfg, hf_config, ep, env.world_size)
    backend = BackendConfig(**backend_kwargs, fake_balanced_gate=cfg.train.force_balanced_routing)
    hf_config.router_aux_loss_coef = cfg.train.aux_loss_coef
    # NeMo picks its own model class by the config's architectures; a preset's config (no checkpoint) has none,
    # and without it NeMo builds transformers' class and hands it kwargs it does not take (``backend``).
    hf_config.architectures = hf_config.architectures or [_causal_lm_class(hf_config.model_type)]
    param_dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    kwargs = dict(dtype=param_dtype, distributed_setup=setup, backend=backend)
    weights = source if source is not None else _preset_checkpoint(cfg, hf_config, param_dtype, env.rank)
    model = NeMoAutoModelForCausalLM.from_pretrained(weights, **kwargs)
    if source is None:
        _barrier()  # every rank has loaded it
        if env.rank == 0:
            shutil.rmtree(weights)
    model.train()
    t = cfg.train
    return Built(
        model=NeMoCausalLM(model, BatchLayout.from_config(t, dp_size=env.world_size).accum),
        mesh=None,
        source=source,
        tokenizer=build_tokenizer(source),
        flops_per_token=_reference_flops(hf_config, t.seq_len),
        checkpointable=False,
        clip_grad_norm=functools.partial(_clip_grad_norm, model, setup.mesh_context, cfg.optim.max_grad_norm, env),
        describe=describe(backend_kwargs, cfg.train.force_balanced_routing, ep),
    )


def _preset_checkpoint(cfg: Config, hf_config, dtype: torch.dtype, rank: int) -> str:
    """A random preset's starting weights as a Hugging Face checkpoint (``output_dir/peer_init``, removed once
    loaded): the Transformers model with ``init_random``'s draw by tensor name, which is what moe_tune and the
    Transformers baseline start from. NeMo's module names differ, so it loads them through its own Hugging Face
    state-dict adapter, as it loads any checkpoint; its ``from_config`` would draw weights of its own."""
    from transformers import AutoModelForCausalLM

    from moe_tune.bench.baseline import _num_experts
    from moe_tune.models.init import init_random
    from moe_tune.models.model import materialize

    path = os.path.join(cfg.output_dir, "peer_init")
    if rank == 0:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        materialize(model, "cpu")
        init_random(model, seed=cfg.train.seed, num_experts=_num_experts(hf_config))
        model.save_pretrained(path)
        del model
    _barrier()  # the other ranks read what rank 0 wrote
    return path


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _causal_lm_class(model_type: str) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]


def _distributed_setup(cfg: Config, hf_config, ep: int, world: int):
    from nemo_automodel.components.distributed import (
        DistributedSetup,
        FSDP2Config,
        MoEParallelizerConfig,
        ParallelismSizes,
    )

    from moe_tune.distributed.fsdp import mixed_precision_policy

    num_experts = next(
        (
            getattr(hf_config, k)
            for k in ("num_experts", "n_routed_experts", "num_local_experts")
            if hasattr(hf_config, k)
        ),
        1,
    )
    if num_experts % ep or world % ep:
        raise ConfigError(f"--ep {ep} must divide the number of experts ({num_experts}) and the world size ({world})")
    mp = mixed_precision_policy(cfg.train.precision)
    ac = {"none": False, "full": "full", "selective": "selective"}[cfg.parallel.activation_checkpointing]
    return DistributedSetup.build(
        strategy=FSDP2Config(mp_policy=mp),
        parallelism_sizes=ParallelismSizes(ep_size=ep),
        moe_parallel_config=MoEParallelizerConfig(mp_policy=mp) if ep > 1 else None,
        activation_checkpointing=ac,
    )


def _clip_grad_norm(model, mesh_context, max_norm: float, env) -> torch.Tensor:
    """NeMo's ``scale_grads_and_clip_grad_norm`` (it also rescales expert gradients for EP)."""
    from nemo_automodel.components.training.utils import scale_grads_and_clip_grad_norm

    moe_mesh = mesh_context.moe_mesh
    norm = scale_grads_and_clip_grad_norm(
        max_norm,
        [model],
        norm_type=2.0,
        device_mesh=mesh_context.device_mesh,
        moe_mesh=moe_mesh,
        ep_axis_name="ep" if moe_mesh is not None and "ep" in (moe_mesh.mesh_dim_names or ()) else None,
        foreach=True,
        dp_group_size=env.world_size,
    )
    return torch.as_tensor(norm, dtype=torch.float32, device=env.device)


def _reference_flops(hf_config, seq_len: int) -> float:
    """FLOPs per token of the Hugging Face model of the same config (NeMo's module names differ)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(hf_config)
    return hf_flops_per_token(reference, seq_len)


def describe(backend_kwargs: dict, fake_balanced_gate: bool, ep: int) -> dict:
    from importlib.metadata import version

    b = backend_kwargs
    return {
        "nemo_automodel": version("nemo_automodel"),
        "backend": {**b, "fake_balanced_gate": fake_balanced_gate},
        "bench_config": {
            "comm": f"nemo {b['dispatcher']}",
            "kernels": f"nemo_automodel attn={b['attn']} linear={b['linear']}",
            "experts": b["experts"],
            "ep": ep,
        },
    }


class Peer(Trainer):
    """moe_tune's Trainer (its step, loop, metrics and summary) on NeMo AutoModel's model (``build_nemo_model``)."""

    def __init__(self, cfg: Config, dispatcher: str = "torch", ep: int | None = None, backend: str = ""):
        self.backend_kwargs = parse_backend(backend, dispatcher)
        builder = functools.partial(build_nemo_model, backend_kwargs=self.backend_kwargs, requested_ep=ep)
        super().__init__(peer_optimizer(cfg), builder=builder)

    def check_config(self, cfg: Config) -> None:
        check_workload(cfg)


def main(argv: list[str] | None = None) -> int:
    from moe_tune.cli.train import compose, precheck, to_config
    from moe_tune.distributed.process_group import destroy_distributed

    parser = argparse.ArgumentParser(prog="python -m moe_tune.bench.peer", description=__doc__.splitlines()[0])
    parser.add_argument("--dispatcher", default="torch", help="NeMo AutoModel MoE dispatcher: torch or deepep")
    parser.add_argument(
        "--ep", type=int, default=None, help="expert-parallel size (default: parallel.ep, else all ranks)"
    )
    parser.add_argument("--backend", default="", help="BackendConfig overrides, e.g. attn=te,linear=te")
    parser.add_argument("overrides", nargs="*", help="moe_tune Hydra overrides (the workload)")
    args = parser.parse_args(argv)
    precheck(args.overrides)
    try:
        Peer(to_config(compose(args.overrides)), args.dispatcher, args.ep, args.backend).fit()
    except UserError as e:
        print(f"moe-tune-bench peer: error: {e}", file=sys.stderr)
        return 2
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
