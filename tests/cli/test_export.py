"""``moe-tune-export``: a training checkpoint to a Hugging Face directory; bad input exits 2."""

import json

import pytest
import torch

from moe_tune.cli.export import main as export_main
from tests.harness import FAST_RUN, assert_hf_logits_equal, read_hf_tensors, run_main, run_ranks, train_run


def _moe_tune_export(args: list, cwd=None):
    """``moe-tune-export args`` (in this process: harness.run_main)."""
    return run_main([str(a) for a in args], cwd=cwd, main=export_main)


def _train_on_ranks(rank: int, overrides: list[str]) -> None:
    train_run(overrides)


def _export(checkpoint, out) -> None:
    r = _moe_tune_export([checkpoint, out])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Warning" not in r.stderr, r.stderr  # one process is intended: DCP's single-process warning is not shown


@pytest.mark.dist
def test_export_cli_from_ep2_checkpoint(tmp_path):
    """moe-tune-export of an EP=2 checkpoint (2 ranks) equals the run's own hf/ export, bit for bit."""
    overrides = [f"output_dir={tmp_path}", "train.steps=2", "checkpoint.every=2", "parallel.ep=2", *FAST_RUN]
    run_ranks(_train_on_ranks, 2, overrides)
    out = tmp_path / "exported"
    _export(tmp_path / "checkpoints" / "step_2", out)
    a, b = read_hf_tensors(tmp_path / "hf"), read_hf_tensors(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert_hf_logits_equal(str(out))


def test_export_cli_bad_input_exits_2(tmp_path):
    r = _moe_tune_export([tmp_path, tmp_path / "o"])
    assert r.returncode == 2 and "not a complete moe-tune checkpoint" in r.stderr


def test_export_refuses_a_directory_it_would_wipe(tmp_path):
    """An export replaces OUT as a whole: a directory holding anything no export writes (notes, the run itself,
    the working directory) is one line and exit 2, untouched; an earlier export is replaced."""
    import shutil

    run = tmp_path / "run"
    train_run([f"output_dir={run}", "train.steps=1", "checkpoint.every=1", *FAST_RUN])
    step = run / "checkpoints" / "step_1"
    notes = tmp_path / "mine"
    notes.mkdir()
    (notes / "notes.txt").write_text("precious")
    for out in (notes, run, tmp_path):
        before = sorted(p.name for p in out.iterdir())
        r = _moe_tune_export([step, out])
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2 and len(lines) == 1 and "which no export writes" in lines[0], r.stderr[-3000:]
        assert sorted(p.name for p in out.iterdir()) == before
    assert (notes / "notes.txt").read_text() == "precious"
    here = tmp_path / "here"  # empty, but the shell's current directory: replacing it would strand the shell
    here.mkdir()
    r = _moe_tune_export([step, "."], cwd=here)
    assert r.returncode == 2 and "is the current directory" in r.stderr and not list(here.iterdir()), r.stderr
    earlier = tmp_path / "earlier"
    shutil.copytree(run / "hf", earlier)
    (earlier / "model.safetensors").write_bytes(b"stale")
    link = tmp_path / "link"
    link.symlink_to(earlier)
    _export(step, link)  # through a symlink: the target is replaced, the link stays a link
    assert link.is_symlink() and not (tmp_path / ".link.old").exists()
    assert_hf_logits_equal(str(earlier))
    shutil.copytree(run / "hf", tmp_path / "no_checkpoints" / "hf")  # what a run with checkpoint.every=0 leaves
    for source, extra, said in [
        (step, ["--base", str(run / "base_model")], "--base applies to LoRA runs;"),
        (run, [], f"is a run directory: give one of its checkpoints, e.g. {step}"),
        (run / "hf", [], f"is the Hugging Face export of the run in {run}: give one of its checkpoints, e.g. {step}"),
        (earlier, [], f"{earlier} is a Hugging Face export, not a checkpoint: rerun with checkpoint.every=N"),
        (
            tmp_path / "no_checkpoints",
            [],
            "is a run directory without checkpoints (checkpoint.every=0, or the run stopped",
        ),
    ]:
        out = tmp_path / "new_out"
        r = _moe_tune_export([source, out, *extra])
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2 and len(lines) == 1 and said in lines[0] and not out.exists(), r.stderr[-3000:]


@pytest.mark.parametrize("peft", [[], ["peft=lora"]], ids=["full", "lora_adapter"])
def test_a_custom_chat_template_is_exported_with_the_model(tmp_path, peft):
    """data.chat_template renders the training records, so the exported model (or LoRA adapter) carries it
    (chat_template.jinja, which transformers prefers to the tokenizer's): in the run's hf/ and, from the
    checkpoint's own copy even once the file is gone, in moe-tune-export's output."""
    from transformers import AutoTokenizer, GenerationConfig

    from tests.data.test_formats import PLAIN_CHATML

    template = tmp_path / "custom.jinja"
    template.write_text("{#- custom -#}" + PLAIN_CHATML)
    data = tmp_path / "chat.jsonl"
    record = '{"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]}\n'
    data.write_text(record * 8)
    run = tmp_path / "run"
    args = [f"output_dir={run}", "data=jsonl", f"data.path={data}", f"data.chat_template={template}"]
    train_run([*args, *peft, "train.steps=2", "checkpoint.every=2", *FAST_RUN])
    assert (run / "hf" / "chat_template.jinja").read_text() == template.read_text()
    template.unlink()
    out = tmp_path / "exported"
    _export(run / "checkpoints" / "step_2", out)
    assert (out / "chat_template.jinja").read_text() == "{#- custom -#}" + PLAIN_CHATML
    if not peft:  # a full export loads as a tokenizer too (an adapter has no tokenizer files)
        tokenizer = AutoTokenizer.from_pretrained(out)
        assert tokenizer.chat_template.startswith("{#- custom -#}")
        # generate() stops where the template ends a turn, in the run's hf/ and in moe-tune-export's output
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        for path in (run / "hf", out):
            assert end in GenerationConfig.from_pretrained(path).eos_token_id


def _tree_digest(root) -> dict[str, str]:
    """Every file under ``root`` (relative path -> sha256 of its bytes): what a refusal must leave as it was."""
    import hashlib

    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def test_export_refuses_a_model_it_did_not_write_or_a_checkpoints_base(tmp_path, capsys):
    """A model directory is replaced by moe-tune-export only if it wrote it (moe_tune_export.json) and no
    checkpoint of the run reads its model there: a LoRA run's own base_model/ (with or without --merge, from any
    of its checkpoints; marked as an export too, as a run trained from an export would be) and a copied model
    directory are one line, exit 2, their files untouched. --overwrite replaces a model directory; an export (its
    own, a run's hf/) is replaced without it."""
    import shutil

    run = tmp_path / "lora"
    train_run([f"output_dir={run}", "peft=lora", "train.steps=2", "checkpoint.every=1", *FAST_RUN])
    base = run / "base_model"
    downloaded = tmp_path / "downloaded"  # a model directory moe_tune did not export (as a download is)
    shutil.copytree(base, downloaded)

    def refused(args: list[str]) -> str:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            export_main(args)
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert exit_.value.code == 2 and len(lines) == 1, lines
        return lines[0]

    (base / "moe_tune_export.json").write_text("{}")  # a checkpoint's source even so
    before, copy = _tree_digest(run), _tree_digest(downloaded)
    for step, merge in [("step_2", ["--merge"]), ("step_2", []), ("step_1", ["--merge"])]:
        line = refused([str(run / "checkpoints" / step), str(base), *merge])
        assert f"{base} is the model checkpoint {run / 'checkpoints' / step} was trained from" in line, line
        assert "--overwrite" in line
    step = str(run / "checkpoints" / "step_2")
    line = refused([step, str(downloaded), "--merge"])
    assert f"{downloaded} holds a model that moe-tune-export did not write" in line and "--overwrite" in line, line
    assert _tree_digest(run) == before and _tree_digest(downloaded) == copy

    export_main([step, str(downloaded), "--merge", "--overwrite"])
    assert (downloaded / "moe_tune_export.json").is_file() and not (downloaded / "adapter_config.json").exists()
    export_main([step, str(downloaded)])  # an earlier export: replaced without --overwrite (now the adapter)
    export_main([step, str(run / "hf")])  # the run's own hf/ is an export too
    assert (downloaded / "adapter_config.json").is_file() and not (downloaded / "config.json").exists()

    # Asked to, it replaces the run's base; the resume's refusal then names that directory once.
    export_main([step, str(base), "--merge", "--overwrite"])
    from moe_tune.checkpoint.state import check_base
    from moe_tune.config import CheckpointError

    meta = json.loads((run / "checkpoints" / "step_2" / "meta.json").read_text())
    with pytest.raises(CheckpointError) as error:
        check_base(meta, {}, 0, str(base), step)
    assert str(error.value).count(str(base)) == 1 and "have changed since the adapters were trained" in str(error.value)


def test_a_run_directory_without_checkpoints_points_to_its_export(tmp_path):
    """A finished run with checkpoint.every=0 holds its run files (config.json of the run, metrics.jsonl,
    summary.json) and hf/: it is named a run directory without checkpoints with its export in hf/, not an export
    (with --merge too); without hf/ (checkpoint.export_hf=false), a run directory without either."""
    import shutil

    run = tmp_path / "run"
    train_run([f"output_dir={run}", "train.steps=1", "checkpoint.every=0", *FAST_RUN])
    assert {"config.json", "metrics.jsonl", "summary.json", "hf"} <= {p.name for p in run.iterdir()}
    start = f"moe-tune-export: error: {run} is not a complete moe-tune checkpoint (needs meta.json and COMPLETE); "
    what = f"{run} is a run directory without checkpoints (checkpoint.every=0, or the run stopped before its first)"
    load = "load it with transformers (a LoRA adapter with PEFT, whose merge_and_unload() merges it)"
    for merge in ([], ["--merge"]):
        r = _moe_tune_export([run, tmp_path / "out", *merge])
        assert r.returncode == 2 and not (tmp_path / "out").exists(), r.stderr[-3000:]
        assert r.stderr.strip().splitlines() == [f"{start}{what}: its Hugging Face export is {run}/hf; {load}"]
    shutil.rmtree(run / "hf")
    r = _moe_tune_export([run, tmp_path / "out"])
    assert r.returncode == 2 and not (tmp_path / "out").exists(), r.stderr[-3000:]
    want = f"{start}{what} and without a Hugging Face export: rerun with checkpoint.every=N"
    assert r.stderr.strip().splitlines() == [want]


def test_a_base_that_is_no_model_directory_is_named_as_found(tmp_path):
    """A LoRA checkpoint's base without config.json: --base naming a run's hf/ (a PEFT adapter directory) or a
    directory that does not exist is named as --base, with what it is; the run's own base, moved or emptied, is
    named as the checkpoint's. A directory that was there was called 'not there', of the checkpoint's base."""
    from types import SimpleNamespace

    from moe_tune.build import _checkpoint_base
    from moe_tune.config import CheckpointError

    adapters, gone, emptied = tmp_path / "hf", tmp_path / "gone", tmp_path / "base"
    adapters.mkdir()
    (adapters / "adapter_config.json").write_text("{}")
    emptied.mkdir()
    cfg = SimpleNamespace(peft=SimpleNamespace(name="lora"))
    for base, source, said in [
        (adapters, emptied, f"--base {adapters} holds no config.json (a PEFT adapter directory, not its base model)"),
        (gone, emptied, f"--base {gone} does not exist; give --base the directory of the base model ckpt was"),
        (None, emptied, f"base model {emptied}, which holds no config.json; put the base model back at that path"),
        (None, gone, f"base model {gone}, which does not exist; put the base model back at that path"),
    ]:
        with pytest.raises(CheckpointError) as e:
            _checkpoint_base("ckpt", {"source": str(source)}, cfg, base and str(base))
        assert said in str(e.value)
