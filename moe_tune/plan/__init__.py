"""``moe-tune-plan``: peak memory and speed per rank of a run, predicted before any GPU is touched.

``plan(cfg, gpus)`` builds the run's model on the meta device under its real mesh (``census``), measures its
layers' saved activations per token on the CPU (``activations``), and predicts the peak
``torch.cuda.max_memory_allocated`` (``memory``) and the step time (``speed``). ``search`` lists the layouts
(expert parallelism, micro-batch, activation checkpointing) of ``gpus`` GPUs that fit, fastest first, each
rejected one with its reason. The rates and constants are the H200's, fitted to the committed rows
(benchmarks/plan_calibration.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from moe_tune.config import AC_MODES, AllToAllConfig, Config, ConfigError
from moe_tune.config.overrides import AUTO_KEYS
from moe_tune.plan.memory import CALIBRATION, GIB, Calibration
from moe_tune.plan.speed import H200, LINKS, Links, Rates

# An H200's memory as torch sees it (143,771 MiB).
DEFAULT_GPU_MEM_GIB = 140.4
# A layout fits when its predicted memory (allocated, the allocator's fragmentation, the CUDA context, what lies
# outside torch's allocator) leaves this share of the GPU free: the prediction's error on the calibration rows
# (benchmarks/README.md, "Planning a run").
DEFAULT_HEADROOM = 0.05
_CENSUS: dict = {}


# transformers' warning for a YaRN config whose max_position_embeddings / original_max_position_embeddings is not
# its factor (GPT-OSS's with other context lengths).
YARN_RATIO_WARNING = "does not match the ratio implicitly set by other parameters"


@contextlib.contextmanager
def quiet_yarn_ratio_warning():
    """Holds back transformers' YaRN ratio warning while the plan reads a config: it is about the rotary
    frequencies a model computes, on which neither memory nor speed depend. Only that message, only here, and
    without entering it in ``warning_once``'s record, so the run that loads the config still says it."""
    log = logging.getLogger("transformers.modeling_rope_utils")

    def warning_once(msg, *args, **kwargs):
        if YARN_RATIO_WARNING not in str(msg):
            type(log).warning_once(log, msg, *args, **kwargs)

    log.warning_once = warning_once
    try:
        yield
    finally:
        del log.warning_once


def hf_config_of(cfg: Config):
    """The transformers config of ``cfg``'s model: a local checkpoint's config.json, or a built-in preset's."""
    from moe_tune.models.presets import trained_config

    if cfg.model.path is not None:
        from transformers import AutoConfig

        from moe_tune.models.source_check import check_weights_match_config

        check_weights_match_config(cfg.model.path)  # the plan counts config.json's sizes: they must be the weights'
        with quiet_yarn_ratio_warning():
            return AutoConfig.from_pretrained(cfg.model.path)
    with quiet_yarn_ratio_warning():
        return trained_config(cfg.model.name, cfg.model.overrides)


def default_gpus(cfg: Config) -> int:
    """The world size the layout names: dp_replicate x dp_shard, or dp_replicate x ep when dp_shard=-1."""
    p = cfg.parallel
    return max(p.dp_replicate, 1) * (p.dp_shard if p.dp_shard > 0 else p.ep)


def _activation_options(cfg: Config, dims):
    """The model options the layers compute with (the measurement runs one process in the compute dtype)."""
    from moe_tune.build import model_options

    options = model_options(cfg, dims)
    compute = torch.float32 if cfg.train.precision == "fp32" else torch.bfloat16
    return dataclasses.replace(
        options,
        dtype=compute,
        experts=dataclasses.replace(options.experts, compute_dtype=None, grad_divide=1.0),
        kernels="torch",  # TransformerEngine's layers are planned as the torch path (docs/planning.md)
        fp8="none",
    )


@dataclass
class Plan:
    config: Config
    gpus: int
    gpu_mem_gib: float
    headroom: float
    census: object
    memory: object
    speed: dict
    routing: str
    hf_config: object = None
    problems: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        d = self.census.dims
        t = self.config.train
        return {
            "model": self.config.model.path or self.config.model.name,
            "shape": {
                "layers": self.census.layers,
                "moe_layers": self.census.moe_layers,
                "experts": self.census.num_experts,
                "top_k": self.census.top_k,
                "hidden": self.census.hidden,
                "vocab": self.census.vocab,
                "params": self.census.total_params,
                "active_params": self.census.active_params,
            },
            "gpus": self.gpus,
            "gpu_mem_gib": self.gpu_mem_gib,
            "layout": {
                "dp_replicate": d.dp_replicate,
                "dp_shard": d.dp_shard,
                "ep": d.ep,
                "efsdp": d.efsdp,
                "micro_batch_size": t.micro_batch_size,
                "seq_len": t.seq_len,
                "activation_checkpointing": self.config.parallel.activation_checkpointing,
                "comm": self.config.comm.name,
                "compile": self.config.kernels.compile,
                "kernels": self.config.kernels.name,
                "precision": t.precision,
                "peft": self.config.peft.name,
                "quantize_base": self.config.peft.quantize_base,
            },
            "routing": self.routing,
            **{k: round(v, 3) if isinstance(v, float) else v for k, v in self.memory.gib().items()},
            "fits": self.fits,
            "problems": self.problems,
            "tokens_per_s_per_gpu": round(self.speed["tokens_per_s_per_gpu"], 1),
            "step_s": round(self.speed["step_s"], 4),
            "step_parts_s": {k: round(v, 4) for k, v in self.speed["parts_s"].items()},
            "communication_share": round(self.speed["communication_share"], 3),
        }


def plan(
    cfg: Config,
    gpus: int | None = None,
    gpu_mem_gib: float = DEFAULT_GPU_MEM_GIB,
    headroom: float = DEFAULT_HEADROOM,
    routing: str = "real",
    calibration: Calibration = CALIBRATION,
    rates: Rates = H200,
    links: Links = LINKS,
    hf_config=None,
) -> Plan:
    """The prediction for ``cfg`` on ``gpus`` GPUs of ``gpu_mem_gib`` each (ConfigError: a layout that cannot run)."""
    from moe_tune.config import validate
    from moe_tune.models.families import expert_dims, num_experts
    from moe_tune.plan import memory, speed
    from moe_tune.plan.activations import measured
    from moe_tune.plan.census import census as count

    gpus = gpus or default_gpus(cfg)
    hf_config = hf_config or hf_config_of(cfg)
    validate(cfg, world_size=gpus, num_experts=num_experts(hf_config), expert_dims=expert_dims(hf_config))
    # What a rank holds does not depend on the micro-batch, checkpointing or the comm backend (each gives rank r the
    # same block of experts; ``memory`` counts their buffers): one build per layout in a search, and no DeepEP or
    # NVSHMEM needed here; nor TransformerEngine: its layers are planned as the torch path (docs/planning.md).
    same = dataclasses.replace(
        cfg,
        comm=AllToAllConfig(),
        train=dataclasses.replace(cfg.train, micro_batch_size=1, global_batch_size=-1),
        parallel=dataclasses.replace(cfg.parallel, activation_checkpointing="none"),
        kernels=dataclasses.replace(cfg.kernels, name="torch", fp8="none", compile=False),
    )
    key = (gpus, repr(same), hf_config.to_json_string())
    if key not in _CENSUS:
        _CENSUS[key] = count(same, hf_config, gpus)
    c = _CENSUS[key]
    with quiet_yarn_ratio_warning():  # the measured layer's reduced config is validated again
        acts = measured(hf_config, _activation_options(cfg, c.dims))
    mem = memory.predict(c, acts, cfg, calibration, routing)
    balanced = routing == "balanced" or cfg.train.force_balanced_routing or c.dims.ep == 1
    imbalance = 1.0 if balanced else calibration.real_routing_imbalance
    step = speed.step_seconds(c, acts, cfg, rates, links, imbalance)
    p = Plan(cfg, gpus, gpu_mem_gib, headroom, c, mem, step, routing, hf_config)
    limit = gpu_mem_gib * (1 - headroom)
    if mem.reserved / GIB > limit:
        p.problems.append(
            f"needs {mem.reserved / GIB:.1f} GiB per GPU (peak allocated {mem.peak / GIB:.1f} GiB + allocator, "
            f"context and comm buffers) > {limit:.1f} GiB ({gpu_mem_gib:g} GiB less {headroom:.0%} headroom)"
        )
    return p


def micro_batches(global_batch_size: int, dp_ranks: int, max_micro_batch: int) -> list[int]:
    """The micro-batches up to ``max_micro_batch`` a run can take: any without a global batch (-1), else those
    dividing each data-parallel rank's share of it. A share that is no whole number leaves [1], whose plan is
    refused with the configuration's error and fix."""
    if global_batch_size == -1:
        return list(range(1, max_micro_batch + 1))
    if global_batch_size % dp_ranks:
        return [1]
    per_rank = global_batch_size // dp_ranks
    return [mb for mb in range(1, min(per_rank, max_micro_batch) + 1) if per_rank % mb == 0]


def candidates(cfg: Config, gpus: int, num_experts: int, max_micro_batch: int = 16, vary=AUTO_KEYS):
    """Layouts to try: every ep dividing both the experts and dp_shard (the GPUs over dp_replicate: expert
    parallelism borrows its ranks), each micro-batch up to ``max_micro_batch`` (``micro_batches``), each
    checkpointing mode; of these only the keys in ``vary``, the others as ``cfg`` has them (``comm`` too: a
    dispatch backend or overlap that needs expert parallelism rules ep=1 out, as moe-tune does)."""
    p, t = cfg.parallel, cfg.train
    shard = p.dp_shard if p.dp_shard > 0 else max(gpus // max(p.dp_replicate, 1), 1)
    eps = [e for e in range(1, shard + 1) if shard % e == 0 and num_experts % e == 0]
    eps = eps if "parallel.ep" in vary else [p.ep]
    acs = AC_MODES if "parallel.activation_checkpointing" in vary else (p.activation_checkpointing,)
    mbs = micro_batches(t.global_batch_size, max(p.dp_replicate, 1) * shard, max_micro_batch)
    mbs = mbs if "train.micro_batch_size" in vary else [t.micro_batch_size]
    for ep in eps:
        for ac in acs:
            for mb in mbs:
                yield dataclasses.replace(
                    cfg,
                    parallel=dataclasses.replace(p, ep=ep, activation_checkpointing=ac),
                    train=dataclasses.replace(t, micro_batch_size=mb),
                )


def search(
    cfg: Config,
    gpus: int,
    gpu_mem_gib: float = DEFAULT_GPU_MEM_GIB,
    headroom: float = DEFAULT_HEADROOM,
    routing: str = "real",
    max_micro_batch: int = 16,
    vary=AUTO_KEYS,
) -> tuple[list[Plan], list[tuple[dict, str]]]:
    """(plans that fit, fastest first; rejected layouts with the reason). A micro-batch that does not fit ends
    that (ep, checkpointing) line: larger ones only need more. ConfigError when no layout tried can run at all (a
    held key or another value makes each invalid): the configuration's error, not a layout too large."""
    from moe_tune.config.validate import check_expert_dims
    from moe_tune.models.families import expert_dims, num_experts

    hf_config = hf_config_of(cfg)
    # How the experts are stored (peft.quantize_base, kernels.experts) holds or fails for every layout alike: a
    # model that cannot take it is refused once, as moe-tune refuses it, not as layouts that do not fit.
    check_expert_dims(cfg, *expert_dims(hf_config))
    fitting: list[Plan] = []
    rejected: list[tuple[dict, str]] = []
    invalid: list[ConfigError] = []
    stop: set[tuple[int, str]] = set()
    for c in candidates(cfg, gpus, num_experts(hf_config), max_micro_batch, vary):
        key = (c.parallel.ep, c.parallel.activation_checkpointing)
        layout = {"ep": c.parallel.ep, "activation_checkpointing": key[1], "micro_batch_size": c.train.micro_batch_size}
        if key in stop:
            continue
        try:
            p = plan(c, gpus, gpu_mem_gib, headroom, routing, hf_config=hf_config)
        except ConfigError as e:
            rejected.append((layout, str(e)))
            invalid.append(e)
            continue
        if p.fits:
            fitting.append(p)
        else:
            rejected.append((layout, p.problems[0]))
            stop.add(key)
    if not fitting and invalid and len(invalid) == len(rejected):
        raise invalid[0]
    # Equal predicted speeds come from a host-bound step, whose launches the model counts once per layer: a
    # recompute still adds its own, so the layout recomputing least comes first, then the one needing least memory.
    fitting.sort(key=lambda p: (-round(p.speed["tokens_per_s_per_gpu"]), _recompute(p), p.memory.peak))
    return [p for i, p in enumerate(fitting) if not any(_no_better(p, q) for q in fitting[:i])], rejected


def _recompute(p: Plan) -> int:
    return {"none": 0, "selective": 1, "full": 2}[p.config.parallel.activation_checkpointing]


def _no_better(p: Plan, q: Plan) -> bool:
    """``p`` recomputes more than ``q``, of the same ep and micro-batch, for no less memory (to the 0.1 GiB shown)
    and no more speed: a row the search leaves out (a small model's checkpointing saves nothing)."""
    same = (
        p.config.parallel.ep == q.config.parallel.ep
        and p.config.train.micro_batch_size == q.config.train.micro_batch_size
    )
    return (
        same
        and _recompute(p) > _recompute(q)
        and float(f"{q.memory.peak / 2**30:.1f}") <= float(f"{p.memory.peak / 2**30:.1f}")
        and round(q.speed["tokens_per_s_per_gpu"]) >= round(p.speed["tokens_per_s_per_gpu"])
    )


__all__ = ["DEFAULT_GPU_MEM_GIB", "DEFAULT_HEADROOM", "Plan", "hf_config_of", "plan", "search"]
