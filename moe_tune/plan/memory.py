"""Peak memory per rank: the predicted ``torch.cuda.max_memory_allocated`` of a training step, with its parts.

Over one step, in order (rank 0; every rank holds the same shapes):

  static      parameters (this rank's shards), buffers (a quantized base), AdamW's two moments (the parameters'
              dtype: fp32 for bf16_fp32_master, bf16 for bf16), FSDP2's gathered root (embeddings and lm_head stay
              gathered from the first forward to the last backward)
  activations what autograd keeps per layer (``moe_tune.plan.activations``, measured per token on the CPU, scaled
              for kernels.compile) x tokens per micro-batch, by checkpointing mode: none keeps all, selective
              recomputes the attention (keeps its input), full keeps each layer's input; routed rows grow by the
              routing's imbalance under expert parallelism (expected for real routing, worst case apart) and
              symm_mem's rows are its capacity; experts kept outside FSDP2 save their cast weights per layer
  gradients   the trained parameters' (this rank's shards), there at the end of the backward (and throughout a
              step with gradient accumulation)
  working     the largest short-lived set: FSDP2's two gathered layers (the one computing and the one prefetched)
              and one layer's unsharded gradients, one layer's recomputed activations (full checkpointing) or its
              backward's working set, the loss's chunk of logits

  peak = static + working + max(activations + lm_head's gradient, gradients)

The two sides of the max are the start of the backward (every activation kept) and its end (every gradient made):
between them each layer's activations are freed as its gradients arrive. Constants the code cannot count
(compiled layers' saving, the backward's working set, the allocator's reserve) are fitted to the committed H200
rows (``CALIBRATION``; benchmarks/README.md, "Planning a run").
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class Calibration:
    """What the memory model takes from measurements (benchmarks/plan_calibration.py fits and prints them)."""

    # Saved bytes of a compiled layer over the eager layer's (inductor fuses the norms' fp32 copies and the
    # activation function's inputs away).
    compiled_activations: float = 0.76
    # A layer backward's working set, in units of that layer's routed-row activations (gradients of the expert
    # GEMMs' inputs and outputs, the permutation's backward).
    backward_working: float = 1.2
    # Bytes per logit of the fused loss's chunk (bf16 logits in place, their gradient, the hidden state's fp32
    # gradient): 1.75 GiB measured for 4,096 rows x 151,936 (benchmarks/README.md, "The loss kernel").
    fused_loss_bytes_per_logit: float = 3.02
    # Without kernels.fused_loss: bf16 logits, their fp32 copy and its gradient.
    unfused_loss_bytes_per_logit: float = 10.0
    # Under expert parallelism: [routed rows, hidden] bf16 buffers a MoE layer keeps beyond what one process keeps
    # (the all-to-all's send and receive copies; the CPU measurement runs without expert parallelism).
    ep_dispatch_copies: float = 1.0
    # Rows a rank receives over the mean under real routing (the busiest rank sets the peak), expert parallelism.
    real_routing_imbalance: float = 1.5
    # Allocated once and kept whatever the model: cuBLAS and Triton workspaces, the loss's and optimizer's buffers.
    fixed_gib: float = 0.3
    # torch's caching allocator needs this much over the peak allocated (fragmentation), for the fit check: under
    # memory pressure it frees its cache and runs close to the GPU's memory (a 24-layer row allocated within a few
    # GiB of an H200's: benchmarks/README.md, "Planning a run"), so the reserve it keeps when memory is plenty is no
    # need.
    reserved_over_allocated: float = 1.03
    # CUDA context, cuBLAS/NCCL workspaces: outside torch's allocator, counted for the fit check.
    context_gib: float = 1.0
    # DeepEP's NVLink buffer per rank (outside torch's allocator; DeepEP sizes it from its tuned configs).
    deepep_buffer_gib: float = 1.0


CALIBRATION = Calibration()


@dataclass
class Memory:
    """Bytes per rank by part, and the peak. ``outside_allocator``: memory the step needs that torch's
    ``max_memory_allocated`` does not count (symmetric and DeepEP buffers)."""

    parts: dict[str, float]
    peak: float
    worst_case_peak: float
    outside_allocator: float
    reserved: float

    def gib(self) -> dict:
        return {
            "peak_gib": self.peak / GIB,
            "worst_case_routing_peak_gib": self.worst_case_peak / GIB,
            "reserved_gib": self.reserved / GIB,
            "outside_allocator_gib": self.outside_allocator / GIB,
            "breakdown_gib": {k: round(v / GIB, 3) for k, v in self.parts.items()},
        }


def optimizer_state_bytes(census) -> float:
    """AdamW's two moments in the parameters' dtype (the step counts are scalars)."""
    return 2.0 * census.trained


def activation_bytes(census, acts, cfg, calib: Calibration, imbalance: float) -> tuple[float, float]:
    """(all layers' kept activations, the largest single layer's full activations) for one micro-batch."""
    tokens = cfg.train.micro_batch_size * cfg.train.seq_len
    compiled = calib.compiled_activations if cfg.kernels.compile else 1.0
    mode = cfg.parallel.activation_checkpointing
    layer_input = 2.0 * census.hidden  # bf16 hidden state per token (what a checkpoint keeps)
    rows = imbalance
    if cfg.comm.name == "symm_mem" and census.dims.ep > 1:
        rows = max(getattr(cfg.comm, "capacity_factor", 2.0), 1.0)

    dispatch = 0.0
    if census.dims.ep > 1:
        dispatch = calib.ep_dispatch_copies * census.top_k * census.hidden * 2.0 * rows

    def full_layer(layer) -> float:
        routed = dispatch if layer is acts.moe else 0.0
        return (layer.attention + layer.rest + layer.routed * (rows - 1.0)) * compiled + routed

    def kept(layer) -> float:
        if mode == "full":
            return layer_input
        if mode == "selective":
            routed = dispatch if layer is acts.moe else 0.0
            return (layer.rest + layer.routed * (rows - 1.0)) * compiled + layer_input + routed
        return full_layer(layer)

    dense_layers = census.layers - census.moe_layers
    per_token = census.moe_layers * kept(acts.moe) + (dense_layers * kept(acts.dense) if acts.dense else 0.0)
    per_token += acts.outside * compiled
    largest = max(full_layer(acts.moe), full_layer(acts.dense) if acts.dense else 0.0)
    kept_total = per_token * tokens + census.moe_layers * census.cast_experts_per_layer
    return kept_total, largest * tokens


def predict(census, acts, cfg, calib: Calibration = CALIBRATION, routing: str = "real") -> Memory:
    """Peak bytes per rank for ``cfg`` (``routing``: "real" or "balanced": forced balanced routing)."""
    from moe_tune.distributed.dims import BatchLayout

    balanced = routing == "balanced" or cfg.train.force_balanced_routing or census.dims.ep == 1
    imbalance = 1.0 if balanced else calib.real_routing_imbalance
    tokens = cfg.train.micro_batch_size * cfg.train.seq_len
    accum = BatchLayout.from_config(cfg.train, census.dims.dp).accum

    optimizer = optimizer_state_bytes(census)
    gathered_root = census.unit_gathered.get(-1, 0) if census.fsdp else 0
    static = census.params + census.frozen_buffers + optimizer + gathered_root + calib.fixed_gib * GIB
    kept, layer_full = activation_bytes(census, acts, cfg, calib, imbalance)
    grads = float(census.trained)
    head_grad = census.vocab * census.hidden * 4.0 if census.trained else 0.0  # fp32 or bf16 x 2 (grad + copy)
    head_grad = min(head_grad, grads)

    layers = [v for k, v in census.unit_gathered.items() if k != -1]
    grads_unsharded = [v for k, v in census.unit_grad_reduce.items() if k != -1]
    fsdp = (2 * max(layers, default=0) + max(grads_unsharded, default=0)) if census.fsdp else 0.0
    chunk = min(cfg.kernels.loss_chunk_size, tokens) if cfg.kernels.fused_loss else tokens
    per_logit = calib.fused_loss_bytes_per_logit if cfg.kernels.fused_loss else calib.unfused_loss_bytes_per_logit
    loss = chunk * census.vocab * per_logit
    routed_layer = acts.moe.routed * tokens * imbalance * (calib.compiled_activations if cfg.kernels.compile else 1)
    if cfg.parallel.activation_checkpointing == "full":
        layer_work = layer_full
    else:
        layer_work = calib.backward_working * routed_layer
    working = fsdp + max(layer_work, loss)

    during = kept + head_grad + (grads if accum > 1 else 0.0)
    peak = static + working + max(during, grads)
    parts = {
        "parameters": float(census.params),
        "quantized_base_and_buffers": float(census.frozen_buffers),
        "optimizer_state": optimizer,
        "gradients": grads,
        "activations": kept,
        "fsdp_gathered": gathered_root + fsdp,
        "layer_working_set": layer_work,
        "loss_chunk": loss,
        "fixed_workspaces": calib.fixed_gib * GIB,
    }
    worst = _worst_case_peak(census, acts, cfg, calib, peak, kept, layer_full)
    outside = _outside_allocator(census, cfg, calib, tokens)
    reserved = peak * calib.reserved_over_allocated + calib.context_gib * GIB + outside
    return Memory(parts, peak, worst, outside, reserved)


def _worst_case_peak(census, acts, cfg, calib: Calibration, peak: float, kept: float, layer_full: float) -> float:
    """The peak if every token of every ep rank were routed to this rank's experts (at most top_k rows per token,
    one per local expert): ep x the mean rows. symm_mem's rows are its capacity whatever the routing."""
    if census.dims.ep == 1 or cfg.comm.name == "symm_mem":
        return peak
    worst_rows = min(census.dims.ep, census.num_experts / max(census.local_experts, 1))
    kept_w, layer_w = activation_bytes(census, acts, cfg, calib, worst_rows)
    recompute = max(0.0, layer_w - layer_full) if cfg.parallel.activation_checkpointing == "full" else 0.0
    return peak - kept + kept_w + recompute


def _outside_allocator(census, cfg, calib: Calibration, tokens: int) -> float:
    """Bytes the comm backend allocates outside torch's caching allocator (NVSHMEM's heap, DeepEP's buffer)."""
    if census.dims.ep == 1:
        return 0.0
    if cfg.comm.name == "symm_mem":
        cap = max(getattr(cfg.comm, "capacity_factor", 2.0), 1.0)
        rows = tokens * census.top_k
        return 2 * 2.0 * census.hidden * (rows + rows * cap)  # two slots of send and receive rows, bf16
    if cfg.comm.name == "deepep":
        return calib.deepep_buffer_gib * GIB
    return 0.0
