"""The dtype an export writes each tensor in. transformers holds some tensors in fp32 whatever dtype a model is
loaded or saved in (its class's ``_keep_in_fp32_modules_strict``: DeepSeek-V3's and GLM-4-MoE's router weight and
``e_score_correction_bias``): a bf16 or fp16 export keeps them fp32, as transformers' own ``save_pretrained`` writes
them, since rounded they would choose other experts than the model trained chose."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

HALF_DTYPES = (torch.bfloat16, torch.float16)


def export_dtypes(model, dtype: torch.dtype | None) -> Callable[[str, torch.dtype], torch.dtype]:
    """``(key, default) -> dtype`` for ``model``'s export: ``default`` (the source's dtype of the key, or the held
    one) where no ``dtype`` is asked for; else ``dtype``, fp32 for a strict fp32 tensor of a half ``dtype``."""
    names = getattr(getattr(model, "_hf_class", None), "_keep_in_fp32_modules_strict", None) or ()
    strict = re.compile("|".join(rf"(^|\.){re.escape(n)}($|\.)" for n in names)) if names else None

    def of(key: str, default: torch.dtype) -> torch.dtype:
        if dtype is None:
            return default
        return torch.float32 if strict and dtype in HALF_DTYPES and strict.search(key) else dtype

    return of
