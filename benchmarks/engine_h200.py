"""One-GPU engine benchmark: moe_tune's GroupedExperts against its per-expert reference, then one training step
of Qwen3-30B-A3B shapes (8 layers) through moe_tune and through plain transformers, with a profile.

Part A (correctness, bf16 on CUDA): ``GroupedExperts`` grouped_mm path vs the per-expert loop, both against a
float64 loop, forward and all gradients, with uneven counts and experts that receive no rows. Passes when every
relative error ``||out - ref|| / ||ref||`` is under 1e-2 (bf16 operands land between 1e-3 and 1e-2), the
grouped path is no worse than 1.5 x the bf16 loop + 1e-3, and empty experts' weight gradients are exactly 0.

Part B (speed): hidden 2048, 128 experts, top-8, moe_intermediate 768, 32 heads, 4 KV heads, head_dim 128,
vocab 151936, 8 layers, random init, seq 4096, micro-batch 1, bf16 parameters, fused AdamW, SDPA, no
activation checkpointing, real routing. Warm-up 3 steps, then the median of 10 (each step synchronised).

FLOPs per token (training = forward + backward = 3 x forward):
    6 * N_active + 6 * L * (n_heads * head_dim) * S
N_active counts matmul parameters a token passes through: per layer q,k,v,o projections
D*(H*hd) + 2*D*(KV*hd) + (H*hd)*D, the router D*E and top_k experts 3*D*I, plus the lm_head V*D
(embeddings are a lookup, not a matmul). The attention term is 12 * L * (H*hd) * S / 2: QK^T and AV cost
2 * 2 * S * (H*hd) per token per layer forward, x3 for training, halved for the causal mask.
For these shapes N_active = 766M and FLOPs/token = 5.40 G. TFLOP/s = tokens/s * FLOPs/token / 1e12.

Writes $OUT/engine.json (partial after every part, so one failure keeps the others), profile tables in
$OUT/profile_<variant>.txt, and prints a short table last. Run from the repository root with
PYTHONPATH=$PWD; COMMIT=<git rev-parse HEAD> in the environment.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import json
import os
import statistics
import time
import traceback
from pathlib import Path

import torch
from profile_summary import profile_steps

OUT = Path(os.environ.get("OUT", "benchmarks/out"))
CKPT = Path(os.environ.get("CKPT_DIR", "/tmp/qwen3_30b_a3b_8l"))
SHAPES = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=8,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, router_aux_loss_coef=0.001,
)  # fmt: skip
SEQ, WARMUP, STEPS, LR = 4096, 3, 10, 1e-5
# Big experts case: E, D, I, routed rows.
BIG = (128, 2048, 768, 32768)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMOKE = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16)  # fmt: skip
if os.environ.get("SMOKE"):  # a CPU dry run of the whole script with tiny shapes
    SHAPES.update(SMOKE)
    SEQ, WARMUP, STEPS, BIG = 64, 1, 2, (16, 64, 32, 512)
REFERENCE = {
    "hf_grouped_mm_tokens_per_s": 30192,
    "hf_grouped_mm_peak_gib": 45.5,
    "source": "H200.md, transformers 5.17",
}
RESULT: dict = {"rows": [], "errors": []}


def save() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "engine.json").write_text(json.dumps(RESULT, indent=2))


def part(name: str):
    """Run one part; record its failure and keep going."""

    def wrap(fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            print(f"== {name}", flush=True)
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                status = "oom" if isinstance(e, torch.OutOfMemoryError) else f"error: {type(e).__name__}: {e}"
                RESULT["errors"].append(
                    {"part": name, "status": status[:500], "traceback": traceback.format_exc()[-3000:]}
                )
                traceback.print_exc()
                return None
            finally:
                print(f"== {name} done in {time.perf_counter() - t0:.1f} s", flush=True)
                save()

        return run

    return wrap


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


# -- Part A -------------------------------------------------------------------------------------------------


def _experts_case(E: int, D: int, F: int, counts: list[int], seed: int) -> dict:
    from moe_tune.moe.experts import ExpertsOptions, ExpertsSpec, GroupedExperts

    g = torch.Generator(device=DEV).manual_seed(seed)
    m = GroupedExperts(ExpertsSpec(num_experts=E, dim=D, hidden=F)).to(DEV)
    with torch.no_grad():
        m.gate_up_proj.copy_(torch.randn(m.gate_up_proj.shape, generator=g, device=DEV) * D**-0.5)
        m.down_proj.copy_(torch.randn(m.down_proj.shape, generator=g, device=DEV) * F**-0.5)
    ref = copy.deepcopy(m).double()
    m = m.bfloat16()
    counts_e = torch.tensor(counts, device=DEV)
    x = torch.randn(sum(counts), D, generator=g, device=DEV)
    dy = torch.randn(sum(counts), D, generator=g, device=DEV)
    results = {}
    for impl, mod, dtype in (
        ("grouped_mm", m, torch.bfloat16),
        ("loop", m, torch.bfloat16),
        ("fp64", ref, torch.float64),
    ):
        mod.options = ExpertsOptions(impl="loop" if impl != "grouped_mm" else "grouped_mm")  # same weights
        mod.zero_grad(set_to_none=True)
        xi = x.to(dtype).requires_grad_()
        y = mod(xi, counts_e)
        y.backward(dy.to(dtype))
        results[impl] = {
            "y": y.detach(),
            "dx": xi.grad,
            "dW_gate_up": mod.gate_up_proj.grad,
            "dW_down": mod.down_proj.grad,
        }
    errs = {impl: {k: rel(v, results["fp64"][k]) for k, v in results[impl].items()} for impl in ("grouped_mm", "loop")}
    empty = [j for j, c in enumerate(counts) if c == 0]
    g_res = results["grouped_mm"]
    empty_zero = all(bool((g_res[k][empty] == 0).all()) for k in ("dW_gate_up", "dW_down")) if empty else True
    finite = all(bool(torch.isfinite(v).all()) for v in g_res.values())
    ok = (
        finite
        and empty_zero
        and all(
            errs["grouped_mm"][k] < 1e-2 and errs["grouped_mm"][k] <= 1.5 * errs["loop"][k] + 1e-3 for k in errs["loop"]
        )
    )
    return {
        "shape": {"E": E, "D": D, "I": F, "rows": sum(counts), "empty_experts": len(empty), "max_rows": max(counts)},
        "rel_err_vs_fp64": errs,
        "grouped_vs_loop_bf16": {k: rel(g_res[k], results["loop"][k]) for k in g_res},
        "empty_expert_grads_zero": empty_zero,
        "finite": finite,
        "pass": ok,
    }


@part("experts_check")
def experts_check() -> None:
    g = torch.Generator().manual_seed(0)
    small = [5, 0, 17, 1, 0, 40, 3, 0]  # uneven, three empty experts
    # Realistic: 4096 tokens x top-8 rows over 128 experts, skewed (Zipf-like) with 9 empty experts.
    E, D, F, R = BIG
    w = 1.0 / torch.arange(1, E + 1).float() ** 0.8
    big = torch.multinomial(w, R, replacement=True, generator=g).bincount(minlength=E)
    big[torch.randperm(E, generator=g)[:9]] = 0
    big[torch.argmax(big)] += R - int(big.sum())
    cases = [_experts_case(8, 128, 64, small, 1), _experts_case(E, D, F, big.tolist(), 2)]
    RESULT["experts_check"] = {"tolerance": "rel err < 1e-2 vs fp64 and <= 1.5 x bf16 loop + 1e-3", "cases": cases}
    RESULT["experts_check"]["pass"] = all(c["pass"] for c in cases)
    # Speed of the grouped path alone at the realistic shape (forward + backward = 18 * R * D * I FLOPs).
    from moe_tune.moe.experts import ExpertsOptions, ExpertsSpec, GroupedExperts

    m = GroupedExperts(ExpertsSpec(num_experts=E, dim=D, hidden=F)).to(DEV, torch.bfloat16)
    torch.nn.init.normal_(m.gate_up_proj, std=0.02)
    torch.nn.init.normal_(m.down_proj, std=0.02)
    x = torch.randn(R, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    counts_e, dy = big.to(DEV), torch.randn_like(x)
    ms = _time_ms(lambda: m(x, counts_e).backward(dy), 3, 20)
    RESULT["experts_check"]["grouped_fwd_bwd_ms"] = ms
    RESULT["experts_check"]["grouped_fwd_bwd_tflops"] = 18 * R * D * F / ms / 1e9
    m.options = ExpertsOptions(impl="loop")  # the per-expert reference, for scale (a host sync per call)
    RESULT["experts_check"]["loop_fwd_bwd_ms"] = _time_ms(lambda: m(x, counts_e).backward(dy), 1, 3)


def _time_ms(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


# -- Part B -------------------------------------------------------------------------------------------------


def flops_per_token(c) -> tuple[float, float]:
    """(FLOPs per token, N_active) by the formula in the module docstring."""
    D, L, V, hd, H, KV = (
        c.hidden_size,
        c.num_hidden_layers,
        c.vocab_size,
        c.head_dim,
        c.num_attention_heads,
        c.num_key_value_heads,
    )
    per_layer = D * H * hd + 2 * D * KV * hd + H * hd * D + D * c.num_experts
    per_layer += c.num_experts_per_tok * 3 * D * c.moe_intermediate_size
    n_active = L * per_layer + V * D
    return 6 * n_active + 6 * L * H * hd * SEQ, n_active


def make_step(model, opt, ids):
    def step():
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out

    return step


def bench(model, variant: str, kind: str, ids, extra: dict) -> dict:
    """Warm-up, then the median of STEPS synchronised steps; then per-phase times and a 2-step profile."""
    row = {"variant": variant, "kind": kind, "status": "running", **extra}
    RESULT["rows"].append(row)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    step = make_step(model, opt, ids)
    sync()
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for i in range(WARMUP + STEPS):
        t0 = time.perf_counter()
        out = step()
        sync()
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
        losses.append(float(out.loss.detach()))  # host sync: logging only, after the timed region
        if i == 0 and getattr(out, "ce_loss", None) is not None:
            row["ce_loss_step0"] = float(out.ce_loss.detach())
    dt = statistics.median(times)
    fpt, _ = flops_per_token(model.config)
    tokens = ids.numel()
    row.update(
        status="ok", step_s_median=dt, step_s_all=times, tokens_per_s_per_gpu=tokens / dt,
        tflops_per_gpu=tokens / dt * fpt / 1e12, peak_mem_gib=_mem("max_memory_allocated"),
        peak_reserved_gib=_mem("max_memory_reserved"), loss_step0=losses[0], final_loss=losses[-1],
    )  # fmt: skip
    save()
    row["phases_ms"] = _phases(model, opt, ids)
    save()
    row["profile"] = profile_steps(step, sync, OUT / f"profile_{variant}.txt", cuda=DEV == "cuda")
    del opt
    return row


def _mem(fn: str) -> float:
    return getattr(torch.cuda, fn)() / 2**30 if DEV == "cuda" else 0.0


def _phases(model, opt, ids) -> dict:
    acc = {"forward": [], "backward": [], "optimizer": []}
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        sync()
        t1 = time.perf_counter()
        out.loss.backward()
        sync()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t3 = time.perf_counter()
        for k, v in zip(acc, (t1 - t0, t2 - t1, t3 - t2)):
            acc[k].append(v * 1e3)
    return {k: statistics.median(v) for k, v in acc.items()}


@part("hf_build_and_save")
def build_hf():
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(**SHAPES)
    torch.manual_seed(0)
    with torch.device(DEV):
        hf = AutoModelForCausalLM.from_config(
            cfg, dtype=torch.bfloat16, experts_implementation="grouped_mm", attn_implementation="sdpa"
        )
    hf.to(DEV)  # a no-op unless from_config ignored the default device
    fpt, n_active = flops_per_token(cfg)
    RESULT["workload"].update(
        num_params=sum(p.numel() for p in hf.parameters()), active_matmul_params=n_active, flops_per_token=fpt
    )
    t0 = time.perf_counter()
    hf.save_pretrained(CKPT)
    RESULT["workload"]["save_s"] = time.perf_counter() - t0
    return hf


@part("hf_baseline")
def run_hf(hf, ids):
    bench(hf, "hf_baseline", "baseline", ids, {"config": {"experts_implementation": "grouped_mm", "attn": "sdpa"}})


@part("moe_tune_load")
def load_moe_tune(hf):
    import moe_tune

    t0 = time.perf_counter()
    try:
        model = moe_tune.AutoModelForCausalLM.from_pretrained(str(CKPT), dtype=torch.bfloat16, device=DEV)
        how = "moe_tune.AutoModelForCausalLM.from_pretrained"
    except Exception as e:
        # Keep the speed measurement even if the loader breaks: same modules, weights copied from the HF model.
        RESULT["errors"].append({"part": "moe_tune_from_pretrained", "status": f"error: {type(e).__name__}: {e}"[:500]})
        traceback.print_exc()
        if hf is None:
            raise
        from moe_tune.models.model import ModelOptions, build_model, materialize

        model = build_model(hf.config, ModelOptions(dtype=torch.bfloat16))
        materialize(model, DEV)
        model.load_state_dict(hf.state_dict(), strict=True)
        how = "fallback: build_model + load_state_dict from the HF model (weights after its benchmark steps)"
    RESULT["workload"]["moe_tune_load_s"] = time.perf_counter() - t0
    RESULT["workload"]["moe_tune_load"] = how
    return model


@part("moe_tune")
def run_moe_tune(model, ids):
    bench(model, "moe_tune", "moe_tune", ids, {"config": {"comm": "all_to_all", "kernels": "torch", "ep": 1}})


def source_hash() -> str:
    h = hashlib.sha256()
    for p in sorted(Path("moe_tune").rglob("*.py")):
        h.update(str(p).encode() + p.read_bytes())
    return h.hexdigest()[:16]


def main() -> None:
    import transformers

    OUT.mkdir(parents=True, exist_ok=True)
    RESULT.update(
        hardware=f"1 x {torch.cuda.get_device_name() if DEV == 'cuda' else 'CPU (smoke run)'}", num_gpus=1, commit=os.environ.get("COMMIT", "unknown"),
        working_tree_dirty=os.environ.get("DIRTY", "unknown"), moe_tune_source_sha256=source_hash(),
        versions={"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__},
        workload={"model": "qwen3_30b_a3b", "num_layers": 8, "seq_len": SEQ, "micro_batch_size": 1,
                  "global_batch_size": 1, "precision": "bf16 params, fused AdamW (lr 1e-5, betas 0.9/0.95)",
                  "activation_checkpointing": "none", "routing": "real", "warmup_steps": WARMUP, "timed_steps": STEPS},
        flop_formula="6 * N_active + 6 * L * (n_heads * head_dim) * S per token; N_active: q,k,v,o + router + "
        "top_k * 3 * D * I per layer, + lm_head V * D",
        reference=REFERENCE,
        notes="moe_tune's loss adds router_aux_loss_coef * aux loss (transformers computes none with "
        "output_router_logits=False); moe_tune uses its chunked linear cross-entropy.",
    )  # fmt: skip
    save()
    experts_check()
    ids = torch.randint(0, SHAPES["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1)).to(DEV)
    hf = build_hf()
    if hf is not None:
        run_hf(hf, ids)
        hf.zero_grad(set_to_none=True)
        gc.collect()
        if DEV == "cuda":
            torch.cuda.empty_cache()
    model = load_moe_tune(hf)
    hf = None  # free the baseline's parameters before moe_tune's peak memory is measured
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()
    if model is not None:
        run_moe_tune(model, ids)
    summary()


def summary() -> None:
    """Compact findings first, the table last (the end of the output is what comes back)."""
    for r in RESULT["rows"]:
        prof = r.get("profile", {})
        print(r["variant"], "phases_ms", json.dumps(r.get("phases_ms")), "profile", json.dumps({
            k: prof.get(k) for k in ("device_ms_per_step_by_category", "device_busy_fraction",
                                     "kernel_launches_per_step", "host_syncs_per_step")}))  # fmt: skip
    ex = RESULT.get("experts_check", {})
    print(f"experts check pass: {ex.get('pass')}; grouped fwd+bwd {ex.get('grouped_fwd_bwd_ms', float('nan')):.2f} ms")
    print("errors:", [e["part"] + ": " + e["status"][:200] for e in RESULT["errors"]] or "none")
    print("\n| variant | status | tokens/s | TFLOP/s | peak GiB | reserved GiB | step ms | loss step0 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in RESULT["rows"]:
        if r["status"] != "ok":
            print(f"| {r['variant']} | {r['status']} | | | | | | |")
            continue
        print(
            f"| {r['variant']} | ok | {r['tokens_per_s_per_gpu']:,.0f} | {r['tflops_per_gpu']:.1f} | "
            f"{r['peak_mem_gib']:.1f} | {r['peak_reserved_gib']:.1f} | {r['step_s_median'] * 1e3:.1f} | {r['loss_step0']:.4f} |"
        )
    print(f"| reference hf grouped_mm (H200.md) | | {REFERENCE['hf_grouped_mm_tokens_per_s']:,} | | 45.5 | | | |")


if __name__ == "__main__":
    main()
