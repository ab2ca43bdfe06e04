"""Every source kind gives the same rows as the same records in JSON Lines: JSON arrays, Parquet, CSV, Arrow files,
save_to_disk directories (Dataset and DatasetDict), a directory of mixed files; a hub name without the hub is one
clear line; ``import moe_tune`` and the built-in set never import ``datasets``."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from moe_tune.config import DataConfig, DataError
from moe_tune.data import build_datasets
from moe_tune.models.presets import build_tokenizer
from tests.harness import PY, cli_env

datasets = pytest.importorskip("datasets")

PAIRS = [{"prompt": f"{a}+{b}=", "response": str(a + b)} for a, b in [(1, 2), (30, 4), (5, 66), (7, 8)]]
CHATS = [
    {"messages": [{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": p["response"]}]}
    for p in PAIRS
]


def rows(tmp_path, path, **options) -> torch.Tensor:
    cfg = DataConfig(name="jsonl", path=str(path), num_samples=0, cache_dir=str(tmp_path / "cache"), **options)
    train, _ = build_datasets(cfg, build_tokenizer(), 64, seed=0)
    return torch.stack([train.ids, train.labels, train.positions])


def write_jsonl(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture(scope="module", autouse=True)
def quiet():
    datasets.disable_progress_bars()


@pytest.mark.parametrize("records", [PAIRS, CHATS], ids=["prompt_completion", "chat"])
def test_files_and_saved_datasets_match_jsonl(tmp_path, records):
    write_jsonl(tmp_path / "ref.jsonl", records)
    reference = rows(tmp_path, tmp_path / "ref.jsonl")
    (tmp_path / "array.json").write_text(json.dumps(records))
    table = datasets.Dataset.from_list(records)
    table.to_parquet(str(tmp_path / "t.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": table}).save_to_disk(str(tmp_path / "saved_dict"))
    arrow = next(n for n in os.listdir(tmp_path / "saved") if n.endswith(".arrow"))
    os.rename(tmp_path / "saved" / arrow, tmp_path / "t.arrow")
    table.save_to_disk(str(tmp_path / "saved"))  # again: the move took its data file
    sources = ["array.json", "t.parquet", "t.arrow", "saved", "saved_dict"]
    if records is PAIRS:  # CSV holds flat records only
        table.to_csv(str(tmp_path / "t.csv"), index=False)
        sources.append("t.csv")
    for name in sources:
        assert torch.equal(rows(tmp_path, tmp_path / name), reference), name


def test_directory_of_mixed_files(tmp_path):
    write_jsonl(tmp_path / "ref.jsonl", PAIRS)
    reference = rows(tmp_path, tmp_path / "ref.jsonl")
    d = tmp_path / "mixed"
    d.mkdir()
    write_jsonl(d / "a.jsonl", PAIRS[:1])
    datasets.Dataset.from_list(PAIRS[1:3]).to_parquet(str(d / "b.parquet"))
    datasets.Dataset.from_list(PAIRS[3:]).to_csv(str(d / "c.csv"), index=False)
    (d / "notes.txt").write_text("not data")
    assert torch.equal(rows(tmp_path, d), reference)  # files in name order, records in file order


def test_hub_name_offline_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError) as e:
        rows(tmp_path, "someone/some-dataset")
    assert str(e.value) == (
        "data.path=someone/some-dataset is not a local file or directory, and HF_HUB_OFFLINE=1 keeps the hub out "
        "of reach; give a local path, or unset HF_HUB_OFFLINE to download it"
    )


def test_missing_local_path(tmp_path):
    with pytest.raises(DataError, match=r"data\.path=.*missing\.jsonl does not exist"):
        rows(tmp_path, tmp_path / "missing.jsonl")


def test_no_datasets_import_without_a_path(tmp_path):
    code = (
        "import sys, moe_tune\n"
        "from moe_tune.config import DataConfig\n"
        "from moe_tune.data import build_datasets\n"
        "from moe_tune.models.presets import build_tokenizer\n"
        f"build_datasets(DataConfig(num_samples=8, cache_dir={str(tmp_path)!r}, val_fraction=0.25), "
        "build_tokenizer(), 64, 0)\n"
        "assert 'datasets' not in sys.modules, 'datasets was imported'\n"
    )
    subprocess.run([PY, "-c", code], check=True, env=cli_env(), timeout=120)
