"""A real single-machine Slurm for tests: munged, slurmctld and slurmd from the distribution's packages, run as
the current (root) user from a temporary directory, without systemd, cgroups or accounting.

    with LocalSlurm.start() as slurm:
        job = slurm.sbatch(["--ntasks=2", "job.sh"])
        slurm.wait(job)  # -> JobState(state="COMPLETED", exit_code=0)

Client commands need ``SLURM_CONF``: run them with ``slurm.env`` (jobs inherit it).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.harness import free_port

COMMANDS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo", "squeue")
# Jobs leave the controller's memory this long after they end (the default, 300 s, would keep every test's jobs).
MIN_JOB_AGE_S = 10


def first_job_id() -> int:
    """Each pytest-xdist worker's cluster numbers its jobs from its own thousand (gw0 from 1, gw1 from 1001): the
    launchers derive a job's rendezvous port from its id (train.sbatch: 20000 + id % 20000; submitit likewise), so
    two clusters on one host, both counting from 1, gave two jobs one port and one job the other's store."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return 1 + 1000 * int(worker.removeprefix("gw") or 0)


SLURM_CONF = """\
ClusterName=moetune
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={socket},cred_expire=5
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
# Requeued jobs wait for the periodic scheduling pass (60 s by default); new submissions start at once anyway.
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
MinJobAge={min_job_age}
FirstJobId={first_job_id}
KillWait=20
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@dataclass(frozen=True)
class JobState:
    state: str  # Slurm's JobState: PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ...
    exit_code: int  # the batch script's exit code (ExitCode=<code>:<signal>)
    restarts: int  # how many times the job was requeued


def missing_commands() -> list[str]:
    return [c for c in COMMANDS if shutil.which(c) is None]


class LocalSlurm:
    """The three daemons, their files in ``self.dir``, and the client calls the tests make."""

    def __init__(self, cpus: int = 4):
        # Every directory on munged's socket path must be world-executable: not pytest's 0700 tmp_path.
        self.dir = Path(tempfile.mkdtemp(prefix="moe_tune_slurm_"))
        self.dir.chmod(0o755)
        self.host = socket.gethostname().split(".")[0]
        self.cpus = cpus
        self.procs: list[subprocess.Popen] = []
        self.env = dict(os.environ, SLURM_CONF=str(self.dir / "slurm.conf"))

    @classmethod
    def start(cls, cpus: int = 4, timeout_s: float = 30) -> LocalSlurm:
        slurm = cls(cpus)
        try:
            slurm._start_munge()
            slurm._write_conf()
            slurm._daemon(["slurmctld", "-D", "-i", "-f", slurm.env["SLURM_CONF"]])
            slurm._daemon(["slurmd", "-D", "-f", slurm.env["SLURM_CONF"], "-N", slurm.host])
            slurm._wait_idle(timeout_s)
        except BaseException:
            slurm.stop()
            raise
        return slurm

    def _start_munge(self) -> None:
        d = self.dir / "munge"
        d.mkdir(mode=0o755)
        subprocess.run(["mungekey", "-c", "-f", "-k", str(d / "key")], check=True, capture_output=True)
        os.chmod(d / "key", 0o400)
        self.socket = d / "socket"
        args = ["munged", "-F", "--force", f"--socket={self.socket}", f"--key-file={d / 'key'}"]
        args += [f"--pid-file={d / 'pid'}", f"--log-file={d / 'log'}", f"--seed-file={d / 'seed'}"]
        self._daemon(args)
        _wait_for(lambda: self.socket.exists(), 10, f"munged made no socket; see {d / 'log'}")

    def _write_conf(self) -> None:
        for sub in ("state", "spool"):
            (self.dir / sub).mkdir()
        text = SLURM_CONF.format(
            host=self.host,
            ctld_port=free_port(),
            slurmd_port=free_port(),
            socket=self.socket,
            dir=self.dir,
            min_job_age=MIN_JOB_AGE_S,
            cpus=self.cpus,
            first_job_id=first_job_id(),
        )
        (self.dir / "slurm.conf").write_text(text)

    def _daemon(self, args: list[str]) -> None:
        log = open(self.dir / f"{args[0]}.stdout", "w")
        self.procs.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env))

    def _wait_idle(self, timeout_s: float) -> None:
        def idle() -> bool:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited with {p.returncode}; see {self.dir}")
            r = self.run(["sinfo", "-h", "-o", "%t"], check=False)
            return r.returncode == 0 and r.stdout.strip() == "idle"

        _wait_for(idle, timeout_s, f"the node never became idle; see {self.dir}/slurmctld.log")

    def run(self, args: list[str], check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(args, capture_output=True, text=True, env=self.env, check=check, timeout=60)

    # -- jobs ---------------------------------------------------------------------------------------------
    def sbatch(self, args: list[str], env: dict[str, str] | None = None) -> str:
        """Submit; returns the job id."""
        r = subprocess.run(
            ["sbatch", "--parsable", *args], capture_output=True, text=True, env={**self.env, **(env or {})}
        )
        if r.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)}: {r.stderr.strip()}")
        return r.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> JobState:
        out = self.run(["scontrol", "show", "job", job_id]).stdout
        fields = dict(re.findall(r"(\w+)=(\S+)", out))
        return JobState(fields["JobState"], int(fields["ExitCode"].split(":")[0]), int(fields.get("Restarts", 0)))

    def wait(self, job_id: str, timeout_s: float = 300, restarts: int = 0) -> JobState:
        """Poll until the job has ended (after at least ``restarts`` requeues); returns its JobState."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            state = self.job(job_id)
            if state.state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") and state.restarts >= restarts:
                return state
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {self.job(job_id)} after {timeout_s} s")

    def cancel_all(self) -> None:
        self.run(["scancel", "--full", "-u", os.environ.get("USER", "root")], check=False)

    def stop(self) -> None:
        """Cancel every job, stop the daemons by their PIDs (slurmd first, munged last), remove the directory."""
        if any(p.args[0] == "slurmctld" and p.poll() is None for p in self.procs):
            self.cancel_all()
            try:
                _wait_for(lambda: not self.run(["squeue", "-h"], check=False).stdout.strip(), 30, "jobs left")
            except TimeoutError:
                pass  # slurmd ends what is left of them as it stops
        for p in reversed(self.procs):
            p.terminate()
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalSlurm:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _wait_for(predicate, timeout_s: float, message: str) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise TimeoutError(message)


def wait_rows(run_dir: Path, rows: int, timeout_s: float = 300) -> None:
    """Until a job's run has written ``rows`` metrics rows (every rank is past its start). The wait is generous: a
    suite on two busy cores (pytest-xdist) can take minutes to start a job's ranks."""
    metrics = run_dir / "metrics.jsonl"
    try:
        _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= rows, timeout_s, "")
    except TimeoutError:
        logs = "".join(f"\n--- {f}:\n{f.read_text()[-2000:]}" for f in sorted(run_dir.glob("logs/*")))
        raise TimeoutError(f"{metrics} has fewer than {rows} rows after {timeout_s} s{logs}") from None
