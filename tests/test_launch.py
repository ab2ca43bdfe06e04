"""The Slurm batch script is valid bash and hands every override to moe_tune under torchrun."""

import os
import subprocess

from tests.harness import ROOT

SBATCH = os.path.join(ROOT, "launch", "slurm", "train.sbatch")


def test_sbatch_is_valid_bash():
    r = subprocess.run(["bash", "-n", SBATCH], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_sbatch_runs_one_torchrun_per_node_with_overrides(tmp_path):
    """Run the script with stand-ins for srun/scontrol/torchrun and check the command it builds."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nshift; "$@"\n')  # drop --kill-on-bad-exit, run the rest
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho node001; echo node002\n")
    (bin_dir / "torchrun").write_text(f'#!/bin/bash\necho "$@" > {tmp_path}/argv\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SLURM_JOB_NODELIST="node[001-002]",
        SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_ID="42",
        SLURM_JOB_NAME="moe_tune",
        GPUS_PER_NODE="8",
    )
    r = subprocess.run(["bash", SBATCH, "parallel.ep=8", "comm=deepep"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    argv = (tmp_path / "argv").read_text().split()
    assert argv[:4] == ["--nnodes", "2", "--nproc-per-node", "8"]
    assert "node001:29500" in argv and argv[argv.index("-m") + 1] == "moe_tune"
    assert argv[-2:] == ["parallel.ep=8", "comm=deepep"] and "output_dir=runs/moe_tune-42" in argv
