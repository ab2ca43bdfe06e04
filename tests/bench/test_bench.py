"""``moe-tune-bench``: argument parsing, failure classification, the baseline's FLOP count and forced balanced
routing against moe_tune's, the report, and the whole benchmark end to end on the tiny model (CPU, 1 process)."""

from __future__ import annotations

import glob
import json
import os
import subprocess

import pytest
import torch
from transformers import AutoModelForCausalLM

from moe_tune.bench.baseline import apply_forced_balanced_routing, hf_flops_per_token
from moe_tune.bench.plans import parse_variants
from moe_tune.bench.report import markdown
from moe_tune.bench.runner import failure_reason, split_overrides
from moe_tune.bench.workload import finish_rows
from moe_tune.config import ConfigError
from moe_tune.metrics import flops_per_token
from moe_tune.models.model import build_model
from moe_tune.models.presets import PRESETS, preset_config
from tests.harness import PY
from tests.tiny import build_hf

ROW_FIELDS = {
    "variant",
    "kind",
    "status",
    "tokens_per_s_per_gpu",
    "tflops_per_gpu",
    "mfu",
    "peak_mem_gib",
    "peak_reserved_gib",
    "final_loss",
    "max_loss_diff_vs_baseline",
    "config",
}
WORKLOAD_FIELDS = {"model", "num_layers", "seq_len", "global_batch_size", "micro_batch_size", "precision", "routing"}


def test_split_overrides_keeps_brackets_and_quotes():
    assert split_overrides("a=1, b=[1,2],c='x,y'") == ["a=1", "b=[1,2]", "c='x,y'"]


def test_parse_variants_names():
    got = parse_variants("a2a:comm=all_to_all,parallel.ep=2;comm=deepep,parallel.ep=2;comm=deepep,parallel.ep=2")
    assert got == [
        ("a2a", ["comm=all_to_all", "parallel.ep=2"]),
        ("comm=deepep,ep=2", ["comm=deepep", "parallel.ep=2"]),
        ("comm=deepep,ep=2-2", ["comm=deepep", "parallel.ep=2"]),
    ]
    assert parse_variants(None) == [("moe_tune", [])]
    assert parse_variants("none") == []  # baselines or the peer only
    assert parse_variants("data.path=/a:b") == [("path=/a:b", ["data.path=/a:b"])]  # ':' after '=' is no name


@pytest.mark.parametrize("variants", ["ok:kernels.compile=true;...", "typo:kernels.compil=true"])
@pytest.mark.slow
def test_a_variant_that_does_not_compose_exits_2_before_any_row(tmp_path, cli_env, variants):
    """A placeholder or a typo in --variants: one line naming the row, exit 2, also for --dry-run (it printed
    a row named '=' for '...' before), nothing written."""
    cmd = [PY, "-m", "moe_tune.bench", "model=tiny_qwen3_moe", "--baselines", "none", "--variants", variants]
    r = subprocess.run([*cmd, "--dry-run", "--out", str(tmp_path / "o")], capture_output=True, text=True, env=cli_env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("moe-tune-bench: error: --variants row ") and not (tmp_path / "o").exists()


def test_loss_differences_against_a_named_reference():
    def row(name, kind, losses, status="ok"):
        return {"variant": name, "kind": kind, "status": status, "losses": losses, "tflops_per_gpu": None}

    rows = [row("hf", "baseline", [2.0, 1.0]), row("a2a", "moe_tune", [2.0, 1.1]), row("dead", "moe_tune", [], "oom")]
    assert finish_rows(rows, None, reference="a2a") == "a2a"
    assert rows[0]["max_loss_diff_vs_baseline"] == pytest.approx(0.1)
    assert rows[0]["max_loss_rel_diff_vs_reference"] == pytest.approx(0.1 / 1.1)
    assert rows[1]["max_loss_rel_diff_vs_reference"] == 0.0
    assert rows[2]["max_loss_rel_diff_vs_reference"] is None
    assert finish_rows(rows, None) == "hf"  # default: the first baseline that ran
    assert rows[1]["max_loss_rel_diff_vs_reference"] == pytest.approx(0.1)
    assert finish_rows(rows, None, reference="missing") is None


def test_failure_reason():
    assert failure_reason("...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 18.55 GiB", 1) == "oom"
    torchrun_tail = (
        "Traceback (most recent call last):\n"
        '  File "x.py", line 3, in <module>\n'
        "RuntimeError: deepep: buffer too small\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
        "============================================================\n"
    )
    assert failure_reason(torchrun_tail, 1) == "error: RuntimeError: deepep: buffer too small"
    assert failure_reason("moe-tune: error: parallel.ep (3) must divide 2", 2) == "error: parallel.ep (3) must divide 2"
    assert failure_reason("", -9) == "error: killed by signal 9"
    ranked = "[rank0]: Traceback (most recent call last):\n[rank0]: ModuleNotFoundError: No module named 'x'\n"
    progress = "Writing model shards: 100%|##########| 1/1 [00:00<00:00, 93.80it/s]\n"
    assert failure_reason(progress + ranked, 1) == "error: ModuleNotFoundError: No module named 'x'"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_hf_flops_per_token_equals_moe_tune(name):
    """The baseline's FLOP count (stacked HF experts + router added to the shared formula) equals moe_tune's."""
    overrides = {
        "num_hidden_layers": 2,
        **({"first_k_dense_replace": 1} if "first_k_dense_replace" in PRESETS[name] else {}),
    }
    ours = flops_per_token(build_model(preset_config(name, overrides)), 4096)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(preset_config(name, overrides))
    assert hf_flops_per_token(hf, 4096) == pytest.approx(ours, rel=1e-12)


def test_qwen3_30b_8_layers_flops_match_the_documented_figure():
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(preset_config("qwen3_30b_a3b", {"num_hidden_layers": 8}))
    assert hf_flops_per_token(hf, 4096) == pytest.approx(5.40e9, rel=0.01)  # shared/gpu/README.md


def test_forced_balanced_routing_matches_moe_tune_assignment():
    from moe_tune.moe.router import Router, RouterSpec

    hf = build_hf("qwen3_moe", num_hidden_layers=1)
    config = hf.config
    assert apply_forced_balanced_routing(hf) == 1
    router = hf.model.layers[0].mlp.gate
    x = torch.randn(10, config.hidden_size)
    _, weights, ids = router(x)
    spec = RouterSpec(num_experts=8, top_k=2, score="softmax", norm_topk_prob=True, force_balanced=True)
    ours = Router(spec, config.hidden_size)
    ours.weight.data.copy_(router.weight.data)
    w_ref, ids_ref, _, _ = ours(x)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(weights, w_ref.to(weights.dtype))


def test_the_baseline_adapter_splits_transformers_loss_for_the_trainers_step():
    """HFCausalLM: ``.loss`` is transformers' (CE over num_items_in_batch + coef x aux), ``.ce_loss`` the CE alone."""
    import torch.nn.functional as F

    from moe_tune.bench.baseline import HFCausalLM

    hf = build_hf("qwen3_moe", num_hidden_layers=1, output_router_logits=True, router_aux_loss_coef=0.01)
    config = hf.config
    ids = torch.randint(4, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :5] = -100  # a masked prompt
    normalizer = torch.tensor(7.0)  # the step's label tokens / dp, as the trainer passes it
    out = HFCausalLM(hf, aux_loss_coef=0.01)(ids, labels=labels, position_ids=None, loss_normalizer=normalizer)
    logits = hf(input_ids=ids).logits
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), reduction="sum")
    torch.testing.assert_close(out.ce_loss, ce / normalizer, rtol=1e-5, atol=1e-6)
    assert out.aux_loss is not None and out.aux_loss > 0
    torch.testing.assert_close(out.loss - out.ce_loss, 0.01 * out.aux_loss)


def test_the_baseline_keeps_no_copy_of_the_step():
    """The Transformers baseline and the NeMo peer are the Trainer with another builder."""
    from moe_tune.bench.baseline import Baseline
    from moe_tune.bench.peer import Peer  # importable without nemo_automodel: it is imported by its builder
    from moe_tune.train import Trainer

    for row in (Baseline, Peer):
        assert issubclass(row, Trainer)
        assert not {"train_step", "fit", "_loop", "_metrics_row"} & set(vars(row))


def test_the_peer_starts_from_the_preset_draw_of_the_other_rows(tmp_path):
    """A random preset reaches NeMo AutoModel as a Hugging Face checkpoint holding init_random's draw (NeMo's own
    from_config would draw other weights): read back, it equals the baseline's initialisation, in the run's
    parameter dtype. (With NeMo installed on CPU, the peer's loss curve matched moe_tune's to 2e-5 from it.)"""
    from moe_tune.bench.baseline import _num_experts
    from moe_tune.bench.peer import _preset_checkpoint
    from moe_tune.cli.train import compose, to_config
    from moe_tune.models.init import init_random

    small = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32}
    small |= {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "vocab_size": 256}
    cfg = to_config(compose([f"output_dir={tmp_path}", "model=qwen3_30b_a3b", "train.seed=3", "train.precision=bf16"]))
    hf_config = preset_config("qwen3_30b_a3b", small)
    path = _preset_checkpoint(cfg, hf_config, torch.bfloat16, rank=0)
    saved = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).state_dict()
    reference = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    init_random(reference, seed=3, num_experts=_num_experts(hf_config))
    expected = reference.state_dict()
    assert saved.keys() == expected.keys()
    for name, t in expected.items():
        assert saved[name].dtype == torch.bfloat16 or not t.is_floating_point(), name
        assert torch.equal(saved[name], t), name


def test_forced_balanced_routing_refuses_biased_routers():
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(
            preset_config("deepseek_v3", {"num_hidden_layers": 2, "first_k_dense_replace": 1})
        )
    with pytest.raises(ConfigError, match="DeepseekV3TopkRouter"):
        apply_forced_balanced_routing(hf)


def test_markdown_states_failures_and_skips():
    row = dict.fromkeys(ROW_FIELDS)
    result = {
        "hardware": "2 x NVIDIA H200",
        "world_size": 2,
        "date": "2000-01-01T00:00:00",
        "commit": "0" * 40,
        "versions": {"torch": "2.11"},
        "workload": {**dict.fromkeys(WORKLOAD_FIELDS, 1), "activation_checkpointing": "none", "steps": 20}
        | {"warmup_steps_excluded": 5, "model": "qwen3_30b_a3b", "num_layers": 8, "published_num_layers": 48},
        "flops_per_token": 5.4e9,
        "peak_tflops_per_gpu": 989.0,
        "peak_source": "datasheet",
        "reference_variant": None,
        "command": "moe-tune-bench x",
        "rows": [{**row, "variant": "deepep", "kind": "moe_tune", "status": "oom", "config": {"comm": "deepep"}}],
        "skipped": [{"variant": "nemo_automodel", "kind": "peer", "reason": "not importable"}],
    }
    text = markdown(result)
    assert "| deepep | moe_tune | oom | deepep |" in text
    assert "8 layers (of 48)" in text and "989 TFLOP/s" in text and "nemo_automodel (peer): not importable" in text
    assert "No reference row ran" in text and "against `None`" not in text
    assert "(causal attention) = 5.4e+09." in text
    # No row ran, so nothing counted the FLOPs: the line says so instead of ending in "= ."
    assert "= not counted (no row ran)." in markdown({**result, "flops_per_token": None})
    assert "20 steps, medians after the first 5." in text
    # As summary.json's medians: every step when none is past train.warmup_steps_excluded, which the line says.
    short = markdown({**result, "workload": {**result["workload"], "steps": 3, "warmup_steps_excluded": 3}})
    assert "3 steps, medians of all 3 (none past train.warmup_steps_excluded=3, so none left out)." in short


@pytest.mark.slow
def test_bench_end_to_end_tiny(tmp_path, cli_env):
    out = tmp_path / "results"
    cmd = [PY, "-m", "moe_tune.bench", "model=tiny_qwen3_moe", "train.steps=2", "train.seq_len=64"]
    cmd += ["train.warmup_steps_excluded=0", "train.precision=fp32", "--baselines", "grouped_mm"]
    cmd += ["--variants", "a2a:comm=all_to_all", "--nproc", "1", "--peer", "automodel", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=cli_env, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (path,) = glob.glob(str(out / "bench-*.json"))
    result = json.loads(open(path).read())
    assert {"hardware", "num_gpus", "commit", "versions", "workload", "rows"} <= set(result)
    assert {"torch", "transformers"} <= set(result["versions"])
    assert WORKLOAD_FIELDS <= set(result["workload"]) and result["workload"]["routing"] == "real"
    assert result["complete"] is True
    rows = {row["variant"]: row for row in result["rows"]}
    assert [(v, rows[v]["kind"], rows[v]["status"]) for v in rows] == [
        ("hf_grouped_mm", "baseline", "ok"),
        ("a2a", "moe_tune", "ok"),
    ]
    for row in rows.values():
        assert ROW_FIELDS <= set(row)
        assert {"comm", "kernels", "ep"} <= set(row["config"])
        assert row["tokens_per_s_per_gpu"] > 0 and len(row["losses"]) == 2
        assert os.path.isfile(os.path.join(row["run_dir"], "metrics.jsonl"))
    # The baseline trains with PyTorch's fused AdamW (what its users run), moe_tune with its compiled update.
    optims = {v: json.load(open(os.path.join(rows[v]["run_dir"], "config.json")))["optim"] for v in rows}
    assert not optims["hf_grouped_mm"]["compiled"] and optims["a2a"]["compiled"]
    # Same weights, data and loss in fp32: the two stacks agree closely; same FLOP formula for both.
    assert rows["a2a"]["max_loss_diff_vs_baseline"] < 1e-3
    assert rows["a2a"]["flops_per_token"] == pytest.approx(rows["hf_grouped_mm"]["flops_per_token"])
    if importlib_missing("nemo_automodel"):
        assert result["skipped"][0]["kind"] == "peer" and "not importable" in result["skipped"][0]["reason"]
    stem = os.path.splitext(path)[0]
    assert os.path.getsize(stem + ".png") > 0
    assert "| a2a | moe_tune | ok |" in open(stem + ".md").read()


def importlib_missing(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None


@pytest.mark.parametrize("base", ["nf4", "fp8"])
def test_a_quantized_base_in_the_overrides_is_shown_in_variants_syntax_that_runs(base, tmp_path, capsys):
    """The refusal of a quantized base given to every row shows the --variants form with the user's value (it said
    'give it in --variants' alone), and that form is accepted."""
    import re
    import shlex

    from moe_tune.cli.bench import main

    out = ["--out", str(tmp_path / "out")]
    assert main(["peft=lora", f"peft.quantize_base={base}", *out]) == 2
    err = capsys.readouterr().err
    shown = re.search(r"--variants ('[^']*')", err).group(1)
    assert shown == f"'qlora_{base}:peft=lora,peft.quantize_base={base}'"
    assert main(["peft=lora", "--variants", *shlex.split(shown), "--dry-run", *out]) == 0
    assert f"qlora_{base} (moe_tune): " in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--baselines", "none", "--variants", "none"], "no rows to run"),
        (["--baselines", "grouped_mm_nofsdp", "--nproc", "2"], "hf_grouped_mm_nofsdp: the plain Transformers model"),
        (["--baselines", "grouped_mm_nofsdp", "--nproc", "1"], "got bf16_fp32_master"),  # the default precision
        # A bf16 base would run under the quantized row's name.
        (["peft=lora", "peft.quantize_base=nf4", "--baselines", "grouped_mm"], "has no Transformers + PEFT baseline"),
        # A misspelt baseline exited 1; --nproc 0 ran on the default count, --nproc -2 gave torchrun -2 ranks.
        (["--baselines", "grouped_mn"], "--baselines 'grouped_mn' is not one of grouped_mm, eager"),
        (["--nproc", "0"], "--nproc 0: give the ranks per row, >= 1"),
        (["--nproc", "-2"], "--nproc -2: give the ranks per row, >= 1"),
        (["--timeout-s", "0"], "--timeout-s 0: give each row's time limit in seconds, > 0"),
        (["--peer", "automodel", "--peer-ep", "0"], "--peer-ep 0: give NeMo AutoModel's EP size, >= 1"),
        (["--peak-tflops", "-1"], "--peak-tflops -1: give the per-GPU peak TFLOP/s, > 0"),
        # The line ended in the overrides the benchmark adds itself (checkpoint.every=0 ...), never typed.
        (["train.stepz=1"], "moe-tune-bench: error: train.stepz is not a config key; did you mean train.steps"),
    ],
)
def test_unrunnable_row_sets_stop_before_any_row(argv, words, tmp_path, capsys):
    from moe_tune.cli.bench import main

    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err
    assert "checkpoint.save_on_signal" not in err
    assert not (tmp_path / "out").exists()


def test_the_bnb4_row_is_qlora_on_one_process_or_skipped_without_bitsandbytes(monkeypatch, capsys, tmp_path):
    """--baselines bnb4: a Transformers + PEFT row on bitsandbytes 4-bit linears (one process, peft=lora), skipped
    with its reason where bitsandbytes is missing; refused before any row for a full fine-tune."""
    import argparse
    import importlib.util

    from moe_tune.bench import plans
    from moe_tune.cli.bench import main
    from moe_tune.cli.train import compose, to_config

    args = argparse.Namespace(baselines="bnb4", variants="none", peer="none")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    built, skipped = plans.build_plans(args, [])
    assert not built and skipped[0]["variant"] == "hf_bnb4" and "pip install bitsandbytes" in skipped[0]["reason"]
    monkeypatch.undo()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    built, _ = plans.build_plans(args, [])
    assert [(p.name, p.args) for p in built] == [("hf_bnb4", ["--bnb4"])]
    lora = to_config(compose(["peft=lora", "peft.quantize_base=nf4"]))  # bitsandbytes' own way: no refusal
    assert plans.plans_problem(built, [], lora, 1) is None
    assert "one process" in plans.plans_problem(built, [], lora, 2)
    assert main(["--baselines", "bnb4", "--variants", "none", "--out", str(tmp_path / "out")]) == 2
    assert "hf_bnb4: QLoRA through bitsandbytes runs peft=lora" in capsys.readouterr().err


def test_bnb4_quantizes_the_linears_and_leaves_the_fused_experts():
    """quantize_linears_4bit does what transformers' BitsAndBytesConfig does: attention linears to Linear4bit,
    lm_head and the fused 3-D expert tensors untouched (bitsandbytes' CPU backend)."""
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (the bnb4 baseline row's)")
    from moe_tune.bench.peft_baseline import quantize_linears_4bit

    model = build_hf("qwen3_moe", torch.bfloat16)
    linears = sum(
        m.weight.numel() for n, m in model.named_modules() if type(m) is torch.nn.Linear and "lm_head" not in n
    )
    assert quantize_linears_4bit(model, "cpu") == linears
    assert isinstance(model.model.layers[0].self_attn.q_proj, bnb.nn.Linear4bit)
    assert type(model.lm_head) is torch.nn.Linear
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
