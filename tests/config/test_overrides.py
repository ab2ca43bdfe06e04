"""The command line before Hydra runs it (issue 18, item 4): Hydra's flags with separate values, ``--help`` with the
user's groups, unknown keys (``+`` included) as one line naming the closest keys, type errors naming the key and
type, every built-in model name a config, and no output_dir made for a config that cannot run."""

import os

import pytest

from moe_tune.cli.train import precheck
from moe_tune.config.overrides import group_options
from tests.harness import run_main


def _moe_tune(args: list[str], cwd):
    """``moe-tune args`` run from ``cwd`` (in this process: harness.run_main)."""
    return run_main(args, cwd=cwd)


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--cfg", "job", "train.steps=3"], "steps: 3"),
        (["train.steps=3", "-c", "job"], "steps: 3"),  # an override before the flag, as users type them
        (["--package", "train", "--cfg", "job", "train.lr=0.5"], "# @package train\nsteps: 60"),
        (["-p", "model", "-c", "job", "model=mixtral_8x7b"], "name: mixtral_8x7b"),
        (["--info", "defaults"], "Defaults List"),
        # data.path alone reads the user's records as data=jsonl (it recorded data.name: arithmetic).
        (["-c", "job", "-p", "data", "data.path=chat.jsonl"], "name: jsonl\npath: chat.jsonl\nnum_samples: 0"),
        # model.path alone loads the checkpoint as model=hf (it kept the default preset's name and family).
        (["-c", "job", "-p", "model", "model.path=ckpt"], "name: hf\npath: ckpt"),
    ],
)
def test_hydra_flags_take_separate_values(args, expected, tmp_path):
    """``--cfg job`` and the like print without running and without making output_dir (they were overrides)."""
    r = _moe_tune([f"output_dir={tmp_path / 'run'}", *args], tmp_path)
    assert r.returncode == 0, r.stderr
    assert expected in r.stdout, r.stdout[-2000:]
    assert not (tmp_path / "run").exists()


def test_help_lists_the_user_groups_and_keys(capsys):
    with pytest.raises(SystemExit) as e:
        precheck(["--help", "train.steps=7"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "base_" not in out  # the schema's ConfigStore entries are no options
    lines = {line.split(":")[0].strip(): line for line in out.splitlines() if line.startswith("  ")}
    assert lines["comm"] == "  comm: all_to_all, deepep, symm_mem"
    assert "hf" in lines["model"] and "submitit_slurm" not in lines["model"]
    assert "steps: 7" in out and "--cfg job" in out


def test_help_lists_each_key_s_allowed_values(capsys):
    """What a key takes is read off its field (choices, range and help), a comm backend's own keys naming it."""
    from moe_tune.config import Config
    from moe_tune.config.constraints import constrained_fields

    with pytest.raises(SystemExit):
        precheck(["--help"])
    out = capsys.readouterr().out
    assert "\n  optim.min_lr_ratio: in [0, 1] (the final learning rate over train.lr)\n" in out
    assert "\n  train.precision: fp32, amp_bf16, bf16_fp32_master, bf16\n" in out
    assert "\n  comm.num_sms: >= 2 and a multiple of 2 (DeepEP pairs SMs per channel) [comm=deepep]\n" in out
    for key, _, constraint in constrained_fields(Config):
        assert "." not in key or f"\n  {key}: {constraint.text()}\n" in out, key


def test_every_builtin_model_is_a_config():
    """The names a model error lists are the configs ``model=<name>`` finds (mixtral_8x7b was listed, not a config)."""
    from moe_tune.models.presets import PRESETS

    assert set(group_options()["model"]) == set(PRESETS) | {"hf"}


def test_the_overrides_config_comments_suggest_compose():
    """A ``model.overrides.<key>=<value>`` a config file's comment suggests composes with that config (a key the
    preset's overrides lack takes a +: qwen3_30b_a3b's comment gave it without, which Hydra refuses)."""
    import glob
    import re

    import moe_tune
    from moe_tune.cli.train import compose, to_config

    suggested = []
    for path in sorted(glob.glob(os.path.join(os.path.dirname(moe_tune.__file__), "conf", "*", "*.yaml"))):
        group, name = os.path.basename(os.path.dirname(path)), os.path.basename(path)[: -len(".yaml")]
        comments = "\n".join(line for line in open(path) if line.lstrip().startswith("#"))
        for override in re.findall(r"\+?model\.overrides\.\w+=\S+?(?=[.,;)]?(?:\s|$))", comments):
            key, value = override.lstrip("+").split("=")
            suggested.append(override)
            cfg = to_config(compose([f"{group}={name}", override]))
            assert str(cfg.model.overrides[key.split(".")[-1]]) == value, (path, override)
    assert len(suggested) >= 2, suggested  # qwen3_30b_a3b's and mixtral_8x7b's


@pytest.mark.parametrize(
    "args,line",
    [
        (["train.stepz=5"], "train.stepz is not a config key; did you mean train.steps"),
        (["+train.stepz=5"], "+train.stepz is not a config key (+ adds no key"),
        (["steps=5"], "steps is not a config key; did you mean train.steps?"),
        # A name from Transformers' TrainingArguments, TRL or PEFT: its moe_tune key first.
        (["train.learning_rate=1e-4"], "train.learning_rate is not a config key; did you mean train.lr?"),
        (["peft.lora_alpha=16"], "peft.lora_alpha is not a config key; did you mean peft.alpha"),
        # The key of the same name in another group first (torchtitan's optimizer.lr), before spellings alike.
        (["optim.lr=1e-4"], "optim.lr is not a config key; did you mean train.lr or "),
        (["optimizer.lr=1e-4"], "optimizer.lr is not a config key; did you mean train.lr"),
        (["peft=qlora"], "peft=qlora is not one of lora, none; QLoRA is peft=lora peft.quantize_base=nf4"),
        # bitsandbytes' switches (Unsloth's load_in_4bit=True): the key list alone named no fix.
        (
            ["load_in_4bit=true"],
            "load_in_4bit is not a config key; a 4-bit frozen base (its routed experts) is peft=lora "
            "peft.quantize_base=nf4 (moe-tune --help lists every key)",
        ),
        (["+model.load_in_8bit=true"], "+model.load_in_8bit is not a config key (+ adds no key: the config's keys"),
        (
            ["+model.load_in_8bit=true"],
            "; an 8-bit frozen base (its routed experts) is peft=lora peft.quantize_base=fp8",
        ),
        (["peft.bnb_4bit_quant_type=nf4"], "peft.bnb_4bit_quant_type is not a config key; a 4-bit frozen base"),
        (["peft=LoRA"], "peft=LoRA is not one of lora, none; did you mean peft=lora?"),
        (["peft=lora", "peft.quantize_base=null"], "peft.quantize_base=null: peft.quantize_base takes none, fp8, nf4"),
        (["data.packing=null"], "data.packing=null: data.packing takes a value, not null; give it one, or leave it"),
        (["comm=All-To-All"], "did you mean comm=all_to_all?"),
        (["train.train.seed=1"], "did you mean train.seed"),
        (["comm.num_sms=8"], "comm.num_sms is an option of comm=deepep, not of comm=all_to_all; add comm=deepep"),
        (["+train.steps=5"], "+train.steps: train.steps is already a key; write train.steps=<value> without the +"),
        # ~ removes a key, which the schema's keys never are: Hydra's line named OmegaConf's classes.
        (["~train.steps"], "~train.steps: the config's keys are fixed by its schema, so ~ removes none; leave out"),
        (["~train.steps=60"], "leave out ~train.steps=60 for train.steps's default (60), or give train.steps=<value>"),
        (["~model.overrides"], "~model.overrides: the config's keys are fixed by its schema, so ~ removes none"),
        (["model.overrides.num_hidden_layers=1"], "add it with +model.overrides.num_hidden_layers=1"),
        (["train.steps=abc"], "train.steps='abc' is not an integer; give train.steps a value of that type"),
        (["train.lr=fast"], "train.lr='fast' is not a number"),
        # OmegaConf's own message for a bool, with every override after it (the whole command line).
        (["data.packing=maybe"], "data.packing='maybe' is not true or false; give data.packing=true or data.packing"),
        # Hydra's grammar takes non-ASCII letters in quoted values only; "write overrides as key=value" misled.
        (
            ["data.path=données.jsonl"],
            "data.path=données.jsonl: Hydra reads a value with letters outside ASCII ('é') only in quotes; write "
            "data.path='données.jsonl' (\"data.path='données.jsonl'\" in a shell, so that the shell passes the quotes on)",
        ),
        # So is a value holding (, #, = or a quote, as a downloaded file's name does ("chat (1).jsonl"): Hydra's line
        # named neither the override nor the quotes.
        (
            ["data.path=chat (1).jsonl"],
            "data.path=chat (1).jsonl: Hydra reads a value holding '(' only in quotes; write "
            "data.path='chat (1).jsonl' (\"data.path='chat (1).jsonl'\" in a shell, so that the shell passes the quotes on)",
        ),
        # "=3" named an empty key: " is not a config key".
        (["=3"], "=3: no key before '='; write key=value"),
        # A list missing a bracket is not told to be quoted.
        (["peft=lora", "peft.target=[attention,experts"], "peft.target=[attention,experts: its brackets do not pair"),
        (
            ["data.path=it's.jsonl"],
            'data.path=it\'s.jsonl: Hydra reads a value holding "\'" only in quotes; write data.path="it\'s.jsonl"',
        ),
        (
            ["peft=lora", "peft.target=attention"],
            "peft.target is a list; write it in brackets: 'peft.target=[attention]'",
        ),
        (
            ["peft.rank=16"],
            "peft.rank applies to LoRA (peft=lora), and peft=none trains every weight: add peft=lora, or drop "
            "peft.rank=16",
        ),
        # Any value is refused, the default too: the line reads right for none.
        (
            ["peft=none", "peft.quantize_base=none"],
            "peft.quantize_base applies to LoRA (peft=lora), and peft=none trains every weight: add peft=lora, or "
            "drop peft.quantize_base=none",
        ),
        (
            ["model=mixtral_8x7"],
            "model=mixtral_8x7 is not one of deepseek_v3, glm4_5_air, gpt_oss_20b, hf, mixtral_8x7b",
        ),
        (["model=hf"], "model=hf needs model.path=<local Hugging Face checkpoint directory>"),
        (["-m", "--cfg", "job"], "-m and --cfg together"),
        # --help lists hydra/launcher's options as a group's: a misspelt one was Hydra's lines and exit 1.
        (["hydra/launcher=submitit_slurn"], "hydra/launcher=submitit_slurn is not one of basic, submitit_local, "),
        (["-m", "hydra/launcher=Basic", "train.lr=1e-3,2e-3"], "did you mean hydra/launcher=basic?"),
        # experiment is an optional group: Hydra took a name it lacks without a word and the defaults trained.
        (["experiment=qwen3_30b_a3b_ep9"], "experiment=qwen3_30b_a3b_ep9 is not one of qwen3_30b_a3b_1gpu, "),
        (["-m", "experiment=qwen3_30b_a3b_ep2,nope"], "experiment=nope is not one of qwen3_30b_a3b_1gpu, "),
        # a,b is a sweep to Hydra: its "Ambiguous value" lines and exit 1 without -m.
        (
            ["peft=lora", "peft.target=q_proj,k_proj"],
            "peft.target=q_proj,k_proj is a sweep to Hydra (a,b: one run per value); peft.target is a list; write "
            "it in brackets: 'peft.target=[q_proj,k_proj]' (quoted for the shell)",
        ),
        (["train.steps=1,2"], "train.steps=1,2 is a sweep (one run per value), which runs with -m; add -m or give"),
        (["data=jsonl", "data.path=a,b.jsonl"], "or quote a string holding a comma: \"data.path='a,b.jsonl'\""),
        (["-m", "peft=lora", "peft.target=q_proj,k_proj"], "to sweep over lists under -m: 'peft.target=[q_proj],[k_"),
    ],
)
def test_bad_command_line_is_one_line_exit_2(args, line, tmp_path, capsys):
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        precheck([f"output_dir={run_dir}", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moe-tune: error: "), err
    assert line in err
    assert "+train.stepz=5" not in err and "To append" not in err  # never Hydra's suggestion to add a key
    assert "(overrides:" not in err and "write overrides as key=value" not in err


@pytest.mark.parametrize(
    "args,line",
    [
        (["parallel.ep=3"], "parallel.ep (3) must divide"),
        (["train.global_batch_size=3"], "train.global_batch_size (3) must be a multiple"),
        (["comm=deepep"], "comm=deepep needs expert parallelism"),
    ],
)
def test_no_output_dir_for_a_config_that_cannot_run(args, line, tmp_path):
    """Checks that need the world size ran after Hydra had made output_dir: now before (torchrun's WORLD_SIZE)."""
    r = _moe_tune([f"output_dir={tmp_path / 'run'}", *args], tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert line in r.stderr
    assert not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize(
    "args,drop",
    [
        (["+model.overrides.num_hidden_layers=1"], "~model.overrides.num_hidden_layers"),
        (["experiment=qwen3_30b_a3b_ep2"], "~model.overrides.num_hidden_layers"),  # the experiment's 8 layers
    ],
)
def test_model_overrides_with_a_model_path_are_refused(args, drop, tiny_checkpoint, tmp_path):
    """model.overrides shape a built-in preset: with model.path the checkpoint's config.json was loaded unchanged
    and the run trained its 2 layers, not the 1 or 8 asked for, without a word."""
    ckpt = tiny_checkpoint()
    r = _moe_tune([f"output_dir={tmp_path / 'run'}", f"model.path={ckpt}", *args], tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"loads that checkpoint's own config.json unchanged; leave it out ({drop} removes" in r.stderr
    assert not os.path.exists(tmp_path / "run")
    ok = _moe_tune(["-c", "job", "-p", "model", f"model.path={ckpt}", *args, drop], tmp_path)
    assert ok.returncode == 0 and "overrides: {}" in ok.stdout, ok.stderr


def test_a_relative_model_path_is_recorded_absolute(tmp_path, monkeypatch):
    """model.path is what checkpoints and LoRA adapters point to as their base: relative, it would name another
    directory for moe-tune-export or a resume run from elsewhere."""
    from moe_tune.config.overrides import compose, to_config
    from tests.tiny import save_tiny

    save_tiny(tmp_path / "base", "qwen3_moe")
    monkeypatch.chdir(tmp_path)
    assert to_config(compose(["model=hf", "model.path=base"])).model.path == str(tmp_path / "base")


@pytest.mark.parametrize(
    "overrides,name",
    [
        (["data.path=chat.jsonl"], "jsonl"),
        (["experiment=qwen3_30b_a3b_1gpu", "data.path=chat.jsonl"], "jsonl"),  # over the experiment's data=random
        (["data=random", "data.path=chat.jsonl"], "random"),  # an explicit choice stays (validate refuses it)
        (["data.path=null"], "arithmetic"),
    ],
)
def test_data_path_alone_chooses_data_jsonl(overrides, name):
    """``data.path=x`` without ``data=jsonl`` trained on x but recorded data.name: arithmetic (and its options)."""
    from moe_tune.config.overrides import compose, parse

    assert compose(overrides).data.name == name
    assert ("data=jsonl" in parse(overrides)[1]) == (name == "jsonl")


@pytest.mark.parametrize(
    "overrides,name",
    [
        (["model.path=ckpt"], "hf"),
        (["experiment=qwen3_30b_a3b_1gpu", "model.path=ckpt"], "hf"),  # over the experiment's model choice
        (["model=qwen3_30b_a3b", "model.path=ckpt"], "qwen3_30b_a3b"),  # an explicit choice stays
        (["model.path=null"], "tiny_qwen3_moe"),
    ],
)
def test_model_path_alone_chooses_model_hf(overrides, name):
    """``model.path=<dir>`` without ``model=hf`` kept the default preset (recorded as model.name, and a checkpoint
    of another family was refused), where ``data.path`` alone already chose ``data=jsonl``."""
    from moe_tune.config.overrides import compose, parse

    assert compose(overrides).model.name == name
    assert ("model=hf" in parse(overrides)[1]) == (name == "hf")


def test_model_path_alone_loads_any_family_and_a_preset_of_another_stays_refused(tiny_checkpoint, tmp_path, capsys):
    """The new-user trial: a Mixtral checkpoint given as model.path alone was refused (exit 2, 'load your
    checkpoint with model=hf'); an explicit preset of another family with it still is."""
    mixtral = tiny_checkpoint("mixtral")
    out = f"output_dir={tmp_path / 'run'}"
    assert "model=hf" in precheck([out, f"model.path={mixtral}"])
    with pytest.raises(SystemExit) as e:
        precheck([out, "model=qwen3_30b_a3b", f"model.path={mixtral}"])
    assert e.value.code == 2
    assert "but model=qwen3_30b_a3b is a preset of family qwen3_moe" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["-m", "hydra.mode=MULTIRUN"])
def test_sweeps_pass_under_multirun(mode, tmp_path):
    """Hydra's sweeps (a,b; lists as [a],[b]) under -m reach Hydra unchanged."""
    args = [mode, f"output_dir={tmp_path}", "peft=lora", "peft.target=[q_proj],[k_proj]", "train.lr=1e-3,2e-3"]
    assert sorted(precheck(args)) == sorted(args)


def test_local_data_paths_are_recorded_absolute_and_hub_names_as_given(tmp_path, monkeypatch):
    """A relative data.path / data.val_path (recorded in config.json and checkpoints) would mean another file for a
    resume or export run from another directory; a hub dataset's name is no path and stays as given."""
    from moe_tune.config.overrides import compose, to_config

    (tmp_path / "train.jsonl").write_text("{}\n")
    (tmp_path / "val.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    cfg = to_config(compose(["data.path=train.jsonl", "data.val_path=./val.jsonl"]))
    assert (cfg.data.path, cfg.data.val_path) == (str(tmp_path / "train.jsonl"), str(tmp_path / "val.jsonl"))
    assert to_config(compose(["data.path=org/some_dataset"])).data.path == "org/some_dataset"


@pytest.mark.parametrize(
    "sweep,line",
    [
        (["train.steps=2,-1"], "train.steps=-1 is out of range: it must be >= 1"),
        (["train.precision=fp32,bf17"], "train.precision='bf17' is not one of fp32"),
        (["model=tiny_qwen3_moe,tiny_qwen3_mo"], "model=tiny_qwen3_mo is not one of"),
        (["train.lr=1e-3,2e-3", "train.steps=3,0"], "train.steps=0 is out of range"),
    ],
)
def test_a_bad_value_of_a_sweep_stops_it_before_its_first_run(sweep, line, tmp_path, capsys):
    """Each run of a -m sweep is checked before the first starts: a bad later value stopped the sweep only once
    the runs before it had trained, leaving its own directory behind."""
    with pytest.raises(SystemExit) as e:
        precheck(["-m", f"output_dir={tmp_path / 'sweep'}", *sweep])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moe-tune: error: "), err
    assert line in err
    assert not os.path.exists(tmp_path / "sweep")


@pytest.mark.parametrize("given", ["output_dir=~/runs/a", "output_dir='~/runs/a'", 'output_dir="~/runs/a"'])
def test_a_home_path_is_expanded_as_a_shell_would(given, tmp_path, monkeypatch):
    """``output_dir=~/runs/a`` as zsh passes it (or quoted): Hydra's grammar refused the unquoted ~ ('token
    recognition error'), and the quoted one made a directory named ~ in the working directory."""
    from moe_tune.config.overrides import compose

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    argv = precheck([given, "train.steps=1"])
    expanded = str(tmp_path / "home" / "runs" / "a")
    assert compose(argv).output_dir == expanded
    assert not (tmp_path / "~").exists()


def test_a_home_data_path_is_expanded_before_it_is_checked(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(SystemExit) as e:
        precheck([f"output_dir={tmp_path / 'run'}", "data.path=~/none.jsonl"])
    assert e.value.code == 2
    assert f"data.path={tmp_path / 'none.jsonl'} does not exist" in capsys.readouterr().err


def test_a_sweep_over_data_paths_checks_each_path(tmp_path, capsys):
    """``-m data.path=a.jsonl,b.jsonl`` was refused as if no data.path were given (the check ran on the config
    without the swept values: 'data=jsonl reads your records from data.path, which is not set')."""
    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text('{"prompt": "1+1=", "completion": "2"}\n')
    out = f"output_dir={tmp_path / 'sweep'}"
    paths = f"data.path={tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}"
    assert paths in precheck(["-m", out, paths])
    with pytest.raises(SystemExit) as e:
        precheck(["-m", out, f"data.path={tmp_path / 'a.jsonl'},{tmp_path / 'c.jsonl'}"])
    assert e.value.code == 2
    assert f"data.path={tmp_path / 'c.jsonl'} does not exist" in capsys.readouterr().err


def _own_configs(tmp_path):
    """A directory of the user's own configs: one built on moe_tune's, one without its defaults, an experiment."""
    conf = tmp_path / "conf"
    (conf / "experiment").mkdir(parents=True)
    (conf / "mine.yaml").write_text("defaults:\n  - config\n  - _self_\ntrain:\n  steps: 2\n")
    (conf / "bare.yaml").write_text("train:\n  steps: 2\n")
    (conf / "experiment" / "short.yaml").write_text("# @package _global_\ntrain:\n  steps: 3\n")
    return str(conf)


@pytest.mark.parametrize(
    "args,line",
    [
        (["--config-name", "mine", "+train.stepz=5"], "+train.stepz is not a config key (+ adds no key"),
        (["--config-name", "mine", "train.stepz=5"], "train.stepz is not a config key; did you mean train.steps"),
        (["--config-name", "mine", "train.lr=-1"], "train.lr=-1.0 is out of range"),
        (["experiment=shortt"], "experiment=shortt is not one of qwen3_30b_a3b_1gpu"),
        (["--config-name", "nope"], "--config-name nope: no config nope.yaml in "),
        (["--config-name", "bare"], "put 'defaults: [config, _self_]' at the top of bare.yaml"),
    ],
)
def test_own_config_dir_is_checked_as_the_packaged_one(args, line, tmp_path, capsys):
    """``--config-dir``/``--config-name`` were left to Hydra alone: a ``+train.stepz=5`` was added without a word
    and the run trained 60 steps, a misspelt key was Hydra's multi-line error and exit 1."""
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        precheck(["--config-dir", _own_configs(tmp_path), f"output_dir={run_dir}", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moe-tune: error: "), err
    assert line in err
    assert not run_dir.exists()


def test_own_config_dir_options_and_configs_compose(tmp_path, capsys):
    conf = _own_configs(tmp_path)
    r = _moe_tune(["--config-dir", conf, "experiment=short", "-c", "job", "-p", "train"], tmp_path)
    assert r.returncode == 0 and "steps: 3" in r.stdout, r.stderr
    r = _moe_tune(["--config-dir", conf, "--config-name", "mine", "-c", "job", "-p", "train"], tmp_path)
    assert r.returncode == 0 and "steps: 2" in r.stdout, r.stderr
    with pytest.raises(SystemExit) as e:
        precheck(["--config-dir", str(tmp_path / "none"), "train.steps=1"])
    assert e.value.code == 2
    assert f"--config-dir {tmp_path / 'none'} is not a directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    "sweep,line",
    [
        (["train.global_batch_size=8,6"], "train.global_batch_size (6) must be a multiple of train.micro_batch_size"),
        (["parallel.ep=1,2"], "parallel.ep (2) must divide parallel.dp_shard (1, world size 1)"),
        (["kernels=torch,te"], "kernels=te: "),
    ],
)
def test_a_sweep_run_here_checks_each_job_s_layout_and_backends(sweep, line, tmp_path, capsys):
    """Under Hydra's basic launcher a sweep's jobs run in this process, with its world size and packages: a job
    whose layout or backend cannot run was refused only when it came up, after the jobs before it had trained."""
    pytest.importorskip("torch")
    if "te" in sweep[0]:
        from moe_tune.env import unusable_reason

        if unusable_reason("transformer_engine") is None:
            pytest.skip("TransformerEngine is usable here")
    with pytest.raises(SystemExit) as e:
        precheck(["-m", f"output_dir={tmp_path / 'sweep'}", "train.steps=1", *sweep])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and line in err, err
    assert not os.path.exists(tmp_path / "sweep")
    launched = ["hydra/launcher=submitit_slurm", "-m", f"output_dir={tmp_path / 'sweep'}", *sweep]
    assert precheck(launched)  # another launcher's jobs run elsewhere, on a world size it picks


def test_a_sweep_into_a_file_is_one_line(tmp_path, capsys):
    """``-m output_dir=<a file>`` was Hydra's NotADirectoryError traceback and exit 1."""
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit) as e:
        precheck(["-m", f"output_dir={tmp_path / 'afile'}", "train.lr=1e-3,2e-3"])
    assert e.value.code == 2
    assert "is a file, not a directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,line",
    [
        (["model.overrides={num_hidden_layers:1}"], "write +model.overrides.num_hidden_layers=1"),
        (["experiment=qwen3_30b_a3b_1gpu", "model.overrides={hidden_size:64}"], "+model.overrides.hidden_size=64 ~"),
        (["experiment=qwen3_30b_a3b_1gpu", "model.overrides={}"], "write ~model.overrides.num_hidden_layers"),
    ],
)
def test_a_whole_free_dict_names_its_keys_one_by_one(args, line, tmp_path, capsys):
    """``model.overrides={...}`` with a key the dict lacks was Hydra's 'To append ... use +model.overrides={...}',
    which was refused in turn ('already a key; write it without the +'); ``{}`` over an experiment's removed
    nothing, without a word."""
    with pytest.raises(SystemExit) as e:
        precheck([f"output_dir={tmp_path / 'run'}", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and line in err and "To append" not in err, err


def test_a_key_given_twice_gets_a_note_naming_the_one_used(tmp_path):
    """Hydra takes the last of two values for one key without a word (a script's default and the user's own can
    meet unnoticed): one note names both and the one used; the same value twice says nothing."""
    r = run_main(["train.steps=5", "--cfg", "job", "train.steps=1", "train.lr=1e-4", "train.lr=1e-4"])
    assert r.returncode == 0 and "steps: 1" in r.stdout, r.stderr[-2000:]
    notes = [line for line in r.stderr.splitlines() if line.startswith("moe-tune: note:")]
    assert notes == [
        "moe-tune: note: train.steps is given 2 times (train.steps=5, train.steps=1); the last, train.steps=1, is used"
    ], r.stderr[-2000:]
