"""Experiment loggers, each read back with its own tracker's reader: TensorBoard's EventAccumulator, the W&B
offline run file (its records parsed with wandb's own protobuf classes), MLflow's client on the file store.
Only rank 0 logs; a missing package is one ConfigError line naming the extra that installs it, said by the CLI and
the launcher before torch is imported and before anything is written."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys
import tomllib

import numpy as np
import pytest

from moe_tune.config import ConfigError, LoggerConfig
from moe_tune.loggers import EXTRAS, PACKAGES, Logger, build_logger, flatten, require_logger, scalars
from tests.harness import PY, ROOT, cli_env

ROWS = [
    {"step": 1, "loss": 2.5, "lr": 1e-3, "grad_norm": 4.0, "skipped_steps": 0, "expert_load/layer_0": 1.25},
    {"step": 2, "loss": 2.0, "lr": 2e-3, "grad_norm": 3.0, "val_loss": 2.25, "val_ppl": float(np.exp(2.25))},
]
CONFIG = {"train": {"lr": 0.003, "steps": 2}, "output_dir": "out", "flag": True}
IMAGE = np.arange(6 * 8 * 3, dtype=np.uint8).reshape(6, 8, 3)


def _needs(module: str):
    return pytest.mark.skipif(
        importlib.util.find_spec(module) is None, reason=f"{module} is not installed (pip install 'moe_tune[{module}]')"
    )


def _write(name: str, tmp_path, **cfg) -> str:
    logger = build_logger(LoggerConfig(name=name, **cfg), str(tmp_path), 0, CONFIG)
    for row in ROWS:
        logger.log(row["step"], row)
    logger.log_image(2, "expert_load", IMAGE)
    logger.close()
    return str(tmp_path / name)


def test_scalars_are_the_numeric_fields_and_the_config_is_flat():
    row = {"step": 3, "loss": 1.5, "skipped_steps": 2, "ok": True, "name": "x", "nan": float("nan")}
    got = scalars(row)
    assert set(got) == {"loss", "skipped_steps", "nan"} and got["skipped_steps"] == 2.0
    assert flatten(CONFIG) == {"train.lr": 0.003, "train.steps": 2, "output_dir": "out", "flag": True}


def test_none_and_other_ranks_get_the_logger_that_does_nothing(tmp_path):
    for cfg, rank in ((LoggerConfig(name="none"), 0), (LoggerConfig(name="tensorboard"), 1)):
        logger = build_logger(cfg, str(tmp_path), rank, CONFIG)
        assert type(logger) is Logger
        logger.log(1, ROWS[0])
        logger.log_image(1, "x", IMAGE)
        logger.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name, package", [("tensorboard", "tensorboard"), ("wandb", "wandb"), ("mlflow", "mlflow")])
def test_a_missing_package_is_one_line_with_the_install_command(monkeypatch, name, package):
    monkeypatch.setitem(sys.modules, package, None)  # find_spec sees it as not installed
    with pytest.raises(ConfigError) as e:
        require_logger(LoggerConfig(name=name))
    assert str(e.value) == f"logger={name} needs the {package} package: pip install 'moe_tune[{name}]'; or logger=none"


@_needs("wandb")
def test_wandb_online_without_credentials_is_one_line_before_anything_is_written(monkeypatch, tmp_path):
    # No key in the environment, no .netrc, no W&B settings: wandb.init would raise UsageError once the run is built.
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    with pytest.raises(ConfigError) as e:
        require_logger(LoggerConfig(name="wandb", mode="online"))
    assert str(e.value).startswith("logger=wandb logger.mode=online needs W&B credentials")
    assert "wandb login" in str(e.value) and "logger.mode=offline" in str(e.value)
    require_logger(LoggerConfig(name="wandb", mode="offline"))  # offline needs no credentials
    monkeypatch.setenv("WANDB_API_KEY", "a" * 40)
    require_logger(LoggerConfig(name="wandb", mode="online"))  # found, not verified: no network call
    assert not (tmp_path / "netrc").exists()


def test_each_loggers_extra_installs_its_package_alone():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    for name, extra in EXTRAS.items():
        distribution = {"mlflow": "mlflow-skinny"}.get(PACKAGES[name], PACKAGES[name])  # mlflow's lighter build
        requirements = extras[extra]
        assert len(requirements) == 1 and requirements[0].startswith(distribution + ">="), (name, extra, requirements)


# Runs an entry point (argv[1], a module) with a package (argv[2]) hidden as if not installed; prints on stdout
# whether torch had been imported when it exited.
HIDDEN = """
import runpy, sys

class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == HIDE:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

HIDE = sys.argv.pop(2)
sys.meta_path.insert(0, NotInstalled())
sys.argv[0] = sys.argv.pop(1)
try:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
finally:
    print("torch imported:", "torch" in sys.modules)
"""


@pytest.mark.parametrize(
    "entry, name",
    [("moe_tune", "tensorboard"), ("moe_tune", "wandb"), ("moe_tune", "mlflow"), ("moe_tune.launch", "tensorboard")],
)
@pytest.mark.slow
def test_a_missing_package_is_said_before_torch_is_imported_and_anything_written(tmp_path, entry, name):
    out = tmp_path / "run"
    launcher = ["--standalone", "--nproc-per-node", "2"] if entry == "moe_tune.launch" else []
    cmd = [PY, "-c", HIDDEN, entry, PACKAGES[name], *launcher, f"logger={name}", f"output_dir={out}"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), timeout=120)
    said = f"moe-tune: error: logger={name} needs the {PACKAGES[name]} package: pip install 'moe_tune[{name}]'"
    assert r.returncode == 2 and r.stderr.splitlines() == [f"{said}; or logger=none"], r.stderr[-3000:]
    assert r.stdout.strip() == "torch imported: False" and not out.exists()


def test_the_expert_load_image_needs_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    require_logger(LoggerConfig(name="none", expert_load_image_every=5))  # no logger: nothing is drawn
    with pytest.raises(ConfigError, match=r"logger.expert_load_image_every=5 draws with matplotlib.*pip install"):
        require_logger(LoggerConfig(name="tensorboard", expert_load_image_every=5))


@_needs("matplotlib")
def test_the_heat_map_is_the_load_over_each_layers_mean():
    from moe_tune.loggers.heatmap import expert_load_image, normalised_load

    counts = np.array([[1, 1, 1, 1], [4, 0, 0, 0], [0, 0, 0, 0]])
    assert normalised_load(counts).tolist() == [[1, 1, 1, 1], [4, 0, 0, 0], [0, 0, 0, 0]]
    image = expert_load_image(counts, step=7)
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3 and image.std() > 0
    assert expert_load_image(counts, step=7, layer_ids=[1, 2, 3]).shape == image.shape


def test_the_heat_map_labels_rows_by_decoder_layer():
    """Rows are MoE layers, labelled by their decoder layer (DeepSeek-V3's first MoE layer is 1), 16 labels at most."""
    from moe_tune.loggers.heatmap import layer_ticks

    assert layer_ticks([1, 2]) == ([0, 1], ["1", "2"])
    rows, labels = layer_ticks(list(range(3, 61)))  # 58 MoE layers of 61, as DeepSeek-V3's
    assert len(rows) <= 16 and rows[0] == 0 and labels[:2] == ["3", "7"]
    assert layer_ticks([]) == ([], [])


@_needs("tensorboard")
def test_tensorboard_scalars_and_image_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(_write("tensorboard", tmp_path), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    for key in ("loss", "lr", "grad_norm", "skipped_steps", "expert_load/layer_0", "val_loss", "val_ppl"):
        expected = [(r["step"], np.float32(r[key])) for r in ROWS if key in r]
        assert [(e.step, np.float32(e.value)) for e in acc.Scalars(key)] == expected, key
    assert "step" not in acc.Tags()["scalars"]
    (image,) = acc.Images("expert_load")
    assert (image.step, image.width, image.height) == (2, 8, 6)


def _wandb_records(path: str) -> list:
    """The records of a W&B run file: wandb's LevelDB-style log (a 7-byte header, then chunks in 32 KiB blocks,
    each with a 7-byte header: CRC, little-endian length, type 1 full / 2 first / 3 middle / 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@_needs("wandb")
def test_wandb_offline_run_holds_the_logged_rows(tmp_path, monkeypatch):
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    log_dir = _write("wandb", tmp_path, run_name="tiny")
    (run_file,) = glob.glob(f"{log_dir}/wandb/offline-run-*/run-*.wandb")
    records = _wandb_records(run_file)
    history = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [h["_step"] for h in history] == [1, 2]
    for h, row in zip(history, ROWS, strict=True):
        assert {k: h[k] for k in scalars(row)} == scalars(row)
    assert history[1]["expert_load/_type"] == "image-file"
    assert glob.glob(f"{log_dir}/wandb/offline-run-*/files/{history[1]['expert_load/path']}")
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert run.display_name == "tiny" and config["train"] == CONFIG["train"], config


def _mlflow_run(log_dir: str):
    """(client, the one finished run) of experiment "proj" in the file store at ``log_dir``."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{log_dir}")
    (run,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert run.info.status == "FINISHED"
    return client, run


@_needs("mlflow")
def test_mlflow_file_store_holds_the_logged_rows(tmp_path):

    client, run = _mlflow_run(_write("mlflow", tmp_path, project="proj"))
    for key in ("loss", "lr", "grad_norm", "expert_load/layer_0", "val_loss", "val_ppl"):
        history = client.get_metric_history(run.info.run_id, key)
        assert [(m.step, m.value) for m in history] == [(r["step"], r[key]) for r in ROWS if key in r], key
    assert run.data.params == {k: str(v) for k, v in flatten(CONFIG).items()}
    images = [a.path for a in client.list_artifacts(run.info.run_id, "images")]
    assert any(p.startswith("images/expert_load+step+2+") and p.endswith(".png") for p in images)


RESUMED = [{"step": 2, "loss": 1.75, "lr": 2e-3}, {"step": 3, "loss": 1.5, "lr": 3e-3}]


def _interrupted_then_resumed(name: str, tmp_path, **cfg) -> str:
    """ROWS logged by an attempt that was stopped after step 2 but checkpointed at step 1; the resumed attempt
    (start_step=1) logs steps 2 and 3 again into the same log_dir."""
    _write(name, tmp_path, **cfg)
    logger = build_logger(LoggerConfig(name=name, **cfg), str(tmp_path), 0, CONFIG, start_step=1)
    for row in RESUMED:
        logger.log(row["step"], row)
    logger.close()
    return str(tmp_path / name)


def test_tensorboard_shows_each_step_once_after_a_resume(tmp_path):
    """TensorBoard's reader drops what the interrupted attempt logged after the checkpoint (step 2)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(_interrupted_then_resumed("tensorboard", tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 2.5), (2, 1.75), (3, 1.5)]


@_needs("mlflow")
def test_mlflow_resume_continues_the_run(tmp_path):

    client, run = _mlflow_run(_interrupted_then_resumed("mlflow", tmp_path, project="proj"))
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
    assert sorted(steps) == [1, 2, 2, 3]  # MLflow keeps every value; the resumed one at step 2 is the later


@_needs("wandb")
def test_wandb_resume_continues_the_run(tmp_path, monkeypatch):
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    log_dir = _interrupted_then_resumed("wandb", tmp_path)
    files = sorted(glob.glob(f"{log_dir}/wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2 and len({f.rsplit("run-", 1)[1] for f in files}) == 1, files  # one run id, two attempts
    runs = [r.run for f in files for r in _wandb_records(f) if r.WhichOneof("record_type") == "run"]
    assert runs[1].resumed or runs[1].run_id == runs[0].run_id
