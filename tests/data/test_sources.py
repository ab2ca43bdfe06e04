"""Every source kind gives the same rows as the same records in JSON Lines: JSON arrays, Parquet, CSV, Arrow files,
save_to_disk directories (Dataset and DatasetDict), a directory of mixed files; a hub name without the hub comes from
the datasets cache or is one clear line, at once; ``import moe_tune`` and the built-in set never import ``datasets``."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from moe_tune.config import DataConfig, DataError
from moe_tune.data import build_datasets
from moe_tune.models.presets import build_tokenizer
from tests.harness import PY, cli_env, run_main

datasets = pytest.importorskip("datasets")

PAIRS = [{"prompt": f"{a}+{b}=", "response": str(a + b)} for a, b in [(1, 2), (30, 4), (5, 66), (7, 8)]]
CHATS = [
    {"messages": [{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": p["response"]}]}
    for p in PAIRS
]


def rows(tmp_path, path, seq_len: int = 64, **options) -> torch.Tensor:
    cfg = DataConfig(name="jsonl", path=str(path), num_samples=0, cache_dir=str(tmp_path / "cache"), **options)
    train, _ = build_datasets(cfg, build_tokenizer(), seq_len, seed=0)
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


def test_json_spread_over_lines_in_a_jsonl_file(tmp_path):
    """A JSON array written to a .jsonl file (an indented json.dump) is read as the array it is; records that are
    indented objects, one over several lines, stop at line 1 naming the layout and the fix (each line read alone
    would be invalid JSON, skipped one by one)."""
    write_jsonl(tmp_path / "ref.jsonl", PAIRS)
    (tmp_path / "array.jsonl").write_text(json.dumps(PAIRS, indent=2))
    assert torch.equal(rows(tmp_path, tmp_path / "array.jsonl"), rows(tmp_path, tmp_path / "ref.jsonl"))
    pretty = tmp_path / "pretty.jsonl"
    pretty.write_text("\n".join(json.dumps(r, indent=2) for r in PAIRS))
    for policy in ("error", "skip"):
        with pytest.raises(DataError) as e:
            rows(tmp_path, pretty, on_bad_record=policy)
        assert str(e.value) == (
            f"{pretty}:1: a record spread over several lines (indented JSON); write one record per line (JSON "
            "Lines: json.dumps without indent), or a JSON array of records"
        )


def tool_chat(name: str, arguments: dict, schema: dict) -> dict:
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return {
        "messages": [
            {"role": "user", "content": "?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "ok"},
            {"role": "assistant", "content": "done"},
        ],
        "tools": [{"type": "function", "function": {"name": name, "parameters": schema}}],
    }


def test_tool_calls_in_columnar_files_match_jsonl(tmp_path):
    """Arrow holds one struct type per column: records whose tool calls or tool schemas have other keys get each
    other's keys as nulls there, which must not reach the rendered text (a call with arguments it never had)."""
    records = [
        tool_chat("add", {"a": 1, "b": 2}, {"type": "object", "properties": {"a": {"type": "integer"}}}),
        tool_chat("say", {"text": "hi"}, {"type": "object", "required": ["text"]}),
    ]
    write_jsonl(tmp_path / "ref.jsonl", records)
    reference = rows(tmp_path, tmp_path / "ref.jsonl", seq_len=512)
    table = datasets.Dataset.from_list(records)
    table.to_parquet(str(tmp_path / "t.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    for name in ("t.parquet", "saved"):
        assert torch.equal(rows(tmp_path, tmp_path / name, seq_len=512), reference), name


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


def test_a_training_directory_holding_a_held_out_split_is_refused(tmp_path):
    """Every file of data.path's directory is trained on: a test or validation split there (named as Hugging Face
    datasets names splits) would be trained on without a word. Words that only contain a split's name are no split."""
    from moe_tune.data import resolve

    d = tmp_path / "d"
    d.mkdir()
    write_jsonl(d / "train.jsonl", PAIRS[:2])
    write_jsonl(d / "devops_validated.jsonl", PAIRS[2:])
    assert [os.path.basename(s.path) for s in resolve(str(d))] == ["devops_validated.jsonl", "train.jsonl"]
    write_jsonl(d / "test.jsonl", PAIRS[2:])
    with pytest.raises(DataError) as e:
        resolve(str(d))
    assert str(e.value) == (
        f"data.path={d} holds test.jsonl, named as a held-out split, and every file there is trained on; give "
        f"data.path={d}/<the training files> and data.val_path={d}/test.jsonl, or move or rename the held-out files"
    )
    (d / "devops_validated.jsonl").unlink()
    (d / "test.jsonl").rename(d / "validation-00000-of-00001.parquet")
    with pytest.raises(DataError, match=f"give data.path={d}/train.jsonl and data.val_path={d}/validation-00000"):
        resolve(str(d))
    assert len(resolve(str(d), "data.val_path")) == 2  # a validation directory may hold any split's files


def test_a_directory_reads_ndjson_and_names_compressed_files(tmp_path):
    """.ndjson is JSON Lines; a compressed data file (.jsonl.gz, .parquet.zst) in the directory stops the run naming
    it and the fix, rather than being left out of the records without a word (other files, notes.txt, still are)."""
    write_jsonl(tmp_path / "ref.jsonl", PAIRS)
    d = tmp_path / "d"
    d.mkdir()
    write_jsonl(d / "a.jsonl", PAIRS[:2])
    write_jsonl(d / "b.ndjson", PAIRS[2:])
    (d / "notes.txt").write_text("not data")
    assert torch.equal(rows(tmp_path, d), rows(tmp_path, tmp_path / "ref.jsonl"))
    (d / "c.jsonl.gz").write_bytes(b"")
    with pytest.raises(DataError) as e:
        rows(tmp_path, d)
    assert str(e.value) == (
        f"data.path={d}: its entry c.jsonl.gz is a compressed data file, which is not read; decompress it (gunzip, "
        "zstd -d, ...) or move it out of the directory"
    )
    with pytest.raises(DataError, match=r"c\.jsonl\.gz is a compressed data file, which is not read; decompress it"):
        rows(tmp_path, d / "c.jsonl.gz")


@pytest.fixture
def no_network(monkeypatch):
    """This process as on a machine without network: no host name resolves, no proxy is set."""
    import socket

    from huggingface_hub import constants

    from moe_tune.data import sources

    def fail(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", fail)
    for variable in (*sources.PROXY_VARIABLES, *sources.OFFLINE_VARIABLES):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)  # as read from them at import
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    sources._resolves.cache_clear()
    yield
    sources._resolves.cache_clear()


def hub_cache(tmp_path, monkeypatch, name: str, records) -> None:
    """``name`` in a datasets cache of its own, as a load of it from the hub leaves it there."""
    import glob
    import shutil

    src = tmp_path / "hub_src.jsonl"
    write_jsonl(src, records)
    cache = tmp_path / "hf_datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    datasets.load_dataset_builder("json", data_files=[str(src)], cache_dir=str(cache)).download_and_prepare()
    (built,) = [p for p in glob.glob(str(cache / "json" / "*" / "*" / "*")) if os.path.isdir(p)]
    owner, dataset = name.split("/")
    target = cache / f"{owner}___{dataset}" / "default" / os.path.join(*built.split(os.sep)[-2:])
    shutil.move(built, target)
    for arrow in target.glob("json-*.arrow"):
        arrow.rename(target / arrow.name.replace("json-", f"{dataset}-"))
    info = json.loads((target / "dataset_info.json").read_text())
    (target / "dataset_info.json").write_text(json.dumps({**info, "config_name": "default"}))


def test_a_hub_name_without_network_fails_at_once(tmp_path, no_network):
    """Not datasets' ~30 s of retries before its offline error: the host name does not resolve, so the hub is not
    asked; one line with how to get the data."""
    import time

    start = time.perf_counter()
    with pytest.raises(DataError) as e:
        rows(tmp_path, "someone/some-dataset")
    assert time.perf_counter() - start < 15
    assert str(e.value) == (
        "data.path=someone/some-dataset is not a local file or directory nor in the datasets cache, and the hub is "
        "out of reach (huggingface.co does not resolve: no network); download it where there is network (hf download "
        "someone/some-dataset --repo-type dataset --local-dir <dir>) and give data.path=<dir>/<the folder of its "
        "data files>"
    )


@pytest.mark.parametrize("variable", ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"])
def test_offline_variables_read_the_datasets_cache(tmp_path, monkeypatch, variable):
    """HF_HUB_OFFLINE or HF_DATASETS_OFFLINE, as Hugging Face's libraries read them: a hub dataset loaded before comes
    from the datasets cache (it was refused); one that is not there is one line naming the variable."""
    monkeypatch.setenv(variable, "1")
    write_jsonl(tmp_path / "ref.jsonl", PAIRS)
    hub_cache(tmp_path, monkeypatch, "someone/cached-set", PAIRS)
    assert torch.equal(rows(tmp_path, "someone/cached-set"), rows(tmp_path, tmp_path / "ref.jsonl"))
    with pytest.raises(DataError) as e:
        rows(tmp_path, "someone/some-dataset")
    assert str(e.value).startswith(
        f"data.path=someone/some-dataset is not a local file or directory nor in the datasets cache, and the hub is "
        f"out of reach ({variable}=1); download it where there is network"
    )
    assert str(e.value).endswith(f"give data.path=<dir>/<the folder of its data files>, or unset {variable}")


def test_a_cached_hub_dataset_without_network_loads_at_once(tmp_path, monkeypatch, no_network):
    import time

    write_jsonl(tmp_path / "ref.jsonl", CHATS)
    hub_cache(tmp_path, monkeypatch, "someone/cached-chats", CHATS)
    start = time.perf_counter()
    assert torch.equal(rows(tmp_path, "someone/cached-chats"), rows(tmp_path, tmp_path / "ref.jsonl"))
    assert time.perf_counter() - start < 15


def test_with_network_the_hub_is_asked(monkeypatch, no_network):
    """Where the hub's name resolves (or a proxy resolves it), datasets loads the name as ever, online."""
    import socket

    from huggingface_hub import constants

    from moe_tune.data import sources

    seen = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: seen.append(constants.HF_HUB_OFFLINE) or "loaded")
    assert sources._load_hub("someone/some-dataset", streaming=True) == "loaded"  # no network: offline
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
    assert sources._load_hub("someone/some-dataset", streaming=True) == "loaded"
    monkeypatch.delenv("HTTPS_PROXY")
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [])
    sources._resolves.cache_clear()
    assert sources._load_hub("someone/some-dataset", streaming=True) == "loaded"
    assert seen == [True, False, False] and constants.HF_HUB_OFFLINE is False


def test_a_utf8_byte_order_mark_on_line_1_is_accepted(tmp_path):
    """Some Windows editors start a UTF-8 file with a BOM; it was read as part of the first record (refused as
    invalid JSON). A JSON Lines file and a JSON array file with one read as without."""
    write_jsonl(tmp_path / "ref.jsonl", CHATS)
    expected = rows(tmp_path, tmp_path / "ref.jsonl")
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + (tmp_path / "ref.jsonl").read_bytes())
    assert torch.equal(rows(tmp_path, tmp_path / "bom.jsonl"), expected)
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(CHATS).encode())
    assert torch.equal(rows(tmp_path, tmp_path / "bom.json"), expected)


def _fifo(path) -> None:
    os.mkfifo(path)


def _directory(path) -> None:
    os.mkdir(path)


def _link_to_dev_zero(path) -> None:
    os.symlink("/dev/zero", path)


def _broken_link(path) -> None:
    os.symlink(path.parent / "gone.jsonl", path)


@pytest.mark.parametrize(
    "make,what",
    [
        (_directory, "a directory"),
        (_fifo, "a FIFO"),
        (_link_to_dev_zero, "a character device (a link to /dev/zero)"),
        (_broken_link, "a link to {gone} that cannot be followed (No such file or directory)"),
    ],
)
def test_an_entry_that_is_not_a_regular_file_is_named(tmp_path, make, what):
    """A directory's x.jsonl that is a directory, a FIFO (reading it waits for a writer forever) or a link to
    /dev/zero (endless) gave tracebacks or hung: one line naming the entry, before any record is read."""
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "a.jsonl", CHATS)
    make(data / "x.jsonl")
    with pytest.raises(DataError) as e:
        rows(tmp_path, data)
    what = what.format(gone=data / "gone.jsonl")
    assert str(e.value) == (
        f"data.path={data}: its entry x.jsonl is {what}, not a regular file; move it out of the directory or rename "
        "it (every .jsonl/.ndjson/.json/.parquet/.csv/.arrow entry is read as records)"
    )


@pytest.mark.parametrize("path,what", [("/dev/zero", "a character device"), ("fifo.jsonl", "a FIFO")])
def test_a_data_path_that_is_not_a_regular_file(tmp_path, path, what):
    """data.path=/dev/zero was said not to exist."""
    if path == "fifo.jsonl":
        path = tmp_path / path
        os.mkfifo(path)
    with pytest.raises(DataError) as e:
        rows(tmp_path, path)
    assert str(e.value) == f"data.path={path} is {what}, not a regular file; give a file or a directory"


def test_a_fifo_in_the_data_directory_is_one_line_exit_2_and_writes_nothing(tmp_path):
    """The same through the command line: exit code 2, one line, no output_dir (the probe's traceback)."""
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "a.jsonl", CHATS)
    os.mkfifo(data / "b.jsonl")
    run = tmp_path / "run"
    r = run_main([f"data.path={data}", f"output_dir={run}"], cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"moe-tune: error: data.path={data}: its entry b.jsonl is a FIFO, not a regular file")
    assert not run.exists()


def test_missing_local_path(tmp_path):
    with pytest.raises(DataError, match=r"data\.path=.*missing\.jsonl does not exist"):
        rows(tmp_path, tmp_path / "missing.jsonl")


@pytest.mark.slow
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
