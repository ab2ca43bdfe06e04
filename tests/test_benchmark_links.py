"""README.md and benchmarks/README.md point only at files that exist (issue 37, item 7).

Checked: every results path they mention (``benchmarks/results/<date>-<hardware>/...``, ``results/<date>-<hardware>/...``
or a bare ``<date>-<hardware>/...``, all under benchmarks/results) and every Markdown link to a local file. A path
cited at a commit, ``<commit>:benchmarks/results/...`` (runs that left the tree), is not looked for in the tree; it
is looked for in that commit where the clone has it. Paths with a placeholder (``*``, ``<...>``, ``{a,b}``) are
checked up to the folder before it.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ["README.md", "benchmarks/README.md"]

_STOP = r"[^\s`'\")\]\[,;|]"
# A results folder is <YYYY-MM-DD>-<hardware>, hardware <N>x<GPU> or cpu; optionally prefixed by benchmarks/results/
# or results/. Not preceded by a word character, '/', '.', ':' or '-': that excludes commit citations and the
# middle of longer paths.
RESULTS_PATH = re.compile(
    r"(?<![\w/.:-])(?:(?:benchmarks/)?results/)?(\d{4}-\d{2}-\d{2}-(?:\d+x[A-Za-z0-9]+|cpu)(?:/" + _STOP + r"*)?)"
)
COMMIT_PATH = re.compile(r"(?<![\w/])([0-9a-f]{7,40}):(benchmarks/" + _STOP + r"*)")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
PLACEHOLDER = re.compile(r"[*<{\[]")


def _checked_part(path: str) -> str:
    """The path up to the folder before its first placeholder, without trailing sentence punctuation."""
    path = path.rstrip(".:")
    match = PLACEHOLDER.search(path)
    if match:
        path = path[: match.start()].rsplit("/", 1)[0]
    return path


def _mentions(text: str) -> list[tuple[int, str]]:
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        out += [(number, m.group(1)) for m in RESULTS_PATH.finditer(line)]
    return out


def _missing(doc: str) -> list[str]:
    text = (ROOT / doc).read_text()
    missing = []
    for number, path in _mentions(text):
        if not (RESULTS / _checked_part(path)).exists():
            missing.append(f"{doc}:{number}: benchmarks/results/{path}")
    for number, line in enumerate(text.splitlines(), 1):
        for m in MD_LINK.finditer(line):
            target = m.group(1).split("#", 1)[0]
            if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target):  # an anchor, http(s):, mailto:
                continue
            if not ((ROOT / doc).parent / _checked_part(target)).exists():
                missing.append(f"{doc}:{number}: link {target}")
    return missing


@pytest.mark.parametrize("doc", DOCS)
def test_every_results_path_and_local_link_exists(doc):
    assert _missing(doc) == []


def test_the_check_finds_paths_in_each_form():
    """The pattern sees the forms the pages use and leaves commit citations to the next test."""
    line = (
        "`benchmarks/results/2026-12-02-cpu/packing_fill/`, (`results/2026-11-30-1xH200/engine.md`), "
        "2026-12-03-1xH200/trl_5783a61/ and `3e9656f:benchmarks/results/2026-12-01-1xH200/gathers/`."
    )
    assert [path for _, path in _mentions(line)] == [
        "2026-12-02-cpu/packing_fill/",
        "2026-11-30-1xH200/engine.md",
        "2026-12-03-1xH200/trl_5783a61/",
    ]
    placeholder = "2026-11-30-1xH200/precision-lr3e-5/<workload>-seed<N>/"
    assert _checked_part(placeholder) == "2026-11-30-1xH200/precision-lr3e-5"


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


@pytest.mark.parametrize("doc", DOCS)
def test_paths_cited_at_a_commit_exist_there(doc):
    if shutil.which("git") is None or _git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("not a git checkout")
    cited = [(c, _checked_part(p).rstrip("/")) for c, p in COMMIT_PATH.findall((ROOT / doc).read_text())]
    if not cited:
        return
    commits = {c for c, _ in cited}
    absent = [c for c in commits if _git("cat-file", "-e", f"{c}^{{commit}}").returncode != 0]
    if absent:
        pytest.skip(f"this clone lacks commit(s) {sorted(absent)} (a shallow clone)")
    missing = [f"{c}:{p}" for c, p in cited if _git("cat-file", "-e", f"{c}:{p}").returncode != 0]
    assert missing == []
