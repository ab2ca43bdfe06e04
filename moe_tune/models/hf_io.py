"""Read Hugging Face safetensors checkpoints straight into a meta-built model, and write them back.

Every in-memory tensor is read as a row range of its *global* (unsharded) shape, so that a rank reads only
what it owns: with expert parallelism an expert tensor's rows are experts, with FSDP2 a parameter's local
shard is a row range of dim 0. Stacked expert tensors are assembled from the per-expert tensors most
published checkpoints use (see ``moe_tune.moe.experts`` for the two layouts).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Container, Iterator

import torch
from safetensors import SafetensorError, safe_open

from moe_tune.config import CheckpointError
from moe_tune.lora import is_adapter
from moe_tune.lora.experts import PROJECTIONS
from moe_tune.models.families import Family
from moe_tune.models.fp8_checkpoint import (
    FP8_DTYPES,
    FP8_NAMES,
    SCALE_SUFFIX,
    checkpoint_block_size,
    dequantize_rows,
    scale_problem,
    unscaled_fp8,
)
from moe_tune.models.shard_index import loose_weight_map, read_index
from moe_tune.models.tied_head import EMBED_KEY, untied_head, untied_head_message
from moe_tune.moe.experts import GroupedExperts

# Stacked expert tensors (dim 0: experts): the weights, their biases and their LoRA adapters.
EXPERT_PARAM = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<name>gate_up_proj|down_proj|gate_up_proj_bias|down_proj_bias"
    r"|lora\.gate_up_A|lora\.gate_up_B|lora\.down_A|lora\.down_B)$"
)
DRAWN_WITH = "moe_tune_drawn_with.json"  # in a tiny preset's base_model/: the train.seed its weights were drawn with
# Files copied verbatim from the source checkpoint into an export.
SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
    **dict(zip(FP8_NAMES, FP8_DTYPES)),
}


def _open(file: str):
    """``safe_open`` of one file of a model directory: CheckpointError naming it when it cannot be parsed."""
    try:
        return safe_open(file, "pt")
    except SafetensorError as e:
        raise CheckpointError(
            f"{file} is not a readable safetensors file ({e}): it is damaged or cut short; restore it from the "
            "model's source (copy or download it again; a built-in preset's base_model/ is built again once deleted)"
        ) from None


def _keys(file: str) -> list[str]:
    with _open(file) as f:
        return list(f.keys())


class CheckpointReader:
    """Key -> file index over a checkpoint directory (single file, sharded with an index, or loose files)."""

    def __init__(self, path: str):
        self.path = path
        weight_map = read_index(path)  # shards inside path only, each present
        if weight_map is None:
            weight_map = loose_weight_map(path, _keys)
        self.weight_map: dict[str, str] = weight_map
        self._handles: dict[str, object] = {}
        self.used: set[str] = set()
        self.fp8_block = checkpoint_block_size(path)  # block-scaled FP8 weights, read dequantized (fp8_checkpoint)

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def _slice(self, key: str):
        name = self.weight_map[key]
        if name not in self._handles:
            self._handles[name] = _open(os.path.join(self.path, name))
        self.used.add(key)
        return self._handles[name].get_slice(key)

    def shape(self, key: str) -> list[int]:
        return list(self._slice(key).get_shape())

    def _scale_key(self, key: str) -> str | None:
        """The block scales' key of a block-scaled FP8 weight (checked to fit it), else None."""
        scale = key + SCALE_SUFFIX
        if self.fp8_block is None or scale not in self.weight_map:
            return None
        weight, scales = self._slice(key), self._slice(scale)
        problem = scale_problem(
            self.path, key, weight.get_dtype(), weight.get_shape(), scales.get_shape(), self.fp8_block
        )
        if problem:
            raise CheckpointError(problem)
        return scale

    def dtype(self, key: str) -> torch.dtype:
        """The dtype ``rows`` returns: bf16 for a block-scaled FP8 weight (what exports write it as)."""
        if self._scale_key(key):
            return torch.bfloat16
        return _DTYPES.get(self._slice(key).get_dtype(), torch.float32)

    def rows(self, key: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        sl = self._slice(key)
        data = sl[:] if start is None else sl[start:stop]
        scale_key = self._scale_key(key)
        if scale_key is None:
            if data.dtype in FP8_DTYPES:
                raise CheckpointError(unscaled_fp8(self.path, key, self.fp8_block))
            return data
        first = 0 if start is None else start
        bn = self.fp8_block[0]
        last_block = (first + data.shape[0] - 1) // bn + 1 if data.shape[0] else first // bn
        scales = self._slice(scale_key)[first // bn : last_block]
        return dequantize_rows(data, scales, first, self.fp8_block)


def disk_key(family: Family, name: str) -> str:
    for mem, disk in family.disk_renames:
        name = name.replace(mem, disk)
    return name


def read_global_rows(reader: CheckpointReader, family: Family, name: str, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of in-memory tensor ``name`` in its global (all experts, unsharded) shape."""
    key = disk_key(family, name)
    if key in reader:
        return reader.rows(key, start, stop)
    m = EXPERT_PARAM.match(name)
    if m and family.disk_experts and m["name"] in family.disk_experts:
        prefix = disk_key(family, m["prefix"])
        parts = family.disk_experts[m["name"]]
        experts = []
        for j in range(start, stop):
            keys = [f"{prefix}.{j}.{p}" for p in parts]
            missing = [k for k in keys if k not in reader]
            if missing:
                raise CheckpointError(
                    f"checkpoint {reader.path} lacks {missing[0]} (needed for {name}); is it complete?"
                )
            experts.append(torch.cat([reader.rows(k) for k in keys], dim=0))
        if not experts:
            return torch.empty(0)
        return torch.stack(experts)
    raise CheckpointError(f"checkpoint {reader.path} has no tensor for {name} (looked for {key}); is it complete?")


def local_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(this rank's rows, index of the first in ``t``'s global dim 0) for a plain tensor or an FSDP2 DTensor
    shard; FSDP's padding rows are dropped. Expert-parallel offsets come on top (``expert_offsets``)."""
    if not hasattr(t, "to_local"):
        return t, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    local = t.to_local()
    if not shape[0]:
        return local[:0], 0
    return local[: shape[0]], offset[0]


def named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters and persistent buffers, tied parameters once."""
    yield from model.named_parameters()
    for name, buf in model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        if leaf not in module._non_persistent_buffers_set:
            yield name, buf


def expert_offsets(model: torch.nn.Module) -> dict[str, int]:
    """For each stacked expert tensor, the global index of this rank's first expert. Empty without EP; under
    EP it lists every expert tensor, ep rank 0's included, so all ranks agree that the experts are EP-sharded."""
    offsets = {}
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts) and module.ep_sharded:
            adapters = [f"lora.{n}" for n, _ in module.lora.named_parameters()] if module.lora is not None else []
            for p in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias", *adapters):
                offsets[f"{name}.{p}"] = module.first_expert
    return offsets


@torch.no_grad()
def load_state(model: torch.nn.Module, path: str, family: Family, strict: bool = True) -> None:
    """Fill every parameter and persistent buffer of a materialised model from ``path``; fail on anything
    missing or left over, or holding NaN/inf, so nothing is silently lost, partially loaded or trained from
    damaged weights. LoRA adapters are not the checkpoint's (``moe_tune.models.lora.init_lora``)."""
    reader = CheckpointReader(path)
    offsets = expert_offsets(model)
    tied = getattr(model.config, "tie_word_embeddings", False)
    nonfinite: list[str] = []
    for name, t in named_tensors(model):
        if (tied and name == "lm_head.weight") or is_adapter(name):
            continue
        local, first = local_rows(t)
        if local.numel() == 0:
            continue  # an empty FSDP shard (more ranks than rows): nothing to read
        start = offsets.get(name, 0) + first
        key, rows = disk_key(family, name), model.num_experts if name in offsets else t.shape[0]
        if key in reader and reader.shape(key)[:1] not in ([], [rows]):  # rows past the model's: never read
            _check_shape(name, reader.shape(key), (rows, *local.shape[1:]))
        src = read_global_rows(reader, family, name, start, start + local.shape[0])
        _check_shape(name, src.shape, local.shape)
        if src.is_floating_point() and not nonfinite and not bool(torch.isfinite(src).all()):
            nonfinite.append(disk_key(family, name))  # src is read on the CPU: no device sync
        local.copy_(src.to(local.dtype))
    if tied and _union_over_ranks(untied_head(reader, *local_rows(model.get_parameter(EMBED_KEY)))):
        raise CheckpointError(untied_head_message(path))
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts) and module.quantized:
            nonfinite += _load_quantized(reader, family, name, module, skip_check=bool(nonfinite))
    nonfinite = sorted(_union_over_ranks(set(nonfinite)))
    if nonfinite:
        raise CheckpointError(
            f"checkpoint {path}: tensor {nonfinite[0]} holds NaN or inf values; the file is damaged or the model "
            "was saved after a divergence. Use a fresh copy of the model"
        )
    if strict:
        used = _union_over_ranks(reader.used)
        unused = set(reader.weight_map) - used - ({"lm_head.weight"} if tied else set())
        ignore = ignored_on_load(model)
        unused = {k for k in unused if not k.endswith("rotary_emb.inv_freq") and not any(p.search(k) for p in ignore)}
        if unused:
            raise CheckpointError(
                f"checkpoint {path} has {len(unused)} tensors the model does not use (e.g. {sorted(unused)[0]}); "
                f"does config.json match the weights?"
            )


def ignored_on_load(model) -> list[re.Pattern]:
    """Keys the causal LM never runs: DeepSeek-V3's and GLM-4-MoE's multi-token-prediction layer, at the depths
    transformers' classes name (model.layers.61.* / .92.* / .46.*) and wherever config.json's
    ``num_nextn_predict_layers`` puts it (the layers right past ``num_hidden_layers``, at any depth)."""
    patterns = getattr(getattr(model, "_hf_class", None), "_keys_to_ignore_on_load_unexpected", None) or ()
    first, extra = model.config.num_hidden_layers, getattr(model.config, "num_nextn_predict_layers", 0) or 0
    return [re.compile(p) for p in (*patterns, *(rf"^model\.layers\.{i}\." for i in range(first, first + extra)))]


def unloaded_source_keys(model) -> tuple[CheckpointReader | None, list[str]]:
    """The source's keys of layers past ``num_hidden_layers`` that loading skips (``ignored_on_load``: the
    multi-token-prediction layer), with a reader of them (block-scaled FP8 is read as bf16, so its scales are left
    out): an export carries them over unchanged, so the layer that config.json's ``num_nextn_predict_layers``
    names is still there for speculative decoding."""
    ignore = ignored_on_load(model)
    if not model.source_dir or not ignore:
        return None, []
    reader, keys = CheckpointReader(model.source_dir), []
    for key in sorted(reader.weight_map):
        layer = re.match(r"model\.layers\.(\d+)\.", key)
        if not layer or int(layer[1]) < model.config.num_hidden_layers or not any(p.search(key) for p in ignore):
            continue
        if reader.fp8_block is not None and key.endswith(SCALE_SUFFIX) and key.removesuffix(SCALE_SUFFIX) in reader:
            continue  # the scales of a weight read dequantized
        keys.append(key)
    return reader, keys


def stacked_on_disk(family: Family, name: str, source_keys: Container[str]) -> bool:
    """Whether an expert tensor is stored as one stacked key (GPT-OSS, or a v5-format source), not per expert."""
    parts = family.disk_experts or {}
    return EXPERT_PARAM.match(name)["name"] not in parts or disk_key(family, name) in source_keys


def quantized_source_tensors(model, expert_writer: bool, dense_writer: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The routed experts of a quantized base (``peft.quantize_base``) as the source's files hold them, by disk key:
    the model keeps them only quantized, and an export writes the weights it was built from, never dequantized
    ones. ``expert_writer``: this rank writes its own experts' per-expert keys; ``dense_writer``: it writes a key
    that stacks every expert (read whole from the files, no gather)."""
    reader, source_keys = None, ()
    for name, module in model.named_modules():
        if not (isinstance(module, GroupedExperts) and module.quantized):
            continue
        if reader is None:
            if not model.source_dir:
                raise CheckpointError(
                    f"the routed experts are held quantized ({module.options.quantized_base}) and the model has no "
                    "source checkpoint to write them from; build it from a checkpoint directory to save it"
                )
            reader = CheckpointReader(model.source_dir)
            source_keys = reader.weight_map
        for proj in PROJECTIONS:
            key = f"{name}.{proj}_proj"
            stacked = stacked_on_disk(model.family, key, source_keys)
            first, count = (0, module.spec.num_experts) if stacked else (module.first_expert, module.num_local_experts)
            if not (dense_writer if stacked else expert_writer):
                continue
            t = read_global_rows(reader, model.family, key, first, first + count)
            yield from to_disk_tensors(model.family, key, t, first, source_keys=source_keys)


def _check_shape(name: str, held, expected) -> None:
    if tuple(held) != tuple(expected):
        raise CheckpointError(
            f"checkpoint tensor for {name} has shape {tuple(held)}, the model expects {tuple(expected)}; "
            f"does config.json match the weights?"
        )


# Experts of a quantized base read, moved and quantized at a time: a few tens of MB of bf16 on the host and GPU.
QUANTIZE_BLOCK = 8


def _load_quantized(
    reader: CheckpointReader, family: Family, name: str, module: GroupedExperts, skip_check: bool
) -> list[str]:
    """A quantized base's experts (``peft.quantize_base``), ``QUANTIZE_BLOCK`` at a time: read in the checkpoint's
    dtype, quantized on the module's device. Returns the disk key of a tensor holding NaN/inf, if any."""
    nonfinite: list[str] = []
    for proj in PROJECTIONS:
        key, shape = f"{name}.{proj}_proj", module.base_shape(proj)
        for j in range(0, shape[0], QUANTIZE_BLOCK):
            b = min(QUANTIZE_BLOCK, shape[0] - j)
            start = module.first_expert + j
            src = read_global_rows(reader, family, key, start, start + b)
            _check_shape(key, src.shape, (b, *shape[1:]))
            if not (skip_check or nonfinite) and not bool(torch.isfinite(src).all()):
                nonfinite.append(disk_key(family, key))
            module.fill_base_(proj, j, src)
    return nonfinite


def _union_over_ranks(used: set[str]) -> set[str]:
    """Sharded (FSDP2/EP) loads read a different subset of keys on each rank: a key is used (or damaged) if any
    rank found it so. Every rank gets the same union, so they all raise or none does."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return used
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(used))  # all ranks (the default group)
    return set().union(*map(set, gathered))


def source_dtypes(path: str) -> dict[str, torch.dtype]:
    reader = CheckpointReader(path)
    return {k: reader.dtype(k) for k in reader.weight_map}


def to_disk_tensors(
    family: Family, name: str, t: torch.Tensor, first_expert: int = 0, source_keys: Container[str] = ()
) -> Iterator[tuple[str, torch.Tensor]]:
    """In-memory tensor -> the (key, tensor) pairs the family stores on disk: one tensor per expert, unless the
    source checkpoint (``source_keys``) stored this tensor stacked as transformers v5 holds it in memory."""
    m = EXPERT_PARAM.match(name)
    if m and family.disk_experts and m["name"] in family.disk_experts and disk_key(family, name) not in source_keys:
        prefix = disk_key(family, m["prefix"])
        parts = family.disk_experts[m["name"]]
        for j in range(t.shape[0]):
            for part, piece in zip(parts, t[j].chunk(len(parts), dim=0)):
                yield f"{prefix}.{first_expert + j}.{part}", piece
    else:
        yield disk_key(family, name), t


def remote_code_files(model_dir: str) -> list[str]:
    """The Python files in ``model_dir`` that its config.json's and tokenizer_config.json's ``auto_map`` name
    (``"AutoConfig": "configuration_deepseek.DeepseekV3Config"``): what ``trust_remote_code=True`` loads from the
    directory. Code in another repository (``"owner/repo--module.Class"``) is not the directory's."""
    names = set()
    for config in ("config.json", "tokenizer_config.json"):
        try:
            with open(os.path.join(model_dir, config)) as f:
                auto_map = json.load(f).get("auto_map") or {}
        except (OSError, ValueError, AttributeError):
            continue
        refs = [r for v in auto_map.values() for r in (v if isinstance(v, list) else [v])]
        names |= {r.rsplit(".", 1)[0] + ".py" for r in refs if isinstance(r, str) and "--" not in r and "." in r}
    return sorted(n for n in names if os.path.isfile(os.path.join(model_dir, n)))


def copy_side_files(src: str | None, out_dir: str) -> None:
    """SIDE_FILES and the remote code the source's ``auto_map`` names, so the export loads as the source does."""
    if not src or (os.path.isdir(out_dir) and os.path.samefile(src, out_dir)):  # saved over its own source
        return
    for name in (*SIDE_FILES, *remote_code_files(src)):
        p = os.path.join(src, name)
        if os.path.isfile(p):
            shutil.copy2(p, os.path.join(out_dir, name))
