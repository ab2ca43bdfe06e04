"""LoRA runs (fp32, CPU; in process, as harness.train_run and harness.run_main run them): only the adapters train and only they are checkpointed; resume is bitwise;
hf/ is a PEFT adapter directory that PEFT loads onto the base with moe_tune's logits, and moe-tune-export --merge
writes the merged model with the same logits; a checkpoint refuses a base it was not trained on."""

from __future__ import annotations

import os

import pytest
import torch

from moe_tune.cli.export import main as export_main
from tests.harness import FAST_RUN, copy_checkpoint, read_hf_tensors, read_metrics, run_main, train_run
from tests.tiny import LORA_TOL, load_hf, rel_err

peft = pytest.importorskip("peft", reason="the LoRA exports are checked with PEFT (in the dev extra)")

LORA = ["peft=lora", "peft.rank=8", "peft.target=[attention,experts]", "train.lr=3e-2", *FAST_RUN]


def _checkpoint_keys(path) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return list(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _export(args: list) -> object:
    """``moe-tune-export args`` (in this process)."""
    return run_main([str(a) for a in args], main=export_main)


def test_lora_trains_adapters_only_resumes_bitwise_and_exports_for_peft(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ["train.steps=6", "checkpoint.every=3", *LORA]
    train_run([f"output_dir={straight}", *common])

    # The checkpoint: adapters and their AdamW moments only, no base weight.
    keys = _checkpoint_keys(straight / "checkpoints" / "step_3")
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora." in k for k in model_keys), model_keys[:3]
    assert all(".lora." in k for k in keys if k.startswith("optim."))
    assert any(".experts.lora.gate_up_A@7" in k for k in model_keys)  # expert adapters stored one per expert

    # Resume: 3 steps, then 3 more from checkpoints/step_3, equals 6 straight, bitwise.
    copy_checkpoint(straight, resumed, 3)
    train_run([f"output_dir={resumed}", *common])
    a, b = [r["loss"] for r in read_metrics(straight)][3:], [r["loss"] for r in read_metrics(resumed)]
    assert len(b) == 3 and a == b, (a, b)
    sa, sb = read_hf_tensors(straight / "hf"), read_hf_tensors(resumed / "hf")
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)

    # hf/ through PEFT onto the untouched base == moe_tune's model from the last checkpoint == the merged export.
    from moe_tune.build import from_checkpoint

    ours, _ = from_checkpoint(str(straight / "checkpoints" / "step_6"))
    ids = torch.randint(0, ours.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = ours.eval()(ids).logits
        base = _hf(straight / "base_model")
        assert rel_err(base(input_ids=ids).logits, logits) > 100 * LORA_TOL  # training moved the adapters
        via_peft = peft.PeftModel.from_pretrained(base, str(straight / "hf")).eval()(input_ids=ids).logits
        assert rel_err(via_peft, logits) < LORA_TOL
        merged_dir = tmp_path / "merged"
        r = _export([straight / "checkpoints" / "step_6", merged_dir, "--merge"])
        assert r.returncode == 0, r.stderr[-2000:]
        assert rel_err(_hf(merged_dir)(input_ids=ids).logits, logits) < LORA_TOL
    assert not os.path.exists(merged_dir / "adapter_config.json")


def test_a_checkpoint_of_adapters_on_tied_embeddings_holds_no_base_weight(tmp_path):
    """Tied embeddings are in the state dict twice (``lm_head.weight`` too), and the base is held in bf16 while
    training (bf16_fp32_master): the checkpoint still holds adapters only, so the merged export of an fp32 base
    keeps its embedding bit for bit (not the bf16 copy training held)."""
    from moe_tune.models.presets import build_tokenizer
    from tests.tiny import save_tiny

    src = save_tiny(tmp_path / "src", "qwen3_moe", tie_word_embeddings=True)
    build_tokenizer(src)
    run, step = tmp_path / "run", tmp_path / "run" / "checkpoints" / "step_1"
    args = ["model=hf", f"model.path={src}", "train.steps=1", "checkpoint.every=1", "checkpoint.export_hf=false"]
    train_run([f"output_dir={run}", *args, "peft=lora", "peft.rank=8", *FAST_RUN[:3]])
    model_keys = [k for k in _checkpoint_keys(step) if k.startswith("model.")]
    assert model_keys and all(".lora." in k for k in model_keys), [k for k in model_keys if ".lora." not in k]
    r = _export([step, tmp_path / "merged", "--merge"])
    assert r.returncode == 0, r.stderr[-2000:]
    key = "model.embed_tokens.weight"
    assert torch.equal(read_hf_tensors(tmp_path / "merged")[key], read_hf_tensors(src)[key])


def test_a_checkpoint_of_adapters_refuses_another_base_and_follows_a_moved_one(tmp_path):
    """Adapters trained on the tiny model drawn with seed 0: resumed onto the one drawn with seed 1, exit 2;
    exported with --base naming that other base, exit 2; with --base naming a moved copy of their own, exported."""
    import shutil

    first, second = tmp_path / "first", tmp_path / "second"
    step = first / "checkpoints" / "step_2"
    assert run_main([f"output_dir={first}", "train.steps=2", "checkpoint.every=2", *LORA]).returncode == 0
    r = run_main([f"output_dir={second}", "train.steps=4", "train.seed=1", f"checkpoint.resume={step}", *LORA])
    assert r.returncode == 2, r.stderr[-2000:]
    (line,) = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert "holds LoRA adapters of another base model" in line and str(second / "base_model") in line

    # The refused resume took back the base model it had built in second/ (nothing written); another run keeps
    # the seed-1 base to name with --base.
    other = tmp_path / "other"
    other_run = [f"output_dir={other}", "train.steps=1", "train.seed=1", "checkpoint.export_hf=false", *LORA]
    assert run_main(other_run).returncode == 0
    export = [step, tmp_path / "out", "--merge", "--base"]
    r = _export([*export, other / "base_model"])
    assert r.returncode == 2 and "another base model" in r.stderr, r.stderr[-2000:]
    assert "give --base the directory of the base model" in r.stderr and "model.path" not in r.stderr
    assert "model.path=<its directory>" in line  # the resume's own fix
    shutil.move(first / "base_model", tmp_path / "moved_base")
    r = _export(export[:-1])
    assert r.returncode == 2 and "--base <dir>" in r.stderr, r.stderr[-2000:]
    r = _export([*export, tmp_path / "moved_base"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert os.path.isfile(tmp_path / "out" / "config.json")


def test_export_merge_of_a_full_fine_tune_is_refused(tmp_path):
    train_run([f"output_dir={tmp_path}", "train.steps=1", "checkpoint.every=1", *FAST_RUN])
    r = _export([tmp_path / "checkpoints" / "step_1", tmp_path / "out", "--merge"])
    assert r.returncode == 2 and "--merge applies to LoRA runs" in r.stderr
    assert r.stderr.rstrip().endswith("whose export is the whole model already: drop --merge"), r.stderr[-2000:]
    assert not os.path.exists(tmp_path / "out")


def test_a_run_on_experts_grouped_gemms_cannot_take_exports_and_merges(tmp_path, tiny_checkpoint):
    """Expert rows of 37 values (no 16 bytes in fp32) train with kernels.experts=loop; from_checkpoint, and so
    moe-tune-export --merge, build the run's model with its loop too (grouped GEMMs refuse those dims), and the
    merged model gives moe_tune's logits."""
    from moe_tune.build import from_checkpoint

    base = tiny_checkpoint("mixtral", hidden_size=32, intermediate_size=37, head_dim=8)
    out = tmp_path / "run"
    run = [f"output_dir={out}", f"model.path={base}", "kernels.experts=loop", "train.steps=1", "checkpoint.every=1"]
    train_run([*run, *LORA])
    step = out / "checkpoints" / "step_1"
    model, _ = from_checkpoint(str(step))
    assert _export([step, tmp_path / "merged", "--merge"]).returncode == 0
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # transformers' own grouped experts refuse those dims too: its per-expert loop reads the merged model
        merged = load_hf(tmp_path / "merged").eval()
        assert rel_err(merged(ids).logits, model.eval()(input_ids=ids).logits) < LORA_TOL


def _snapshot(run) -> dict:
    """Every entry under ``run`` with its inode, size, modification and change times: a write, or a move away and
    back (a ``base_model/`` set aside and restored), changes them. ``run``'s own times are left out: the
    writability probe (``check_output_dir``) creates and removes an entry in it."""
    out = {}
    for root, dirs, files in os.walk(run):
        for name in [*dirs, *files]:
            st = os.stat(os.path.join(root, name))
            key = os.path.relpath(os.path.join(root, name), run)
            out[key] = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return out


def test_a_lora_resume_with_another_seed_is_refused_before_anything_is_written(tmp_path):
    """A LoRA run of the tiny preset drawn with train.seed=0, resumed in its output_dir with train.seed=1: refused
    (exit 2, the seeds named) from the checkpoint's meta.json, before base_model/ is set aside and drawn again and
    before the run lock is written: the directory is as the first run left it, entry for entry."""
    run = tmp_path / "run"
    first = [f"output_dir={run}", "train.steps=2", "checkpoint.every=2", "checkpoint.export_hf=false", *LORA]
    assert run_main(first).returncode == 0
    before = _snapshot(run)
    r = run_main([*first, "train.steps=4", "train.seed=1"])
    assert r.returncode == 2, r.stderr[-2000:]
    (line,) = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert f"this run draws {run / 'base_model'} with train.seed=1" in line and "give train.seed=0" in line, line
    assert _snapshot(run) == before
