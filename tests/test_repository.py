"""The repository's own hygiene: every tracked folder is seen by git, ruff and pytest (none is named like an ignore
pattern or a tool's default exclude, which would hide new files there from ``git status`` and the folder from lint
and collection)."""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ruff's default ``exclude`` (ruff settings reference) and pytest's default ``norecursedirs`` (pytest reference):
# a folder of one of these names is skipped by the tool unless the configuration overrides the default.
RUFF_DEFAULT_EXCLUDE = (
    ".bzr", ".direnv", ".eggs", ".git", ".git-rewrite", ".hg", ".ipynb_checkpoints", ".mypy_cache", ".nox",
    ".pants.d", ".pyenv", ".pytest_cache", ".pytype", ".ruff_cache", ".svn", ".tox", ".venv", ".vscode",
    "__pypackages__", "_build", "buck-out", "dist", "node_modules", "site-packages", "venv", "build",
)  # fmt: skip
PYTEST_DEFAULT_NORECURSE = ("*.egg", ".*", "_darcs", "build", "CVS", "dist", "node_modules", "venv", "{arch}")


def tracked_folders() -> list[str]:
    if shutil.which("git") is None or not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout: the tracked folders are git's")
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    folders = set()
    for f in files:
        parts = f.split("/")[:-1]
        folders.update("/".join(parts[: i + 1]) for i in range(len(parts)))
    return sorted(folders)


def test_no_tracked_folder_matches_an_ignore_pattern():
    folders = tracked_folders()
    p = subprocess.run(
        ["git", "check-ignore", "--no-index", "--verbose", "--stdin"],
        cwd=ROOT,
        input="\n".join(f + "/" for f in folders),
        capture_output=True,
        text=True,
    )
    assert p.returncode in (0, 1), p.stderr
    assert not p.stdout.strip(), (
        "tracked folders matched by an ignore pattern (anchor it with a leading /):\n" + p.stdout
    )


def test_no_tracked_folder_is_named_like_a_tools_default_exclude():
    names = {part for f in tracked_folders() for part in f.split("/")}
    ruff = sorted(n for n in names if n in RUFF_DEFAULT_EXCLUDE)
    pytest_skips = sorted(n for n in names if any(fnmatch.fnmatch(n, pat) for pat in PYTEST_DEFAULT_NORECURSE))
    # Folders starting with "." are pytest's default skip and tracked on purpose only for CI (.ci): not tests.
    pytest_skips = [n for n in pytest_skips if not n.startswith(".")]
    assert not ruff and not pytest_skips, f"named like ruff's default excludes: {ruff}; pytest's: {pytest_skips}"


def test_the_checks_see_what_they_claim(tmp_path):
    """An unanchored folder pattern matches a deeper tracked folder of that name; the anchored one does not."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("dist/\n")
    check = ["git", "check-ignore", "--no-index", "-q", "pkg/dist/"]
    assert subprocess.run(check, cwd=tmp_path).returncode == 0
    (tmp_path / ".gitignore").write_text("/dist/\n")
    assert subprocess.run(check, cwd=tmp_path).returncode == 1
