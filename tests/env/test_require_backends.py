"""``require_backends(cfg)``: the start-of-run check that every backend the config names is usable here.

``config.validate`` checks the config alone; these refusals depend on the machine, so they live in moe_tune.env.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from moe_tune.cli.train import compose, to_config
from moe_tune.config import ConfigError, validate
from moe_tune.env import backends, require_backends

PACKAGE = pathlib.Path(backends.__file__).parents[1]


@pytest.mark.parametrize(
    "overrides,world,message",
    [
        (["comm=deepep", "parallel.ep=2"], 2, "deepep"),
        (["comm=symm_mem", "parallel.ep=2"], 2, "symm_mem"),
        (["kernels=te"], 1, "TransformerEngine is not installed"),
    ],
)
def test_unusable_backend_is_refused_with_one_line(overrides, world, message):
    cfg = to_config(compose(overrides))
    validate(cfg, world_size=world)  # the config itself is fine: only this machine lacks the backend
    with pytest.raises(ConfigError) as e:
        require_backends(cfg)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_deepep_refusal_says_how_to_build(monkeypatch):
    monkeypatch.setattr(backends, "_installed", lambda module: module != "deep_ep")
    cfg = to_config(compose(["comm=deepep", "parallel.ep=2"]))
    with pytest.raises(ConfigError, match="not on PyPI") as e:
        require_backends(cfg)
    assert str(e.value).startswith("comm=deepep: DeepEP is not installed") and "v1.2.1" in str(e.value)


def test_the_reason_is_unusable_reasons(monkeypatch):
    """TE usable on a (pretend) H200, MXFP8 not: the refusal is the fp8 mode's, word for word."""
    monkeypatch.setattr(backends, "_cuda", lambda: ("NVIDIA H200", (9, 0)))
    monkeypatch.setattr(backends, "_installed", lambda module: True)
    monkeypatch.setattr(backends, "_import_error", lambda module: None)
    cfg = to_config(compose(["kernels=te", "kernels.fp8=mxfp8"]))
    with pytest.raises(ConfigError) as e:
        require_backends(cfg)
    assert str(e.value) == backends.unusable_reason("fp8_mxfp8")
    assert backends.backends_needed(cfg) == ["transformer_engine", "fp8_mxfp8"]


def test_defaults_need_no_backend():
    cfg = to_config(compose([]))
    assert backends.backends_needed(cfg) == []
    require_backends(cfg)


def _moe_tune_imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("moe_tune"):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("moe_tune")}
    return names


def test_backend_checks_are_not_imported_from_below():
    """config (layer 0) imports nothing of moe_tune but its own layer (itself and the layout's arithmetic); moe/ (layer 3) never reaches up into moe_tune.env.
    Function-level imports count too."""
    config_files = [PACKAGE / "config.py"] if (PACKAGE / "config.py").exists() else (PACKAGE / "config").rglob("*.py")
    for path in config_files:
        assert all(m.startswith(("moe_tune.config", "moe_tune.distributed.dims")) for m in _moe_tune_imports(path)), (
            path
        )
    for path in (PACKAGE / "moe").rglob("*.py"):
        assert not {m for m in _moe_tune_imports(path) if m.startswith("moe_tune.env")}, path
