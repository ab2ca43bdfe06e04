"""The house rules of CONTRIBUTING.md that imports and lengths show, read from the source with ``ast`` (no moe_tune
code is imported):

(a) no import cycle among moe_tune modules, function-level (lazy) imports counted;
(b) imports go one way: a module imports only from its own layer or the layers above it (LAYERS, top first),
    and every moe_tune module is placed in a layer;
(c) no file in moe_tune/ over MAX_FILE_LINES lines;
(d) no function or method over MAX_FUNCTION_LINES lines, from ``def`` to the end of its body (decorators not
    counted).

LAYERS is also the layer table of docs/architecture.md: tests/test_docs.py holds the two to the same rows.

An import is any ``import``/``from ... import`` statement anywhere in a module (top level, inside functions,
under ``if TYPE_CHECKING:``), plus registry strings ``"moe_tune.pkg.module:Name"`` that code resolves with
importlib. ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``. Importing
a submodule is not counted as importing its parent packages (every package does that, harmlessly).
"""

from __future__ import annotations

import ast
import os
import re
import sys
from collections import defaultdict
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "moe_tune"

# Layers, top first. A module may import from its own layer or any layer above (a lower number), never from a
# layer below. An entry names a module or a package (all its submodules); a module takes the layer of its longest
# matching entry, so one package can span layers (``moe_tune.distributed``: the layout's arithmetic beside the
# config, its meshes above the model, the parallelisms that wrap a built model below it). "moe_tune.__init__" is
# the package's own __init__.py only. Within a layer the modules may import each other (acyclically, rule a).
# The last layer holds the entry points (``moe_tune.cli``), the ``python -m`` doors that only call them, and the
# benchmark's rows (each row's process is an entry point of its own).
LAYERS: list[tuple[str, ...]] = [
    ("moe_tune.config", "moe_tune.distributed.dims"),
    ("moe_tune.distributed.process_group", "moe_tune.distributed.mesh"),
    ("moe_tune.kernels",),
    ("moe_tune.lora",),
    ("moe_tune.moe",),
    ("moe_tune.models",),
    ("moe_tune.distributed",),
    (
        "moe_tune.data",
        "moe_tune.optim",
        "moe_tune.checkpoint",
        "moe_tune.metrics",
        "moe_tune.env",
        "moe_tune.run_record",
        "moe_tune.build",
        "moe_tune.loggers",
    ),
    ("moe_tune.train",),
    (
        "moe_tune.cli",
        "moe_tune.bench",
        "moe_tune.launch",
        "moe_tune.__init__",
        "moe_tune.__main__",
        "moe_tune.bench.__main__",
        "moe_tune.env.__main__",
    ),
]
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60

REGISTRY_STRING = re.compile(r"(moe_tune(?:\.\w+)+):\w+")


@dataclass(frozen=True)
class Edge:
    src: str  # importing module
    dst: str  # imported module
    path: str  # file of src, relative to the repository
    line: int
    how: str  # "import", "lazy import" (inside a function) or "registry string"

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.src} -> {self.dst} ({self.how})"


def module_files() -> dict[str, str]:
    """Dotted module name -> path relative to the repository, for every .py file under moe_tune/."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, PACKAGE)):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), ROOT)
            parts = rel[: -len(".py")].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = rel
    return out


def is_package(module: str, files: dict[str, str]) -> bool:
    return files[module].endswith("__init__.py")


def layer_of(module: str) -> int | None:
    """The layer of the longest entry of LAYERS that names ``module`` or a package above it."""
    best, best_len = None, -1
    for i, entries in enumerate(LAYERS):
        for entry in entries:
            if entry == f"{PACKAGE}.__init__":
                hit = module == PACKAGE
            else:
                hit = module == entry or module.startswith(entry + ".")
            if hit and len(entry) > best_len:
                best, best_len = i, len(entry)
    return best


def _resolve_relative(module: str, files: dict[str, str], level: int, name: str | None) -> str:
    base = module.split(".") if is_package(module, files) else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([name] if name else []))


def _target(name: str, files: dict[str, str]) -> str | None:
    """The module an import of ``name`` runs last: the longest prefix of ``name`` that is a moe_tune module."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in files:
            return candidate
    return None


def _function_lines(tree: ast.AST) -> set[int]:
    """Line numbers of import statements that sit inside a function (lazy imports)."""
    lazy = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    lazy.add(node.lineno)
    return lazy


def import_edges(files: dict[str, str]) -> tuple[list[Edge], list[str]]:
    """Every moe_tune -> moe_tune import, and the imports of moe_tune names that are no module at all."""
    edges, broken = [], []
    for module, rel in files.items():
        with open(os.path.join(ROOT, rel)) as f:
            tree = ast.parse(f.read(), filename=rel)
        lazy = _function_lines(tree)
        for node in ast.walk(tree):
            names: list[str] = []
            how = "lazy import" if getattr(node, "lineno", None) in lazy else "import"
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve_relative(module, files, node.level, node.module) if node.level else node.module
                if base is None:
                    continue
                # `from pkg import sub` imports the submodule pkg.sub when there is one, else a name of pkg.
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                m = REGISTRY_STRING.fullmatch(node.value)
                if m:
                    names, how = [m.group(1)], "registry string"
            for name in names:
                if name != PACKAGE and not name.startswith(PACKAGE + "."):
                    continue
                dst = _target(name, files)
                if dst is None:
                    broken.append(f"{rel}:{node.lineno}: {module} imports {name}, which is no module in {PACKAGE}/")
                elif dst != module:
                    edges.append(Edge(module, dst, rel, node.lineno, how))
    return sorted(set(edges), key=lambda e: (e.path, e.line, e.dst)), broken


def cycles(edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    graph = defaultdict(set)
    for e in edges:
        graph[e.src].add(e.dst)
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_every_module_is_placed_in_a_layer():
    unplaced = [f"{rel}: {module}" for module, rel in module_files().items() if layer_of(module) is None]
    assert not unplaced, "modules in no layer of LAYERS (add them to LAYERS here and to docs/architecture.md):\n" + (
        "\n".join(unplaced)
    )


def test_no_import_of_a_missing_module():
    _, broken = import_edges(module_files())
    assert not broken, "imports of moe_tune names that are no module:\n" + "\n".join(broken)


def cycle_report(edges: list[Edge]) -> list[str]:
    """One line per cycle, then every import edge inside it."""
    lines = []
    for component in cycles(edges):
        members = set(component)
        lines.append(f"cycle among {', '.join(component)}:")
        lines += [f"  {e}" for e in edges if e.src in members and e.dst in members]
    return lines


def upward_imports(edges: list[Edge]) -> list[str]:
    out = []
    for e in edges:
        src, dst = layer_of(e.src), layer_of(e.dst)
        if src is not None and dst is not None and dst > src:
            out.append(f"{e} [layer {src} imports layer {dst}]")
    return out


def test_no_import_cycles():
    edges, _ = import_edges(module_files())
    report = cycle_report(edges)
    assert not report, "import cycles:\n" + "\n".join(report)


def test_imports_go_from_lower_layers_to_higher_ones_only():
    edges, _ = import_edges(module_files())
    upward = upward_imports(edges)
    assert not upward, f"{len(upward)} import(s) from a layer to one below it:\n" + "\n".join(upward)


def test_files_are_at_most_400_lines():
    long = []
    for rel in module_files().values():
        with open(os.path.join(ROOT, rel)) as f:
            n = len(f.read().splitlines())
        if n > MAX_FILE_LINES:
            long.append(f"{rel}:1: {n} lines")
    assert not long, f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(sorted(long))


def function_lengths(rel: str) -> list[tuple[int, str, int]]:
    """(line of ``def``, qualified name, lines from ``def`` to the end of the body) of every function."""
    with open(os.path.join(ROOT, rel)) as f:
        tree = ast.parse(f.read(), filename=rel)
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                # lineno is the `def` line; decorators sit above it and are not counted.
                out.append((child.lineno, prefix + child.name, child.end_lineno - child.lineno + 1))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def test_functions_are_at_most_60_lines():
    long = [
        f"{rel}:{line}: {name} is {n} lines"
        for rel in module_files().values()
        for line, name, n in function_lengths(rel)
        if n > MAX_FUNCTION_LINES
    ]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (def to end of body):\n" + "\n".join(long)


# -- the checker on itself: small synthetic cases --------------------------------------------------------------


def test_checker_sees_lazy_imports_relative_imports_and_registry_strings(tmp_path, monkeypatch):
    """The checks find what they claim to: a cycle made only by a function-level import, a relative import, a
    registry string, and the def-to-end count that leaves decorators out."""
    pkg = tmp_path / PACKAGE
    (pkg / "moe").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text("def f():\n    from moe_tune.moe import layer\n")
    (pkg / "moe" / "__init__.py").write_text("from .layer import Layer\n")
    (pkg / "moe" / "layer.py").write_text("import moe_tune.config\nX = 'moe_tune.train:Trainer'\nclass Layer: ...\n")
    (pkg / "train.py").write_text("@staticmethod\n@property\ndef g():\n    return 1\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    files = module_files()
    assert set(files) == {"moe_tune", "moe_tune.config", "moe_tune.moe", "moe_tune.moe.layer", "moe_tune.train"}
    edges, broken = import_edges(files)
    got = {(e.src, e.dst, e.how) for e in edges}
    assert got == {
        ("moe_tune.config", "moe_tune.moe.layer", "lazy import"),
        ("moe_tune.moe", "moe_tune.moe.layer", "import"),
        ("moe_tune.moe.layer", "moe_tune.config", "import"),
        ("moe_tune.moe.layer", "moe_tune.train", "registry string"),
    }, got
    assert not broken
    assert cycles(edges) == [["moe_tune.config", "moe_tune.moe.layer"]]
    assert cycle_report(edges) == [
        "cycle among moe_tune.config, moe_tune.moe.layer:",
        "  moe_tune/config.py:2: moe_tune.config -> moe_tune.moe.layer (lazy import)",
        "  moe_tune/moe/layer.py:1: moe_tune.moe.layer -> moe_tune.config (import)",
    ]
    assert upward_imports(edges) == [
        "moe_tune/config.py:2: moe_tune.config -> moe_tune.moe.layer (lazy import) [layer 0 imports layer 4]",
        "moe_tune/moe/layer.py:2: moe_tune.moe.layer -> moe_tune.train (registry string) [layer 4 imports layer 8]",
    ]
    assert function_lengths(os.path.join(PACKAGE, "train.py")) == [(3, "g", 2)]
    assert layer_of("moe_tune") == 9 and layer_of("moe_tune.models.hf_io") == 5 and layer_of("moe_tune.x") is None
