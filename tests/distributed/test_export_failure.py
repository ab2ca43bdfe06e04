"""A run's export that fails on one rank (a full disk) ends on every rank: one line from rank 0, exit 1 on each, no
partial directory, instead of the other ranks waiting in a collective for a rank that has gone. On gloo ranks with
one rank's writes failing, and under moe_tune's launcher on a real filesystem that fills during the export."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import uuid

import pytest

from tests.harness import FAST_TRAINER, PY, cli_env, run_ranks

pytestmark = pytest.mark.dist
EXPORT_FAILED = "failed: no space left on device"


def _body(rank: int, out: str, peft: str, failing: int) -> None:
    from moe_tune.cli.train import compose, to_config
    from moe_tune.models import export, peft_export
    from moe_tune.train import Trainer

    real = export.save_safetensors

    def write(tensors, path):  # the failing rank's disk is full; the other's is not
        if rank == failing:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        real(tensors, path)

    export.save_safetensors = peft_export.save_safetensors = write
    errors = logging.FileHandler(os.path.join(out, f"rank{rank}.err"))
    errors.setLevel(logging.ERROR)
    logging.getLogger("moe_tune").addHandler(errors)
    overrides = [f"output_dir={out}", *FAST_TRAINER, "parallel.ep=2", f"peft={peft}"]
    trainer = Trainer(to_config(compose(overrides)), write_run_files=False)
    hf = os.path.join(out, "hf")
    with pytest.raises(SystemExit) as stopped:
        trainer.export(hf)
    assert stopped.value.code == 1
    assert not os.path.exists(hf) and not os.path.exists(os.path.join(out, ".hf.partial"))


@pytest.mark.parametrize(
    "peft,failing",
    [("none", 1), ("none", 0), ("lora", 0)],
    ids=["experts-on-rank-1", "rank-0", "lora-adapters-on-rank-0"],
)
def test_an_export_failing_on_one_rank_ends_every_rank_with_one_line(tmp_path, peft, failing):
    run_ranks(_body, 2, str(tmp_path), peft, failing)
    first, second = ((tmp_path / f"rank{r}.err").read_text().splitlines() for r in (0, 1))
    assert len(first) == 1 and f"exporting to {tmp_path / 'hf'} {EXPORT_FAILED}" in first[0], first
    assert second == []


RUN = ["train.steps=2", "checkpoint.every=2", "parallel.ep=2", *FAST_TRAINER]


def _launch(out: str) -> subprocess.CompletedProcess:
    cmd = [PY, "-m", "moe_tune.launch", "--standalone", "--nproc-per-node", "2", f"output_dir={out}", *RUN]
    return subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=600)


def _size(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


@pytest.fixture
def small_filesystem(tmp_path):
    """``mount(bytes) -> dir``: a tmpfs of that size (skips where mounting is not permitted: not root, or a
    container without the capability)."""
    mounted = []

    def mount(size: int) -> str:
        where = tmp_path / f"fs-{uuid.uuid4().hex[:8]}"
        where.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip() or r.returncode}")
        mounted.append(where)
        return str(where)

    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    yield mount
    for where in mounted:
        subprocess.run(["umount", str(where)], check=False)


def test_a_real_full_disk_during_a_two_rank_export_is_one_line_and_exit_1(tmp_path, small_filesystem):
    roomy = tmp_path / "roomy"
    r = _launch(str(roomy))
    assert r.returncode == 0, r.stderr[-3000:]
    export_bytes, everything = _size(roomy / "hf"), _size(roomy)
    # Room for the run's other files (base model, checkpoint, metrics), not for half its export
    fs = small_filesystem(everything - export_bytes // 2)
    r = _launch(os.path.join(fs, "run"))
    assert r.returncode == 1, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if EXPORT_FAILED in line]
    assert len(lines) == 1 and lines[0].startswith(tuple(f"{h:02d}:" for h in range(24))), r.stderr[-3000:]
    assert "[rank0] exporting to" in lines[0], lines
    assert "Traceback" not in r.stderr and "Connection closed" not in r.stderr, r.stderr[-3000:]
    assert sorted(os.listdir(os.path.join(fs, "run", "checkpoints"))) == ["step_2"]
    assert not {"hf", ".hf.partial", "summary.json"} & set(os.listdir(os.path.join(fs, "run")))
