"""One optimizer step of the real Trainer against plain PyTorch: the loss it returns is the mean cross-entropy
over the step's label tokens (prompt tokens masked, padding ignored), not over every token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_tune.cli.train import compose, to_config

FAST = ["train.seq_len=48", "train.micro_batch_size=2", "data.num_samples=64", "train.precision=fp32"]


@pytest.fixture
def trainer(tmp_path):
    from moe_tune.distributed.process_group import destroy_distributed
    from moe_tune.train import Trainer

    overrides = ["train.global_batch_size=4", "train.aux_loss_coef=0", "train.z_loss_coef=0"]
    cfg = to_config(compose([f"output_dir={tmp_path}", "checkpoint.export_hf=false", *FAST, *overrides]))
    yield Trainer(cfg)
    destroy_distributed()


def step_batches(trainer, step: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """The (ids, labels, position_ids) micro-batches the trainer takes for ``step`` on this rank (the one place
    this test reaches into the trainer's data path)."""
    return [trainer._micro_batch(step, m) for m in range(trainer.layout.accum)]


def test_step_loss_is_the_mean_over_label_tokens(trainer):
    batches = step_batches(trainer, 0)
    assert len(batches) == 2  # gradient accumulation: the mean is over both micro-batches' label tokens
    ce_sum, label_tokens, all_tokens = 0.0, 0, 0
    with torch.no_grad():
        for ids, labels, pos in batches:
            logits = trainer.model(ids, position_ids=pos, return_logits=True).logits
            shifted = labels[:, 1:]
            ce_sum += F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).double(),
                shifted.reshape(-1),
                ignore_index=-100,
                reduction="sum",
            ).item()
            label_tokens += int((shifted != -100).sum())
            all_tokens += shifted.numel()
    # Masked prompts make the two means differ: the test can tell them apart.
    assert 0 < label_tokens < 0.8 * all_tokens, (label_tokens, all_tokens)
    per_micro = [int((labels[:, 1:] != -100).sum()) for _, labels, _ in batches]
    assert per_micro[0] != per_micro[1], per_micro  # a mean of per-micro-batch means would differ too
    reference = ce_sum / label_tokens

    out = trainer.train_step(0)
    loss = float(out["loss"])
    assert abs(loss - reference) <= 1e-5 * reference, (loss, reference, ce_sum / all_tokens)

    # The step updated the weights from that loss: step 1's loss on step 0's batches is lower.
    with torch.no_grad():
        after = 0.0
        for ids, labels, pos in batches:
            after += trainer.model(ids, labels=labels, position_ids=pos, loss_normalizer=label_tokens).ce_loss.item()
    assert after < reference, (after, reference)


@pytest.mark.parametrize("max_norm", [0.05, 1000.0, 0.0])
def test_clipped_step_equals_torch_clip_then_adamw(tmp_path, max_norm):
    """Gradient clipping done inside the optimizer (its grad_scale) updates the weights as
    ``torch.nn.utils.clip_grad_norm_`` followed by AdamW does (max_norm 0.05 clips here; 1000, above the norm, must
    leave the gradients as they are; 0 turns clipping off). A large eps makes the update depend on the gradients'
    scale (Adam's first step is otherwise scale-free)."""
    import copy

    from moe_tune.distributed.process_group import destroy_distributed
    from moe_tune.train import Trainer

    overrides = [f"optim.max_grad_norm={max_norm}", "optim.eps=0.01", "train.aux_loss_coef=0", "train.z_loss_coef=0"]
    cfg = to_config(compose([f"output_dir={tmp_path}", "checkpoint.export_hf=false", *FAST, *overrides]))
    trainer = Trainer(cfg)
    try:
        reference = copy.deepcopy(trainer.model)
        batches = step_batches(trainer, 0)
        normalizer = trainer._loss_normalizer(batches)
        for ids, labels, pos in batches:
            reference(ids, labels=labels, position_ids=pos, loss_normalizer=normalizer).ce_loss.backward()
        params = [p for p in reference.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"))
        g = trainer.optimizer.param_groups[0]
        opt = torch.optim.AdamW(params, lr=g["lr"], betas=g["betas"], eps=0.01, weight_decay=g["weight_decay"])
        opt.step()

        out = trainer.train_step(0)
        assert float(out["grad_norm"]) == pytest.approx(float(norm), rel=1e-5) and 0.5 < float(norm) < 1000
        for (name, a), b in zip(trainer.model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-7, msg=name)
    finally:
        destroy_distributed()


@pytest.mark.parametrize(
    "overrides, stochastic",
    [
        (["train.precision=bf16"], True),  # automatic: bf16 parameters round stochastically
        (["train.precision=bf16", "optim.stochastic_rounding=false"], False),
        (["train.precision=bf16_fp32_master"], False),  # fp32 master weights: nothing to round
    ],
)
def test_bf16_parameters_round_stochastically_unless_told_not_to(make_trainer, monkeypatch, overrides, stochastic):
    """optim.stochastic_rounding's automatic value picks the optimizer the run builds, and plain bf16's lost
    updates are warned about only when asked for; the peers' optimizer (moe-tune-bench) follows the same choice."""
    from moe_tune import optim as module
    from moe_tune.bench.baseline import peer_optimizer
    from moe_tune.optim.stochastic import StochasticRoundingAdamW

    warnings = []  # the Trainer reconfigures logging (so pytest's caplog would miss it)
    monkeypatch.setattr(module.log, "warning", lambda msg, *args: warnings.append(msg % args))
    trainer = make_trainer("train.steps=1", *overrides)
    assert isinstance(trainer.optimizer, StochasticRoundingAdamW) == stochastic
    warned = any("optim.stochastic_rounding=false with train.precision=bf16" in w for w in warnings)
    assert warned == (not stochastic and "train.precision=bf16" in overrides)
    assert peer_optimizer(trainer.cfg).optim.compiled == stochastic  # its Triton kernel, or torch's fused AdamW
    assert trainer.cfg.optim.stochastic_rounding is stochastic  # decided, so config.json and checkpoints say so


@pytest.mark.parametrize("precision", ["fp32", "amp_bf16", "bf16_fp32_master", "bf16"])
def test_every_precision_trains_a_step(make_trainer, precision):
    """Each train.precision runs a training step (amp_bf16: under autocast, through the chunked loss) to a finite
    loss and gradient norm."""
    trainer = make_trainer("train.steps=1", f"train.precision={precision}")
    out = trainer.train_step(0)
    assert torch.isfinite(out["loss"]) and torch.isfinite(out["grad_norm"]), precision


def test_balancing_losses_take_their_own_coefficients(tmp_path):
    """The step's gradient is that of ce + (train.aux_loss_coef x mean aux loss + train.z_loss_coef x mean z-loss)
    per micro-batch, averaged over the step's two micro-batches (summed, the update is another): the two
    coefficients differ (0.01 and 0.3) and each loss's value comes from the MoE layers of a reference copy, so a
    z-loss scaled by the aux coefficient (or the reverse) gives another update. A large eps makes AdamW's update
    follow the gradients' scale."""
    import copy

    from moe_tune.distributed.process_group import destroy_distributed
    from moe_tune.train import Trainer

    aux_coef, z_coef = 0.01, 0.3
    overrides = [f"train.aux_loss_coef={aux_coef}", f"train.z_loss_coef={z_coef}", "optim.eps=0.01"]
    overrides.append("train.global_batch_size=4")  # two micro-batches of FAST's 2 rows
    cfg = to_config(compose([f"output_dir={tmp_path}", "checkpoint.export_hf=false", *FAST, *overrides]))
    trainer = Trainer(cfg)
    try:
        reference = copy.deepcopy(trainer.model)
        batches = step_batches(trainer, 0)
        assert len(batches) == 2
        normalizer = trainer._loss_normalizer(batches)
        z_share = 0.0
        for ids, labels, pos in batches:
            out = reference(ids, labels=labels, position_ids=pos, loss_normalizer=normalizer)
            ce, stats = out.ce_loss, out.moe_stats
            aux = torch.stack(stats.aux_loss).mean()
            z = torch.stack(stats.z_loss).mean()
            (ce + (aux_coef * aux + z_coef * z) / len(batches)).backward()
            z_share = max(z_share, float(z_coef * z.detach() / ce.detach()))
        assert z_share > 1e-3  # the z-loss term is large enough to move the update beyond the tolerance
        params = [p for p in reference.parameters() if p.requires_grad]
        torch.nn.utils.clip_grad_norm_(params, cfg.optim.max_grad_norm)
        g = trainer.optimizer.param_groups[0]
        opt = torch.optim.AdamW(params, lr=g["lr"], betas=g["betas"], eps=0.01, weight_decay=g["weight_decay"])
        opt.step()

        trainer.train_step(0)
        for (name, a), b in zip(trainer.model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-7, msg=name)
    finally:
        destroy_distributed()


def test_weight_decay_follows_the_names_of_the_trainers_model(make_trainer, tiny_checkpoint):
    """The trainer hands the optimizer its model's parameter names: GPT-OSS's stacked expert biases ([experts, out],
    not 1-D) get no weight decay, its expert matrices do (tests/optim/test_weight_decay.py: the rule itself)."""
    path = tiny_checkpoint("gpt_oss")
    trainer = make_trainer("model=hf", f"model.path={path}", "data=random", "optim.weight_decay=0.1")
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    decay = {names[id(p)]: g["weight_decay"] for g in trainer.optimizer.param_groups for p in g["params"]}
    assert decay["model.layers.0.mlp.experts.gate_up_proj_bias"] == 0.0
    assert decay["model.layers.0.mlp.experts.gate_up_proj"] == 0.1


def _edge_label_batches(vocab: int, seq: int) -> list[tuple[torch.Tensor, torch.Tensor, None]]:
    """Two micro-batches of 2 rows: the first with 3 label tokens after the shift, the second with 93; four rows
    carry a label at position 0 (which the shifted loss never uses) and two at the last position (which it
    does), so a count of unshifted labels, or of labels[:, :-1], differs from the right one."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (2, 2, seq), generator=g)
    keep = torch.zeros(2, 2, seq, dtype=torch.bool)
    keep[0, 0, [0, 7]] = True
    keep[0, 1, [0, 20, seq - 1]] = True
    keep[1, 0, : seq - 1] = True  # all but the last
    keep[1, 1, :] = True
    labels = torch.where(keep, ids, torch.full_like(ids, -100))
    return [(ids[m], labels[m], None) for m in range(2)]


def test_loss_normalizer_counts_the_shifted_label_positions_of_all_micro_batches(trainer):
    """The step's loss (and the scale of its gradients) is the cross-entropy summed over the positions the shifted
    loss uses, over every micro-batch, divided by their number: 3 + 93 here, not a mean of per-micro-batch means,
    not a count of unshifted labels (100) or of labels[:, :-1] (98)."""
    seq = trainer.cfg.train.seq_len
    batches = _edge_label_batches(trainer.model.config.vocab_size, seq)
    shifted = [int((labels[:, 1:] != -100).sum()) for _, labels, _ in batches]
    assert shifted == [3, 2 * seq - 3]
    assert sum(int((labels != -100).sum()) for _, labels, _ in batches) == sum(shifted) + 4
    assert sum(int((labels[:, :-1] != -100).sum()) for _, labels, _ in batches) == sum(shifted) + 2
    ce_sum = 0.0
    with torch.no_grad():
        for ids, labels, _ in batches:
            logits = trainer.model(ids, return_logits=True).logits
            ce_sum += F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).double(),
                labels[:, 1:].reshape(-1),
                ignore_index=-100,
                reduction="sum",
            ).item()
    trainer._micro_batch = lambda step, micro: batches[micro]
    loss = float(trainer.train_step(0)["loss"])
    assert loss == pytest.approx(ce_sum / sum(shifted), rel=1e-6)


@pytest.mark.parametrize("seq_len, warned", [(8192, True), (4096, False)])
def test_a_sequence_past_the_models_positions_is_warned_about(make_trainer, monkeypatch, seq_len, warned):
    """train.seq_len beyond config.json's max_position_embeddings (4096 for the tiny preset) trains on positions
    the model never saw: a warning names both and the fixes."""
    from moe_tune import build as module

    warnings = []  # the Trainer reconfigures logging (so pytest's caplog would miss it)
    monkeypatch.setattr(module.log, "warning", lambda msg, *args: warnings.append(msg % args))
    make_trainer("train.steps=1", f"train.seq_len={seq_len}", "train.micro_batch_size=1")
    hits = [w for w in warnings if "max_position_embeddings" in w]
    assert bool(hits) == warned
    assert not warned or hits[0].startswith(
        "train.seq_len=8192 is longer than the model's max_position_embeddings=4096"
    )
