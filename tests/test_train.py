"""The embedded default run end to end, a 2-rank torchrun on gloo, resume and export."""

import json
import os
import subprocess

import pytest
import torch
from conftest import PY, needs_te

CONTRACT_METRICS = {
    "step",
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "tokens_per_s_per_gpu",
    "tflops_per_gpu",
    "peak_mem_gib",
}
CONTRACT_SUMMARY = {
    "config",
    "versions",
    "hardware",
    "commit",
    "final_loss",
    "tokens_per_s_per_gpu",
    "tflops_per_gpu",
    "peak_mem_gib",
}
FAST = ["train.seq_len=64", "train.micro_batch_size=2", "data.num_samples=256", "train.precision=fp32"]


def run_cli(args, env, nproc=1, timeout=600):
    cmd = [PY, "-m", "moe_tune", *args]
    if nproc > 1:
        cmd = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "moe_tune", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return r


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def read_hf_tensors(d) -> dict:
    """Every tensor of a Hugging Face directory, single file or sharded with an index."""
    from safetensors import safe_open

    idx = d / "model.safetensors.index.json"
    files = set(json.load(open(idx))["weight_map"].values()) if idx.exists() else {"model.safetensors"}
    out = {}
    for name in files:
        with safe_open(d / name, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def hf_logits_equal(hf_dir):
    """transformers loads hf/ and gives the same logits as moe_tune's model loaded from it."""
    from transformers import AutoModelForCausalLM

    import moe_tune

    ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ours = moe_tune.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.randint(4, ref.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ref(ids).logits, ours(ids).logits
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_default_run_end_to_end(tmp_path, cli_env):
    """`moe-tune` with no overrides but the run directory: loss falls, files per CONTRACT.md, hf/ loads."""
    commits = {_git_head()}
    run_cli([f"output_dir={tmp_path}"], cli_env)
    commits.add(_git_head())  # other commits may land while it runs
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 61)) and all(CONTRACT_METRICS <= set(r) for r in rows)
    first, last = sum(r["loss"] for r in rows[:5]) / 5, sum(r["loss"] for r in rows[-5:]) / 5
    assert last < 0.5 * first, (first, last)
    with open(tmp_path / "summary.json") as f:
        summary = json.load(f)
    assert CONTRACT_SUMMARY <= set(summary)
    # The values, not only the keys: this run's config, versions, commit and rows.
    with open(tmp_path / "config.json") as f:
        assert summary["config"] == json.load(f)
    assert summary["config"]["model"]["name"] == "tiny_qwen3_moe"
    assert summary["versions"]["torch"] == torch.__version__
    assert summary["commit"] in commits, (summary["commit"], commits)
    assert summary["hardware"].startswith("cpu (") and summary["hardware"].endswith("x 1 processes")
    assert summary["final_loss"] == rows[-1]["loss"]
    tps = sorted(r["tokens_per_s_per_gpu"] for r in rows)
    assert 0 < tps[0] <= summary["tokens_per_s_per_gpu"] <= tps[-1]  # a median of the rows
    for r in rows:
        # TFLOP/s per GPU = FLOPs per token x tokens/s per GPU (the formula in metrics.py)
        assert r["tflops_per_gpu"] == pytest.approx(summary["flops_per_token"] * r["tokens_per_s_per_gpu"] / 1e12)
        assert r["lr"] > 0 and r["grad_norm"] > 0
    hf_logits_equal(str(tmp_path / "hf"))


def _git_head() -> str:
    from conftest import ROOT

    if os.environ.get("MOE_TUNE_COMMIT"):
        return os.environ["MOE_TUNE_COMMIT"]
    return subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()


@pytest.mark.dist
def test_two_rank_torchrun_gloo(tmp_path, cli_env):
    """The default job under torchrun with 2 ranks (FSDP2 on gloo, then EP=2): one run directory, rank 0 writes."""
    run_cli([f"output_dir={tmp_path / 'dp'}", "train.steps=4", *FAST], cli_env, nproc=2)
    run_cli([f"output_dir={tmp_path / 'ep'}", "train.steps=4", "parallel.ep=2", *FAST], cli_env, nproc=2)
    dp, ep = read_metrics(tmp_path / "dp"), read_metrics(tmp_path / "ep")
    assert [r["step"] for r in dp] == [1, 2, 3, 4] == [r["step"] for r in ep]
    # Same data, same weights: expert parallelism changes where experts run, not the maths.
    for a, b in zip(dp, ep):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a["loss"], b["loss"])
    hf_logits_equal(str(tmp_path / "ep" / "hf"))


BAD_FAMILY = ["model.family=mixtral", "train.steps=2", *FAST]
BAD_FAMILY_LINE = "moe-tune: error: model.family=mixtral but the checkpoint's model_type is qwen3_moe"


@pytest.mark.dist
def test_bad_value_found_after_the_process_group_exists(tmp_path, cli_env):
    """model.family disagrees with the checkpoint: known only once the model config is read, after every rank
    joined the process group. A rank exits 2 with the one line, no traceback; torchrun then fails the job, and
    nothing hangs. torchrun SIGTERMs the other rank as soon as one exits, so only one rank's line is certain."""
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "moe_tune"]
    r = subprocess.run(
        cmd + [f"output_dir={tmp_path}", *BAD_FAMILY], capture_output=True, text=True, env=cli_env, timeout=300
    )
    assert r.returncode != 0
    assert r.stderr.count(BAD_FAMILY_LINE) >= 1, r.stderr[-3000:]
    # torchrun's root cause (the first rank to exit) is our exit code, not a crash or its own SIGTERM.
    root_cause = r.stderr.split("Root Cause", 1)[-1]
    assert "exitcode  : 2 " in root_cause, r.stderr[-3000:]
    # The message is never an exception rendered by Python: no frame of moe_tune's code, no exception line.
    frames = [line for line in r.stderr.splitlines() if line.lstrip().startswith('File "') and "moe_tune" in line]
    assert not frames, r.stderr[-3000:]
    assert all(line.startswith("moe-tune: error: ") for line in r.stderr.splitlines() if "model.family=mixtral" in line)
    # Found after the process group existed: rank 0 had built the base model before the ranks' barrier.
    assert (tmp_path / "base_model" / "config.json").exists()
    assert not (tmp_path / "metrics.jsonl").exists()


def test_bad_value_after_the_process_group_exists_tears_it_down(tmp_path, monkeypatch, capsys):
    """In process (one rank): the group was created before the value was found bad, and the CLI destroys it
    before exiting 2 (with NCCL, an exit without destroy_process_group() warns and can hang)."""
    import torch.distributed as dist

    from moe_tune.cli import compose, run
    from moe_tune.dist.env import destroy_distributed

    destroy_distributed()  # a group left over from an earlier in-process test
    created = []
    init_process_group = dist.init_process_group

    def spy(*args, **kwargs):
        created.append(kwargs.get("world_size"))
        return init_process_group(*args, **kwargs)

    monkeypatch.setattr(dist, "init_process_group", spy)
    with pytest.raises(SystemExit) as e:
        run(compose([f"output_dir={tmp_path}", *BAD_FAMILY]))
    assert e.value.code == 2
    assert created == [1]  # the group existed when the error was found
    assert not dist.is_initialized()  # and it is gone
    assert capsys.readouterr().err.count(BAD_FAMILY_LINE) == 1


@pytest.mark.dist
def test_resume_is_bitwise(tmp_path, cli_env):
    """6 steps straight == 3 steps, stop, resume from checkpoints/step_3 for 3 more (fp32, CPU, rtol=0)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ["train.steps=6", "checkpoint.every=3", *FAST]
    run_cli([f"output_dir={straight}", *common], cli_env)
    _resume_from(straight, resumed, 3)
    run_cli([f"output_dir={resumed}", *common], cli_env)
    a = [r["loss"] for r in read_metrics(straight)][3:]
    b = [r["loss"] for r in read_metrics(resumed)]
    assert len(b) == 3 and a == b, (a, b)
    sa, sb = read_hf_tensors(straight / "hf"), read_hf_tensors(resumed / "hf")
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("layout", ["parallel.ep=2", "parallel.dp_replicate=2"])
def test_bf16_stochastic_rounding_trains_and_resumes_bitwise(tmp_path, cli_env, layout):
    """bf16 parameters with optim.stochastic_rounding on 2 ranks: 4 steps straight == 2, resume, 2 (the random
    bits are seeded by the step, so none need saving; the bf16 moments are in the checkpoint). EP=2: FSDP2 DTensor
    parameters and plain expert shards. HSDP (two replicas): the checkpoint holds one replica's copy, so the
    resumed run equals the straight one only if both replicas rounded identically."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = [
        "train.steps=4",
        "checkpoint.every=2",
        *FAST[:-1],
        "train.precision=bf16",
        "optim.stochastic_rounding=true",
        layout,
    ]
    run_cli([f"output_dir={straight}", *common], cli_env, nproc=2)
    _resume_from(straight, resumed, 2)
    run_cli([f"output_dir={resumed}", *common], cli_env, nproc=2)
    a = [r["loss"] for r in read_metrics(straight)]
    b = [r["loss"] for r in read_metrics(resumed)]
    assert len(b) == 2 and a[2:] == b, (a, b)
    assert a[-1] < a[0]
    sa, sb = read_hf_tensors(straight / "hf"), read_hf_tensors(resumed / "hf")
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def _resume_from(straight, resumed, step: int, drop_extra_state: bool = False) -> None:
    """An interrupted run: the straight run's step checkpoint and base model, copied to a fresh output dir."""
    import shutil

    os.makedirs(resumed / "checkpoints")
    shutil.copytree(straight / "checkpoints" / f"step_{step}", resumed / "checkpoints" / f"step_{step}")
    shutil.copytree(straight / "base_model", resumed / "base_model")
    if drop_extra_state:
        for f in (resumed / "checkpoints" / f"step_{step}").glob("extra_state.rank*.pt"):
            f.unlink()


@pytest.mark.gpu
@needs_te
def test_te_fp8_delayed_resume_is_bitwise_on_gpu(tmp_path, cli_env):
    """kernels=te with FP8 delayed scaling on one GPU: 6 steps straight == 3 steps, resume, 3 more, bit for bit.
    Delayed scaling quantizes with the amax history of earlier steps, which lives in TE's module extra state; a
    resume from the same checkpoint without that state (control) must give other losses, or the test shows
    nothing."""
    env = {**cli_env, "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
    common = [
        "train.steps=6",
        "checkpoint.every=3",
        "kernels=te",
        "kernels.fp8=delayed",
        "train.seq_len=256",
        "train.micro_batch_size=2",
        "data.num_samples=256",
    ]
    straight, resumed, control = tmp_path / "straight", tmp_path / "resumed", tmp_path / "control"
    run_cli([f"output_dir={straight}", *common], env)
    assert list((straight / "checkpoints" / "step_3").glob("extra_state.rank0.pt"))
    _resume_from(straight, resumed, 3)
    _resume_from(straight, control, 3, drop_extra_state=True)
    run_cli([f"output_dir={resumed}", *common], env)
    r = run_cli([f"output_dir={control}", *common], env)
    assert "no module extra state" in r.stderr
    a = [m["loss"] for m in read_metrics(straight)][3:]
    b = [m["loss"] for m in read_metrics(resumed)]
    c = [m["loss"] for m in read_metrics(control)]
    assert len(b) == 3 and a == b, (a, b)
    assert c != a, (a, c)


def test_a_signal_during_the_agreement_is_counted_at_the_next_step(monkeypatch):
    """The handler's flag is never cleared by the all-reduce: a signal that lands while the ranks agree on the
    previous step's flags stops every rank one step later instead of being lost."""
    import signal

    import torch.distributed as dist

    from moe_tune.train import StopSignal

    before = signal.getsignal(signal.SIGTERM)
    stop = StopSignal(enabled=True)
    assert signal.getsignal(signal.SIGTERM) == stop._on_signal
    try:
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)

        def all_reduce(flag, op=None, group=None):
            stop._on_signal(signal.SIGUSR1, None)  # arrives while the collective runs; the other rank had none

        monkeypatch.setattr(dist, "all_reduce", all_reduce)
        assert stop.agreed("cpu") is False and stop.signum is None
        assert stop.agreed("cpu") is True and stop.signum == signal.SIGUSR1
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) == before  # the previous handlers are back


@pytest.mark.dist
def test_sigterm_saves_the_step_every_rank_agreed_on_and_resumes(tmp_path, cli_env):
    """Slurm's time limit or preemption, as torchrun sees it: SIGTERM to the launcher, which passes it to its
    ranks. Both ranks stop after the same step, save it, exit 128 + 15; the run resumes from it, and its losses
    and its final weights (the last update included) equal a run that was never stopped (fp32, CPU, bitwise).
    A constant schedule after warm-up makes the learning rate independent of train.steps, which differs here."""
    import signal
    import time

    run = tmp_path / "stopped"
    fast = [*FAST, "parallel.ep=2", "optim.schedule=constant"]
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "moe_tune"]
    args = [f"output_dir={run}", "train.steps=100000", "checkpoint.export_hf=false", *fast]
    p = subprocess.Popen(cmd + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert "stopped by signal 15 after step" in err, err[-3000:]
    saved = [d.name for d in (run / "checkpoints").iterdir() if (d / "COMPLETE").exists()]
    assert len(saved) == 1, saved
    n = int(saved[0].removeprefix("step_"))
    assert [r["step"] for r in read_metrics(run)] == list(range(1, n + 1))  # the saved step is the last trained
    assert not (run / "hf").exists()
    # Resume two steps past it, and compare with a run that trained straight through.
    common = [f"train.steps={n + 2}", "checkpoint.export_hf=true", *fast]
    run_cli([f"output_dir={run}", *common], cli_env, nproc=2)
    straight = tmp_path / "straight"
    run_cli([f"output_dir={straight}", *common], cli_env, nproc=2)
    a, b = read_metrics(straight), read_metrics(run)
    assert [r["step"] for r in b] == [r["step"] for r in a] == list(range(1, n + 3))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["grad_norm"] for r in a] == [r["grad_norm"] for r in b]
    # A step's loss is taken before its update: only the weights show the last update (n + 2) was the same.
    sa, sb = read_hf_tensors(straight / "hf"), read_hf_tensors(run / "hf")
    assert sa.keys() == sb.keys() and len(sa) > 0
    differ = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not differ, differ


@pytest.mark.dist
def test_export_cli_from_ep2_checkpoint(tmp_path, cli_env):
    """moe-tune-export of an EP=2 checkpoint (2 ranks) equals the run's own hf/ export, bit for bit."""
    run_cli([f"output_dir={tmp_path}", "train.steps=2", "checkpoint.every=2", "parallel.ep=2", *FAST], cli_env, nproc=2)
    out = tmp_path / "exported"
    r = subprocess.run(
        [PY, "-m", "moe_tune.export_cli", str(tmp_path / "checkpoints" / "step_2"), str(out)],
        capture_output=True,
        text=True,
        env=cli_env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = read_hf_tensors(tmp_path / "hf"), read_hf_tensors(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    hf_logits_equal(str(out))


def test_export_cli_bad_input_exits_2(tmp_path, cli_env):
    r = subprocess.run(
        [PY, "-m", "moe_tune.export_cli", str(tmp_path), str(tmp_path / "o")],
        capture_output=True,
        text=True,
        env=cli_env,
    )
    assert r.returncode == 2 and "not a complete moe-tune checkpoint" in r.stderr


@pytest.mark.dist
def test_aux_loss_free_bias_update_two_ranks(tmp_path, cli_env):
    """DeepSeek-V3 style balancing: the selection bias moves every step, from all ranks' loads, identically: 2 ranks
    with EP=2 end with the biases of one process that took both ranks' rows (micro-batch 4) itself. (Per-rank
    equality and the update rule: tests/dist/test_expert_bias_update.py.)"""
    common = ["model=tiny_deepseek_v3", "train.steps=3", "train.aux_loss_coef=0", "train.bias_update_rate=0.01"]
    run_cli([f"output_dir={tmp_path / 'ep2'}", *common, "parallel.ep=2", *FAST], cli_env, nproc=2)
    run_cli([f"output_dir={tmp_path / 'one'}", *common, *FAST, "train.micro_batch_size=4"], cli_env)

    def biases(run):
        return {k: v for k, v in read_hf_tensors(run / "hf").items() if "e_score_correction_bias" in k}

    ep2, one = biases(tmp_path / "ep2"), biases(tmp_path / "one")
    assert len(ep2) == 2  # the two MoE layers (layer 0 is dense)
    for k, b in ep2.items():
        # Each step moves every expert's bias by +-rate (or 0 at the mean load): 3 steps -> multiples of 0.01.
        assert 0 < b.abs().max() <= 0.03 + 1e-6 and torch.allclose(b * 100, (b * 100).round(), atol=1e-4)
        assert torch.equal(b, one[k]), (k, b, one[k])


def test_gradient_accumulation_matches_one_big_micro_batch(tmp_path, cli_env):
    """global batch 4 as 2 micro-batches of 2 == one micro-batch of 4 (same rows, same loss normalisation)."""
    common = ["train.steps=3", "checkpoint.export_hf=false", *FAST[:1], "data.num_samples=256", "train.precision=fp32"]
    run_cli(
        [f"output_dir={tmp_path / 'accum'}", "train.micro_batch_size=2", "train.global_batch_size=4", *common], cli_env
    )
    run_cli(
        [f"output_dir={tmp_path / 'big'}", "train.micro_batch_size=4", "train.global_batch_size=4", *common], cli_env
    )
    a, b = read_metrics(tmp_path / "accum"), read_metrics(tmp_path / "big")
    for x, y in zip(a, b):
        assert (
            abs(x["loss"] - y["loss"]) <= 1e-5 * abs(y["loss"])
            and abs(x["grad_norm"] - y["grad_norm"]) <= 1e-4 * y["grad_norm"]
        )


def test_hydra_multirun_gives_each_job_its_own_run_directory(tmp_path, cli_env):
    """`moe-tune -m a=1,2`: Hydra's sweep (the same path the submitit_slurm launcher takes) runs both jobs."""
    r = run_cli(
        ["-m", f"output_dir={tmp_path}", "train.lr=1e-3,2e-3", "train.steps=2", "checkpoint.export_hf=false", *FAST],
        cli_env,
    )
    for job in ("0", "1"):
        rows = read_metrics(tmp_path / "multirun" / job)
        assert [row["step"] for row in rows] == [1, 2], r.stdout
    lrs = [json.load(open(tmp_path / "multirun" / j / "config.json"))["train"]["lr"] for j in ("0", "1")]
    assert lrs == [1e-3, 2e-3]
