"""``SlurmLauncher``: Hydra's submitit launcher with one Slurm task per rank, whose every rank's exit comes back to
the submitter (``moe_tune.cli.slurm`` says why and how). It lives in ``hydra_plugins`` because Hydra takes
launchers from there only; Hydra imports this module at every start (of any Hydra app), so it imports neither
moe_tune nor submitit at the top."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import traceback

from hydra.plugins.launcher import Launcher

try:
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as _SubmititLauncher
except ImportError:  # without the [slurm] extra
    _SubmititLauncher = None


def _exit_with(code: int) -> None:
    """At interpreter exit, after submitit wrote the task's result: leave with the rank's own code, so that Slurm
    records it and ``srun --kill-on-bad-exit`` stops the ranks still waiting for this one."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _term_before_training(signum, frame) -> None:
    """SIGTERM in a task before the trainer takes it over (its StopSignal replaces this handler): nothing is saved
    yet, so there is nothing to stop for; the task carries on to its own end (a job whose other rank failed: this
    rank's own error, or Slurm's SIGKILL after KillWait). submitit's handler of it (SUBMITIT_PREEMPT_SIGNAL=TERM)
    would take it for a preemption and requeue the job on rank 0, running a job whose rank failed again (seen in
    the failing-job test: Restarts=1 and Slurm's exit 0); exiting 143 instead would record a stop for a failure."""
    print(f"moe-tune: SIGTERM ({signum}) before training started: nothing to save; not stopping here", file=sys.stderr)


# The exit codes of a job stopped by a signal it saves on (StopSignal.SIGNALS: SIGTERM, SIGUSR1; Slurm's time-limit
# warning, preemption): every rank saved the step they agreed on.
STOPPED = {128 + 15, 128 + 10}


def _requeue(env) -> bool:
    """``hydra.launcher.max_num_timeout`` > 0: requeue this stopped job (it resumes from the step it saved, with
    ``checkpoint.resume=auto``), one requeue fewer left in its submission. False when none are left."""
    from submitit.core import utils

    paths = env.paths
    delayed = utils.DelayedSubmission.load(paths.submitted_pickle)
    countdown = delayed._timeout_countdown - 1
    if countdown < 0:
        return False
    delayed.set_timeout(delayed._timeout_min, countdown)
    with utils.temporary_save_path(paths.submitted_pickle) as tmp:
        delayed.dump(tmp)
    env._requeue(countdown)  # scontrol requeue: Slurm ends this attempt's tasks and runs the job again
    print(
        f"moe-tune: job {env.job_id} requeued ({countdown} requeues left); it resumes from its checkpoint", flush=True
    )
    return True


if _SubmititLauncher is None:

    class SlurmLauncher(Launcher):
        """``hydra/launcher=submitit_slurm`` without hydra-submitit-launcher: one line and exit 2."""

        def __init__(self, **params) -> None:
            print(
                "moe-tune: error: hydra/launcher=submitit_slurm and submitit_slurm_cpu need Hydra's submitit launcher: "
                "pip install 'moe_tune[slurm]'",
                file=sys.stderr,
            )
            raise SystemExit(2)

        def setup(self, **kwargs) -> None: ...

        def launch(self, job_overrides, initial_job_idx): ...


else:

    class SlurmLauncher(_SubmititLauncher):
        def __call__(self, *args, **kwargs):
            """In each task: the job as this task's rank; returns its RankExit (in Hydra's JobReturn) in every case."""
            import submitit
            from hydra.core.utils import JobReturn, JobStatus

            from moe_tune.cli.slurm import RankExit, exit_of
            from moe_tune.config import register_configs

            register_configs()  # before Hydra composes the job's config here, as the submitter did
            submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
            env = submitit.JobEnvironment()
            # A requeued attempt: the task's result of the attempt before is stale (the submitter must wait for
            # this attempt's, not read that one).
            env.paths.result_pickle.unlink(missing_ok=True)
            signal.signal(signal.SIGTERM, _term_before_training)  # the trainer's StopSignal replaces it
            ret, exc = JobReturn(), None
            try:
                ret = super().__call__(*args, **kwargs)
                if ret.status == JobStatus.FAILED:  # Hydra caught an exception of the job function
                    exc = ret._return_value
                    traceback.print_exception(exc, file=sys.stderr)
            except SystemExit as e:
                exc = e
            code, message = exit_of(exc)
            if code in STOPPED and env.global_rank == 0 and _requeue(env):
                _exit_with(code)  # no result for this attempt: the submitter waits for the requeued one
            if code:
                atexit.register(_exit_with, code)
            ret.status = JobStatus.COMPLETED
            ret.return_value = RankExit(str(env.job_id), env.global_rank, env.num_tasks, code, message)
            return ret

        def launch(self, job_overrides, initial_job_idx):
            """In the submitter: Hydra's launch, then every task's RankExit; exits on any failed job."""
            # Slurm's warning before the time limit (--signal, hydra.launcher.signal_delay_s) as TERM, which every
            # rank answers by saving the step they agree on (submitit's default, USR2, would stop them unsaved).
            # Read once, when submitit is first imported: here, before Hydra's launch imports it.
            os.environ.setdefault("SUBMITIT_PREEMPT_SIGNAL", "TERM")
            from submitit.core.utils import UncompletedJobError

            from moe_tune.cli.slurm import failure_line, job_exit_code, quiet_submitit

            with quiet_submitit():  # its sacct polls: no line twice, none at every poll
                try:
                    returns = super().launch(job_overrides, initial_job_idx)
                except UncompletedJobError as e:  # a task that was killed leaves no result
                    print(f"moe-tune: error: {' '.join(str(e).split()[:40])}", file=sys.stderr)
                    raise SystemExit(1) from None
                failed = [exits for exits in map(self._task_exits, returns) if any(e.code for e in exits)]
            for exits in failed:
                print(f"moe-tune: error: {failure_line(exits)}", file=sys.stderr)
            if failed:
                raise SystemExit(job_exit_code(failed[0]))
            return returns

        def _task_exits(self, first) -> list:
            """Every task's RankExit of the job whose rank-0 JobReturn is ``first`` (all its tasks have ended)."""
            import submitit

            rank0 = first.return_value  # a moe_tune.cli.slurm.RankExit
            job = submitit.SlurmJob(self.params["submitit_folder"], rank0.job_id, tasks=range(rank0.num_tasks))
            return [rank0] + [job.task(i).result().return_value for i in range(1, rank0.num_tasks)]
