"""Step time per rank, and so tokens/s per GPU: the step's work divided by rates measured on an H200.

    compute    forward matmul FLOPs per token by kind (``Census.flops_matmul_per_token``) x tokens, times the
               passes each kind runs (forward, input gradient, weight gradient where trained; a checkpointed
               layer's forward again), each kind at its own rate: dense GEMMs, the routed experts' grouped GEMMs
               (slower with fewer rows per expert: ``rate x rows / (rows + half_rate_rows)``), attention, lm_head
    memory     the activations' bytes moved by the step's elementwise work (norms, activation function, routing
               permutations and their backward): ``passes`` x the eager layer's saved bytes, at HBM bandwidth
    optimizer  AdamW reads and writes each trained parameter's value, gradient and moments once
    comm       the dispatch and combine all-to-alls (forward, backward, and a full checkpoint's recompute), not
               overlapped (they run on the compute stream); FSDP2's all-gathers and reduce-scatters overlap the
               compute and cost only what exceeds it
    host       a fixed time per layer and micro-batch (launches, the dispatch's host sync), counted where it exceeds
               the GPU's time (the host queues ahead: only a small model waits for its launches)
    fsdp       FSDP2's copies per byte it manages (gathers into and out of its buffers, casts, reductions)

Rates: ``H200``, fitted to the committed one-H200 and 2 x H200 rows (benchmarks/plan_calibration.py --fit); they
are effective rates of this model, not kernel peaks (the dense rate absorbs what the model leaves out).
Links for layouts beyond one node are assumptions, stated in ``Links``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rates:
    dense_tflops: float = 760.0
    experts_tflops: float = 440.0
    half_rate_rows: float = 224.0  # rows per expert at which the grouped GEMM runs at half its rate
    attention_tflops: float = 475.0
    head_tflops: float = 650.0
    hbm_tb_s: float = 3.6
    memory_passes_eager: float = 14.0
    memory_passes_compiled: float = 6.0
    host_ms_per_layer_eager: float = 12.0
    host_ms_per_layer_compiled: float = 0.0
    # FSDP2's copies each micro-batch (all-gather copy-in/out and casts, gradient reduction and its casts), per byte
    # of the parameters it manages and of their gradients: with one rank it is all copying (fp32 master weights on
    # one GPU run at a quarter of bf16's speed).
    fsdp_ns_per_byte: float = 0.0048
    # Expert parallelism's per-layer cost beyond the bytes on the wire: the split sizes' host sync, the counts'
    # all-to-all, the permutations in and out (fitted to the 2 x H200 rows).
    ep_ms_per_layer: float = 3.75
    # comm.overlap: each MoE layer's two halves cost this much more host and launch time than one whole
    # (the 2 x H200 rows with and without it, micro-batch 1 and 4).
    overlap_ms_per_layer: float = 1.8


@dataclass(frozen=True)
class Links:
    """Bandwidth per GPU, GB/s: NVLink within a node (from NCCL's all_to_all measured on 2 x H200), one 400 Gb/s
    InfiniBand NIC per GPU between nodes after protocol overhead (an assumption: no multi-node run here).
    benchmarks/README.md, "Planning a run", gives the figures behind both."""

    gpus_per_node: int = 8
    nvlink_gb_s: float = 500.0
    network_gb_s: float = 45.0

    def bandwidth(self, group: int, stride: int = 1) -> float:
        """A collective over ``group`` ranks spaced ``stride`` apart: NVLink when they share a node."""
        return self.nvlink_gb_s if group * stride <= self.gpus_per_node else self.network_gb_s


H200 = Rates()
LINKS = Links()


def step_seconds(census, acts, cfg, rates: Rates = H200, links: Links = LINKS, imbalance: float = 1.0) -> dict:
    """Seconds per optimizer step on one rank, by part, with ``tokens_per_s_per_gpu``."""
    from moe_tune.distributed.dims import BatchLayout

    dims = census.dims
    layout = BatchLayout.from_config(cfg.train, dims.dp)
    tokens = cfg.train.micro_batch_size * cfg.train.seq_len  # per rank and micro-batch
    ac = cfg.parallel.activation_checkpointing
    layer_recompute = 1.0 if ac == "full" else 0.0
    compute = _compute_seconds(census, cfg, rates, imbalance, tokens)
    moved = census.layers * tokens * (acts.moe.total if acts.moe else 0.0)
    passes = rates.memory_passes_compiled if cfg.kernels.compile else rates.memory_passes_eager
    memory = moved * passes / (rates.hbm_tb_s * 1e12)
    host = census.layers * (rates.host_ms_per_layer_compiled if cfg.kernels.compile else rates.host_ms_per_layer_eager)
    host /= 1e3
    fsdp_copies = census.fsdp_bytes * rates.fsdp_ns_per_byte / 1e9 if census.fsdp else 0.0
    # The host queues work ahead of the GPU: a small model's step is as long as its launches take, a large one's as
    # its kernels; the host's time shows only where it exceeds the GPU's.
    ep = 0.0
    if dims.ep > 1:
        ep = census.moe_layers * rates.ep_ms_per_layer * (1.0 + layer_recompute) / 1e3
        ep += census.moe_layers * rates.overlap_ms_per_layer / 1e3 if cfg.comm.overlap else 0.0
    gpu = compute + memory + fsdp_copies + ep
    host = max(0.0, host - gpu)
    per_micro = gpu + host

    comm, fsdp_exposed = _comm_seconds(census, cfg, links, imbalance, tokens, layer_recompute, per_micro)
    per_micro += comm + fsdp_exposed

    optimizer = census.trained * 7.0 / (rates.hbm_tb_s * 1e12)  # p, g, m, v read; p, m, v written
    step = per_micro * layout.accum + optimizer
    real_tokens = tokens * layout.accum
    return {
        "step_s": step,
        "tokens_per_s_per_gpu": real_tokens / step,
        "parts_s": {
            "compute": compute * layout.accum,
            "memory_bound": memory * layout.accum,
            "host": host * layout.accum,
            "fsdp_copies": fsdp_copies * layout.accum,
            "expert_parallel_overhead": ep * layout.accum,
            "expert_parallel_comm": comm * layout.accum,
            "fsdp_comm_exposed": fsdp_exposed * layout.accum,
            "optimizer": optimizer,
        },
        "communication_share": (comm + fsdp_exposed) * layout.accum / step,
    }


def _compute_seconds(census, cfg, rates: Rates, imbalance: float, tokens: int) -> float:
    """The matmuls' seconds per micro-batch: forward FLOPs by kind x the passes each runs, at its rate."""
    f = census.flops_matmul_per_token
    trained = 2.0 if cfg.peft.name == "lora" else 3.0  # forward + input gradient (+ weight gradient)
    ac = cfg.parallel.activation_checkpointing
    layer_recompute = 1.0 if ac == "full" else 0.0
    attention_recompute = 1.0 if ac in ("full", "selective") else 0.0
    rows_per_expert = tokens * census.top_k * census.dims.ep / max(census.num_experts, 1) * imbalance
    # a model whose layers are all dense (mlp_only_layers, first_k_dense_replace) routes no rows: no expert FLOPs
    experts_rate = rates.experts_tflops * rows_per_expert / (rows_per_expert + rates.half_rate_rows) or 1.0
    seconds_per_token = (
        f["dense"] * (trained + layer_recompute) / rates.dense_tflops
        + f["experts"] * (trained + layer_recompute) * imbalance / experts_rate
        + f["attention"] * (3.0 + attention_recompute) / rates.attention_tflops
        + f["head"] * trained / rates.head_tflops
    ) / 1e12
    return seconds_per_token * tokens


def _comm_seconds(census, cfg, links: Links, imbalance: float, tokens: int, recompute: float, compute: float):
    """(the all-to-alls' seconds per micro-batch, FSDP2's collectives' seconds beyond ``compute``)."""
    dims = census.dims
    comm = 0.0
    if dims.ep > 1:
        rows = tokens * census.top_k * imbalance
        bytes_per_layer = 2 * rows * census.hidden * 2.0 * (dims.ep - 1) / dims.ep  # dispatch + combine, bf16
        comm = census.moe_layers * bytes_per_layer * (2.0 + recompute) / (links.bandwidth(dims.ep) * 1e9)
    fsdp_exposed = 0.0
    if census.fsdp and dims.dp_shard > 1:
        gathered = sum(census.unit_gathered.values())
        reduced = sum(census.unit_grad_reduce.values())
        share = (dims.dp_shard - 1) / dims.dp_shard
        fsdp = (2 * gathered + reduced) * share / (links.bandwidth(dims.dp_shard) * 1e9)
        fsdp_exposed = max(0.0, fsdp - compute - comm)
    return comm, fsdp_exposed
