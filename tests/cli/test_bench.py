"""``moe-tune-bench`` as a command (issue 18, item 6): without matplotlib it stops before any row with one line
naming the extra to install (it crashed after every row had run); ``--help`` says what it does in whole sentences."""

import sys

import pytest

from moe_tune.cli import bench


def test_without_matplotlib_it_stops_before_any_row(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    out = tmp_path / "results"
    assert bench.main(["train.steps=1", "--baselines", "none", "--out", str(out)]) == 2
    printed = capsys.readouterr()
    assert printed.err == "moe-tune-bench: error: the PNG chart needs matplotlib: pip install 'moe_tune[bench]'\n"
    assert "running" not in printed.out and not out.exists()


def test_help_describes_the_command_in_whole_sentences(capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "one workload through the plain Transformers baseline, moe_tune variants and (when installed) NeMo " in text
    assert "AutoModel, side by side." in text and "--variants" in text
