"""The launch scripts are valid bash and hand every override to ``python -m moe_tune.launch`` (the real runs: the
Slurm ones in tests/slurm/, the launcher itself in tests/cli/test_launch.py)."""

import os
import re
import signal
import subprocess
import time

import pytest

from tests.harness import ROOT

SBATCH = os.path.join(ROOT, "launch", "slurm", "train.sbatch")
TORCHRUN = os.path.join(ROOT, "launch", "torchrun.sh")


@pytest.mark.parametrize("script", [SBATCH, TORCHRUN])
def test_scripts_are_valid_bash(script):
    r = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_sbatch_asks_for_nothing_a_partition_may_refuse():
    """GPUs, CPUs and exclusivity come from sbatch's command line (a GPU request is refused on a node without
    GPUs, a fixed CPU count leaves the job pending on smaller nodes); a signal before the time limit, requeue."""
    directives = re.findall(r"^#SBATCH\s+(--[\w-]+)(?:=(\S+))?", open(SBATCH).read(), flags=re.M)
    names = {name for name, _ in directives}
    assert not names & {"--gpus-per-node", "--gres", "--gpus", "--cpus-per-task", "--exclusive", "--mem"}
    assert ("--signal", "B:TERM@120") in directives and "--requeue" in names


def stub_bin(tmp_path, **scripts: str) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


def test_sbatch_runs_one_launcher_per_node_with_overrides(tmp_path):
    """Stand-ins for srun, scontrol and python: the command the script builds, and its log in the run directory."""
    path = stub_bin(
        tmp_path,
        srun='while [[ $1 == --* ]]; do shift; done; "$@"',  # srun's own options, then the task's command
        scontrol="echo node001; echo node002",
        python=f'echo "$@" > {tmp_path}/argv',
    )
    env = dict(os.environ, PATH=path, SLURM_JOB_NODELIST="node[001-002]", SLURM_JOB_NUM_NODES="2")
    env.update(SLURM_JOB_ID="42", SLURM_JOB_NAME="moe_tune", SLURM_GPUS_ON_NODE="8", SLURM_CPUS_PER_TASK="64")
    run = tmp_path / "run"
    r = subprocess.run(["bash", SBATCH, "parallel.ep=8", f"output_dir={run}"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    argv = (tmp_path / "argv").read_text().split()
    assert argv[:4] == ["-m", "moe_tune.launch", "--nnodes", "2"]
    assert argv[argv.index("--nproc-per-node") + 1] == "8" and "node001:20042" in argv
    assert argv[-2:] == ["parallel.ep=8", f"output_dir={run}"]
    assert "job 42 exited with 0" in (run / "logs" / "slurm-42.out").read_text()


@pytest.mark.parametrize("quote", ["'", '"'])
def test_sbatch_logs_into_a_quoted_output_dir(tmp_path, quote):
    """An output_dir quoted for Hydra (a comma in the path): the log goes to that directory, not to one named
    after the quoted text under the submit directory; the override reaches the ranks as given."""
    path = stub_bin(
        tmp_path,
        srun='while [[ $1 == --* ]]; do shift; done; "$@"',
        scontrol="echo node001",
        python=f'echo "$@" > {tmp_path}/argv',
    )
    env = dict(os.environ, PATH=path, SLURM_JOB_NODELIST="node001", SLURM_JOB_NUM_NODES="1", SLURM_JOB_ID="44")
    env.update(SLURM_JOB_NAME="moe_tune")
    run = tmp_path / "a,b"
    override = f"output_dir={quote}{run}{quote}"
    r = subprocess.run(["bash", SBATCH, override], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "job 44 exited with 0" in (run / "logs" / "slurm-44.out").read_text()
    assert not (tmp_path / quote).exists() and (tmp_path / "argv").read_text().split()[-1] == override


@pytest.mark.parametrize("value", ["~/runs/a", "'~/runs/a'"])
def test_sbatch_logs_into_an_output_dir_under_home(tmp_path, value):
    """output_dir=~/runs/a as zsh or quotes pass it: moe-tune writes the run under the home directory, and the log
    went to a directory named ~ under the submit directory instead of <output_dir>/logs/."""
    path = stub_bin(
        tmp_path,
        srun='while [[ $1 == --* ]]; do shift; done; "$@"',
        scontrol="echo node001",
        python=f'echo "$@" > {tmp_path}/argv',
    )
    home = tmp_path / "home"
    env = dict(os.environ, PATH=path, SLURM_JOB_NODELIST="node001", SLURM_JOB_NUM_NODES="1", SLURM_JOB_ID="45")
    env.update(SLURM_JOB_NAME="moe_tune", HOME=str(home))
    r = subprocess.run(["bash", SBATCH, f"output_dir={value}"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "job 45 exited with 0" in (home / "runs" / "a" / "logs" / "slurm-45.out").read_text()
    assert not (tmp_path / "~").exists() and not (tmp_path / "'~").exists()
    assert (tmp_path / "argv").read_text().split()[-1] == f"output_dir={value}"


def test_sbatch_says_why_when_output_dir_cannot_hold_its_log(tmp_path):
    """Slurm's own output goes to /dev/null: an output_dir the script cannot write (a read-only file system; here a
    file in its path) is one line in the submit directory's slurm-<job id>.out and exit 2, no rank started."""
    path = stub_bin(tmp_path, srun=f"touch {tmp_path}/srun_ran", scontrol="echo node001")
    submit_dir = tmp_path / "submit"
    submit_dir.mkdir()
    (tmp_path / "afile").write_text("")
    env = dict(os.environ, PATH=path, SLURM_JOB_NODELIST="node001", SLURM_JOB_NUM_NODES="1", SLURM_JOB_ID="43")
    env.update(SLURM_JOB_NAME="moe_tune", SLURM_SUBMIT_DIR=str(submit_dir))
    run = tmp_path / "afile" / "run"
    r = subprocess.run(["bash", SBATCH, f"output_dir={run}"], capture_output=True, text=True, env=env, cwd=submit_dir)
    assert r.returncode == 2 and not (tmp_path / "srun_ran").exists()
    lines = (submit_dir / "slurm-43.out").read_text().splitlines()
    assert lines == [
        f"moe-tune: error: cannot write the job's log {run}/logs/slurm-43.out (a read-only file system, a file in the "
        "path or no permission); give an output_dir you can write to"
    ]


@pytest.mark.parametrize("state", ["RUNNING", "SIGNALING"])
def test_sbatch_passes_the_time_limit_warning_on_and_requeues_while_slurm_is_signalling(tmp_path, state):
    """The time-limit warning (``--signal=B:TERM@120``) reaches the script while slurmctld may still be sending it:
    squeue then shows the running job as SIGNALING. Taken for a job Slurm was ending, the warning was not passed to
    the ranks and the job was not requeued: it ran into its time limit and ended TIMEOUT, the run unfinished."""
    calls, pid = tmp_path / "calls", tmp_path / "rank_pid"
    path = stub_bin(
        tmp_path,
        srun='while [[ $1 == --* ]]; do shift; done; "$@"',
        scontrol=f'if [[ $1 == show ]]; then echo node001; else echo "scontrol $*" >> {calls}; fi',
        squeue=f"echo {state}",
        scancel=f'echo "scancel $*" >> {calls}; kill -TERM "$(cat {pid})"',
        # A rank that saves and exits 143 on TERM, as moe-tune does.
        python=f"trap 'exit 143' TERM; echo $$ > {pid}; while :; do sleep 0.1; done",
    )
    env = dict(os.environ, PATH=path, SLURM_JOB_NODELIST="node001", SLURM_JOB_NUM_NODES="1", SLURM_JOB_ID="46")
    env.update(SLURM_JOB_NAME="moe_tune")
    run = tmp_path / "run"
    script = subprocess.Popen(["bash", SBATCH, f"output_dir={run}"], env=env, cwd=tmp_path)
    try:
        deadline = time.time() + 30
        while not pid.exists() and time.time() < deadline:
            time.sleep(0.1)
        script.send_signal(signal.SIGTERM)  # Slurm's warning before the time limit
        code = script.wait(timeout=20)
    finally:  # a script that did not pass the warning on leaves its rank running: ended here
        if script.poll() is None:
            os.kill(int(pid.read_text()), signal.SIGTERM)
            script.wait(timeout=20)
    assert code == 143
    assert calls.read_text().splitlines() == ["scancel --signal=TERM 46.0", "scontrol requeue 46"]
    assert "requeued; it resumes from its newest complete checkpoint" in (run / "logs" / "slurm-46.out").read_text()


def test_torchrun_sh_starts_one_rank_per_gpu(tmp_path):
    path = stub_bin(tmp_path, python=f'echo "$@" > {tmp_path}/argv', **{"nvidia-smi": "echo GPU 0; echo GPU 1"})
    r = subprocess.run([TORCHRUN, "parallel.ep=2"], capture_output=True, text=True, env=dict(os.environ, PATH=path))
    assert r.returncode == 0, r.stderr
    argv = (tmp_path / "argv").read_text().split()
    assert argv == ["-m", "moe_tune.launch", "--standalone", "--nproc-per-node", "2", "parallel.ep=2"]
