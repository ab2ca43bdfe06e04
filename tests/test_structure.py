"""The house rules of CONTRIBUTING.md that imports and lengths show, read from the source with ``ast`` (no moe_tune
code is imported):

(a) no import cycle among moe_tune modules, function-level (lazy) imports counted;
(b) imports go one way: a module imports only from its own layer or the layers above it (LAYERS, top first),
    and every moe_tune module is placed in a layer;
(c) no file in moe_tune/ over MAX_FILE_LINES lines;
(d) no function or method over MAX_FUNCTION_LINES lines, from ``def`` to the end of its body (decorators not
    counted);
(e) no writes into another layer's objects, where the source shows them: no module outside ``moe_tune.train``
    writes through a name ``trainer`` or a parameter annotated with ``Trainer``; no module writes a private
    attribute (``x._name``) of an object other than ``self``/``cls``; no function writes through a parameter whose
    annotation names a class of a moe_tune module in another layer. A write is an assignment (``=``, augmented,
    annotated; attribute or item, at any depth below the name) or ``setattr``/``object.__setattr__`` with a
    literal attribute name.

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
    (
        "moe_tune.distributed.env",
        "moe_tune.distributed.process_group",
        "moe_tune.distributed.mesh",
        "moe_tune.distributed.shard",
    ),
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
        "moe_tune.plan",
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

# Private attributes of third-party objects that moe_tune must write, where the library offers no public path:
# (file, target as the source spells it) -> why.
THIRD_PARTY_PRIVATE_WRITES = {
    ("moe_tune/kernels/te.py", "model.config._attn_implementation"): "transformers picks a registered attention "
    "function by this config property, and the model is built already",
    ("moe_tune/models/model.py", "config._attn_implementation"): "transformers picks a registered attention "
    "function by this config property, and the model is built already",
    ("moe_tune/models/generation.py", "generation._from_model_config"): "transformers' GenerationConfig has no public "
    "setter for it; left True, transformers may rebuild generation_config.json from config.json",
}

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


@dataclass(frozen=True)
class Write:
    path: str  # file of the writing module, relative to the repository
    line: int
    target: str  # what is written, as the source spells it
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.target} ({self.why})"


def _root(node: ast.AST) -> tuple[str | None, list[str]]:
    """The name an attribute/item chain starts from, and the attribute names along it (``a.b[0].c``: a, [b, c])."""
    attrs = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            attrs.append(node.attr)
        node = node.value
    return (node.id if isinstance(node, ast.Name) else None), attrs[::-1]


def _written(tree: ast.AST):
    """(node, object expression, attribute name or None for an item) of every write into an object in ``tree``."""
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            f, name = node.func, node.args[1]
            setter = (isinstance(f, ast.Name) and f.id == "setattr") or (
                isinstance(f, ast.Attribute) and f.attr == "__setattr__" and _root(f.value)[0] == "object"
            )
            if setter and isinstance(name, ast.Constant) and isinstance(name.value, str):
                yield node, node.args[0], name.value
        while targets:
            t = targets.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                targets += t.elts
            elif isinstance(t, ast.Starred):
                targets.append(t.value)
            elif isinstance(t, ast.Attribute):
                yield node, t.value, t.attr
            elif isinstance(t, ast.Subscript):
                yield node, t.value, None


def _is_private(attr: str | None) -> bool:
    return attr is not None and attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))


def _imported_names(module: str, tree: ast.AST, files: dict[str, str]) -> dict[str, str]:
    """Local name -> the moe_tune module it names or comes from (``from pkg import Name``: pkg, or pkg.Name when
    that is a module; ``import pkg.mod as m``: pkg.mod)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(PACKAGE) and a.asname:
                    names[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_relative(module, files, node.level, node.module) if node.level else node.module
            if base and (base == PACKAGE or base.startswith(PACKAGE + ".")):
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    names[a.asname or a.name] = sub if sub in files else base
    return names


def _annotation_classes(annotation: ast.AST | None, imported: dict[str, str]) -> list[tuple[str, str]]:
    """(class name, the moe_tune module it is imported from) of each name in a parameter's annotation."""
    if annotation is None:
        return []
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):  # a quoted annotation
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return []
    out = []
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name) and node.id in imported:
            out.append((node.id, imported[node.id]))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imported:
            out.append(
                (node.attr, imported[node.value.id])
            )  # ckpt.RunState, with ``from moe_tune import checkpoint as ckpt``
    return out


def _foreign_parameters(module: str, fn: ast.AST, imported: dict[str, str]) -> dict[str, str]:
    """Parameter name -> why it is not this module's to write: named ``trainer`` or annotated with ``Trainer``
    (outside moe_tune.train), or annotated with a class imported from a module of another layer."""
    args = fn.args
    out = {}
    for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
        if a is None or a.arg in ("self", "cls"):
            continue
        classes = _annotation_classes(a.annotation, imported)
        if not module.startswith(f"{PACKAGE}.train") and (
            a.arg == "trainer" or any(c == "Trainer" for c, _ in classes)
        ):
            out[a.arg] = "the trainer's state is written only in moe_tune.train"
            continue
        for cls, owner in classes:
            if layer_of(owner) is not None and layer_of(owner) != layer_of(module):
                out[a.arg] = f"a {cls} of {owner} (layer {layer_of(owner)}), written from layer {layer_of(module)}"
                break
    return out


def foreign_writes(files: dict[str, str]) -> list[Write]:
    """Every write rule (e) forbids, in the files of ``files``."""
    found = []
    for module, rel in files.items():
        with open(os.path.join(ROOT, rel)) as f:
            tree = ast.parse(f.read(), filename=rel)
        imported = _imported_names(module, tree, files)
        foreign = {}  # id of a write node -> (parameter, why) of the function it is in
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                params = _foreign_parameters(module, fn, imported)
                for node in ast.walk(fn):
                    foreign[id(node)] = params
        outside_train = not module.startswith(f"{PACKAGE}.train")
        for node, obj, attr in _written(tree):
            name, chain = _root(obj)
            target = ast.unparse(obj) + (f".{attr}" if attr is not None else "[...]")
            if outside_train and name == "trainer":
                found.append(Write(rel, node.lineno, target, "the trainer's state is written only in moe_tune.train"))
            elif name in foreign.get(id(node), {}):
                found.append(Write(rel, node.lineno, target, foreign[id(node)][name]))
            elif _is_private(attr) and not (name in ("self", "cls") and not chain):
                if (rel, target) not in THIRD_PARTY_PRIVATE_WRITES:
                    found.append(Write(rel, node.lineno, target, "a private attribute of another object"))
    return sorted(set(found), key=lambda w: (w.path, w.line, w.target))


def test_no_module_writes_into_another_layers_objects():
    writes = foreign_writes(module_files())
    assert not writes, f"{len(writes)} write(s) into objects another module owns:\n" + "\n".join(map(str, writes))


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


def test_checker_sees_writes_into_objects_of_other_layers(tmp_path, monkeypatch):
    """Rule (e) finds a checkpoint module writing the trainer's step (plain, augmented, nested, through a parameter
    annotated with Trainer, by setattr), a scheduler's private attribute (and by object.__setattr__), and a
    model module writing into a config parameter of another layer; it leaves alone the trainer's own writes, an
    object's writes to its own private attributes, reads, and writes into same-layer or unannotated objects."""
    pkg = tmp_path / PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text("class Config: ...\n")
    (pkg / "train.py").write_text(
        "class Trainer:\n    def f(self, trainer):\n        trainer.step = 1\n        self._step = 2\n"
    )
    (pkg / "checkpoint.py").write_text(
        "from moe_tune.train import Trainer\n"
        "def load(trainer, t: 'Trainer', scheduler, other):\n"
        "    trainer.step = 1\n"
        "    trainer.data.position += 1\n"
        "    t.accum: int = 2\n"
        "    setattr(t, 'layout', None)\n"
        "    scheduler._last_lr = [0.1]\n"
        "    object.__setattr__(scheduler, '_x', 0)\n"
        "    a, (b, other.c) = 1, (2, 3)\n"
        "    other.d, other._e = trainer.step, 4\n"
        "class Saver:\n"
        "    def __init__(self):\n"
        "        self._n = 0\n"
        "        setattr(self, '_m', 1)\n"
        "        self.child._n = 2\n"
        "    @classmethod\n"
        "    def make(cls):\n"
        "        cls._count = 1\n"
    )
    (pkg / "models.py").write_text(
        "from moe_tune.config import Config\n"
        "from moe_tune import models as same\n"
        "def apply(cfg: Config, opts: 'same.Options', x):\n"
        "    cfg.dtype = 'bf16'\n"
        "    cfg.overrides['layers'] = 2\n"
        "    opts.dtype = cfg.dtype\n"
        "    x.y = 1\n"
        "class Options: ...\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    got = [(w.path, w.line, w.target) for w in foreign_writes(module_files())]
    assert got == [
        ("moe_tune/checkpoint.py", 3, "trainer.step"),
        ("moe_tune/checkpoint.py", 4, "trainer.data.position"),
        ("moe_tune/checkpoint.py", 5, "t.accum"),
        ("moe_tune/checkpoint.py", 6, "t.layout"),
        ("moe_tune/checkpoint.py", 7, "scheduler._last_lr"),
        ("moe_tune/checkpoint.py", 8, "scheduler._x"),
        ("moe_tune/checkpoint.py", 10, "other._e"),
        ("moe_tune/checkpoint.py", 15, "self.child._n"),
        ("moe_tune/models.py", 4, "cfg.dtype"),
        ("moe_tune/models.py", 5, "cfg.overrides[...]"),
    ], got
    whys = {w.target: w.why for w in foreign_writes(module_files())}
    assert whys["t.accum"] == "the trainer's state is written only in moe_tune.train"
    assert whys["scheduler._last_lr"] == "a private attribute of another object"
    assert whys["cfg.dtype"] == "a Config of moe_tune.config (layer 0), written from layer 5"
