"""Resharding: a checkpoint written at one layout (world size, ep, dp_shard, dp_replicate) resumes at another.

Each test trains the reference run uninterrupted at layout A, saving at step 1 on the way; the resumed runs train
one step each at other layouts, from the previous run's checkpoint. The first step after each resume must give the
reference's loss, learning rate and weights (fp32, CPU, a fixed batch per step: every layout trains on the same
global rows; the balancing loss is off because it is computed per forward over the rows of one micro-batch).
Not bitwise: the layouts sum the same numbers in other orders. The Hugging Face export compares the weights."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from tests.harness import FAST_TRAINER, CheckpointRun, read_hf_tensors, run_ranks

STEPS = 5
COMMON = [
    *FAST_TRAINER,
    "train.global_batch_size=4",
    "train.aux_loss_coef=0",
    "train.lr=3e-4",
    f"train.steps={STEPS}",
    "checkpoint.export_hf=false",
]
TOL = 1e-6


def _run(rank: int, out: str, overrides: list[str], result: str) -> None:
    """Train ``out``'s run to STEPS (or one step when it resumes), saving and exporting after each step; rank 0
    writes the losses and each param group's hyperparameters (after the load, then after each step)."""
    from moe_tune.cli.train import compose, to_config
    from moe_tune.train import Trainer

    t = Trainer(to_config(compose([f"output_dir={out}", *COMMON, *overrides])), write_run_files=False)
    groups = {t.step: _hypers(t)}
    losses = {}
    stop = STEPS if t.step == 0 else t.step + 1
    while t.step < stop:
        out_step = t.train_step(t.step)
        t.step += 1
        losses[t.step] = out_step["loss"].item()  # host sync: the loss to compare
        groups[t.step] = _hypers(t)
        t.save()
        t.export(f"{out}/hf_{t.step}")
    if rank == 0:
        torch.save({"losses": losses, "groups": groups}, result)


def _hypers(t) -> list[dict]:
    keys = ("lr", "initial_lr", "betas", "eps", "weight_decay")
    lrs = t.scheduler.get_last_lr()
    assert len(lrs) == len(t.optimizer.param_groups)
    return [{**{k: g[k] for k in keys}, "last_lr": lr} for g, lr in zip(t.optimizer.param_groups, lrs)]


def _in_process(out, overrides: list[str], result: str) -> None:
    """One process, no launcher: the layout without any parallelism."""
    from moe_tune.distributed.process_group import destroy_distributed

    try:
        _run(0, str(out), overrides, result)
    finally:
        destroy_distributed()


def _assert_continues(ref: dict, ref_dir, res: dict, res_dir) -> None:
    """The resumed run's one step equals the reference's same step: loss, hyperparameters, weights."""
    (step,) = res["losses"]
    assert abs(res["losses"][step] - ref["losses"][step]) <= TOL, (step, res["losses"], ref["losses"])
    for when in (step - 1, step):  # right after the load, and after the step
        want = ref["groups"][when][0]
        assert all(g == want for g in res["groups"][when]), (when, res["groups"][when], want)
    a, b = read_hf_tensors(ref_dir / f"hf_{step}"), read_hf_tensors(res_dir / f"hf_{step}")
    assert a.keys() == b.keys() and a
    worst = max(((a[k] - b[k]).abs().max().item(), k) for k in a)
    assert worst[0] <= TOL, (step, worst)


def _chain(tmp_path, layouts: list[tuple[int, list[str]]]) -> None:
    """Reference at layouts[0] for STEPS steps; then each later layout resumes from the previous run's last
    checkpoint (the reference's step 1 first) and trains one step."""
    runs = []
    for i, (world, overrides) in enumerate(layouts):
        out, result = tmp_path / f"run{i}", str(tmp_path / f"run{i}.pt")
        if i:
            overrides = [*overrides, f"checkpoint.resume={runs[-1][0]}/checkpoints/step_{i}"]
        if world == 1:
            _in_process(out, overrides, result)
        else:
            run_ranks(_run, world, str(out), overrides, result)
        runs.append((out, torch.load(result)))
    ref_dir, ref = runs[0]
    for res_dir, res in runs[1:]:
        _assert_continues(ref, ref_dir, res, res_dir)


@pytest.mark.dist
@pytest.mark.slow
def test_ep2_to_one_process_to_ep2_to_dp_shard2_to_one_process(tmp_path, no_launcher):
    """EP=2 on 2 ranks (experts plain tensors outside FSDP2: two param groups) -> one process (one group) -> EP=2
    -> FSDP over 2 ranks (dp_shard=2: experts sharded by rows) -> one process."""
    ep2, one, dp_shard2 = (2, ["parallel.ep=2"]), (1, []), (2, ["parallel.dp_shard=2"])
    _chain(tmp_path, [ep2, one, ep2, dp_shard2, one])


def test_the_global_batch_is_kept_across_a_resume_with_another_micro_batch(tmp_path, no_launcher):
    """train.global_batch_size=-1 (one micro-batch per rank): a run of micro-batch 2 resumed at micro-batch 1
    accumulates two, so its step trains the reference's rows (not half of them, shifted)."""
    auto = "train.global_batch_size=-1"
    _chain(tmp_path, [(1, [auto]), (1, [auto, "train.micro_batch_size=1"])])


@pytest.mark.parametrize(
    "global_batch, micro_batch, dp, saved, expect",
    [
        (-1, 1, 2, 8, 4),  # kept: 4 micro-batches of 1 on each of 2 ranks
        (-1, 4, 1, 4, 1),  # the same layout
        (-1, 4, 1, None, 1),  # a checkpoint older than rows_per_step, saved with -1: nothing to keep
        (-1, 4, 1, 6, "set train.micro_batch_size to a divisor of 6"),
        (-1, 1, 4, 6, "resume on a number of data-parallel ranks that divides 6"),
        (-1, 2, 2, 2, "set train.micro_batch_size=1"),
        (8, 1, 2, 4, "set train.global_batch_size=4 (or -1 to keep the checkpoint's)"),
    ],
)
def test_keep_global_batch(global_batch, micro_batch, dp, saved, expect):
    from moe_tune.checkpoint import keep_global_batch
    from moe_tune.config import CheckpointError, Config
    from moe_tune.distributed.dims import BatchLayout

    cfg = Config()
    cfg.train.global_batch_size, cfg.train.micro_batch_size = global_batch, micro_batch
    layout = BatchLayout.from_config(cfg.train, dp)
    meta = {"config": {"train": {"global_batch_size": -1}}, **({} if saved is None else {"rows_per_step": saved})}
    if isinstance(expect, int):
        assert keep_global_batch(layout, cfg.train, meta, "ckpt") == BatchLayout(micro_batch, expect, dp)
    else:
        with pytest.raises(CheckpointError, match="replay or skip data") as e:
            keep_global_batch(layout, cfg.train, meta, "ckpt")
        assert str(e.value).endswith(expect), str(e.value)


def _plain_trainer(steps: int = 1, split: bool = False, stochastic: bool = False, **overrides):
    """A one-process model, optimizer and scheduler after ``steps`` steps, without a process group (what
    moe_tune.checkpoint reads of a trainer). ``split``: the experts in a param group of their own, after the
    others' (as with EP: FSDP2 DTensors first, plain expert tensors second); ``stochastic``: bf16 parameters and
    the stochastic-rounding AdamW."""

    from moe_tune.config import Config
    from moe_tune.models.init import init_random
    from moe_tune.models.model import build_model, materialize
    from moe_tune.models.presets import preset_config
    from moe_tune.optim import build_scheduler
    from moe_tune.optim.stochastic import StochasticRoundingAdamW

    cfg = Config()
    model = build_model(preset_config("tiny_qwen3_moe", {"num_hidden_layers": 2, **overrides}, vocab_size=64))
    materialize(model, "cpu")
    init_random(model, seed=0, num_experts=model.num_experts)
    if stochastic:
        model.to(torch.bfloat16)
    named = list(model.named_parameters())
    experts = [p for n, p in named if ".experts." in n]
    groups = [[p for n, p in named if ".experts." not in n], experts] if split else [[p for _, p in named]]
    cfg.optim.weight_decay = 0.1  # the config the optimizer was built from (a resume applies its decay rule)
    hyper = dict(lr=cfg.train.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt_class = StochasticRoundingAdamW if stochastic else torch.optim.AdamW
    opt = opt_class([{"params": g} for g in groups], **hyper)
    sched = build_scheduler(opt, cfg.optim, total_steps=10)
    trainer = CheckpointRun(model=model, optimizer=opt, scheduler=sched, step=0, cfg=cfg)
    for _ in range(steps):
        _plain_step(trainer)
    return trainer


def _plain_step(t) -> float:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(t.step))
    loss = t.model(ids, labels=ids).loss
    loss.backward()
    t.optimizer.step()
    t.scheduler.step()
    t.optimizer.zero_grad(set_to_none=True)
    t.step += 1
    return loss.item()  # host sync: the loss to compare


@pytest.mark.parametrize("stochastic", [False, True], ids=["adamw", "stochastic_rounding"])
@pytest.mark.parametrize(("saved_split", "resumed_split"), [(True, False), (False, True)])
def test_param_groups_and_optimizer_state_are_matched_by_name(tmp_path, stochastic, saved_split, resumed_split):
    """Two param groups (experts apart, as with EP) <-> one: each parameter gets its own moments and its group's
    hyperparameters and learning rate back, whatever group it is in now."""

    saved = _plain_trainer(steps=2, split=saved_split, stochastic=stochastic, num_hidden_layers=1)
    saved.save(str(tmp_path / "step_2"))
    resumed = _plain_trainer(steps=0, split=resumed_split, stochastic=stochastic, num_hidden_layers=1)
    resumed.load(str(tmp_path / "step_2"))
    assert resumed.step == 2
    params = dict(saved.model.named_parameters())
    for name, p in resumed.model.named_parameters():
        assert torch.equal(p, params[name]), name
        a, b = saved.optimizer.state[params[name]], resumed.optimizer.state[p]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    keys = ("lr", "initial_lr", "betas", "eps", "weight_decay")
    want = {k: saved.optimizer.param_groups[0][k] for k in keys}
    assert [{k: g[k] for k in keys} for g in resumed.optimizer.param_groups] == [want] * (1 + resumed_split)
    assert resumed.scheduler.get_last_lr() == [saved.scheduler.get_last_lr()[0]] * (1 + resumed_split)
    # The next step: the same loss; with AdamW the same weights too (an element's update does not depend on its
    # group). Stochastic rounding draws its bits by a parameter's position, which the grouping changes.
    assert _plain_step(resumed) == _plain_step(saved)
    if not stochastic:
        params = dict(saved.model.named_parameters())
        assert all(torch.equal(p, params[n]) for n, p in resumed.model.named_parameters())
    assert resumed.scheduler.get_last_lr() == [saved.scheduler.get_last_lr()[0]] * (1 + resumed_split)


def test_hyperparameters_given_anew_on_resume_take_effect(tmp_path, caplog):
    """train.lr, optim.weight_decay and train.steps changed for the resume: the peak and current rates scale by the
    lr ratio (still in warm-up, where train.steps does not change the rate), the decay is the new one; each change
    logged. tests/train/test_resume_schedule.py: the resumed step's rate is the new schedule's."""

    saved = _plain_trainer(steps=2, num_hidden_layers=1)
    saved.save(str(tmp_path / "step_2"))
    resumed = _plain_trainer(steps=0, num_hidden_layers=1)
    resumed.cfg.train.lr, resumed.cfg.optim.weight_decay = saved.cfg.train.lr / 4, 0.05
    resumed.cfg.train.steps = saved.cfg.train.steps + 10
    with caplog.at_level("INFO", logger="moe_tune"):
        changes = resumed.load(str(tmp_path / "step_2")).changes
    assert changes == ("train.lr 0.003 -> 0.00075", "optim.weight_decay 0.1 -> 0.05", "train.steps 60 -> 70")
    (group,), (before,) = resumed.optimizer.param_groups, saved.optimizer.param_groups
    assert group["lr"] == pytest.approx(before["lr"] / 4) and group["initial_lr"] == pytest.approx(
        before["initial_lr"] / 4
    )
    assert resumed.scheduler.base_lrs == pytest.approx([b / 4 for b in saved.scheduler.base_lrs])
    assert resumed.scheduler.get_last_lr() == pytest.approx([before["lr"] / 4])
    assert group["weight_decay"] == 0.05 and group["betas"] == before["betas"]
    for change in ("train.lr", "optim.weight_decay 0.1 -> 0.05", "train.steps"):
        assert change in caplog.text, caplog.text
    # Nothing changed: nothing logged, the checkpoint's values exactly.
    caplog.clear()
    again = _plain_trainer(steps=0, num_hidden_layers=1)
    with caplog.at_level("INFO", logger="moe_tune"):
        assert again.load(str(tmp_path / "step_2")).changes == ()
    assert "resuming with" not in caplog.text and again.optimizer.param_groups[0]["lr"] == before["lr"]


def test_a_resume_into_another_precision_or_rounding_says_so(tmp_path, caplog):
    """A bf16 + stochastic-rounding checkpoint resumed without those flags loads into this run's dtypes (fp32
    master weights, round to nearest): allowed, but a warning names both changes, so that a forgotten flag does
    not change memory and rounding silently; optim.compiled (the same maths) is logged as information."""

    saved = _plain_trainer(steps=1, stochastic=True, num_hidden_layers=1)
    saved.cfg.train.precision, saved.cfg.optim.stochastic_rounding = "bf16", True
    saved.cfg.optim.compiled = False
    saved.save(str(tmp_path / "step_1"))
    resumed = _plain_trainer(steps=0, num_hidden_layers=1)
    with caplog.at_level("INFO", logger="moe_tune"):
        resumed.load(str(tmp_path / "step_1"))
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [
        "resuming with this run's train.precision bf16 -> bf16_fp32_master; optim.stochastic_rounding True -> "
        "False (the checkpoint had the former)"
    ], caplog.text
    assert "optim.compiled False -> True" in caplog.text
    params = dict(saved.model.named_parameters())
    for name, p in resumed.model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, params[name].float()), name


def test_a_resume_with_other_data_or_another_model_path_says_so(tmp_path, caplog):
    """Other data for the remaining steps is named in the resume warning; a model.path other than the one the
    checkpoint was trained from is warned about too (its weights continue; the new path's are not loaded)."""

    saved = _plain_trainer(steps=1, num_hidden_layers=1)
    saved.cfg.data.path, saved.cfg.data.name, saved.cfg.model.path = "train.jsonl", "jsonl", "/ckpt/a"
    saved.save(str(tmp_path / "step_1"))
    resumed = _plain_trainer(steps=0, num_hidden_layers=1)
    resumed.cfg.data.path, resumed.cfg.data.name, resumed.cfg.model.path = "other.jsonl", "jsonl", "/ckpt/b"
    with caplog.at_level("INFO", logger="moe_tune"):
        resumed.load(str(tmp_path / "step_1"))
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "model.path /ckpt/b is not the checkpoint's (/ckpt/a): training continues from the checkpoint's" in warned[0]
    assert warned[1] == "resuming with this run's data.path train.jsonl -> other.jsonl (the checkpoint had the former)"


def _no_groups() -> dict:
    """A scheduler state with no param groups, at step 0 (what ``this_runs_hyperparameters`` reads of one)."""
    return {"base_lrs": [], "last_epoch": 0}


def test_a_resume_that_makes_other_rows_of_the_data_says_so():
    """The same records packed at another length, shuffled by another seed, unpacked or masked otherwise: the
    remaining steps read other rows than the run would have, so the resume names each change."""
    from moe_tune.checkpoint.resume import this_runs_hyperparameters
    from moe_tune.cli.train import compose, to_config

    saved = asdict(to_config(compose([])))
    overrides = ["train.seq_len=128", "train.seed=1", "data.packing=false", "data.train_on=all"]
    changes, _ = this_runs_hyperparameters(to_config(compose(overrides)), saved, [], _no_groups(), [])
    assert changes == [
        "data.train_on assistant -> all",
        "data.packing True -> False",
        "train.seq_len 256 -> 128",
        "train.seed 0 -> 1",
    ]
    unchanged = to_config(compose(["data.num_proc=2", "data.cache_dir=/tmp/elsewhere"]))
    assert this_runs_hyperparameters(unchanged, saved, [], _no_groups(), [])[0] == []


def test_a_lora_resume_warns_of_another_alpha_dropout_or_quantized_base():
    """A requeue that forgets peft.quantize_base=nf4 trains on a bf16 base (other rounding, about twice the
    memory), and another peft.alpha rescales the adapters: both are warned about, naming both sides."""
    from moe_tune.checkpoint.resume import this_runs_hyperparameters
    from moe_tune.cli.train import compose, to_config

    def config(*overrides):
        return to_config(compose(["peft=lora", *overrides]))

    saved = asdict(config("peft.quantize_base=nf4"))
    changes, _ = this_runs_hyperparameters(config("peft.alpha=64"), saved, [], _no_groups(), [])
    assert changes == ["peft.alpha 32.0 -> 64.0", "peft.quantize_base nf4 -> none"]
    assert this_runs_hyperparameters(config("peft.quantize_base=nf4"), saved, [], _no_groups(), [])[0] == []


def test_a_lora_resume_from_a_moved_base_says_the_adapters_continue_on_it():
    """A LoRA checkpoint holds adapters only: with a base moved elsewhere (same fingerprint) the line said
    "continues from the checkpoint's weights", which the base weights do not."""
    from moe_tune.checkpoint import other_source_message

    line = other_source_message("/ckpt/b", "/ckpt/a", lora=True)
    assert "the checkpoint's adapters continue on /ckpt/b's base weights" in line
    assert "checkpoint's weights" not in other_source_message("/ckpt/b", "/ckpt/a", lora=True)
    assert "continues from the checkpoint's weights" in other_source_message("/ckpt/b", "/ckpt/a", lora=False)


@pytest.mark.parametrize(
    ("saved", "resumed", "named"),
    [
        ({}, {"num_hidden_layers": 3}, "no parameter model.layers.2."),  # a layer more than the checkpoint
        ({"num_hidden_layers": 3}, {}, "parameter model.layers.2."),  # a layer fewer: unexpected
        ({"num_experts": 4}, {}, "Missing key in checkpoint state_dict: model.model.layers.0.mlp.experts."),
        ({}, {"num_experts": 4}, "Size mismatch"),  # the router's rows: 8 experts saved, 4 now
    ],
)
def test_names_that_do_not_match_the_model_are_a_checkpoint_error(tmp_path, saved, resumed, named):
    from moe_tune.config import CheckpointError

    _plain_trainer(**saved).save(str(tmp_path / "step_1"))
    with pytest.raises(CheckpointError, match="does not match the model") as e:
        _plain_trainer(steps=0, **resumed).load(str(tmp_path / "step_1"))
    assert named in str(e.value) and "\n" not in str(e.value), str(e.value)
    # Not this run's output_dir (Config's outputs/run): starting afresh over that would not help.
    assert str(e.value).endswith(f"without checkpoint.resume={tmp_path / 'step_1'}"), str(e.value)


@pytest.mark.dist
@pytest.mark.slow
def test_lora_adapters_reshard_ep2_to_one_process_to_dp_shard2(tmp_path, no_launcher):
    """LoRA: checkpoints of adapters (the expert adapters one per expert, like the experts) resume at another
    layout: EP=2 (adapters sharded with the experts, outside FSDP2) -> one process -> FSDP over 2 ranks."""
    lora = ["peft=lora", "peft.rank=8"]
    _chain(tmp_path, [(2, ["parallel.ep=2", *lora]), (1, lora), (2, ["parallel.dp_shard=2", *lora])])


@pytest.mark.parametrize("saved_decay", [0.1, 0.0])
def test_a_resume_keeps_norms_and_biases_out_of_weight_decay(tmp_path, saved_decay):
    """Saved with decay 0.1 (its groups split by the rule) or 0 (one group), resumed with 0.2: the groups of
    matrices decay at 0.2, those of norms and biases at 0 (they got 0.2 too when the new value went to every
    group)."""
    from moe_tune.optim import build_scheduler, is_decayed, param_groups

    def trainer(decay: float, steps: int):
        t = _plain_trainer(steps=0, num_hidden_layers=1)
        t.cfg.optim.weight_decay = decay
        t.optimizer = torch.optim.AdamW(param_groups(t.model.named_parameters(), decay, False), lr=t.cfg.train.lr)
        t.scheduler = build_scheduler(t.optimizer, t.cfg.optim, total_steps=10)
        for _ in range(steps):
            _plain_step(t)
        return t

    saved = trainer(saved_decay, steps=2)
    saved.save(str(tmp_path / "step_2"))
    resumed = trainer(0.2, steps=0)
    resumed.load(str(tmp_path / "step_2"))
    names = {id(p): n for n, p in resumed.model.named_parameters()}
    decays = {
        (group["weight_decay"], is_decayed(names[id(p)], p))
        for group in resumed.optimizer.param_groups
        for p in group["params"]
    }
    assert decays == {(0.2, True), (0.0, False)}
