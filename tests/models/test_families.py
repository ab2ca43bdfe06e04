"""Parity with Hugging Face eager for every family, litgpt style: a tiny random checkpoint is saved with
``save_pretrained``, loaded through moe_tune, and compared in fp32 (logits, loss, aux loss, every gradient);
then save/load round trips and the exported directory is read back by plain transformers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import moe_tune
from moe_tune.config import CheckpointError, ConfigError
from tests.harness import run_main
from tests.tiny import FAMILIES, VOCAB, build_hf, load_hf, rel_err, save_tiny

TOL = 1e-5  # relative (norm of the difference over the norm of the reference), fp32


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, request):
    return save_tiny(tmp_path_factory.mktemp(request.param), request.param)


def parametrize_families():
    return pytest.mark.parametrize("checkpoint", FAMILIES, indirect=True)


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))


def _disk(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@parametrize_families()
def test_logits_and_loss_match_hf(checkpoint):
    hf = load_hf(checkpoint).eval()
    ours = moe_tune.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = _ids()
    with torch.no_grad():
        ref = hf(ids, labels=ids)
        out = ours(input_ids=ids, labels=ids, return_logits=True)
    assert rel_err(out.logits, ref.logits) < TOL
    assert rel_err(out.loss, ref.loss) < TOL
    # Routing is not trivial: every MoE layer spreads tokens over more experts than top-k.
    moes = ours.moe_layers()
    assert out.moe_stats.layer_idx == tuple(m.layer_idx for m in moes)
    for moe, counts_E in zip(moes, out.moe_stats.counts_E, strict=True):
        assert int((counts_E > 0).sum()) > moe.spec.router.top_k


def _assert_grads_match(checkpoint: str, seed: int) -> None:
    hf = load_hf(checkpoint).train()
    # HF adds no aux loss unless output_router_logits; ours is tested on its own below.
    ours = moe_tune.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, aux_loss_coef=0.0).train()
    ids = _ids(seed)
    ref = hf(ids, labels=ids)
    out = ours(input_ids=ids, labels=ids, return_logits=True)
    assert rel_err(out.logits, ref.logits) < TOL
    assert rel_err(out.loss, ref.loss) < TOL
    ref.loss.backward()
    out.loss.backward()
    theirs, mine = dict(hf.named_parameters()), dict(ours.named_parameters())
    assert sorted(theirs) == sorted(mine)
    for name, p in theirs.items():
        assert p.grad is not None and mine[name].grad is not None, name
        # The absolute floor only matters for gradients that are zero in exact arithmetic (a top-1 router whose
        # gate is renormalised to 1 gets rounding noise of ~1e-8 in both models).
        assert (mine[name].grad - p.grad).norm() <= TOL * p.grad.norm() + 1e-7, name
    routers = [n for n in theirs if n.endswith(("mlp.gate.weight", "mlp.router.weight"))]
    assert len(routers) == len(ours.moe_layers()) > 0


@parametrize_families()
def test_gradients_match_hf(checkpoint):
    _assert_grads_match(checkpoint, seed=1)


VARIANTS = [
    ("deepseek_v3", dict(q_lora_rank=None)),  # DeepSeek-V2-Lite style attention
    ("deepseek_v3", dict(rope_interleave=False, n_group=1, topk_group=1)),
    (
        "deepseek_v3",
        dict(
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=1e4,
                factor=4.0,
                original_max_position_embeddings=16,
                mscale=1.0,
                mscale_all_dim=1.0,
                beta_fast=32,
                beta_slow=1,
            )
        ),
    ),
    ("qwen3_moe", dict(mlp_only_layers=[0])),
    ("qwen3_moe", dict(hidden_act="swish", mlp_only_layers=[1])),  # transformers' other name for SiLU
    ("qwen2_moe", dict(decoder_sparse_step=2, norm_topk_prob=True)),
    ("mixtral", dict(num_experts_per_tok=1)),
    ("olmoe", dict(norm_topk_prob=True, num_experts_per_tok=3)),
    ("gpt_oss", dict(num_experts_per_tok=4, rope_parameters=dict(rope_type="default", rope_theta=1e4))),
    ("glm4_moe", dict(use_qk_norm=False, n_group=1, topk_group=1, norm_topk_prob=False)),
]


@pytest.mark.parametrize("model_type,overrides", VARIANTS, ids=[f"{m}-{'-'.join(o)}" for m, o in VARIANTS])
def test_config_variants_match_hf(model_type, overrides, tiny_checkpoint):
    """Dense layers in other places, other attention and rotary flavours, other top-k and renormalisation."""
    _assert_grads_match(tiny_checkpoint(model_type, **overrides), seed=7)


def test_mixtral_input_jitter_draws_what_transformers_draws(tiny_checkpoint):
    """``router_jitter_noise``: in training each element of the MoE block's input is scaled by U(1 - j, 1 + j), one
    draw as transformers makes it, so the same seed gives HF's logits and loss (fp32, TOL); another seed moves the
    logits (the jitter is on); eval mode draws none."""
    path = tiny_checkpoint("mixtral", router_jitter_noise=0.2)
    hf = load_hf(path).train()
    ours = moe_tune.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, aux_loss_coef=0.0).train()
    ids = _ids(3)
    torch.manual_seed(11)
    ref = hf(ids, labels=ids)
    torch.manual_seed(11)
    out = ours(input_ids=ids, labels=ids, return_logits=True)
    assert rel_err(out.logits, ref.logits) < TOL
    assert rel_err(out.loss, ref.loss) < TOL
    torch.manual_seed(12)
    assert rel_err(ours(input_ids=ids, labels=ids, return_logits=True).logits, ref.logits) > 1e-2
    with torch.no_grad():
        assert rel_err(ours.eval()(input_ids=ids, return_logits=True).logits, hf.eval()(ids).logits) < TOL


def _router_outputs(hf) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(router logits, chosen experts) of each HF MoE layer, recorded by forward hooks on the router."""
    outs = []
    for layer in hf.model.layers:
        block = layer.mlp
        router = getattr(block, "gate", None) or getattr(block, "router", None)
        if router is not None and hasattr(block, "experts"):
            router.register_forward_hook(lambda m, i, o: outs.append((o[0].detach(), o[2].detach())))
    return outs


@parametrize_families()
def test_aux_loss_matches_hand_formula(checkpoint):
    """Our per-layer Switch/GShard loss ``E/(T*K) * sum_i count_i * mean_t p_ti`` from HF's own routing, with
    ``p`` the family's router probabilities (softmax, or sigmoid scores normalised per token)."""
    hf = load_hf(checkpoint).train()
    # DeepSeek-V3 and GLM-4-MoE configs have no coefficient (they balance by expert bias): give one.
    ours = moe_tune.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, aux_loss_coef=0.01).train()
    recorded = _router_outputs(hf)
    ids = _ids(2)
    with torch.no_grad():
        hf(ids)
        out = ours(input_ids=ids, labels=ids)
    moes = ours.moe_layers()
    assert len(recorded) == len(moes) > 0
    sigmoid = moes[0].spec.router.score == "sigmoid"
    stats = out.moe_stats  # the forward's routing statistics, one entry per MoE layer
    assert len(stats.counts_E) == len(stats.aux_loss) == len(moes)
    for (logits_TE, ids_TK), counts, aux in zip(recorded, stats.counts_E, stats.aux_loss, strict=True):
        T, E = logits_TE.shape
        K = ids_TK.shape[1]
        probs_TE = logits_TE.sigmoid() if sigmoid else logits_TE.softmax(-1)
        probs_TE = probs_TE / probs_TE.sum(-1, keepdim=True)
        counts_E = torch.bincount(ids_TK.reshape(-1), minlength=E).double()
        expected = E / T * (counts_E * probs_TE.double().mean(0)).sum()
        assert torch.equal(counts, counts_E.long())
        assert rel_err(aux, expected) < TOL
        if not sigmoid:
            # Hugging Face's load_balancing_loss_func on one softmax router's logits: the same value (same
            # scaling, K when balanced), so published router_aux_loss_coef values keep their strength.
            from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

            assert rel_err(aux, load_balancing_loss_func((logits_TE,), E, K)) < TOL
    # The model's aux loss is the mean over MoE layers, added to the CE loss with aux_loss_coef.
    assert rel_err(out.aux_loss, torch.stack(stats.aux_loss).mean()) < 1e-6
    assert rel_err(out.loss, out.ce_loss + 0.01 * out.aux_loss) < 1e-6


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_default_balancing_loss_is_the_one_transformers_adds(tiny_checkpoint, family):
    """Without ``aux_loss_coef``, a training forward's loss holds the balancing loss where transformers' does: the
    config's router_aux_loss_coef when it outputs the router logits, none otherwise (the same loss as
    transformers' then; with router logits the two losses are each model's own, tested above)."""
    ids = _ids(3)
    for logits in (False, True):
        path = tiny_checkpoint(family, router_aux_loss_coef=0.05, output_router_logits=logits)
        ours = moe_tune.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
        out = ours(input_ids=ids, labels=ids)
        assert rel_err(out.loss, out.ce_loss + 0.05 * out.aux_loss if logits else out.ce_loss) < 1e-6
        if not logits:
            assert rel_err(out.loss, load_hf(path).train()(ids, labels=ids).loss) < TOL


def test_an_aux_loss_coef_of_0_adds_no_balancing_loss_where_the_config_gives_one(tiny_checkpoint):
    """aux_loss_coef=0.0 (the CLI passes it where nothing trains the router, peft=lora) is a coefficient, not
    "unset": the loss is the cross-entropy alone though the config outputs router logits with router_aux_loss_coef."""
    ids = _ids(3)
    path = tiny_checkpoint("qwen3_moe", router_aux_loss_coef=0.05, output_router_logits=True)
    ours = moe_tune.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, aux_loss_coef=0.0).train()
    out = ours(input_ids=ids, labels=ids)
    assert torch.equal(out.loss, out.ce_loss)


@parametrize_families()
def test_save_load_bit_exact_and_hf_reads_export(checkpoint, tmp_path):
    ours = moe_tune.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    out_dir = str(tmp_path / "export")
    ours.save_pretrained(out_dir)

    src, exported = _disk(checkpoint), _disk(out_dir)
    assert sorted(exported) == sorted(src)
    for k, t in src.items():
        assert exported[k].shape == t.shape and exported[k].dtype == t.dtype, k
        torch.testing.assert_close(exported[k], t, rtol=0, atol=0, msg=k)
    assert os.path.isfile(os.path.join(out_dir, "generation_config.json"))
    with open(os.path.join(checkpoint, "config.json")) as f, open(os.path.join(out_dir, "config.json")) as g:
        assert json.load(f) == json.load(g)

    again = moe_tune.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    a, b = ours.state_dict(), again.state_dict()
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=k)

    ids = _ids(3)
    with torch.no_grad():
        ref = load_hf(checkpoint).eval()(ids).logits
        hf_export = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
        torch.testing.assert_close(load_hf(out_dir).eval()(ids).logits, ref, rtol=0, atol=0)
        assert rel_err(hf_export(ids).logits, ours.eval()(input_ids=ids).logits) < TOL


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory, request):
    return save_tiny(tmp_path_factory.mktemp(f"{request.param}_bf16"), request.param, dtype=torch.bfloat16)


@pytest.mark.parametrize("bf16_checkpoint", FAMILIES, indirect=True)
def test_bf16_source_keeps_dtypes_on_export(bf16_checkpoint, tmp_path):
    """A bf16 checkpoint (DeepSeek-V3 and GLM-4-MoE keep the router weight and correction bias in fp32) exports
    with the same key dtypes and bits, whether loaded in bf16 or upcast to fp32."""
    disk = _disk(bf16_checkpoint)
    assert any(t.dtype == torch.bfloat16 for t in disk.values())
    for dtype in (torch.bfloat16, torch.float32):
        ours = moe_tune.AutoModelForCausalLM.from_pretrained(bf16_checkpoint, dtype=dtype)
        hf = load_hf(bf16_checkpoint, dtype=dtype)
        assert {k: v.dtype for k, v in ours.state_dict().items()} == {k: v.dtype for k, v in hf.state_dict().items()}
        out_dir = str(tmp_path / str(dtype).replace("torch.", ""))
        ours.save_pretrained(out_dir)
        exported = _disk(out_dir)
        assert sorted(exported) == sorted(disk)
        for k, t in disk.items():
            assert exported[k].dtype == t.dtype and exported[k].shape == t.shape, k
            torch.testing.assert_close(exported[k], t, rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("bf16_checkpoint", FAMILIES, indirect=True)
def test_bf16_moe_block_as_accurate_as_hf(bf16_checkpoint):
    """In bf16 the results cannot be equal (other summation orders; our gates stay fp32 until the combine), so
    measure both against the same block in fp32: ours must be about as close to it as Hugging Face's bf16 is."""
    ours = moe_tune.AutoModelForCausalLM.from_pretrained(bf16_checkpoint, dtype=torch.bfloat16).eval()
    hf = load_hf(bf16_checkpoint, dtype=torch.bfloat16).eval()
    ref = load_hf(bf16_checkpoint, dtype=torch.float32).eval()
    x = torch.randn(4, 32, ours.config.hidden_size, generator=torch.Generator().manual_seed(8))

    def block(model, dtype):
        y = model.model.layers[-1].mlp(x.to(dtype))
        return (y[0] if isinstance(y, tuple) else y).float()

    with torch.no_grad():
        y_ref, y_hf, y_ours = block(ref, torch.float32), block(hf, torch.bfloat16), block(ours, torch.bfloat16)
    assert rel_err(y_ours, y_ref) < 1.25 * rel_err(y_hf, y_ref)
    assert rel_err(y_ours, y_hf) < 1e-2


def test_tied_embeddings(tmp_path, tiny_checkpoint):
    src = tiny_checkpoint("qwen3_moe", tie_word_embeddings=True)
    assert "lm_head.weight" not in _disk(src)
    ours = moe_tune.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    ids = _ids(5)
    with torch.no_grad():
        assert rel_err(ours(input_ids=ids).logits, load_hf(src).eval()(ids).logits) < TOL
    ours.save_pretrained(str(tmp_path / "out"))
    assert sorted(_disk(str(tmp_path / "out"))) == sorted(_disk(src))


def test_tied_config_with_a_head_unlike_the_embedding_is_refused(tiny_checkpoint):
    """config.json says tie_word_embeddings=true and the weights hold an lm_head.weight: transformers ties the two
    only where they are equal (it keeps both otherwise), so another head is a CheckpointError naming both keys and
    the fix, never dropped; an equal one ties, as transformers does, with its logits."""
    src = tiny_checkpoint("qwen3_moe", tie_word_embeddings=False)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump({**cfg, "tie_word_embeddings": True}, f)
    with pytest.raises(
        CheckpointError,
        match="tie_word_embeddings=true but its lm_head.weight differs from "
        'model.embed_tokens.weight.*"tie_word_embeddings": false',
    ):
        moe_tune.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    weights = _disk(src)
    save_file(
        {**weights, "lm_head.weight": weights["model.embed_tokens.weight"].clone()},
        os.path.join(src, "model.safetensors"),
    )
    ours = moe_tune.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    with torch.no_grad():
        assert rel_err(ours(input_ids=_ids(5)).logits, load_hf(src).eval()(_ids(5)).logits) < TOL


def test_a_tied_source_that_stores_its_head_exports_it(tmp_path, tiny_checkpoint):
    """tie_word_embeddings=true with an lm_head.weight in the files, equal to the embedding (some releases store
    both): transformers loads it, and the export keeps the key (it was dropped), the embedding's values in it, the
    source's dtype, and the same logits in transformers."""
    src = tiny_checkpoint("qwen3_moe", tie_word_embeddings=True)
    weights = _disk(src)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, os.path.join(src, "model.safetensors"))
    ours = moe_tune.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    out = str(tmp_path / "out")
    ours.save_pretrained(out)
    exported = _disk(out)
    assert sorted(exported) == sorted(weights)
    assert {k: t.dtype for k, t in exported.items()} == {k: t.dtype for k, t in weights.items()}
    assert torch.equal(exported["lm_head.weight"], exported["model.embed_tokens.weight"])
    with torch.no_grad():
        assert rel_err(load_hf(out).eval()(_ids(5)).logits, ours(input_ids=_ids(5)).logits) < TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_stacked_expert_layout_on_disk(tmp_path, family):
    """A checkpoint in transformers v5's in-memory layout (``save_pretrained(save_original_format=False)``: experts
    stacked, ``experts.gate_up_proj``, and Mixtral's block named ``mlp``, not ``block_sparse_moe``) loads as well as
    the per-expert layout, and exports in the layout it came in."""
    hf = build_hf(family).eval()
    src = tmp_path / "stacked"
    hf.save_pretrained(src, save_original_format=False)
    assert "model.layers.1.mlp.experts.gate_up_proj" in _disk(str(src))
    ours = moe_tune.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    ids = _ids(6)
    with torch.no_grad():
        assert rel_err(ours(input_ids=ids).logits, hf(ids).logits) < TOL
    ours.save_pretrained(str(tmp_path / "out"))
    exported, disk = _disk(str(tmp_path / "out")), _disk(str(src))
    assert sorted(exported) == sorted(disk)
    for k, t in disk.items():
        torch.testing.assert_close(exported[k], t, rtol=0, atol=0, msg=k)


def test_sharded_checkpoint_round_trip(tmp_path):
    src = str(tmp_path / "src")
    build_hf("mixtral").save_pretrained(src, max_shard_size="40KB")
    assert os.path.isfile(os.path.join(src, "model.safetensors.index.json"))
    ours = moe_tune.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    out = str(tmp_path / "out")
    ours.save_pretrained(out, max_shard_bytes=40_000)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1
    again = moe_tune.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for k, v in ours.state_dict().items():
        torch.testing.assert_close(again.state_dict()[k], v, rtol=0, atol=0, msg=k)


def test_a_model_safetensors_beside_an_index_of_other_shards_is_refused(tmp_path):
    """transformers loads model.safetensors where one is present and the index otherwise: a directory with both
    (a sharded save copied over a one-file one) gave the two libraries different weights without a word."""
    import shutil

    src = str(tmp_path / "src")
    build_hf("mixtral").save_pretrained(src, max_shard_size="40KB")
    other = str(tmp_path / "one")
    build_hf("mixtral", seed=1).save_pretrained(other)
    shutil.copy(os.path.join(other, "model.safetensors"), src)
    with pytest.raises(CheckpointError, match="holds both model.safetensors and model.safetensors.index.json"):
        moe_tune.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)


def test_an_index_naming_model_safetensors_itself_loads(tmp_path):
    """An index whose one shard is model.safetensors (a one-file checkpoint saved with an index) is what
    transformers reads either way: loaded, not refused as a model.safetensors beside an index of other shards."""
    from safetensors import safe_open as open_file

    src = str(tmp_path / "src")
    build_hf("mixtral").save_pretrained(src)
    with open_file(os.path.join(src, "model.safetensors"), "pt") as f:
        weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    with open(os.path.join(src, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    moe_tune.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)


def test_a_directory_without_safetensors_files_is_named_as_such(tmp_path):
    """Weights in another format only: said so, not a list of every tensor the model misses."""
    from moe_tune.models.hf_io import CheckpointReader

    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"holds no \*.safetensors files; give a Hugging Face checkpoint"):
        CheckpointReader(str(tmp_path))


def test_pytorch_bin_weights_are_named_with_the_conversion(tiny_checkpoint, tmp_path):
    """An older release's ``pytorch_model.bin`` (a Hugging Face checkpoint all the same) is named, with the
    conversion transformers makes, for the CLI (exit 2, nothing written) and the Python API alike; the
    converted directory loads."""
    from safetensors.torch import load_file

    src = tiny_checkpoint("mixtral")
    path = tmp_path / "bin_only"
    path.mkdir()
    for name in ("config.json", "generation_config.json"):
        (path / name).write_bytes((Path(src) / name).read_bytes())
    torch.save(load_file(os.path.join(src, "model.safetensors")), path / "pytorch_model.bin")
    line = (
        f"{path} holds PyTorch weights (pytorch_model.bin) and no *.safetensors files, the only weights moe_tune "
        f"reads; convert them once with transformers (AutoModelForCausalLM.from_pretrained('{path}')"
        ".save_pretrained(<dir>), then copy the tokenizer files there) and give <dir> in its place"
    )
    with pytest.raises(CheckpointError) as e:
        moe_tune.AutoModelForCausalLM.from_pretrained(str(path))
    assert str(e.value) == line
    out = tmp_path / "out"
    result = run_main([f"model.path={path}", "train.steps=1", f"output_dir={out}"])
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [f"moe-tune: error: {line}"]
    assert not out.exists()
    AutoModelForCausalLM.from_pretrained(str(path)).save_pretrained(tmp_path / "converted")
    moe_tune.AutoModelForCausalLM.from_pretrained(str(tmp_path / "converted"))


def test_mtp_layer_ignored_extra_tensors_refused(tiny_checkpoint):
    """DeepSeek-V3 checkpoints carry a multi-token-prediction layer (model.layers.61.*) that transformers skips;
    so do we. Any other tensor the model does not use is an error, not silently dropped."""
    from safetensors.torch import save_file

    src = Path(tiny_checkpoint("deepseek_v3"))
    extra = {"model.layers.61.eh_proj.weight": torch.zeros(4, 4)}
    save_file(extra, str(src / "model-mtp.safetensors"))
    moe_tune.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    save_file({"model.extra.weight": torch.zeros(4)}, str(src / "model-extra.safetensors"))
    with pytest.raises(CheckpointError, match="model.extra.weight"):
        moe_tune.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)


def test_a_tensor_in_two_loose_files_is_refused_naming_both(tiny_checkpoint):
    """Without an index, a backup copy beside model.safetensors (another model's weights, same keys) was read in
    its place because its name sorts later; transformers reads model.safetensors alone."""
    import shutil

    src, other = Path(tiny_checkpoint("qwen3_moe")), Path(tiny_checkpoint("qwen3_moe", seed=1))
    shutil.copy(other / "model.safetensors", src / "model_backup.safetensors")
    with pytest.raises(CheckpointError) as e:
        moe_tune.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    assert "is in both model.safetensors and model_backup.safetensors, and no model.safetensors.index.json" in str(
        e.value
    )


@pytest.mark.parametrize(
    "family,field,value,words",
    [
        ("qwen3_moe", "vocab_size", 120, "model.embed_tokens.weight has shape (128, 48), the model expects (120, 48)"),
        (
            "gpt_oss",
            "num_local_experts",
            4,
            "config.json: num_local_experts=4 but the safetensors weights beside it hold 8",
        ),
    ],
)
def test_tensor_with_more_rows_than_config_json_says_is_refused(tiny_checkpoint, family, field, value, words):
    """Tensors are read as row ranges: a config.json that says fewer rows (a vocabulary or an expert count cut
    down) loaded the first rows and dropped the rest without a word, where transformers refuses the mismatch. The
    expert count is checked against the safetensors headers before anything is built; the vocabulary at load."""
    src = Path(tiny_checkpoint(family))
    config = json.loads((src / "config.json").read_text())
    config[field] = value
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as e:
        moe_tune.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    assert words in str(e.value)


@pytest.mark.parametrize("family,layer", [("deepseek_v3", 61), ("glm4_moe", 46)])
def test_mtp_layer_is_exported_as_the_source_holds_it(tiny_checkpoint, tmp_path, family, layer):
    """The multi-token-prediction layer loading skips is carried into the export unchanged (keys, values, dtypes):
    config.json still names it (num_nextn_predict_layers), and speculative decoding reads it."""
    from safetensors.torch import save_file

    from tests.harness import read_hf_tensors

    src = Path(tiny_checkpoint(family))
    mtp = {
        f"model.layers.{layer}.eh_proj.weight": torch.randn(48, 96, dtype=torch.bfloat16),
        f"model.layers.{layer}.mlp.experts.3.down_proj.weight": torch.randn(48, 40),
    }
    save_file(mtp, str(src / "model-mtp.safetensors"))
    out = str(tmp_path / "out")
    moe_tune.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).save_pretrained(out)
    exported = read_hf_tensors(out)
    assert set(exported) == set(read_hf_tensors(src)) | set(mtp)  # read_hf_tensors reads model.safetensors
    for k, v in mtp.items():
        assert exported[k].dtype == v.dtype and torch.equal(exported[k], v), k


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_mtp_layer_right_past_the_model_is_skipped_where_config_names_it(tiny_checkpoint, tmp_path, family):
    """A multi-token-prediction layer at another depth than the published releases' (here layer 2 of a 2-layer
    model, config.json's num_nextn_predict_layers=1) loads as transformers loads it, skipped, not refused as
    tensors the model does not use; the export carries it over unchanged."""
    from safetensors.torch import save_file

    from tests.harness import read_hf_tensors

    src = Path(tiny_checkpoint(family, num_nextn_predict_layers=1))
    mtp = {
        "model.layers.2.eh_proj.weight": torch.randn(48, 96, dtype=torch.bfloat16),
        "model.layers.2.mlp.experts.3.down_proj.weight": torch.randn(48, 40),
    }
    save_file(mtp, str(src / "model-mtp.safetensors"))
    out = str(tmp_path / "out")
    moe_tune.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).save_pretrained(out)
    exported = read_hf_tensors(out)
    assert all(torch.equal(exported[k], v) for k, v in mtp.items())


def test_unsupported_architecture(tiny_checkpoint):
    llama = tiny_checkpoint("llama")
    with pytest.raises(ConfigError) as err:
        moe_tune.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
    msg = str(err.value)
    assert "'llama'" in msg and "LlamaForCausalLM" in msg
    for family in FAMILIES:
        assert family in msg


def test_an_expert_activation_other_than_silu_names_the_value_and_the_fix(tiny_checkpoint, tmp_path):
    """hidden_act='gelu' (transformers would run its experts with it; moe_tune's compute SwiGLU): one line naming
    the value and the fix, through the Python API and the command (exit 2, output_dir not made)."""
    src = tiny_checkpoint("qwen3_moe", hidden_act="gelu")
    with pytest.raises(ConfigError) as err:
        moe_tune.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    line = str(err.value)
    assert line.startswith("qwen3_moe: hidden_act='gelu', but moe_tune's experts compute SwiGLU only"), line
    assert "give a model with hidden_act='silu'" in line and "drop model.overrides.hidden_act" in line, line
    r = run_main(["+model.overrides.hidden_act=gelu", f"output_dir={tmp_path / 'run'}", "train.steps=1"])
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"moe-tune: error: {line}"], r.stderr[-2000:]
    assert not (tmp_path / "run").exists()


GROUP_ROUTING_REFUSED = [
    ("deepseek_v3", dict(n_group=3), "n_group=3 does not split n_routed_experts=8"),
    ("deepseek_v3", dict(n_group=8, topk_group=2), "n_group=8 does not split n_routed_experts=8"),
    ("glm4_moe", dict(topk_group=5), "topk_group=5 is more than n_group=4"),
    ("deepseek_v3", dict(n_group=None), "n_group=None must be a whole number >= 1"),
    ("glm4_moe", dict(topk_group=1, num_experts_per_tok=3), "num_experts_per_tok=3 is more than the 2 experts"),
]


@pytest.mark.parametrize("model_type,overrides,words", GROUP_ROUTING_REFUSED)
def test_group_limited_routing_transformers_cannot_run_is_refused(tiny_checkpoint, model_type, overrides, words):
    """n_group, topk_group and num_experts_per_tok of a sigmoid router: a split transformers' routing fails on
    (groups of unequal size, or of one expert, more groups kept than there are) or picks among -inf scores (more
    experts per token than the kept groups hold) is one ConfigError naming the values and the fix, before the
    model is built; the real releases' settings (tiny.py's) load."""
    with pytest.raises(ConfigError, match="set n_group to one of|raise topk_group") as err:
        moe_tune.AutoModelForCausalLM.from_pretrained(tiny_checkpoint(model_type, **overrides), dtype=torch.float32)
    assert words in str(err.value) and str(err.value).startswith(f"{model_type}: ")
