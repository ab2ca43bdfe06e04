"""A checkpoint whose config.json ties the output head to the input embedding (``tie_word_embeddings``) and whose
weights hold an ``lm_head.weight`` of their own. transformers ties the two only where they are equal and keeps both
otherwise; a tied model would train and export the embedding alone, losing the checkpoint's head."""

from __future__ import annotations

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
