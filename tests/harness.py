"""How tests run moe_tune outside the pytest process: N ranks in spawned processes (``run_ranks``), the CLI in a
subprocess (``run_cli``), and reading what a run wrote.

``run_ranks`` bodies are module-level functions ``fn(rank, *args)`` (spawn pickles them by reference); a failure
on any rank is re-raised in pytest with that rank's traceback.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_tune.distributed.process_group import destroy_distributed, init_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS")

needs_te = pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is None,
    reason="TransformerEngine is not installed (pip install 'moe_tune[te]' on a CUDA machine)",
)


class CheckpointRun(types.SimpleNamespace):
    """What a Trainer hands ``moe_tune.checkpoint``, for a model built without one: ``model``, ``optimizer``,
    ``scheduler``, ``step`` and ``cfg`` over one rank, no source, one micro-batch per step, no custom chat
    template; ``save`` and ``load`` as the trainer does them (a load's step applied by the run, here)."""

    def state(self):
        from moe_tune.checkpoint import RunState
        from moe_tune.distributed.dims import BatchLayout

        layout = BatchLayout.from_config(self.cfg.train, dp_size=1)
        return RunState(self.model, self.optimizer, self.scheduler, self.cfg, layout)

    def save(self, path: str) -> float:
        from moe_tune import checkpoint as ckpt

        return ckpt.save(self.state(), self.step, path)

    def load(self, path: str):
        from moe_tune import checkpoint as ckpt

        resumed = ckpt.load(self.state(), path)
        self.step = resumed.step
        return resumed


def triton_interpreted(code: str, gpu_test: str) -> None:
    """Runs ``code`` in a fresh Python with TRITON_INTERPRET=1: the Triton kernels it calls, and Triton's own library
    functions they call, element by element in NumPy (the code a GPU compiles). A fresh interpreter, because Triton
    reads the variable as its library is decorated. On a GPU machine the test skips, naming ``gpu_test``, which runs
    the compiled kernel instead (the H200 machines' Triton 3.6 also interprets a runtime loop bound as an array)."""
    pytest.importorskip("triton", reason="Triton is not installed (pip install -e '.[dev]' brings it)")
    if torch.cuda.is_available():
        pytest.skip(f"a GPU runs the compiled kernel ({gpu_test}); Triton's interpreter is the CPU's stand-in")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]


def compile_for_hopper(kernel, pointers: dict, scalars: dict, constexprs: dict, num_warps=4, num_stages=3) -> str:
    """``kernel`` compiled ahead of time for sm90 by Triton's own compiler, on the CPU (no GPU needed): code the
    interpreter runs but a GPU compile refuses fails here. Arguments by name: ``pointers`` and ``scalars`` map to
    Triton type strings ("*bf16", "i32"), ``constexprs`` to values. Returns the PTX."""
    triton = pytest.importorskip("triton", reason="Triton is not installed (pip install -e '.[dev]' brings it)")
    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton has no CUDA backend to compile with")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**pointers, **scalars, **dict.fromkeys(constexprs, "constexpr")}
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(ASTSource(kernel, signature, constexprs), GPUTarget("cuda", 90, 32), options).asm["ptx"]


# -- ranks in processes -------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world_size: int, port: int, backend: str, args: tuple, environ: dict[str, str]) -> None:
    os.environ.clear()  # the test's environment when it called run_ranks (a forked rank has the server's)
    os.environ.update(environ)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    if backend == "nccl":
        os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")  # NVLink multicast off, as moe-tune-env's probes run
    init_distributed(backend)  # with CUDA: this rank's GPU is cuda:<rank>
    try:
        fn(rank, *args)
        # Free what the body built (sharded modules, DTensors) and line the ranks up while the group is alive: a gloo
        # group torn down under live DTensors, or while the other rank still communicates, can abort the process.
        gc.collect()
        dist.barrier()
    finally:
        destroy_distributed()


# What a rank needs imported; the fork server imports it once per test session (never running a torch op, so no
# thread pool or CUDA context is forked), and each gloo rank forks from it instead of starting Python and importing
# torch and transformers anew (a spawned rank paid about 3 s of CPU for that, 2 ranks per call, ~50 calls a suite).
FORK_SERVER_PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "moe_tune.build",
    "moe_tune.train",
    "tests.harness",
]


def run_ranks(fn, world_size: int = 2, *args, backend: str = "gloo") -> None:
    """``fn(rank, *args)`` on ``world_size`` local processes that share one default process group of ``backend``
    (gloo on CPU; nccl for GPU tests, one GPU per rank). gloo ranks see no GPU: on a GPU machine each would bind
    cuda:<rank> to its CPU group (torch 2.11 on one H200: SIGSEGV, or a failed deepcopy splitting the mesh's
    groups; with CUDA_VISIBLE_DEVICES empty the same tests pass). gloo ranks fork from a server that has imported
    FORK_SERVER_PRELOAD; nccl ranks are spawned (a fresh process per GPU); either way a rank starts with this
    process's environment as it is now."""
    hidden = {"CUDA_VISIBLE_DEVICES": ""} if backend == "gloo" else {}
    saved = {k: os.environ.get(k) for k in hidden}
    os.environ.update(hidden)  # the fork server (started by the first call) and the ranks inherit it
    try:
        if backend == "gloo":
            mp.set_forkserver_preload(FORK_SERVER_PRELOAD)  # read when the server starts
        args = (fn, world_size, free_port(), backend, args, dict(os.environ))
        method = "forkserver" if backend == "gloo" else "spawn"
        mp.start_processes(_entry, args=args, nprocs=world_size, join=True, start_method=method)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# -- a whole run in this process ----------------------------------------------------------------------------


def train_run(overrides: list[str]) -> dict:
    """A whole run as ``moe-tune <overrides>`` trains it, in this process: ``Trainer(cfg).fit()`` (export, summary;
    the command line's own checks and Hydra are tests/cli's); returns the summary. In the pytest process the
    one-process group it creates is destroyed after; under ``run_ranks`` the ranks' group is the run's."""
    from moe_tune.cli.train import compose, to_config
    from moe_tune.train import Trainer

    own_group = not dist.is_initialized()
    try:
        return Trainer(to_config(compose(list(overrides)))).fit()
    finally:
        if own_group:
            destroy_distributed()


def copy_checkpoint(straight, resumed, step: int, drop_extra_state: bool = False) -> None:
    """An interrupted run: ``straight``'s checkpoint of ``step`` and base model, copied to a fresh output dir
    ``resumed`` (``drop_extra_state``: without the modules' extra state, as a checkpoint from before TE's)."""
    import shutil

    straight, resumed = Path(straight), Path(resumed)
    os.makedirs(resumed / "checkpoints")
    shutil.copytree(straight / "checkpoints" / f"step_{step}", resumed / "checkpoints" / f"step_{step}")
    shutil.copytree(straight / "base_model", resumed / "base_model")
    if drop_extra_state:
        for f in (resumed / "checkpoints" / f"step_{step}").glob("extra_state.rank*.pt"):
            f.unlink()


# -- a command in this process -----------------------------------------------------------------------------


def run_main(args: list[str], cwd=None, main=None) -> subprocess.CompletedProcess:
    """``moe-tune <args>`` (``main``: another entry point's ``main(argv)``) in this process, as the command runs it
    (sys.argv, the working directory ``cwd``), without a Python and torch start-up: returns what
    ``subprocess.run(..., capture_output=True, text=True)`` would. stdout and stderr hold what Python writes (print,
    logging, then the warnings shown, as an interpreter's default filters show them); an exception that escapes is
    exit 1 with its traceback on stderr. Not for what only a process shows: signals, the environment read at
    import, writes from C++, torchrun."""
    import contextlib
    import io
    import logging
    import traceback
    import warnings

    from moe_tune.train.lock import release_held

    if main is None:
        from moe_tune.cli.train import main as train_main

        def main(argv):  # reads sys.argv, as its console script does
            return train_main()

    out, err, saved_argv, here = io.StringIO(), io.StringIO(), sys.argv[:], os.getcwd()
    # The entry points take SIGINT, SIGTERM and SIGUSR1 over for the process (honour_sigint): back after the run.
    saved_signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    # Logging as in a fresh interpreter: no handler but the last resort (warnings and errors to stderr) until the
    # run configures its own; pytest's capture handlers come back after.
    root = logging.getLogger()
    saved_logging = root.handlers[:], root.level
    last_resort = logging.StreamHandler(err)
    last_resort.setLevel(logging.WARNING)
    root.handlers = [last_resort]
    root.setLevel(logging.WARNING)
    code = 0
    with contextlib.ExitStack() as stack:
        shown = stack.enter_context(warnings.catch_warnings(record=True))
        warnings.simplefilter("default")
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        try:
            if cwd is not None:
                os.chdir(cwd)
            sys.argv = [PY, *args]
            main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int | None):
                print(e.code, file=sys.stderr)
        except Exception:
            traceback.print_exc()
            code = 1
        finally:
            sys.argv = saved_argv
            os.chdir(here)
            release_held()  # a run refused or failed in this process leaves no lock behind
            destroy_distributed()
            for signum, handler in saved_signals.items():
                signal.signal(signum, handler)
            root.handlers = saved_logging[0]
            root.setLevel(saved_logging[1])
    stderr = err.getvalue() + "".join(
        warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line) for w in shown
    )
    return subprocess.CompletedProcess(sys.argv[:1] + list(args), code, out.getvalue(), stderr)


# -- the CLI in a subprocess ---------------------------------------------------------------------------------

# Overrides that make a run of the default job take seconds on a CPU, and an in-process Trainer of it build and
# step in about a second (seq_len 64: a built-in record rendered through the chat template still has tokens that
# carry loss).
FAST_RUN = ["train.seq_len=64", "train.micro_batch_size=2", "data.num_samples=256", "train.precision=fp32"]
FAST_TRAINER = ["train.seq_len=64", "train.micro_batch_size=2", "data.num_samples=64", "train.precision=fp32"]


def cli_env() -> dict[str, str]:
    """Environment for ``python -m moe_tune`` in a subprocess: one CPU process, no launcher variables."""
    env = dict(os.environ)
    for k in LAUNCH_VARS:
        env.pop(k, None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_cli(args: list[str], env: dict[str, str], nproc: int = 1, timeout: float = 600) -> subprocess.CompletedProcess:
    """``moe-tune <args>``, under torchrun with ``nproc`` ranks when above 1; asserts exit code 0."""
    cmd = [PY, "-m", "moe_tune", *args]
    if nproc > 1:
        cmd = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "moe_tune", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return r


# -- what a run wrote ---------------------------------------------------------------------------------------


def read_metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def read_hf_tensors(d) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face directory, single file or sharded with an index, or of a PEFT adapter
    directory (a LoRA run's hf/)."""
    from safetensors import safe_open

    idx = os.path.join(d, "model.safetensors.index.json")
    files = set(json.load(open(idx))["weight_map"].values()) if os.path.exists(idx) else {"model.safetensors"}
    if os.path.exists(os.path.join(d, "adapter_model.safetensors")):
        files = {"adapter_model.safetensors"}
    out = {}
    for name in files:
        with safe_open(os.path.join(d, name), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def assert_hf_logits_equal(hf_dir) -> None:
    """transformers loads ``hf_dir`` and gives the same logits as moe_tune's model loaded from it."""
    from transformers import AutoModelForCausalLM

    import moe_tune

    ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ours = moe_tune.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.randint(4, ref.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ref(ids).logits, ours(ids).logits
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def signal_after_rows(
    cmd: list[str], env: dict[str, str], run_dir, rows: int, signum: int, preexec_fn=None
) -> tuple[int, str]:
    """Start ``cmd`` (``preexec_fn``: run in the child before it starts, as Popen's), send ``signum`` once
    ``run_dir``'s metrics.jsonl has ``rows`` lines (or after 240 s), and return (exit code, stderr)."""
    import time

    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=preexec_fn)
    metrics = Path(run_dir) / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= rows:
            break
        time.sleep(0.2)
    p.send_signal(signum)
    _, err = p.communicate(timeout=120)
    return p.returncode, err
