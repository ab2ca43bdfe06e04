"""Every module of moe_tune imports on its own, as the first moe_tune module of an interpreter: an import cycle
that only a particular first import trips (a user's script, one test file collected alone) fails here. The heavy
third-party packages are imported once, then each module is imported in a forked child of that interpreter."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import moe_tune

MODULES = sorted(  # a __main__ runs its command line
    m.name for m in pkgutil.walk_packages(moe_tune.__path__, "moe_tune.") if not m.name.endswith(".__main__")
)

CHILDREN = """
import importlib, os, sys, traceback
import torch, transformers, safetensors, omegaconf, hydra  # imported once: the children share them
bad = []
for name in sys.argv[1:]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: this module first, then leave without running the parent's cleanup
        os.close(read)
        try:
            importlib.import_module(name)
            os._exit(0)
        except BaseException:
            os.write(write, traceback.format_exc().strip().splitlines()[-1].encode())
            os._exit(1)
    os.close(write)
    with os.fdopen(read) as f:
        message = f.read()
    if os.waitpid(pid, 0)[1]:
        bad.append(f"{name}: {message}")
print("\\n".join(bad))
"""


def test_every_module_imports_first():
    assert "moe_tune.distributed.dims" in MODULES  # a module that once could not be the first import
    out = subprocess.run([sys.executable, "-c", CHILDREN, *MODULES], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and not out.stdout.strip(), out.stdout + out.stderr[-2000:]
