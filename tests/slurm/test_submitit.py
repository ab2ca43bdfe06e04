"""``moe-tune hydra/launcher=submitit_slurm_cpu ... -m`` on a real Slurm: one task per rank of the layout, every
rank's exit back in the submitter, which exits non-zero with the job's one line when the job fails."""

from __future__ import annotations

import json
import subprocess

from tests.harness import FAST_RUN, PY, ROOT, cli_env, read_metrics


def submit(slurm, run_dir, *overrides: str) -> subprocess.CompletedProcess:
    """``moe-tune`` submitting one job through the launcher and waiting for it, as a user runs it."""
    cmd = [PY, "-m", "moe_tune", "hydra/launcher=submitit_slurm_cpu", f"output_dir={run_dir}", *FAST_RUN]
    cmd += ["checkpoint.export_hf=false", *overrides, "-m"]
    env = {**cli_env(), "SLURM_CONF": slurm.env["SLURM_CONF"]}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)


def test_ep2_job_runs_two_ranks(slurm, tmp_path):
    r = submit(slurm, tmp_path, "parallel.ep=2", "train.steps=4")
    assert r.returncode == 0, r.stderr[-3000:]
    job_dir = tmp_path / "multirun" / "0"
    assert json.loads((job_dir / "summary.json").read_text())["world_size"] == 2
    assert [row["step"] for row in read_metrics(job_dir)] == [1, 2, 3, 4]
    results = sorted(p.name.split("_")[1] for p in (tmp_path / "multirun" / ".submitit").glob("*/*_result.pkl"))
    assert results == ["0", "1"]  # one task per rank, each reported back


def test_a_failing_job_is_the_submitters_exit_2(slurm, tmp_path):
    """A value found wrong inside the job (it needs the world size): the submitter exits 2 with one line naming the
    ranks and the job's error, instead of waiting for a result that never comes."""
    r = submit(slurm, tmp_path, "parallel.ep=2", "train.global_batch_size=3")
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("moe-tune: error:")]
    assert len(errors) == 1, r.stderr[-3000:]
    assert "ranks 0,1 exited with code 2: train.global_batch_size (3) must be a multiple" in errors[0]
    assert "Traceback" not in r.stderr
