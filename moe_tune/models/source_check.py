"""Checks of a model source before anything is built or written: a local Hugging Face directory's config.json
and safetensors headers, and the built-in presets' ``model.overrides``. Each failure is one CheckpointError or
ConfigError line naming the file (and line) or the key, and the fix; nothing here reads a tensor.
"""

from __future__ import annotations

import difflib
import glob
import hashlib
import json
import os
import re
import struct
from collections import Counter

from moe_tune.config import CheckpointError, ConfigError
from moe_tune.models.fp8_checkpoint import block_size, check_headers
from moe_tune.models.shard_index import index_without_shards, read_index

# A safetensors file starts with the header's length (8 bytes, little-endian) and then that many bytes of JSON.
HEADER_LEN_BYTES = 8
MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit
FINGERPRINT_SAMPLE_BYTES = 1 << 20


def base_fingerprint(path: str) -> str:
    """A cheap identity of a checkpoint directory (what LoRA adapters are checked against): config.json, and for
    each safetensors file its name, size and first and last MiB (its header and a sample of its weights). It
    changes when the weights are replaced, not when the directory moves; reading it costs a few MiB per file."""
    h = hashlib.sha256()
    with open(os.path.join(path, "config.json"), "rb") as f:
        h.update(f.read())
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        size = os.path.getsize(file)
        h.update(f"{os.path.basename(file)}:{size}".encode())
        with open(file, "rb") as f:
            h.update(f.read(FINGERPRINT_SAMPLE_BYTES))
            f.seek(max(0, size - FINGERPRINT_SAMPLE_BYTES))
            h.update(f.read(FINGERPRINT_SAMPLE_BYTES))
    return h.hexdigest()


def read_config_json(path: str) -> dict:
    """``path``/config.json as a dict; a file that is not a JSON object with a ``model_type`` is a CheckpointError."""
    file = os.path.join(path, "config.json")
    try:
        with open(file, encoding="utf-8") as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{file}:{e.lineno}:{e.colno}: not valid JSON ({e.msg}); fix the file or copy config.json from the "
            "model's original release"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: cannot be read ({e}); give a readable Hugging Face config.json") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise CheckpointError(
            f'{file} has no model_type; add the architecture\'s model_type (e.g. "model_type": "qwen3_moe") '
            "or copy config.json from the model's original release"
        )
    return cfg


def check_safetensors_header(file: str) -> dict:
    """The header of one ``.safetensors`` file: a length that fits the file, then a JSON object (returned)."""
    size = os.path.getsize(file)
    fix = "the file is truncated or corrupt; download or copy it again"
    with open(file, "rb") as f:
        raw = f.read(HEADER_LEN_BYTES)
        if len(raw) < HEADER_LEN_BYTES:
            raise CheckpointError(f"{file}: {size} bytes, too short for a safetensors header; {fix}")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES or HEADER_LEN_BYTES + n > size:
            raise CheckpointError(f"{file}: header length {n} does not fit the file's {size} bytes; {fix}")
        header = f.read(n)
    try:
        parsed = json.loads(header)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{file}: the safetensors header is not valid JSON; {fix}") from None
    if not isinstance(parsed, dict):
        raise CheckpointError(f"{file}: the safetensors header is not a JSON object; {fix}")
    try:
        end = max((e["data_offsets"][1] for k, e in parsed.items() if k != "__metadata__"), default=0)
    except (TypeError, KeyError, IndexError):
        raise CheckpointError(f"{file}: the safetensors header has an entry without data_offsets; {fix}") from None
    if HEADER_LEN_BYTES + n + end > size:
        raise CheckpointError(f"{file}: {size} bytes, but its header lists {HEADER_LEN_BYTES + n + end}; {fix}")
    return parsed


# Sizes a model needs at least one of: zero or less would build a model without that part, or fail mid-run.
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "decoder_sparse_step",  # transformers takes each layer index modulo it
)
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
DENSE_LAYER_KEYS = ("mlp_only_layers", "first_k_dense_replace", "decoder_sparse_step")


def check_sizes(fields: dict, name, fix: str) -> None:
    """Every size in ``fields`` (a transformers config's) a whole number >= 1, and no more experts per token than
    experts; ``name(key)`` is how the message names a field (a file's or ``model.overrides``'), ``fix`` ends it."""
    for key in SIZE_FIELDS:
        value = fields.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"{name(key)}={value!r} must be a whole number >= 1; {fix}")
    experts = next((key for key in EXPERT_COUNTS if isinstance(fields.get(key), int)), None)
    top_k = fields.get("num_experts_per_tok")
    if experts is not None and isinstance(top_k, int) and top_k > fields[experts]:
        raise ConfigError(
            f"{name('num_experts_per_tok')}={top_k} is more than the model's {fields[experts]} experts "
            f"({name(experts)}); {fix}"
        )


def check_shared_expert(fields: dict, name, fix: str) -> None:
    """Qwen2-MoE's ``shared_expert_intermediate_size`` a whole number >= 1. At 0 transformers builds the shared
    expert zero wide (its output is zero), and weights with no elements are what FSDP2 cannot shard (a run of
    several ranks stops in its first reduce-scatter); ``name`` and ``fix`` as ``check_sizes``'."""
    key = "shared_expert_intermediate_size"
    value = fields.get(key)
    if fields.get("model_type") != "qwen2_moe" or value is None:
        return
    if value == 0 and not isinstance(value, bool):
        raise ConfigError(
            f"{name(key)}=0 (a Qwen2-MoE without a shared expert) is not supported: transformers builds that expert "
            f"zero wide, and its empty weights cannot be sharded; {fix}"
        )
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name(key)}={value!r} must be a whole number >= 1; {fix}")


def check_source_dir(path: str, weights: bool = True) -> dict:
    """A local Hugging Face directory: its config.json (returned; its sizes, and that transformers reads it), its
    shard index and every safetensors file's header. ``weights=False`` (a plan, which reads none): an index
    without any of its shards is a copy of the JSON files alone, not an interrupted download."""
    from transformers import AutoConfig

    cfg = read_config_json(path)
    file = os.path.join(path, "config.json")
    check_sizes(cfg, lambda key: f"{file}: {key}", "fix it there or copy config.json from the model's original release")
    check_shared_expert(
        cfg,
        lambda key: f"{file}: {key}",
        "give a Qwen2-MoE checkpoint with a shared expert (shared_expert_intermediate_size >= 1)",
    )
    block = block_size(cfg, file)  # a quantization moe_tune does not read: refused here, before anything is built
    try:
        AutoConfig.from_pretrained(path)
    except Exception as e:  # transformers' own validation: a wrongly typed field, an unknown value
        reason = str(e).strip().splitlines()
        raise CheckpointError(
            f"{file}: transformers cannot read it ({' '.join(line.strip() for line in reason[:2])}); fix that "
            "field or copy config.json from the model's original release"
        ) from None
    if weights or not index_without_shards(path):
        read_index(path)
    entries = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        header = check_safetensors_header(file)
        entries.update({k: e for k, e in header.items() if k != "__metadata__" and isinstance(e, dict)})
    check_headers(path, entries, block)
    check_expert_shapes(path, entries)
    check_weights_match_config(path)
    return cfg


def check_expert_shapes(path: str, entries: dict[str, dict]) -> None:
    """A layer's per-expert tensors of one projection share one shape, as the stacked tensor they are read into
    needs (``entries``: the safetensors headers' key -> {"dtype", "shape"}): one that differs is named here, before
    anything is built, rather than failing the stacking as the model loads."""
    groups: dict[str, dict[str, tuple]] = {}
    for key, entry in entries.items():
        if m := EXPERT_KEY.match(key):
            group = f"{key[: m.start(2)]}*{key[m.end(2) :]}"
            groups.setdefault(group, {})[key] = tuple(entry.get("shape") or ())
    for group, shapes in sorted(groups.items()):
        counts = Counter(shapes.values())
        if len(counts) > 1:
            common = counts.most_common(1)[0][0]
            odd = min(k for k, s in shapes.items() if s != common)
            raise CheckpointError(
                f"checkpoint {path}: {odd} has shape {shapes[odd]} where the layer's other experts' ({group}) have "
                f"{common}, and they are stacked into one tensor; the file is damaged or mixes models: use a fresh "
                "copy of the model"
            )


LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\..*\.experts\.(\d+)\.")  # one tensor per expert
STACKED_EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\..*\.experts\.[^.]+$")  # [experts, ...] (GPT-OSS)
WEIGHT_SIZE_SOURCES = {
    "hidden_size": "model.embed_tokens.weight's width",
    "num_hidden_layers": "layers model.layers.N",
    "num_experts": "routed experts per MoE layer",
}


def _header_shapes(path: str) -> dict[str, list[int]]:
    shapes: dict[str, list[int]] = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        header = check_safetensors_header(file)
        shapes.update({k: e.get("shape") for k, e in header.items() if k != "__metadata__" and isinstance(e, dict)})
    return shapes


def expert_layers(path: str) -> set[int]:
    """The layer indices whose routed experts the weights hold (their safetensors headers alone)."""
    return {int(m[1]) for k in _header_shapes(path) if (m := EXPERT_KEY.match(k) or STACKED_EXPERT_KEY.match(k))}


def dense_layers(cfg: dict) -> set[int]:
    """The decoder layers config.json gives a dense MLP, as transformers' MoE classes decide: Qwen-MoE's
    ``mlp_only_layers``, each layer i whose i + 1 its ``decoder_sparse_step`` does not divide, and every layer of a
    config without experts; DeepSeek-V3's and GLM-4-MoE's first ``first_k_dense_replace``."""
    step, first = cfg.get("decoder_sparse_step"), cfg.get("first_k_dense_replace")
    step = step if isinstance(step, int) and step >= 1 else 1
    first = first if isinstance(first, int) else 0
    only = {i for i in cfg.get("mlp_only_layers") or [] if isinstance(i, int)}
    no_experts = any(cfg.get(k) == 0 for k in EXPERT_COUNTS)
    layers = range(cfg.get("num_hidden_layers") or 0)
    return {i for i in layers if no_experts or i in only or i < first or (i + 1) % step}


def _check_moe_layers(path: str, cfg: dict) -> None:
    """The layers config.json routes through experts are those whose experts the weights hold (a checkpoint whose
    weights hold none is left to the load's own messages)."""
    held, layers = expert_layers(path), cfg.get("num_hidden_layers")
    if not held or not isinstance(layers, int):
        return
    held = {i for i in held if i < layers}  # past them: a multi-token-prediction layer, which loading skips
    said = set(range(layers)) - dense_layers(cfg)
    if held == said:
        return
    keys = ", ".join(f"{k}={cfg[k]}" for k in DENSE_LAYER_KEYS if k in cfg) or "no key making any layer dense"
    weights = "the safetensors weights beside it hold"
    what = f"makes layers {_some(held - said)} dense ({keys}) but {weights} routed experts there"
    if not held - said:
        what = f"routes layers {_some(said - held)} through experts ({keys}) but {weights} none there"
    raise CheckpointError(
        f"{os.path.join(path, 'config.json')}: {what}; config.json was edited or belongs to another "
        "checkpoint: set those keys as the model's release has them, or give the checkpoint it describes"
    )


def _some(layers: set[int], shown: int = 6) -> str:
    first = sorted(layers)[:shown]
    return f"{first}" + (f" and {len(layers) - shown} more" if len(layers) > shown else "")


def weight_sizes(path: str) -> dict[str, int]:
    """The sizes a local checkpoint's weights have, read from its safetensors headers alone (no tensor data):
    ``hidden_size`` (the embedding's width), ``num_hidden_layers`` (layer indices present) and ``num_experts``
    (routed experts of the largest MoE layer); a size the keys do not show is left out."""
    shapes = _header_shapes(path)
    sizes: dict[str, int] = {}
    embed = shapes.get("model.embed_tokens.weight")
    if isinstance(embed, list) and len(embed) == 2:
        sizes["hidden_size"] = embed[1]
    layers = {int(m[1]) for k in shapes if (m := LAYER_KEY.match(k))}
    if layers:
        sizes["num_hidden_layers"] = len(layers)
    experts: dict[int, int] = {}
    for key, shape in shapes.items():
        if m := EXPERT_KEY.match(key):
            experts[int(m[1])] = max(experts.get(int(m[1]), 0), int(m[2]) + 1)
        elif (m := STACKED_EXPERT_KEY.match(key)) and isinstance(shape, list) and len(shape) >= 2:
            experts[int(m[1])] = max(experts.get(int(m[1]), 0), shape[0])
    if experts:
        sizes["num_experts"] = max(experts.values())
    return sizes


def check_weights_match_config(path: str) -> None:
    """config.json's expert count, hidden size and layer count are those of the weights beside it (their
    safetensors headers): whatever counts the model from config.json alone (moe-tune-plan) would otherwise count
    another model. Layers past ``num_hidden_layers`` that ``num_nextn_predict_layers`` names (DeepSeek-V3's and
    GLM-4-MoE's multi-token-prediction layer, which loading skips) are allowed."""
    file = os.path.join(path, "config.json")
    cfg = read_config_json(path)
    weights = weight_sizes(path)
    experts_key = next((k for k in EXPERT_COUNTS if k in cfg), None)
    said = {"hidden_size": cfg.get("hidden_size"), "num_hidden_layers": cfg.get("num_hidden_layers")}
    if experts_key is not None:
        said["num_experts"] = cfg[experts_key]
    extra_layers = cfg.get("num_nextn_predict_layers") or 0
    for what, value in said.items():
        held = weights.get(what)
        if held is None or not isinstance(value, int) or held == value:
            continue
        if what == "num_hidden_layers" and isinstance(extra_layers, int) and value < held <= value + extra_layers:
            continue
        key = experts_key if what == "num_experts" else what
        raise CheckpointError(
            f"{file}: {key}={value} but the safetensors weights beside it hold {held} ({WEIGHT_SIZE_SOURCES[what]}); "
            f"config.json was edited or belongs to another checkpoint: set {key}={held} there, or give the checkpoint "
            "it describes"
        )
    _check_moe_layers(path, cfg)


def _same_type(value, default) -> bool:
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return True


def check_overrides(name: str, overrides: dict) -> None:
    """``model.overrides`` of a preset: every value of the type of the field it replaces."""
    from moe_tune.models.presets import preset_config

    preset = preset_config(name)
    defaults = preset.to_dict()
    for key, value in overrides.items():
        if key not in defaults and not hasattr(preset, key):  # a typo would be silently ignored by transformers
            near = difflib.get_close_matches(key, defaults, n=1)
            hint = f"did you mean model.overrides.{near[0]}?" if near else f"the fields are those of {name}'s config"
            raise ConfigError(f"model.overrides.{key}: {name}'s config has no field {key}; {hint}")
        default = defaults.get(key)
        if default is not None and not _same_type(value, default):
            kind = type(default).__name__
            raise ConfigError(
                f"model.overrides.{key}={value!r} must be a {kind} (as the preset's {key}={default!r}); "
                f"try model.overrides.{key}={default!r}"
            )
    overridden = preset_config(name, overrides).to_dict()
    check_sizes(overridden, lambda key: f"model.overrides.{key}", "change the override")
    shared = defaults.get("shared_expert_intermediate_size")
    check_shared_expert(
        overridden, lambda key: f"model.overrides.{key}", f"drop the override (the preset's is {shared})"
    )


def config_differences(saved, requested: dict) -> list[str]:
    """Fields of a saved transformers config that differ from ``requested`` (``key: saved -> requested``). Read
    through the config object: it maps aliases (``num_experts``) and nested fields (``rope_parameters``)."""
    out = []
    for key, value in requested.items():
        old = getattr(saved, key, None)
        if old is None:
            old = (getattr(saved, "rope_parameters", None) or {}).get(key)
        if isinstance(old, list) and isinstance(value, tuple):
            value = list(value)
        if old != value:
            out.append(f"{key}: {old!r} -> {value!r}")
    return out


__all__ = [
    "check_overrides",
    "check_expert_shapes",
    "check_safetensors_header",
    "check_shared_expert",
    "check_sizes",
    "check_source_dir",
    "check_weights_match_config",
    "config_differences",
    "read_config_json",
    "weight_sizes",
]
