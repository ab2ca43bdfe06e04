"""A LoRA run's adapters as a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``)
that ``peft.PeftModel.from_pretrained`` loads onto the plain transformers model.

Keys are PEFT's: ``base_model.model.<module>.lora_{A,B}.weight``. Linears map one to one (A: rank x in,
B: out x rank). The experts' adapters take the form of PEFT's parameter adapters (``target_parameters``) on
transformers' fused expert tensors: for E experts, ``lora_A.weight`` is ``[E * rank, in]`` (expert-major) and
``lora_B.weight`` ``[out, rank * E]`` (expert index fastest), so that PEFT's ``B[:, :, j] @ A[j]`` is expert j's
update. Both projections of an experts module are adapted; PEFT nests its wrappers in the module's parameter
order, so ``gate_up_proj``'s adapter sits one ``base_layer.`` deeper than ``down_proj``'s.
"""

from __future__ import annotations

import json
import os

import torch

from moe_tune.config import ConfigError
from moe_tune.distributed.process_group import rank_world
from moe_tune.lora import ADAPTER, is_adapter
from moe_tune.models.export import end_together, full_tensor, gather_experts, save_safetensors
from moe_tune.models.generation import stop_at_end_of_turn, write_chat_template
from moe_tune.models.hf_io import EXPERT_PARAM, CheckpointReader, copy_side_files, expert_offsets, read_global_rows

PREFIX = "base_model.model."
# PEFT (0.21, on transformers v5) reads a target_modules entry ending in these names as a transformers-v4 expert
# projection and retargets it to the fused experts (qwen2_moe, qwen3_moe, olmoe, deepseek_v3, glm4_moe): linears
# so named (dense MLPs, shared experts) are given as target_parameters ``<linear>.weight`` instead, which PEFT
# adapts with the same A and B under the same keys.
RETARGETED_NAMES = ("gate_proj", "up_proj", "down_proj", "gate", "w1", "w2", "w3")
# Expert projection -> (PEFT's parameter name, wrapper depth below the experts module)
EXPERT_TARGETS = {"gate_up": ("gate_up_proj", "base_layer."), "down": ("down_proj", "")}


def peft_tensors(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
    """One of our adapter tensors (whole: every expert, unsharded) as PEFT's (key, tensor)."""
    module, which = ADAPTER.split(name)[0], ADAPTER.search(name)[2]
    if which in ("A", "B"):
        return f"{PREFIX}{module}.lora_{which}.weight", t
    proj, factor = which.rsplit("_", 1)
    depth = EXPERT_TARGETS[proj][1]
    if factor == "A":  # [E, r, in] -> [E * r, in]
        return f"{PREFIX}{module}.{depth}lora_A.weight", t.reshape(-1, t.shape[-1])
    E, out, r = t.shape  # [E, out, r] -> [out, r * E], expert fastest
    return f"{PREFIX}{module}.{depth}lora_B.weight", t.permute(1, 2, 0).reshape(out, r * E)


def adapter_config(model, lora_names: list[str], router_names: list[str]) -> dict:
    spec = model.options.lora
    linears = sorted({ADAPTER.split(n)[0] for n in lora_names if not EXPERT_PARAM.match(n)})
    retargeted = [n for n in linears if n.rsplit(".", 1)[-1] in RETARGETED_NAMES]
    linears = [n for n in linears if n not in retargeted]
    experts = sorted({EXPERT_PARAM.match(n)["prefix"] for n in lora_names if EXPERT_PARAM.match(n)})
    params = [f"{m}.{EXPERT_TARGETS[p][0]}" for m in experts for p in EXPERT_TARGETS]
    params += [f"{n}.weight" for n in retargeted]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": model.source_dir,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        # PEFT's parameter adapters refuse dropout; it only acts in training, so the loaded model is the same.
        "lora_dropout": 0.0 if params else spec.dropout,
        "target_modules": linears or None,
        "target_parameters": params or None,
        "modules_to_save": router_names or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def moved_routers(model) -> set[str]:
    """The frozen routers whose correction bias (``e_score_correction_bias``) is no longer the source's: aux-loss-free
    balancing (``train.bias_update_rate``) moves it while the router's weight stays frozen, and PEFT would load the
    source's bias under the adapters. They are saved whole too (modules_to_save). Buffers are whole on every rank,
    so every rank finds the same routers and gathers the same tensors."""
    if not model.source_dir:
        return set()
    reader, moved = CheckpointReader(model.source_dir), set()
    for name, buf in model.named_buffers():
        if name.endswith(".e_score_correction_bias"):
            held = read_global_rows(reader, model.family, name, 0, buf.shape[0]).to(buf.dtype)
            if not torch.equal(held, buf.detach().cpu()):
                moved.add(name.rsplit(".", 1)[0])
    return moved


# What write_adapter writes; a full save into the same directory removes them (MoECausalLM.save_pretrained).
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")


def check_not_base(out_dir: str, base: str | None) -> None:
    """Adapters saved into a directory replace the weights there (moe_tune and transformers would read those in
    their place): the directory of their own base would lose the model they are adapters of. ConfigError."""
    if base is not None and os.path.isdir(out_dir) and os.path.isdir(base) and os.path.samefile(out_dir, base):
        raise ConfigError(
            f"save_pretrained({os.fspath(out_dir)!r}) would write LoRA adapters into the directory of their base "
            f"model ({base}), replacing the weights the adapters need with the adapters alone; save them to a new "
            "directory"
        )


@torch.no_grad()
def write_adapter(model, out_dir: str, ep_group=None, dtype=None, chat_template: str | None = None) -> None:
    """Every rank calls it: adapters are gathered (FSDP shards, then experts over the ep mesh axis) one tensor at
    a time; rank 0 writes them. Trained routers (``train_router``) and those whose correction bias moved
    (``moved_routers``) are saved whole, as PEFT's modules_to_save.
    ``chat_template`` (data.chat_template's text) is written beside them as chat_template.jinja."""
    rank, world = rank_world()
    offsets = expert_offsets(model)
    tensors: dict[str, torch.Tensor] = {}
    names, routers = [], []
    moved = moved_routers(model)
    for name, p in model.named_parameters():
        if not (is_adapter(name) or p.requires_grad or name.rsplit(".", 1)[0] in moved):
            continue
        full = full_tensor(p)
        if name in offsets:  # an expert adapter under EP: every ep rank's experts, in expert order
            full = gather_experts(full, ep_group)
        if rank != 0:
            continue
        full = full.detach().to(dtype or full.dtype).cpu().contiguous()
        if is_adapter(name):
            key, value = peft_tensors(name, full)
            names.append(name)
        else:  # a trained or moved router: PEFT's modules_to_save entry under the module's own key
            key, value = PREFIX + name, full
            routers.append(name.rsplit(".", 1)[0])
        tensors[key] = value.contiguous()
    error = None
    if rank == 0:
        try:
            _write_files(model, out_dir, tensors, names, routers, dtype, chat_template)
        except Exception as e:  # raised on every rank by end_together
            error = e
    end_together(error)


def _write_files(model, out_dir: str, tensors: dict, names: list[str], routers: list[str], dtype, chat_template):
    """Rank 0: the adapter directory's files."""
    for name, buf in model.named_buffers():  # a saved module is whole: DeepSeek-V3's correction bias too
        if name.rsplit(".", 1)[0] in routers:
            tensors[PREFIX + name] = buf.detach().to(dtype or buf.dtype).cpu().contiguous()
    os.makedirs(out_dir, exist_ok=True)
    save_safetensors(tensors, os.path.join(out_dir, ADAPTER_FILES[0]))
    with open(os.path.join(out_dir, ADAPTER_FILES[1]), "w") as f:
        json.dump(adapter_config(model, names, sorted(set(routers))), f, indent=2, sort_keys=True)
    # The base's tokenizer and generation config beside the adapters (as a TRL run saves them), the latter
    # stopping at the chat template's end of turn: GenerationConfig.from_pretrained(out_dir) for generate.
    copy_side_files(model.source_dir, out_dir)
    write_chat_template(out_dir, chat_template)
    if model.source_dir:
        stop_at_end_of_turn(out_dir, config_dir=model.source_dir)
