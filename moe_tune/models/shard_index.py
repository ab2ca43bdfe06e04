"""A sharded Hugging Face checkpoint's index (``model.safetensors.index.json``): tensor name -> shard file, checked
before any shard is read (by the source checks and by the reader that loads the weights); without one, the same
map over the directory's loose safetensors files."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from moe_tune.config import CheckpointError

INDEX = "model.safetensors.index.json"


def read_index(path: str) -> dict[str, str] | None:
    """``path``'s sharded-checkpoint index as tensor name -> shard file (None: not sharded). Every shard must be a
    plain file name inside ``path`` that exists: an absolute path or one leading elsewhere would read weights
    from outside ``model.path``, a missing shard is an interrupted download. A ``model.safetensors`` the index
    does not name is refused: transformers would load it in the index's place."""
    file = os.path.join(path, INDEX)
    if not os.path.isfile(file):
        return None
    fix = "download the checkpoint again (or copy the index from the model's original release)"
    try:
        with open(file, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise CheckpointError(f"{file}: not a valid index ({e}); {fix}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f'{file}: no "weight_map" of tensor names to shard files; {fix}')
    for shard in sorted(set(weight_map.values())):
        if os.path.basename(shard) != shard or shard in ("", ".", ".."):
            raise CheckpointError(
                f"{file} names the shard {shard!r}: shards must be file names inside {path} (a path would read "
                f"weights from elsewhere); {fix}"
            )
        if not os.path.isfile(os.path.join(path, shard)):
            raise CheckpointError(f"{file} names {shard}, which {path} does not hold (an interrupted download?); {fix}")
    single = "model.safetensors"
    if os.path.isfile(os.path.join(path, single)) and single not in weight_map.values():
        raise CheckpointError(
            f"{path} holds both {single} and {INDEX} naming other shards: transformers reads {single}, the index "
            "would give other weights; move the one that is not the model out of the directory"
        )
    return weight_map


def index_without_shards(path: str) -> bool:
    """Whether ``path`` holds a shard index and no safetensors file at all: a copy of a checkpoint's JSON files
    alone (``hf download <id> --include '*.json'``), which moe-tune-plan plans from config.json."""
    return os.path.isfile(os.path.join(path, INDEX)) and not any(n.endswith(".safetensors") for n in os.listdir(path))


def loose_weight_map(path: str, keys_of: Callable[[str], list[str]]) -> dict[str, str]:
    """Tensor name -> file over every ``*.safetensors`` of ``path`` without an index (``keys_of(file)``: the file's
    tensor names). A name in two files is refused: which copy the model gets would depend on the files' names
    (a backup copy beside ``model.safetensors``), where transformers reads ``model.safetensors`` alone."""
    files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise CheckpointError(no_safetensors_problem(path))
    weight_map: dict[str, str] = {}
    for name in files:
        for key in keys_of(os.path.join(path, name)):
            if key in weight_map:
                raise CheckpointError(
                    f"{path}: tensor {key} is in both {weight_map[key]} and {name}, and no {INDEX} says which to "
                    f"read; move the file that is not part of the model out of {path}"
                )
            weight_map[key] = name
    return weight_map


def no_safetensors_problem(path: str) -> str:
    """The line for a directory without safetensors files; one with PyTorch pickles (``pytorch_model*.bin``, the
    format of older releases) is told how to convert them."""
    pickles = sorted(n for n in os.listdir(path) if n.startswith("pytorch_model") and n.endswith(".bin"))
    if not pickles:
        return f"{path} holds no *.safetensors files; give a Hugging Face checkpoint directory"
    return (
        f"{path} holds PyTorch weights ({pickles[0]}) and no *.safetensors files, the only weights moe_tune reads; "
        f"convert them once with transformers (AutoModelForCausalLM.from_pretrained('{path}').save_pretrained(<dir>)"
        ", then copy the tokenizer files there) and give <dir> in its place"
    )
