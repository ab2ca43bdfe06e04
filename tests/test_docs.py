"""README.md, CONTRIBUTING.md and docs/*.md against the tree they describe (issue 37, item 6):

- the layer table of docs/architecture.md lists exactly the entries of tests/test_structure.py's LAYERS, in order;
- every local link resolves, its ``#anchor`` too (a heading of the target page, as GitHub makes anchors);
- every repository path the pages name (``moe_tune/...``, ``tests/...``, ``benchmarks/...``, ...) exists, and every
  dotted ``moe_tune.x.y`` name leads to a module or a name defined where it points;
- README stays a front door: at most about 150 lines, linking every page of docs/.

Paths under benchmarks/results and paths cited at a commit are tests/test_benchmark_links.py's (README and
benchmarks/README.md); its check runs here on the other pages too.
"""

from __future__ import annotations

import ast
import io
import pathlib
import re
import sys
import tokenize

import pytest

from tests.test_benchmark_links import _checked_part, _mentions
from tests.test_structure import LAYERS, PACKAGE

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = ["README.md", "CONTRIBUTING.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 150

MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
# A path into the repository: one of its top-level folders, then anything up to a space or closing punctuation.
REPO_PATH = re.compile(
    r"(?<![\w/.:<-])((?:moe_tune|tests|benchmarks|docs|launch|docker|hydra_plugins|\.ci)/[^\s`'\")\]\[,;|]*)"
)
DOTTED = re.compile(r"(?<![\w/.])moe_tune(?:\.\w+)+")
CODE_BLOCK = re.compile(r"^```.*?^```", re.S | re.M)


def read(page: str) -> str:
    return (ROOT / page).read_text()


# -- the architecture page's layer table ----------------------------------------------------------------------


def layer_table(text: str) -> list[tuple[str, tuple[str, ...]]]:
    """(layer column, module entries as dotted names) of each row of the first table under '## Layers'. A cell
    lists paths under moe_tune/ in backticks: ``config/`` is ``moe_tune.config``, ``distributed/dims.py`` is
    ``moe_tune.distributed.dims``, ``__init__.py`` is ``moe_tune.__init__`` (the package's own file)."""
    section = re.split(r"^## Layers\n", text, maxsplit=1, flags=re.M)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # past the header and |---|
    out = []
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        paths = re.findall(r"`([^`]+)`", cells[1])
        dotted = tuple(f"{PACKAGE}." + re.sub(r"(/|\.py)$", "", p).replace("/", ".") for p in paths)
        out.append((cells[0], dotted))
    return out


def test_architecture_layer_table_lists_the_entries_of_layers_in_order():
    got = layer_table(read("docs/architecture.md"))
    want = [(str(i), tuple(entries)) for i, entries in enumerate(LAYERS)]
    assert got == want, "docs/architecture.md's layer table differs from tests/test_structure.py's LAYERS"


def test_layer_table_reader_reads_paths_as_layers_entries():
    text = "## Layers\n\n| layer | modules | what |\n|---|---|---|\n| 0 | `config/`, `distributed/dims.py` | x |\n"
    text += "| 1 | `__init__.py`, `bench/__main__.py` | y |\n\n## Next\n| 9 | `z/` | |\n"
    assert layer_table(text) == [
        ("0", ("moe_tune.config", "moe_tune.distributed.dims")),
        ("1", ("moe_tune.__init__", "moe_tune.bench.__main__")),
    ]


# -- links, anchors, paths and names ----------------------------------------------------------------------------


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    return {anchor(h) for h in re.findall(r"^#{1,6} (.+)$", CODE_BLOCK.sub("", text), re.M)}


def broken_links(page: str, text: str) -> list[str]:
    out = []
    for target in MD_LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http(s):, mailto:
            continue
        path, _, fragment = target.partition("#")
        file = (ROOT / page).parent / path if path else ROOT / page
        if not file.exists():
            out.append(f"{page}: link {target}: no such file")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file.read_text()):
            out.append(f"{page}: link {target}: no heading with that anchor")
    return out


def missing_paths(page: str, text: str) -> list[str]:
    out = []
    text = MD_LINK.sub("]", text)  # link targets are relative to the page: broken_links checks them
    for path in REPO_PATH.findall(text):
        if not (ROOT / _checked_part(path)).exists():
            out.append(f"{page}: {path}")
    for _, path in _mentions(text):  # results folders named without their benchmarks/results/ prefix
        if not (ROOT / "benchmarks" / "results" / _checked_part(path)).exists():
            out.append(f"{page}: benchmarks/results/{path}")
    return out


def _defines(file: pathlib.Path, name: str) -> bool:
    return re.search(rf"^\s*(?:def|class)\s+{name}\b|^\s*{name}\s*[:=]|\bimport\b.*\b{name}\b", file.read_text(), re.M)


def unknown_names(page: str, text: str) -> list[str]:
    """Dotted names whose modules do not exist, or whose last part is no name defined in the module named."""
    out = []
    for name in set(DOTTED.findall(text)):
        where, parts = ROOT / PACKAGE, name.split(".")[1:]
        for part in parts:
            if (where / part).is_dir():
                where = where / part
            elif (where / f"{part}.py").is_file():
                where = where / f"{part}.py"
            elif where.is_dir() and _defines(where / "__init__.py", part) or where.is_file() and _defines(where, part):
                break  # a name defined there (what follows is an attribute of it)
            else:
                out.append(f"{page}: {name}")
                break
    return sorted(out)


@pytest.mark.parametrize("page", PAGES)
def test_links_paths_and_names_in_the_pages_exist(page):
    text = read(page)
    assert broken_links(page, text) + missing_paths(page, text) + unknown_names(page, text) == []


def test_the_checks_find_what_is_gone(tmp_path):
    """Each check reports a missing file, a missing anchor, a missing path and a name no module defines."""
    text = (
        "[a](docs/nowhere.md) [b](docs/data.md#no-such-heading) [c](docs/data.md#bad-records) "
        "`moe_tune/no_such_module.py` `tests/test_docs.py` `moe_tune.build.from_checkpoint` "
        "`moe_tune.build.no_such_function` `moe_tune.nowhere.x`"
    )
    assert broken_links("README.md", text) == [
        "README.md: link docs/nowhere.md: no such file",
        "README.md: link docs/data.md#no-such-heading: no heading with that anchor",
    ]
    assert missing_paths("README.md", text) == ["README.md: moe_tune/no_such_module.py"]
    assert unknown_names("README.md", text) == [
        "README.md: moe_tune.build.no_such_function",
        "README.md: moe_tune.nowhere.x",
    ]
    assert anchor("Outputs (`output_dir`)") == "outputs-output_dir"
    assert anchor("Checkpoints: what is guaranteed") == "checkpoints-what-is-guaranteed"


# -- README as a front door -------------------------------------------------------------------------------------


def test_readme_is_a_front_door_linking_every_docs_page():
    text = read("README.md")
    assert len(text.splitlines()) <= README_MAX_LINES, "README.md grew past a front door: move the detail to docs/"
    linked = {target.partition("#")[0] for target in MD_LINK.findall(text)}
    unlinked = [p for p in PAGES if p.startswith("docs/") and p not in linked]
    assert not unlinked, f"docs pages README.md does not link: {unlinked}"
    assert "CONTRIBUTING.md" in linked


# -- no benchmark figures in docstrings and comments ------------------------------------------------------------

# A measured speed or time, or a ratio of two measurements: "20.8 ms", "2.3 TB/s", "5,892 tokens/s", "0.71x".
FIGURE = re.compile(r"\d[\d.,]* ?(?:ms|us|µs|GB/s|TB/s|GiB/s|tokens/s|TFLOP/s)\b|\b\d+\.\d+x\b")


def prose(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, text) of every docstring line and comment of a .py file, every comment of a YAML file."""
    source = path.read_text()
    if path.suffix != ".py":
        return [(n, line) for n, line in enumerate(source.splitlines(), 1) if line.lstrip().startswith("#")]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                out += [(first.lineno + i, line) for i, line in enumerate(first.value.value.splitlines())]
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    return out


def figures_in_prose(root: pathlib.Path) -> list[str]:
    found = []
    for path in sorted([*root.rglob("*.py"), *root.rglob("*.yaml")]):
        rel = path.relative_to(ROOT).as_posix()
        found += [f"{rel}:{n}: {text.strip()}" for n, text in prose(path) if FIGURE.search(text)]
    return found


def test_docstrings_and_comments_quote_no_benchmark_figures():
    """A figure in a docstring goes stale while the code stays: give the reason in one clause and point to
    benchmarks/README.md by section, where the figure lives with its commit and command (CONTRIBUTING.md)."""
    assert figures_in_prose(ROOT / PACKAGE) == []


def test_the_figure_check_reads_docstrings_and_comments_only(tmp_path, monkeypatch):
    (tmp_path / "m.py").write_text(
        '"""Fast: 20.8 ms per step."""\n\n\ndef f():\n    """1.37x NeMo."""\n    x = "9 ms"  # 2.3 TB/s\n    return x\n'
    )
    (tmp_path / "c.yaml").write_text("# 5,892 tokens/s\nkey: 3 ms\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert figures_in_prose(tmp_path) == [
        "c.yaml:1: # 5,892 tokens/s",
        "m.py:1: Fast: 20.8 ms per step.",
        "m.py:5: 1.37x NeMo.",
        "m.py:6: # 2.3 TB/s",
    ]


# -- the routed experts' share of Qwen3-30B-A3B ------------------------------------------------------------------


def test_the_experts_share_of_qwen3_30b_a3b_quoted_is_its_parameter_count():
    """README and docs/lora.md said 97% of the weights are routed experts: Qwen3-30B-A3B's are 95% of its weights
    (97% of its decoder layers', without the embeddings and lm_head), counted here on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    from moe_tune.models.presets import preset_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset_config("qwen3_30b_a3b"))
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    experts = sum(n for name, n in sizes.items() if ".mlp.experts." in name)
    layers = sum(n for name, n in sizes.items() if ".layers." in name)
    share, layer_share = round(100 * experts / sum(sizes.values())), round(100 * experts / layers)
    assert "The frozen experts, 95% of the weights" in read("README.md") and share == 95
    assert f"({share}% of Qwen3-30B-A3B's, {layer_share}% of its decoder layers')" in read("docs/lora.md")


def test_the_full_deepseek_v3_that_models_md_names_is_deepseek_v3():
    """docs/models.md's overrides for the full DeepSeek-V3 from ``model=deepseek_v3`` (cut to 1 dense + 3 MoE
    layers) give its 61 layers, the first 3 dense, and its 671B parameters without the multi-token-prediction layer
    (``num_hidden_layers=61`` alone keeps the cut's one dense layer: 60 MoE layers, 692.9B parameters)."""
    import torch
    from transformers import AutoModelForCausalLM

    from moe_tune.config.overrides import check, to_config
    from moe_tune.models.presets import trained_config

    given = re.search(r"and `([^`]+)` gives the full model", read("docs/models.md").replace("\n", " ")).group(1)
    cfg = to_config(check(["model=deepseek_v3", *given.split()]))
    hf = trained_config(cfg.model.name, cfg.model.overrides)
    assert (hf.num_hidden_layers, hf.first_k_dense_replace) == (61, 3)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    assert sum(p.numel() for p in model.parameters()) == 671_026_404_352
