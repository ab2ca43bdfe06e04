"""Whole training runs through the CLI: resume is bitwise (fp32; bf16 with stochastic rounding; TE FP8 delayed
scaling on a GPU), SIGTERM stops every rank after the same step and resumes, aux-loss-free balancing on 2 ranks
equals one process, gradient accumulation equals one big micro-batch."""

import os

import pytest
import torch

from tests.harness import FAST_RUN, PY, needs_te, read_hf_tensors, read_metrics, run_cli, signal_after_rows


@pytest.mark.dist
def test_resume_is_bitwise(tmp_path, cli_env):
    """6 steps straight == 3 steps, stop, resume from checkpoints/step_3 for 3 more (fp32, CPU, rtol=0)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ["train.steps=6", "checkpoint.every=3", *FAST_RUN]
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
        *FAST_RUN[:-1],
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


@pytest.mark.dist
def test_sigterm_saves_the_step_every_rank_agreed_on_and_resumes(tmp_path, cli_env):
    """Slurm's time limit or preemption, as torchrun sees it: SIGTERM to the launcher, which passes it to its
    ranks. Both ranks stop after the same step, save it, exit 128 + 15; the run resumes from it, and its losses
    and its final weights (the last update included) equal a run that was never stopped (fp32, CPU, bitwise).
    A constant schedule after warm-up makes the learning rate independent of train.steps, which differs here."""
    import signal

    run = tmp_path / "stopped"
    fast = [*FAST_RUN, "parallel.ep=2", "optim.schedule=constant"]
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "moe_tune"]
    args = [f"output_dir={run}", "train.steps=100000", "checkpoint.export_hf=false", *fast]
    _, err = signal_after_rows(cmd + args, cli_env, run, 3, signal.SIGTERM)
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
def test_aux_loss_free_bias_update_two_ranks(tmp_path, cli_env):
    """DeepSeek-V3 style balancing: the selection bias moves every step, from all ranks' loads, identically: 2 ranks
    with EP=2 end with the biases of one process that took both ranks' rows (micro-batch 4) itself. (Per-rank
    equality and the update rule: tests/train/test_expert_bias_update.py.)"""
    common = ["model=tiny_deepseek_v3", "train.steps=3", "train.aux_loss_coef=0", "train.bias_update_rate=0.01"]
    run_cli([f"output_dir={tmp_path / 'ep2'}", *common, "parallel.ep=2", *FAST_RUN], cli_env, nproc=2)
    run_cli([f"output_dir={tmp_path / 'one'}", *common, *FAST_RUN, "train.micro_batch_size=4"], cli_env)

    def biases(run):
        return {k: v for k, v in read_hf_tensors(run / "hf").items() if "e_score_correction_bias" in k}

    ep2, one = biases(tmp_path / "ep2"), biases(tmp_path / "one")
    assert len(ep2) == 2  # the two MoE layers (layer 0 is dense)
    for k, b in ep2.items():
        # Each step moves every expert's bias by +-rate (or 0 at the mean load): 3 steps -> multiples of 0.01.
        assert 0 < b.abs().max() <= 0.03 + 1e-6 and torch.allclose(b * 100, (b * 100).round(), atol=1e-4)
        assert torch.equal(b, one[k]), (k, b, one[k])


def test_gradient_accumulation_matches_one_big_micro_batch(tmp_path, cli_env):
    """global batch 4 as 2 micro-batches of 2 == one micro-batch of 4 (same rows, same loss normalisation). The
    load-balancing loss is off: it is computed per forward, from the routing of the rows that share a micro-batch,
    so it differs between the two by design (with train.aux_loss_coef=0.001 the grad norms differ by 2e-3)."""
    common = [
        "train.steps=3",
        "train.aux_loss_coef=0",
        "checkpoint.export_hf=false",
        *FAST_RUN[:1],
        "data.num_samples=256",
        "train.precision=fp32",
    ]
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
