"""A checkpoint whose config.json ties the output head to the input embedding (``tie_word_embeddings``) and whose
weights hold an ``lm_head.weight`` of their own. transformers ties the two only where they are equal and keeps both
otherwise; a tied model would train and export the embedding alone, losing the checkpoint's head."""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator

import torch

HEAD_KEY = "lm_head.weight"
EMBED_KEY = "model.embed_tokens.weight"


def untied_head(reader, embed_rows: torch.Tensor, first: int) -> set[str]:
    """``{"lm_head.weight"}`` where ``reader`` holds one unlike the embedding loaded (this rank's ``embed_rows``, the
    rows from ``first``): another shape, or those rows unequal in the model's dtype; else empty."""
    if HEAD_KEY not in reader:
        return set()
    if reader.shape(HEAD_KEY) != reader.shape(EMBED_KEY):
        return {HEAD_KEY}
    head = reader.rows(HEAD_KEY, first, first + embed_rows.shape[0])
    return set() if torch.equal(head.to(embed_rows.device, embed_rows.dtype), embed_rows) else {HEAD_KEY}


def untied_head_message(path: str) -> str:
    return (
        f"checkpoint {path}: config.json has tie_word_embeddings=true but its {HEAD_KEY} differs from {EMBED_KEY}, "
        f"so the tied model would drop the checkpoint's head (transformers keeps both, untied); set "
        f'"tie_word_embeddings": false in {path}/config.json, or remove {HEAD_KEY} from its weights'
    )


def with_tied_head(
    pieces: Iterable[tuple[str, torch.Tensor]], tied: bool, source_keys: Container[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """An export's ``(key, tensor)`` pairs, and after the embedding's the same tensor as ``lm_head.weight`` where the
    model ties its head and the source's files hold that key too (equal to the embedding: an unequal one is refused
    at load): the export keeps the source's keys, and transformers loads either."""
    for key, piece in pieces:
        yield key, piece
        if tied and key == EMBED_KEY and HEAD_KEY in source_keys:
            yield HEAD_KEY, piece.clone()  # safetensors refuses two keys of one storage in a file
