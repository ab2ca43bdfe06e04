"""Whole training runs (``Trainer.fit``: every step, checkpoints, the Hugging Face export), in process or on 2 gloo
ranks under the rank harness: resume is bitwise (fp32; bf16 with stochastic rounding; TE FP8 delayed scaling on a
GPU), aux-loss-free balancing on 2 ranks equals one process, gradient accumulation equals one big micro-batch. One
end-to-end smoke through torchrun (slow): SIGTERM stops every rank after the same step and resumes."""

import pytest
import torch
import torch.distributed as dist

from tests.harness import (
    FAST_RUN,
    PY,
    assert_hf_logits_equal,
    copy_checkpoint,
    needs_te,
    read_hf_tensors,
    read_metrics,
    run_cli,
    run_ranks,
    signal_after_rows,
    train_run,
)


def _assert_resumed_bitwise(straight, resumed, step: int) -> None:
    """The resumed run's losses are the straight run's after ``step``, and its exported weights the same bits."""
    a = [r["loss"] for r in read_metrics(straight)]
    b = [r["loss"] for r in read_metrics(resumed)]
    assert len(b) == len(a) - step and a[step:] == b, (a, b)
    sa, sb = read_hf_tensors(straight / "hf"), read_hf_tensors(resumed / "hf")
    assert sa.keys() == sb.keys() and sa and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("extra", [[], ["peft=lora", "peft.dropout=0.1"]], ids=["full", "lora_dropout"])
def test_resume_is_bitwise(tmp_path, extra):
    """6 steps straight == 3 steps, stop, resume from checkpoints/step_3 for 3 more (fp32, CPU, rtol=0); with LoRA
    dropout the resumed steps draw the straight run's masks."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ["train.steps=6", "checkpoint.every=3", *FAST_RUN, *extra]
    train_run([f"output_dir={straight}", *common])
    copy_checkpoint(straight, resumed, 3)
    train_run([f"output_dir={resumed}", *common])
    _assert_resumed_bitwise(straight, resumed, 3)


def _straight_then_resumed(rank: int, straight: str, resumed: str, common: list[str], step: int) -> None:
    """On each rank: the straight run, then (from its checkpoint of ``step``, copied by rank 0) the resumed one."""
    train_run([f"output_dir={straight}", *common])
    if rank == 0:
        copy_checkpoint(straight, resumed, step)
    dist.barrier()
    train_run([f"output_dir={resumed}", *common])


@pytest.mark.dist
@pytest.mark.parametrize("layout", ["parallel.ep=2", "parallel.dp_replicate=2"])
def test_bf16_stochastic_rounding_trains_and_resumes_bitwise(tmp_path, layout):
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
    run_ranks(_straight_then_resumed, 2, str(straight), str(resumed), common, 2)
    _assert_resumed_bitwise(straight, resumed, 2)
    a = [r["loss"] for r in read_metrics(straight)]
    assert a[-1] < a[0]


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
    copy_checkpoint(straight, resumed, 3)
    copy_checkpoint(straight, control, 3, drop_extra_state=True)
    run_cli([f"output_dir={resumed}", *common], env)
    r = run_cli([f"output_dir={control}", *common], env)
    assert "no module extra state" in r.stderr
    a = [m["loss"] for m in read_metrics(straight)][3:]
    b = [m["loss"] for m in read_metrics(resumed)]
    c = [m["loss"] for m in read_metrics(control)]
    assert len(b) == 3 and a == b, (a, b)
    assert c != a, (a, c)


@pytest.mark.slow
@pytest.mark.dist
def test_sigterm_saves_the_step_every_rank_agreed_on_and_resumes(tmp_path, cli_env):
    """Slurm's time limit or preemption, as torchrun sees it: SIGTERM to the launcher, which passes it to its
    ranks. Both ranks stop after the same step, save it, exit 128 + 15; the run resumes from it, and its losses
    and its final weights (the last update included) equal a run that was never stopped (fp32, CPU, bitwise).
    A constant schedule after warm-up makes the learning rate independent of train.steps, which differs here.
    (The fast lane holds the parts: tests/train/test_signals.py, the agreement on 2 ranks; test_loop.py, a
    signal's checkpoint; test_resume_is_bitwise above.)"""
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


def _train_on_ranks(rank: int, *runs: list[str]) -> None:
    for overrides in runs:
        train_run(overrides)


@pytest.mark.dist
def test_ep2_trains_as_fsdp_on_two_ranks(tmp_path):
    """The default job on 2 gloo ranks, FSDP2 (dp_shard=2) then EP=2: same data, same weights, so the same losses
    over 4 steps (expert parallelism changes where experts run, not the maths), and EP=2's hf/ loads in
    transformers with moe_tune's logits. (The same through torchrun: tests/cli/test_train.py, slow.)"""
    dp, ep = tmp_path / "dp", tmp_path / "ep"
    common = ["train.steps=4", *FAST_RUN]
    run_ranks(_train_on_ranks, 2, [f"output_dir={dp}", *common], [f"output_dir={ep}", "parallel.ep=2", *common])
    a, b = read_metrics(dp), read_metrics(ep)
    assert [r["step"] for r in a] == [1, 2, 3, 4] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * abs(x["loss"]), (x["loss"], y["loss"])
    assert_hf_logits_equal(str(ep / "hf"))


@pytest.mark.dist
def test_aux_loss_free_bias_update_two_ranks(tmp_path):
    """DeepSeek-V3 style balancing: the selection bias moves every step, from all ranks' loads, identically: 2 ranks
    with EP=2 end with the biases of one process that took both ranks' rows (micro-batch 4) itself, after 3 steps.
    (Per-rank equality and the update rule of one step: tests/train/test_expert_bias_update.py.)"""
    common = ["model=tiny_deepseek_v3", "train.steps=3", "train.aux_loss_coef=0", "train.bias_update_rate=0.01"]
    run_ranks(_train_on_ranks, 2, [f"output_dir={tmp_path / 'ep2'}", *common, "parallel.ep=2", *FAST_RUN])
    train_run([f"output_dir={tmp_path / 'one'}", *common, *FAST_RUN, "train.micro_batch_size=4"])

    def biases(run):
        return {k: v for k, v in read_hf_tensors(run / "hf").items() if "e_score_correction_bias" in k}

    ep2, one = biases(tmp_path / "ep2"), biases(tmp_path / "one")
    assert len(ep2) == 2  # the two MoE layers (layer 0 is dense)
    for k, b in ep2.items():
        # Each step moves every expert's bias by +-rate (or 0 at the mean load): 3 steps -> multiples of 0.01.
        assert 0 < b.abs().max() <= 0.03 + 1e-6 and torch.allclose(b * 100, (b * 100).round(), atol=1e-4)
        assert torch.equal(b, one[k]), (k, b, one[k])


def test_gradient_accumulation_matches_one_big_micro_batch(tmp_path):
    """global batch 4 as 2 micro-batches of 2 == one micro-batch of 4 (same rows, same loss normalisation), over
    3 whole steps. The load-balancing loss is off: it is computed per forward, from the routing of the rows that
    share a micro-batch, so it differs between the two by design (with train.aux_loss_coef=0.001 the grad norms
    differ by 2e-3). (Under FSDP on 2 ranks, gradient by gradient: tests/train/test_accumulation.py.)"""
    common = [
        "train.steps=3",
        "train.aux_loss_coef=0",
        "checkpoint.export_hf=false",
        *FAST_RUN[:1],
        "data.num_samples=256",
        "train.precision=fp32",
    ]
    train_run([f"output_dir={tmp_path / 'accum'}", "train.micro_batch_size=2", "train.global_batch_size=4", *common])
    train_run([f"output_dir={tmp_path / 'big'}", "train.micro_batch_size=4", "train.global_batch_size=4", *common])
    a, b = read_metrics(tmp_path / "accum"), read_metrics(tmp_path / "big")
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert (
            abs(x["loss"] - y["loss"]) <= 1e-5 * abs(y["loss"])
            and abs(x["grad_norm"] - y["grad_norm"]) <= 1e-4 * y["grad_norm"]
        )
