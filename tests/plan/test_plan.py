"""moe-tune-plan: what a rank holds (against a built model and the sharding arithmetic), activations by
checkpointing mode, pinned predictions for fixed configurations (a change to the model or the engine's memory shows
up here as a diff, and against the measured H200 figure), the search and the command line."""

from __future__ import annotations

import json
import math

import pytest
import torch

from moe_tune.cli.plan import main as plan_main
from moe_tune.config.overrides import check, to_config
from moe_tune.models.presets import build_tokenizer
from moe_tune.plan import plan, search
from moe_tune.plan.memory import GIB
from tests.tiny import FAMILIES, tiny_config


def _cfg(*overrides: str):
    return to_config(check(list(overrides)))


def _built_bytes(hf_config, cfg) -> int:
    from moe_tune.build import assemble, model_options
    from moe_tune.distributed.dims import ParallelDims

    model = assemble(hf_config, model_options(cfg, ParallelDims(1, 1, 1, 1)), lambda m: None, "cpu")
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("family", FAMILIES)
def test_one_rank_holds_what_the_built_model_holds(family):
    hf = tiny_config(family)
    for cfg in (_cfg(), _cfg("peft=lora")):
        p = plan(cfg, 1, hf_config=hf)
        assert p.census.params == _built_bytes(hf, cfg)
        assert 0 < p.census.trained <= p.census.params


def _hf_counts(hf) -> tuple[int, int]:
    """(total, active) of transformers' model of ``hf``: active drops each experts module's parameters times
    (E - top-k) / E, the experts a token does not run."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        ref = AutoModelForCausalLM.from_config(hf)
    E = getattr(hf, "num_local_experts", None) or hf.num_experts
    routed = sum(p.numel() for m in ref.modules() if type(m).__name__.endswith("Experts") for p in m.parameters())
    return ref.num_parameters(), ref.num_parameters() - routed * (E - hf.num_experts_per_tok) // E


@pytest.mark.parametrize("family", FAMILIES)
def test_parameter_counts_are_transformers_whatever_the_layout(family):
    """The plan's total and active parameters are transformers' counts, under EP (a rank builds its share of the
    experts) and LoRA (adapters are not the model's) alike."""
    hf = tiny_config(family)
    for world, overrides in ((1, ()), (2, ("parallel.ep=2",)), (1, ("peft=lora",))):
        census = plan(_cfg(*overrides), world, hf_config=hf).census
        assert (census.total_params, census.active_params) == _hf_counts(hf), overrides


@pytest.mark.parametrize("base", ["fp8", "nf4"])
def test_a_quantized_base_counts_its_experts_unquantized(base):
    hf = tiny_config("qwen3_moe", hidden_size=64, moe_intermediate_size=64)
    census = plan(_cfg("peft=lora", f"peft.quantize_base={base}"), 1, hf_config=hf).census
    assert (census.total_params, census.active_params) == _hf_counts(hf)


@pytest.mark.parametrize("world,ep", [(4, 1), (4, 2), (4, 4), (8, 2)])
def test_a_rank_holds_its_expert_block_and_its_fsdp_shard(world, ep):
    """Rank 0's bytes equal the layout's arithmetic: its E/ep experts, dim-0 sharded over efsdp (whole when
    efsdp = 1: experts outside FSDP2), every other parameter dim-0 sharded over dp_shard (FSDP2's ceil)."""
    hf = tiny_config("qwen3_moe")
    cfg = _cfg(f"parallel.ep={ep}")
    p = plan(cfg, world, hf_config=hf)
    from moe_tune.models.model import build_model

    whole = build_model(hf)  # meta, every expert, fp32 as bf16_fp32_master stores them
    efsdp = world // ep
    want = 0
    for name, t in whole.named_parameters():
        rows = t.shape[0]
        if ".experts." in name:
            rows //= ep
            shard = rows if efsdp == 1 else math.ceil(rows / efsdp)
        else:
            shard = math.ceil(rows / world)
        want += shard * (t.numel() // t.shape[0]) * t.element_size()
    assert p.census.params == want
    assert p.census.local_experts == 8 // ep


def test_checkpointing_keeps_less_and_full_keeps_each_layers_input():
    hf = tiny_config("qwen3_moe")
    kept = {}
    for mode in ("none", "selective", "full"):
        p = plan(_cfg(f"parallel.activation_checkpointing={mode}"), 1, hf_config=hf)
        kept[mode] = p.memory.parts["activations"]
    assert kept["none"] > kept["selective"] > kept["full"] > 0
    acts_outside = kept["full"] - 2 * hf.hidden_size * hf.num_hidden_layers * 4 * 256
    assert 0 <= acts_outside < kept["full"]  # each layer keeps its bf16 input; the rest is after the last layer


def test_expert_parallel_worst_case_and_comm_buffers():
    hf = tiny_config("qwen3_moe")
    a2a = plan(_cfg("parallel.ep=2"), 2, hf_config=hf)
    assert a2a.memory.worst_case_peak > a2a.memory.peak
    assert a2a.memory.outside_allocator == 0
    symm = plan(_cfg("parallel.ep=2", "comm=symm_mem"), 2, hf_config=hf)
    assert symm.memory.outside_allocator > 0  # NVSHMEM's buffers are not torch's
    assert symm.memory.parts["activations"] > a2a.memory.parts["activations"]  # rows padded to its capacity
    assert a2a.speed["parts_s"]["expert_parallel_comm"] > 0


# (overrides, GPUs, pinned peak GiB, pinned tokens/s/GPU, measured peak GiB on H200: benchmarks/plan_rows.json)
PINNED = [
    (
        ("experiment=qwen3_30b_a3b_1gpu", "train.precision=bf16", "train.micro_batch_size=4", "kernels.compile=true"),
        1,
        53.44,
        67901.0,
        53.23,
    ),
    (
        ("experiment=qwen3_30b_a3b_lora_1gpu", "parallel.activation_checkpointing=full", "kernels.compile=true"),
        1,
        68.519,
        11366.8,
        69.59,
    ),
    (
        ("experiment=qwen3_30b_a3b_ep2_fast", "train.precision=bf16", "train.micro_batch_size=1"),
        2,
        27.317,
        31695.6,
        26.8,
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("overrides,gpus,peak,speed,measured", PINNED)
def test_pinned_predictions(overrides, gpus, peak, speed, measured):
    d = plan(_cfg(*overrides), gpus).as_dict()
    assert d["peak_gib"] == pytest.approx(peak, rel=2e-3)
    assert d["tokens_per_s_per_gpu"] == pytest.approx(speed, rel=2e-3)
    assert abs(d["peak_gib"] / measured - 1) <= 0.10


def test_search_lists_fitting_layouts_fastest_first_and_says_why_others_do_not_fit():
    cfg = _cfg("train.seq_len=2048")
    fitting, rejected = search(cfg, 4, gpu_mem_gib=4.0, headroom=0.1, max_micro_batch=64)
    assert fitting and rejected
    speeds = [p.speed["tokens_per_s_per_gpu"] for p in fitting]
    assert speeds == sorted(speeds, reverse=True)
    assert all(p.memory.reserved / GIB <= 4.0 * 0.9 for p in fitting)
    assert {p.census.dims.ep for p in fitting} <= {1, 2, 4}  # divisors of both 8 experts and 4 GPUs
    assert all("GiB" in why for _, why in rejected)
    too_big = [lay for lay, _ in rejected]
    for lay in too_big:  # a rejected micro-batch is the smallest that failed on its line: none larger was tried
        same = [
            q
            for q in fitting
            if (q.census.dims.ep, q.config.parallel.activation_checkpointing)
            == (lay["ep"], lay["activation_checkpointing"])
        ]
        assert all(q.config.train.micro_batch_size < lay["micro_batch_size"] for q in same)


def test_search_of_equal_speeds_takes_the_least_recompute_first_and_drops_what_saves_nothing(monkeypatch):
    """LoRA on the tiny model is host-bound: the checkpointing modes predict one speed, though a recompute adds its
    launches (not in the model). Where a recompute saves no memory either (to the 0.1 GiB a row shows), its row
    is left out: only none stays. Where each saves memory, the order is none, selective, full, whatever order they
    were tried in."""
    import moe_tune.plan as plan_module

    fitting, _ = search(_cfg("peft=lora"), 1, vary=("parallel.activation_checkpointing",))
    assert [p.config.parallel.activation_checkpointing for p in fitting] == ["none"]
    saved = {"none": 0.0, "selective": 0.5, "full": 1.0}  # GiB a mode saves: rows that differ
    plan_of = plan_module.plan

    def saving(c, *args, **kwargs):
        p = plan_of(c, *args, **kwargs)
        p.memory.peak -= int(saved[c.parallel.activation_checkpointing] * 2**30)
        return p

    monkeypatch.setattr(plan_module, "plan", saving)
    fitting, _ = search(_cfg("peft=lora"), 1, vary=("parallel.activation_checkpointing",))
    speeds = [round(p.speed["tokens_per_s_per_gpu"]) for p in fitting]
    assert len(set(speeds)) == 1, speeds
    assert [p.config.parallel.activation_checkpointing for p in fitting] == ["none", "selective", "full"]


def test_cli_search_holds_the_layout_keys_given(capsys):
    """--search varies only the layout keys the overrides leave open; a key given as auto is searched without
    --search (as moe-tune takes it)."""
    assert plan_main(["--search", "--gpus", "4", "parallel.ep=2", "--json", "--max-micro-batch", "2"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["searched"] == ["parallel.activation_checkpointing", "train.micro_batch_size"]
    assert {f["layout"]["ep"] for f in d["fits"]} == {2}
    assert plan_main(["--gpus", "4", "train.micro_batch_size=auto", "--max-micro-batch", "4"]) == 0
    out = capsys.readouterr().out
    first, second = out.splitlines()[:2]
    assert first.startswith("tiny_qwen3_moe (4 layers, ") and "experts, top-" in first  # the model, as without --search
    assert (
        second
        == "layouts of 4 GPU(s) that fit, fastest first (parallel.ep, parallel.activation_checkpointing as given):"
    )
    assert {line.split()[1] for line in out.splitlines() if line.startswith("  ep=")} == {
        "mb=1",
        "mb=2",
        "mb=3",
        "mb=4",
    }


def test_cli_piped_into_head_ends_quietly():
    """``moe-tune-plan ... | head -1``: the reader has closed the pipe before the plan is printed (``true`` reads
    nothing); no BrokenPipeError traceback, and the plan's exit code."""
    import subprocess
    import sys

    cmd = f"{sys.executable} -m moe_tune.cli.plan --search --gpus 4 --json | true; exit ${{PIPESTATUS[0]}}"
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_cli_prints_one_json_object(capsys):
    import sys

    hook = sys.excepthook
    # flags and overrides in any order, as moe-tune takes them
    assert plan_main(["--gpus", "2", "parallel.ep=2", "--json", "train.micro_batch_size=2"]) == 0
    # the fake process group's excepthook (a "[rank0]:" prefix on a traceback's lines) goes with the group: not one
    # more prefix per plan
    assert sys.excepthook is hook
    d = json.loads(capsys.readouterr().out)
    assert d["layout"]["micro_batch_size"] == 2 and d["layout"]["ep"] == 2 and d["gpus"] == 2
    assert d["peak_gib"] > 0 and d["fits"]
    # the model moe-tune trains: the tiny preset takes its local tokenizer's vocabulary, as build_tiny_checkpoint does
    assert d["shape"]["vocab"] == len(build_tokenizer()) and d["shape"]["layers"] == 4
    assert set(d["breakdown_gib"]) >= {"parameters", "optimizer_state", "gradients", "activations", "loss_chunk"}


def test_cli_refuses_bad_input_with_one_line(capsys):
    assert plan_main(["train.micro_batch_size=0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moe-tune-plan: error:") and "micro_batch_size" in err[0]
    assert plan_main(["parallel.ep=3", "--gpus", "4"]) == 2
    assert "parallel.ep" in capsys.readouterr().err
    for flags, named in (
        (["--gpu-mem-gib", "0"], "--gpu-mem-gib"),
        (["--gpu-mem-gib", "nan"], "--gpu-mem-gib nan"),
        (["--gpu-mem-gib", "inf"], "--gpu-mem-gib inf"),
        (["--headroom", "1.5"], "--headroom"),
        (["--search", "--max-micro-batch", "0"], "--max-micro-batch"),
        (["model=hf", "model.path=/nonexistent/ckpt"], "/nonexistent/ckpt"),
    ):
        assert plan_main(flags) == 2, flags
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and named in err[0], err


def test_a_search_refuses_a_base_the_experts_dims_cannot_hold_once(monkeypatch, capsys):
    """peft.quantize_base=fp8 on experts of hidden 40 (not a multiple of 16) fails every layout alike: --search and
    moe-tune's auto give moe-tune's one line and exit 2, not every layout rejected, exit 3 and "use more GPUs"."""
    from moe_tune.config import ConfigError
    from moe_tune.plan.auto import resolve

    bad = ["peft=lora", "peft.quantize_base=fp8", "+model.overrides.moe_intermediate_size=40"]
    said = "peft.quantize_base=fp8 needs the model dim (128) and the expert hidden dim (40) to be multiples of 16"
    assert plan_main([*bad, "--search", "--max-micro-batch", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError) as e:
        resolve([*bad, "parallel.activation_checkpointing=auto"])
    assert said in str(e.value) and "no layout" not in str(e.value)


def test_cli_says_when_a_layout_does_not_fit_and_exits_3(capsys):
    assert plan_main(["--gpu-mem-gib", "0.05"]) == 3
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "GiB" in out
    assert plan_main(["--gpu-mem-gib", "0.05", "--search", "--max-micro-batch", "2"]) == 3
    out = capsys.readouterr().out
    assert "fastest first:\n  none\nrejected:\n  ep=1 mb=1" in out


@pytest.mark.parametrize(
    "family,dense", [("qwen2_moe", {"decoder_sparse_step": 2}), ("qwen3_moe", {"mlp_only_layers": [1]})]
)
def test_a_qwen_moe_dense_layer_keeps_activations(family, dense):
    """A dense layer between MoE layers (decoder_sparse_step > 1, mlp_only_layers) is measured as one: two layers
    of which one is dense keep more than the one MoE layer alone (the dense layer counted, not taken as zero)."""
    cfg = _cfg()
    both = plan(cfg, 1, hf_config=tiny_config(family, num_hidden_layers=2, **dense))
    alone = plan(cfg, 1, hf_config=tiny_config(family, num_hidden_layers=1))
    assert both.census.moe_layers == alone.census.moe_layers == 1
    assert both.memory.parts["activations"] > alone.memory.parts["activations"]


@pytest.mark.parametrize(
    "family,dense", [("qwen3_moe", {"mlp_only_layers": [0, 1]}), ("deepseek_v3", {"first_k_dense_replace": 2})]
)
def test_a_model_whose_layers_are_all_dense_is_planned(family, dense):
    """A checkpoint of a MoE family with no MoE layer (every layer in mlp_only_layers, or first_k_dense_replace
    past the last), which moe-tune trains, is planned too, under EP as well: no expert FLOPs at no expert rate."""
    hf = tiny_config(family, **dense)
    for world, overrides in ((1, ()), (2, ("parallel.ep=2",))):
        p = plan(_cfg(*overrides), world, hf_config=hf)
        assert p.census.moe_layers == 0 and p.speed["tokens_per_s_per_gpu"] > 0


def test_activations_do_not_depend_on_the_measured_length():
    """Per-token bytes come out the same from a model measured at two lengths (flash-like attention)."""
    from moe_tune.build import model_options
    from moe_tune.distributed.dims import ParallelDims
    from moe_tune.plan import _activation_options
    from moe_tune.plan import activations as A

    hf = tiny_config("qwen3_moe")
    cfg = _cfg()
    options = _activation_options(cfg, ParallelDims(1, 1, 1, 1))
    assert options.dtype == torch.bfloat16 and model_options(cfg, ParallelDims(1, 1, 1, 1)).dtype == torch.float32
    a = A.measure(hf, options)
    assert a.moe.attention > 0 and a.moe.rest > a.moe.routed > 0


def test_auto_takes_the_fastest_layout_that_fits(monkeypatch):
    from moe_tune.plan.auto import resolve

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    got = resolve(["train.seq_len=2048", "parallel.ep=auto", "train.micro_batch_size=auto"])
    fitting, _ = search(_cfg("train.seq_len=2048"), 4, vary=("parallel.ep", "train.micro_batch_size"))
    best = fitting[0]
    want = [f"parallel.ep={best.census.dims.ep}", f"train.micro_batch_size={best.config.train.micro_batch_size}"]
    assert got == ["train.seq_len=2048", *want]
    assert "parallel.activation_checkpointing=none" not in got  # a key not asked for is left as given


def test_auto_through_moe_tunes_command_line(monkeypatch, capsys):
    from moe_tune.cli.train import precheck

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = precheck(["parallel.activation_checkpointing=auto", "train.steps=1", "output_dir=/nonexistent/never"])
    ac = [a for a in argv if a.startswith("parallel.activation_checkpointing=")]
    assert ac == ["parallel.activation_checkpointing=none"]  # the tiny model fits an H200 without checkpointing
    assert "moe-tune: auto: parallel.activation_checkpointing=none" in capsys.readouterr().err
    precheck(["train.micro_batch_size=auto", "train.steps=1", "output_dir=/nonexistent/never"])
    # no train.global_batch_size given: the micro-batch sets the global batch, and the line says so
    assert "the global batch is then" in capsys.readouterr().err


def test_auto_without_a_gpu_plans_against_the_host_memory_the_run_has(monkeypatch, capsys):
    """Without a GPU the run trains on the CPU in this process's share of the host memory: auto plans against that
    (it planned against an H200's 140 GiB) and says so."""
    from moe_tune.config import ConfigError
    from moe_tune.plan.auto import resolve

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr("moe_tune.plan.auto.gpu_memory_gib", lambda: None)
    monkeypatch.setattr("moe_tune.models.host_memory.available_bytes", lambda: 12 * GIB)
    seen = []
    monkeypatch.setattr(
        "moe_tune.plan.search", lambda cfg, gpus, mem, **kw: seen.append(mem) or search(cfg, gpus, mem, **kw)
    )
    resolve(["parallel.activation_checkpointing=auto"])
    assert seen == [6.0]  # 12 GiB available, shared by the node's 2 processes
    line = capsys.readouterr().err
    assert "GiB peak of 6 GiB of host memory, this process's share (no GPU visible: the run trains on the CPU)" in line
    # the speed model's rates are an H200's: no tokens/s is promised for the CPU
    assert "the fastest that fits by the planner's H200 rates" in line and "tokens/s" not in line
    monkeypatch.setattr("moe_tune.models.host_memory.available_bytes", lambda: GIB // 8)
    with pytest.raises(ConfigError, match=r"no layout of 2 process\(es\) of 0 GiB of host memory"):
        resolve(["train.micro_batch_size=auto", "parallel.activation_checkpointing=auto"])


def test_auto_refuses_a_sweep_and_a_layout_that_cannot_fit(monkeypatch):
    from moe_tune.config import ConfigError
    from moe_tune.plan.auto import resolve

    with pytest.raises(ConfigError, match="sweep"):
        resolve(["train.micro_batch_size=auto"], multirun=True)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr("moe_tune.plan.auto.gpu_memory_gib", lambda: 0.25)
    with pytest.raises(ConfigError, match="no layout of 1 GPU"):
        resolve(["train.micro_batch_size=auto", "parallel.activation_checkpointing=auto"])


def test_a_search_none_of_whose_layouts_can_run_is_the_configurations_error(monkeypatch, capsys):
    """A held ep not dividing the experts under --search, a global batch no micro-batch divides under auto: every
    layout tried is invalid, so the plan and moe-tune say that error (one line, exit 2), not that nothing fits
    (exit 3, a list of the same error) or "use more GPUs, peft=lora" (auto)."""
    from moe_tune.config import ConfigError
    from moe_tune.plan.auto import resolve

    assert plan_main(["--search", "--gpus", "6", "parallel.ep=3"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        "moe-tune-plan: error: the model's number of experts (8) must be divisible by parallel.ep (3); "
        "try parallel.ep=2"
    ]
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match=r"^train.global_batch_size \(6\) must be a multiple of"):
        resolve(["train.global_batch_size=6", "parallel.ep=auto"])
    # only the micro-batches dividing each rank's share of the global batch (8 / 4 ranks) are tried
    fitting, rejected = search(_cfg("train.global_batch_size=8"), 4, vary=("train.micro_batch_size",))
    assert [p.config.train.micro_batch_size for p in fitting] == [2, 1] and rejected == []


def test_search_tries_every_micro_batch_dividing_a_ranks_share_and_the_max_given():
    """A global batch of 24 on 4 ranks (6 rows each) takes micro-batches 1, 2, 3 and 6; without one, every
    micro-batch up to --max-micro-batch (12 included) runs. Powers of two alone missed 3, 6 and 12."""
    from moe_tune.plan import candidates

    def tried(*overrides, max_micro_batch=16):
        cfg = _cfg(*overrides)
        layouts = candidates(cfg, 4, 8, max_micro_batch, vary=("train.micro_batch_size",))
        return [c.train.micro_batch_size for c in layouts]

    assert tried("train.global_batch_size=24") == [1, 2, 3, 6]
    assert tried("train.global_batch_size=24", max_micro_batch=4) == [1, 2, 3]
    assert tried(max_micro_batch=12) == list(range(1, 13))
    fitting, _ = search(_cfg("train.global_batch_size=24"), 4, vary=("train.micro_batch_size",))
    assert sorted(p.config.train.micro_batch_size for p in fitting) == [1, 2, 3, 6]


def test_auto_with_a_dispatch_backend_picks_a_layout_that_uses_it(monkeypatch):
    """comm=deepep (or comm.overlap=true) needs expert parallelism: auto and --search must not offer parallel.ep=1,
    which moe-tune then refuses ("comm=deepep needs expert parallelism")."""
    from moe_tune.config import validate
    from moe_tune.plan.auto import resolve

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    for comm, why in (("comm=deepep", "comm=deepep needs expert parallelism"), ("comm.overlap=true", "has none")):
        got = resolve([comm, "parallel.ep=auto"])
        assert got == [comm, "parallel.ep=2"]
        validate(_cfg(*got), world_size=2, num_experts=8)  # the run takes it
        fitting, rejected = search(_cfg(comm), 2, vary=("parallel.ep",))
        assert [p.census.dims.ep for p in fitting] == [2]
        assert [lay["ep"] for lay, _ in rejected] == [1] and why in rejected[0][1]


def test_auto_plans_for_the_world_the_run_will_have(monkeypatch):
    """A lone moe-tune in an allocation's shell (salloc -n 8: SLURM_NTASKS without SLURM_PROCID) runs one process:
    auto planned 8 GPUs for it (parallel.ep=8, which the one-rank run then refused)."""
    from moe_tune.plan.auto import world_size

    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "8")
    assert world_size() == 1
    monkeypatch.setenv("SLURM_PROCID", "3")  # srun's task 3 of 8
    assert world_size() == 8
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's, first
    assert world_size() == 2


def test_a_plan_keeps_transformers_yarn_ratio_warning_back_and_the_run_still_gets_it(tiny_checkpoint, capsys):
    """A GPT-OSS config.json whose max_position_embeddings / original_max_position_embeddings is not its YaRN factor
    made every plan print transformers' warning about it: rotary frequencies, which no prediction depends on. The
    plan holds that one message back; a load outside the plan (the run's) still says it."""
    import logging
    import shutil

    from transformers import AutoConfig

    src = tiny_checkpoint("gpt_oss", num_hidden_layers=2)
    path = f"{src}_json"
    shutil.copytree(src, path)
    config = json.loads(open(f"{path}/config.json").read())
    config["max_position_embeddings"] = 72  # a ratio no earlier load has warned of (warning_once)
    with open(f"{path}/config.json", "w") as f:
        json.dump(config, f)
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    log = logging.getLogger("transformers.modeling_rope_utils")
    log.addHandler(handler)
    try:
        assert plan_main([f"model.path={path}", "--gpus", "1"]) == 0
        assert capsys.readouterr().out.startswith(f"{path} (2 layers, ")
        assert not [m for m in said if "original_max_position_embeddings" in m]
        AutoConfig.from_pretrained(path)
        assert [m for m in said if "implicit factor" in m and "0.017578125" in m]
    finally:
        log.removeHandler(handler)


def test_cli_plans_a_checkpoints_json_files_alone(tmp_path, tiny_checkpoint, capsys):
    """``hf download <id> --include '*.json'`` (config.json and the shard index, no weights) is what a laptop plans
    from: the plan reads no weights, so it plans it (moe-tune's check refused it as an interrupted download). A
    download with some of the index's shards missing is still refused."""
    import shutil

    src = tiny_checkpoint(num_hidden_layers=2)
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    meta = tmp_path / "meta"
    meta.mkdir()
    shutil.copy(f"{src}/config.json", meta)
    (meta / "model.safetensors.index.json").write_text(json.dumps(index))
    assert plan_main([f"model.path={meta}", "--gpus", "2"]) == 0
    assert capsys.readouterr().out.startswith(f"{meta} (2 layers, ")
    index["weight_map"]["lm_head.weight"] = "model.safetensors"  # one shard here, one not
    shutil.copy(f"{src}/model.safetensors", meta)
    (meta / "model.safetensors.index.json").write_text(json.dumps(index))
    assert plan_main([f"model.path={meta}", "--gpus", "2"]) == 2
    assert "names model-00001-of-00002.safetensors, which" in capsys.readouterr().err


def test_search_tries_the_expert_parallelism_that_dp_shard_holds():
    """ep borrows its ranks from dp_shard: with dp_replicate=2 on 4 GPUs (dp_shard 2) ep=4 is no layout to try
    (it was listed as rejected, "parallel.ep (4) must divide parallel.dp_shard (2, ...)")."""
    fitting, rejected = search(_cfg("parallel.dp_replicate=2"), 4, vary=("parallel.ep",))
    assert sorted(p.census.dims.ep for p in fitting) == [1, 2] and rejected == []


def test_auto_is_said_by_the_first_rank_of_an_srun_job_alone(monkeypatch, capsys):
    """srun's tasks (SLURM_PROCID, no RANK) each plan: the line is rank 0's, not one per task."""
    from moe_tune.plan.auto import resolve

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    for task, said in (("1", False), ("0", True)):
        monkeypatch.setenv("SLURM_PROCID", task)
        assert resolve(["parallel.ep=auto"]) == ["parallel.ep=1"]
        assert ("moe-tune: auto: parallel.ep=1" in capsys.readouterr().err) == said


def test_cli_names_an_adapter_as_moe_tune_does(tmp_path, capsys):
    """A PEFT adapter directory as model.path: moe-tune's line (its base model), not an unreadable config.json."""
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": "/b"}))
    assert plan_main([f"model.path={tmp_path}", "--gpus", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a PEFT LoRA adapter" in err[0] and "give model.path=/b" in err[0], err


def test_cli_plan_of_a_quantized_base_says_its_speed_is_bf16s(capsys):
    """The speed model counts a quantized base's GEMMs as bf16's: the plan says so, with the measured ratios."""
    assert plan_main(["peft=lora", "peft.quantize_base=nf4"]) == 0
    out = capsys.readouterr().out
    assert (
        "the speed counts the nf4 base's GEMMs as bf16's" in out
        and "nf4 0.65-0.71x" in out
        and "nf4 0.87x on one H200" in out
    )
    assert plan_main(["peft=lora"]) == 0
    assert "the speed counts" not in capsys.readouterr().out


def test_cli_plans_transformer_engine_as_the_torch_path_without_it(monkeypatch, capsys):
    """kernels=te is not modelled (docs/planning.md): planned as the torch path, on a machine without
    TransformerEngine too (the census built TE's layers: ModuleNotFoundError and a traceback)."""
    import sys

    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # not installed, as on a laptop
    assert plan_main(["kernels=te", "--gpus", "2", "--max-micro-batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "kernels=te: TransformerEngine's layers are not modelled, predicted as the torch path" in out
    assert plan_main(["kernels=te", "kernels.fp8=current", "--gpus", "2", "--search", "--max-micro-batch", "2"]) == 0


def test_cli_lora_search_that_fits_nowhere_tries_fp8_then_nf4_bases(capsys):
    """A LoRA search with no layout fitting on a bf16 base searches again with the frozen experts quantized and bf16
    adapters, FP8 first, NF4 where FP8 fits nowhere, and says what fits then (the full Qwen3-30B-A3B: 68.5 GiB on a
    bf16 base, about 37 with FP8, about 24 with NF4)."""
    args = [
        "model=qwen3_30b_a3b",
        "peft=lora",
        "train.seq_len=4096",
        "--gpus",
        "1",
        "--search",
        "--max-micro-batch",
        "1",
    ]
    assert plan_main([*args, "--gpu-mem-gib", "48", "--json"]) == 3  # a 48 GB card: FP8 is enough
    quantized = json.loads(capsys.readouterr().out)["quantized_base"]
    assert quantized["base"] == "fp8" and quantized["fits"] >= 1
    assert quantized["overrides"] == ["peft.quantize_base=fp8", "train.precision=bf16"]
    assert quantized["best"]["layout"]["quantize_base"] == "fp8" and quantized["best"]["reserved_gib"] < 46
    assert plan_main([*args, "--gpu-mem-gib", "40"]) == 3  # 40 GB: FP8 fits nowhere, NF4 does
    out = capsys.readouterr().out
    assert "with the frozen experts in NF4 and bf16 adapters (peft.quantize_base=nf4 train.precision=bf16), " in out
    assert float(out.split("best: ")[-1].split("(")[1].split(" GiB")[0]) < 38
    assert plan_main([*args, "--gpu-mem-gib", "40", "peft.quantize_base=fp8", "--json"]) in (0, 3)
    assert "quantized_base" not in json.loads(capsys.readouterr().out)  # a quantized base is the user's own choice


def test_plannings_auto_example_is_what_auto_says(monkeypatch, capsys):
    """docs/planning.md's `auto` line for the full Qwen3-30B-A3B on 8 H200s is the one the planner prints."""
    import re
    from pathlib import Path

    from moe_tune.plan.auto import resolve

    doc = (Path(__file__).parents[2] / "docs" / "planning.md").read_text()
    line = re.search(r"^moe-tune: auto: .*$", doc, re.M).group(0)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr("moe_tune.plan.auto.gpu_memory_gib", lambda: 139.8)  # an H200's, as torch reports it
    resolve(["model=qwen3_30b_a3b", "train.seq_len=4096", "parallel.ep=auto", "train.micro_batch_size=auto"])
    assert capsys.readouterr().err.strip() == line


@pytest.mark.parametrize(
    "family, edit, said",
    [
        ("qwen3_moe", {"num_experts": 16}, "num_experts=16 but the safetensors weights beside it hold 8"),
        ("gpt_oss", {"num_local_experts": 4}, "num_local_experts=4 but the safetensors weights beside it hold 8"),
        ("qwen3_moe", {"hidden_size": 64}, "hidden_size=64 but the safetensors weights beside it hold 48"),
        ("mixtral", {"num_hidden_layers": 3}, "num_hidden_layers=3 but the safetensors weights beside it hold 2"),
    ],
    ids=["experts", "stacked-experts", "hidden", "layers"],
)
def test_cli_refuses_a_config_json_that_its_weights_contradict(tiny_checkpoint, capsys, family, edit, said):
    """The plan counts the model from config.json: one edited away from its weights (read from the safetensors
    headers) is one line naming both values, exit 2, where the plan would have been of another model."""
    path = tiny_checkpoint(family)
    assert plan_main(["model=hf", f"model.path={path}", "--gpus", "1"]) == 0
    capsys.readouterr()
    config = json.loads(open(f"{path}/config.json").read())
    open(f"{path}/config.json", "w").write(json.dumps({**config, **edit}))
    assert plan_main(["model=hf", f"model.path={path}", "--gpus", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"moe-tune-plan: error: {path}/config.json: {said} "), err
    assert f"set {next(iter(edit))}=" in err[0], err


@pytest.mark.parametrize(
    "family, edit, said",
    [
        ("qwen3_moe", {"mlp_only_layers": [1]}, "makes layers [1] dense (mlp_only_layers=[1], decoder_sparse_step=1)"),
        ("qwen2_moe", {"decoder_sparse_step": 2}, "makes layers [0] dense (mlp_only_layers=[], decoder_sparse_step=2)"),
        ("deepseek_v3", {"first_k_dense_replace": 0}, "routes layers [0] through experts (first_k_dense_replace=0)"),
    ],
    ids=["mlp_only_layers", "decoder_sparse_step", "first_k_dense_replace"],
)
def test_a_config_json_naming_other_dense_layers_than_its_weights_is_refused(
    tiny_checkpoint, capsys, family, edit, said
):
    """Which layers are dense comes from config.json's keys, which experts exist from the weights: layers that
    disagree are one line naming them and the keys, exit 2, for the plan and the model alike (the plan counted a
    model without those experts; the load said only that a tensor was missing)."""
    import moe_tune
    from moe_tune.config import CheckpointError

    path = tiny_checkpoint(family)
    capsys.readouterr()  # transformers' progress bar as it saved the checkpoint
    config = json.loads(open(f"{path}/config.json").read())
    open(f"{path}/config.json", "w").write(json.dumps({**config, **edit}))
    assert plan_main(["model=hf", f"model.path={path}", "--gpus", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"moe-tune-plan: error: {path}/config.json: {said}"), err
    with pytest.raises(CheckpointError, match="config.json was edited or belongs to another checkpoint"):
        moe_tune.AutoModelForCausalLM.from_pretrained(path)


def test_a_multi_token_prediction_layer_past_num_hidden_layers_is_no_contradiction(tiny_checkpoint, monkeypatch):
    """DeepSeek-V3's checkpoints hold one layer more than num_hidden_layers (num_nextn_predict_layers names it)."""
    from moe_tune.models.source_check import check_weights_match_config
    from moe_tune.models.source_check import weight_sizes as read_sizes

    path = tiny_checkpoint("deepseek_v3")
    held = read_sizes(path)
    config = json.loads(open(f"{path}/config.json").read())
    open(f"{path}/config.json", "w").write(json.dumps({**config, "num_nextn_predict_layers": 1}))
    monkeypatch.setattr(
        "moe_tune.models.source_check.weight_sizes",
        lambda p: {**held, "num_hidden_layers": held["num_hidden_layers"] + 1},
    )
    check_weights_match_config(path)


def test_cli_expands_a_home_model_path_as_moe_tune_does(tmp_path, monkeypatch, capsys):
    """``model.path=~/ckpt`` as zsh passes it was Hydra's 'token recognition error at: ~' here, where moe-tune
    reads it as the home directory's ckpt."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert plan_main(["model.path=~/ckpt"]) == 2
    assert f"model.path={tmp_path / 'ckpt'} does not exist" in capsys.readouterr().err


def test_a_plan_leaves_no_fake_mesh_to_the_run_that_follows():
    """``auto`` plans in the process that then trains: DTensor's sharding cache, keyed by meshes that compare equal
    whatever their process group, must not hand rank 1's experts the plan's rank-0 mesh (rank 1 then read experts
    0-3 of the checkpoint again and the load refused the unread 4-7)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from moe_tune.build import model_options
    from moe_tune.distributed.dims import ParallelDims
    from moe_tune.distributed.expert_parallel import ep_dispatchers
    from moe_tune.distributed.mesh import build_mesh
    from moe_tune.distributed.parallelize import parallelize
    from moe_tune.models.hf_io import local_rows
    from moe_tune.models.model import build_model

    hf, cfg = tiny_config("qwen3_moe"), _cfg("parallel.ep=1")
    plan(cfg, 2, hf_config=hf)
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)  # the run, seen from rank 1
    try:
        mesh = build_mesh(ParallelDims(1, 2, 1, 2), "cpu")
        model = build_model(hf, model_options(cfg, mesh.dims), ep_dispatchers(mesh, cfg.comm), None)
        parallelize(model, mesh, cfg)
        experts = model.moe_layers()[0].experts.gate_up_proj
        assert tuple(experts.device_mesh.get_coordinate()) == (1,)
        assert local_rows(experts)[1] == 4
    finally:
        dist.destroy_process_group()


def test_planning_md_names_every_flag_of_the_help():
    """Every flag ``moe-tune-plan --help`` lists is explained in docs/planning.md."""
    import pathlib
    import re

    from moe_tune.cli.plan import _parser

    doc = (pathlib.Path(__file__).parents[2] / "docs" / "planning.md").read_text()
    flags = {s for a in _parser()._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
    assert flags == {"--gpus", "--gpu-mem-gib", "--headroom", "--routing", "--search", "--max-micro-batch", "--json"}
    assert [f for f in sorted(flags) if not re.search(rf"`{f}[ `]", doc)] == []
