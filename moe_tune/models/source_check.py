"""Checks of a model source before anything is built or written: a local Hugging Face directory's config.json
and safetensors headers, and the built-in presets' ``model.overrides``. Each failure is one CheckpointError or
ConfigError line naming the file (and line) or the key, and the fix; nothing here reads a tensor.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import struct

from moe_tune.config import CheckpointError, ConfigError

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


def check_safetensors_header(file: str) -> None:
    """The header of one ``.safetensors`` file: a length that fits the file, then a JSON object."""
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


def check_source_dir(path: str) -> dict:
    """A local Hugging Face directory: its config.json (returned) and every safetensors file's header."""
    cfg = read_config_json(path)
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        check_safetensors_header(file)
    return cfg


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

    defaults = preset_config(name).to_dict()
    for key, value in overrides.items():
        default = defaults.get(key)
        if default is not None and not _same_type(value, default):
            kind = type(default).__name__
            raise ConfigError(
                f"model.overrides.{key}={value!r} must be a {kind} (as the preset's {key}={default!r}); "
                f"try model.overrides.{key}={default!r}"
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


__all__ = ["check_overrides", "check_safetensors_header", "check_source_dir", "config_differences", "read_config_json"]
