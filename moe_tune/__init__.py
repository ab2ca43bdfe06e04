"""moe_tune: fine-tune Hugging Face Mixture-of-Experts checkpoints.

``import moe_tune`` needs neither a GPU, DeepEP nor TransformerEngine; heavy modules load on first use.
"""

from __future__ import annotations

__version__ = "0.1.0"


class AutoModelForCausalLM:
    """``moe_tune.AutoModelForCausalLM.from_pretrained(local_dir, dtype=torch.float32, kernels="torch")``."""

    @staticmethod
    def from_pretrained(path: str, dtype="float32", kernels: str = "torch", device=None, **options):
        """``options``: ``moe_tune.models.model.ModelOptions`` fields (``aux_loss_coef``, ``loss_chunk_size``...)."""
        from moe_tune.build import from_pretrained

        return from_pretrained(path, dtype=dtype, kernels=kernels, device=device, **options)


# Submodules of the Python API reachable as attributes after a plain ``import moe_tune`` (docs/python-api.md's
# ``moe_tune.build.from_checkpoint``), imported on first use so that ``import moe_tune`` stays light.
LAZY_SUBMODULES = ("build",)


def __getattr__(name: str):
    if name in LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"moe_tune.{name}")
    raise AttributeError(f"module 'moe_tune' has no attribute {name!r}")


__all__ = ["AutoModelForCausalLM", "__version__"]
