"""Is a backend usable here? Two levels, both cheap enough to run before any process group exists.

``unusable_reason(name)`` is what ``require_backends(cfg)`` asks for each backend the config names: is the
package importable, is there a CUDA GPU, is its compute capability high enough. It returns one line naming the
problem and the fix, or None. ``probe(name)`` goes further and *runs* a tiny call of the backend (a grouped GEMM
forward and backward, a TransformerEngine Linear, a symmetric-memory allocation...) and checks its numbers;
``moe-tune-env`` prints it.

Nothing heavy is imported at module import time: torch and every backend load inside the functions.
"""

from __future__ import annotations

import importlib
import importlib.util

from moe_tune.config import Config, ConfigError

BACKENDS = (
    "grouped_mm",
    "grouped_mm_fp8",
    "frozen_fp8",
    "deepep",
    "symm_mem",
    "transformer_engine",
    "fp8_current",
    "fp8_delayed",
    "fp8_blockwise",
    "fp8_mxfp8",
)

TE_HOWTO = "TransformerEngine is not installed: pip install 'moe_tune[te]' (transformer-engine[pytorch]); or pick kernels=torch"
# Lowest compute capability per backend.
_MIN_CC = {
    "deepep": (9, 0),
    "symm_mem": (8, 0),
    "transformer_engine": (8, 0),
    "grouped_mm": (8, 0),
    "grouped_mm_fp8": (9, 0),
    "frozen_fp8": (9, 0),
}


def _cuda() -> tuple[str, tuple[int, int]] | None:
    """(name, compute capability) of the current CUDA device, or None when there is none."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(), tuple(torch.cuda.get_device_capability())


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _import_error(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except Exception as e:  # a broken install raises anything (ImportError, OSError for a missing .so...)
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def _no_gpu(key: str, fix: str) -> str:
    return f"{key} needs a CUDA GPU and none is visible here (torch.cuda.is_available() is False); {fix}"


def _needs_gpu(what: str, key: str, gpu, min_cc: tuple[int, int], fix: str) -> str | None:
    """None if ``gpu`` runs ``what``, else the line saying why not, ending with ``fix`` (the value to use instead)."""
    if gpu is None:
        return _no_gpu(key, fix)
    name, cc = gpu
    if cc < min_cc:
        return (
            f"{key} needs compute capability >= {min_cc[0]}.{min_cc[1]} for {what}; "
            f"this GPU is {name} (sm{cc[0]}{cc[1]}); {fix}"
        )
    return None


def unusable_reason(name: str) -> str | None:
    """None if backend ``name`` can be used here, else one line saying why not and what to do."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")
    if name == "grouped_mm":
        return _grouped_mm_reason()
    gpu = _cuda()
    if name == "grouped_mm_fp8":
        return _grouped_mm_fp8_reason(gpu)
    if name == "frozen_fp8":
        return _frozen_fp8_reason(gpu)
    if name == "deepep":
        if not _installed("deep_ep"):
            from moe_tune.moe.dispatch.deepep import DEEPEP_HOWTO  # lazy: that module imports torch

            return f"comm=deepep: {DEEPEP_HOWTO}"
        reason = _needs_gpu(
            "DeepEP's kernels (built for Hopper)", "comm=deepep", gpu, _MIN_CC["deepep"], "use comm=all_to_all"
        )
        if reason:
            return reason
        err = _import_error("deep_ep")
        return f"comm=deepep: `import deep_ep` fails ({err}); rebuild DeepEP against this torch" if err else None
    if name == "symm_mem":
        return _symm_mem_reason(gpu)
    if name == "transformer_engine":
        return _te_reason("kernels=te", gpu)
    # fp8 modes: the GPU decides first (an mxfp8 request on Hopper is wrong whatever is installed).
    key = f"kernels.fp8={name.removeprefix('fp8_')}"
    if gpu is None:
        return _no_gpu(key, "use kernels.fp8=none")
    gpu_name, cc = gpu
    if name == "fp8_mxfp8" and cc < (10, 0):
        return (
            f"{key} needs a Blackwell GPU (compute capability 10.x, sm100) for MXFP8 block scaling; this GPU is "
            f"{gpu_name} (sm{cc[0]}{cc[1]}): use kernels.fp8=current or kernels.fp8=delayed"
        )
    if name == "fp8_blockwise" and cc < (9, 0):
        return (
            f"{key} needs Hopper or newer (compute capability >= 9.0) for block-scaled FP8 GEMMs; this GPU is "
            f"{gpu_name} (sm{cc[0]}{cc[1]}): use kernels.fp8=current"
        )
    if cc < (8, 9):
        return (
            f"{key} needs FP8 tensor cores (compute capability >= 8.9: Ada, Hopper, Blackwell); this GPU is "
            f"{gpu_name} (sm{cc[0]}{cc[1]}): use kernels.fp8=none"
        )
    return _te_reason(key, gpu)


def _grouped_mm_reason() -> str | None:
    import torch
    import torch.nn.functional as F

    if not hasattr(F, "grouped_mm") and not hasattr(torch, "_grouped_mm"):
        return f"kernels.experts=grouped_mm needs torch >= 2.10 (torch.nn.functional.grouped_mm); this is torch {torch.__version__}"
    gpu = _cuda()
    if gpu is not None and gpu[1] < _MIN_CC["grouped_mm"]:
        key = "kernels.experts=grouped_mm"
        return _needs_gpu("grouped_mm's CUDA kernel", key, gpu, _MIN_CC["grouped_mm"], "use kernels.experts=loop")
    return None


def _grouped_mm_fp8_reason(gpu) -> str | None:
    import torch

    key = "kernels.experts=grouped_mm_fp8"
    what = "row-wise scaled FP8 grouped GEMMs (torch._scaled_grouped_mm)"
    reason = _needs_gpu(what, key, gpu, _MIN_CC["grouped_mm_fp8"], "use kernels.experts=grouped_mm")
    if reason:
        return reason
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"{key} needs torch._scaled_grouped_mm (torch >= 2.9); this is torch {torch.__version__}"
    return None


def _frozen_fp8_reason(gpu) -> str | None:
    """peft.quantize_base=fp8: Hopper's FP8 grouped GEMM on a GPU; without one, its emulation on the CPU (dequantized
    operands, fp32 matmuls: for tests and small models)."""
    import torch

    key = "peft.quantize_base=fp8"
    if gpu is None:
        return None
    what = "FP8 grouped GEMMs (torch._scaled_grouped_mm)"
    reason = _needs_gpu(what, key, gpu, _MIN_CC["frozen_fp8"], "use peft.quantize_base=none")
    if reason:
        return reason
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"{key} needs torch._scaled_grouped_mm (torch >= 2.9); this is torch {torch.__version__}"
    if not _installed("triton"):
        return f"{key} quantizes activations with a Triton kernel on the GPU: pip install triton"
    return None


def _te_reason(key: str, gpu) -> str | None:
    if not _installed("transformer_engine"):
        return f"{key}: {TE_HOWTO}"
    reason = _needs_gpu("TransformerEngine", key, gpu, _MIN_CC["transformer_engine"], "use kernels=torch")
    if reason:
        return reason
    err = _import_error("transformer_engine.pytorch")
    return (
        f"{key}: `import transformer_engine.pytorch` fails ({err}); reinstall it for this torch and CUDA"
        if err
        else None
    )


def _symm_mem_reason(gpu) -> str | None:
    reason = _needs_gpu("symmetric memory", "comm=symm_mem", gpu, _MIN_CC["symm_mem"], "use comm=all_to_all")
    if reason:
        return reason
    import torch

    try:
        from torch.distributed import _symmetric_memory as symm
    except ImportError as e:
        return f"comm=symm_mem: torch {torch.__version__} has no torch.distributed._symmetric_memory ({e}); use torch >= 2.11"
    if not symm.is_nvshmem_available():
        return (
            f"comm=symm_mem: NVSHMEM is not available to torch {torch.__version__} "
            "(symm_mem.is_nvshmem_available() is False); pip install nvidia-nvshmem-cu13 (cu12 on CUDA 12), or pick comm=all_to_all"
        )
    if not hasattr(torch.ops.symm_mem, "all_to_all_vdev"):
        return f"comm=symm_mem: torch {torch.__version__} lacks torch.ops.symm_mem.all_to_all_vdev; use torch >= 2.11"
    return None


def backends_needed(cfg: Config) -> list[str]:
    """The backends of ``BACKENDS`` that ``cfg`` asks for (the defaults, all_to_all and torch, need none)."""
    needed = []
    if cfg.kernels.experts == "grouped_mm_fp8":
        needed.append("grouped_mm_fp8")
    if cfg.peft.name == "lora" and cfg.peft.quantize_base == "fp8":
        needed.append("frozen_fp8")
    if cfg.comm.name in ("deepep", "symm_mem"):
        needed.append(cfg.comm.name)
    if cfg.kernels.name == "te":
        needed.append("transformer_engine")
    if cfg.kernels.fp8 != "none":
        needed.append(f"fp8_{cfg.kernels.fp8}")
    return needed


def require_backends(cfg: Config) -> None:
    """Raise ConfigError (one line: the problem and the fix) for the first backend ``cfg`` needs that is not
    usable here. Run it after ``config.validate(cfg)``, before any process group exists."""
    for name in backends_needed(cfg):
        reason = unusable_reason(name)
        if reason is not None:
            raise ConfigError(reason)


# -- probes: run the backend ---------------------------------------------------------------------------


def probe(name: str) -> tuple[bool, str]:
    """Run a tiny call of backend ``name`` here. Returns (ok, detail): what ran and what it measured, or why
    it could not run. Never raises for a backend failure."""
    reason = unusable_reason(name)
    if reason is not None:
        return False, reason
    from moe_tune.env import probes

    try:
        if name.startswith("fp8_"):
            return probes.run_fp8(name.removeprefix("fp8_"))
        return getattr(probes, f"run_{name}")()
    except Exception as e:
        return False, f"{name}: the probe call failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
