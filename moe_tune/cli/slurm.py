"""What ``hydra/launcher=submitit_slurm`` reports: every rank's exit, back in the submitting ``moe-tune ... -m``. The
launcher class itself is ``hydra_plugins.moe_tune_launcher.slurm.SlurmLauncher`` (Hydra takes launchers from the
``hydra_plugins`` package only).

Hydra's plugin runs the job in every task but hands the submitter rank 0's result only; and a job that ends
through ``SystemExit`` (moe_tune's exit 2 for a value to fix, 128 + the signal when stopped) leaves no result at
all, so the submitter waits for one for as long as Slurm does not say the job ended (forever without Slurm
accounting). Here every task returns its ``RankExit`` however the job ended and exits with the rank's own code;
the submitter reads every task's and, when one failed, exits with that code and one line per failed job naming
the ranks, their codes and their error line.

Each task is one rank: the rendezvous (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``)
comes from ``SLURM_*`` through submitit's ``TorchDistributedEnvironment`` (the port derived from the job id).

While the submitter waits, submitit polls ``sacct`` for the jobs' states; ``quiet_submitit`` keeps that quiet: each
submitit warning once, and where Slurm accounting is off, one note in place of a failed poll's two lines (sacct's own
and submitit's warning, itself printed twice) at every poll, every minute of a long job.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class RankExit:
    """How one rank (one Slurm task) of a job ended."""

    job_id: str
    rank: int
    num_tasks: int
    code: int  # 0 finished, 2 a value to fix, 128 + signal when stopped, 1 anything else
    message: str = ""  # its one-line error


def exit_of(exc: BaseException | None) -> tuple[int, str]:
    """(exit code, one-line message) of a job function that returned (``exc`` None), exited or raised."""
    if exc is None:
        return 0, ""
    if isinstance(exc, SystemExit):
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        # cli.fail prints its line and raises SystemExit(2) while handling the UserError that holds the line.
        cause = exc.__context__
        return code, " ".join(str(cause).split()) if code == 2 and cause is not None else ""
    lines = str(exc).strip().splitlines()
    return 1, f"{type(exc).__name__}: {lines[0] if lines else ''}"


def failure_line(exits: list[RankExit]) -> str:
    """One line for a job: the ranks that did not exit 0, those with the same code and message together."""
    groups: dict[tuple[int, str], list[int]] = {}
    for e in exits:
        if e.code:
            groups.setdefault((e.code, e.message), []).append(e.rank)
    parts = []
    for (code, message), ranks in groups.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {','.join(map(str, ranks))}"
        parts.append(f"{who} exited with code {code}" + (f": {message}" if message else ""))
    return f"job {exits[0].job_id}: " + "; ".join(parts)


def job_exit_code(exits: list[RankExit]) -> int:
    """The submitter's exit code for a failed job: the code of a rank that reported its own error (others may
    only have been stopped by Slurm when it failed first: submitit exits those -1 without a message), else the
    first non-zero code; never negative (a shell would read -1 as 255)."""
    failed = [e for e in exits if e.code]
    reported = [e for e in failed if e.message]
    code = (reported or failed)[0].code
    return code if code > 0 else 1


def _below_warning(record: logging.LogRecord) -> bool:
    return record.levelno < logging.WARNING


def warnings_once(logger: logging.Logger) -> None:
    """submitit's logger writes every record to stdout and its warnings to stderr as well, so a terminal shows each
    warning twice: warnings go to the handlers meant for them only (those at WARNING and above)."""
    if not any(h.level >= logging.WARNING for h in logger.handlers):
        return
    for handler in logger.handlers:
        if handler.level < logging.WARNING and _below_warning not in handler.filters:
            handler.addFilter(_below_warning)


def accounting_problem() -> str | None:
    """Why ``sacct`` can never answer here, in sacct's words: Slurm accounting is off, or there is no sacct. None
    where it answers, and where it fails otherwise (a database down for a while: submitit's polls may succeed later)."""
    try:
        r = subprocess.run(
            ["sacct", "-n", "-X", "-o", "JobID", "-S", "now"], capture_output=True, text=True, timeout=30
        )
    except FileNotFoundError:
        return "sacct is not installed"
    except (OSError, subprocess.TimeoutExpired):
        return None
    off = r.returncode != 0 and "accounting storage is disabled" in r.stderr
    return f"sacct: {r.stderr.strip().splitlines()[0]}" if off else None


@contextlib.contextmanager
def quiet_submitit():
    """The submitter's wait for its jobs: submitit's warnings once each; where sacct cannot answer, one note and no
    polls (a job's end is read from its tasks' result files, as it was when each poll failed)."""
    import submitit
    from submitit.slurm.slurm import SlurmInfoWatcher

    warnings_once(logging.getLogger("submitit"))
    problem = accounting_problem()
    if problem is None:
        yield
        return

    class NoSacct(SlurmInfoWatcher):
        def _make_command(self):
            return None  # no poll: the job's state stays unknown, its result files tell when it ended

    print(
        f"moe-tune: note: Slurm accounting is not available here ({problem}): the submitter learns that a job ended "
        "from its tasks' results, so a job killed before writing them (scancel, a lost node) leaves it waiting",
        file=sys.stderr,
    )
    saved = submitit.SlurmJob.watcher
    submitit.SlurmJob.watcher = NoSacct(delay_s=saved._delay_s)
    try:
        yield
    finally:
        submitit.SlurmJob.watcher = saved
