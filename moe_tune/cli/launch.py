"""``python -m moe_tune.launch [torchrun options] [moe-tune overrides]``: torchrun running ``-m moe_tune``, with the
exit code a job scheduler needs.

torchrun itself exits 1 with its agent's traceback when it is stopped by a signal (Slurm's time limit or
preemption), although every rank saved the agreed step and exited 128 + the signal; and it exits 1 for a rank's
exit 2 (a value to fix). Here the launcher exits 128 + the signal with one line in the first case, and with the
first failed rank's own exit code (its error line already printed) in the second. torchrun's agent passes SIGTERM,
SIGINT, SIGHUP and SIGQUIT on to the ranks, and dies of SIGUSR1 (what ``sbatch --signal=USR1@...`` sends before the
time limit) at once, leaving the ranks to find their parent gone (``watch_launcher``) and the scheduler no exit code:
here SIGUSR1 is passed on as SIGTERM is.

    python -m moe_tune.launch --standalone --nproc-per-node 8 model=hf model.path=/ckpt parallel.ep=8

Arguments up to the first ``key=value`` override are torchrun's (``--nproc-per-node 8`` or ``--nproc-per-node=8``);
Hydra's ``-m``/``--multirun`` (a sweep), anywhere, is moe_tune's: the launcher names the module itself.
"""

from __future__ import annotations

import os
import signal
import sys

MULTIRUN = ("-m", "--multirun")


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(torchrun's arguments, moe_tune's arguments): overrides start at the first ``key=value`` not led by ``-``.
    ``-m`` is torchrun's flag for a module too, but the launcher always runs ``-m moe_tune``: wherever it stands it
    asks moe_tune for a sweep, and leads moe_tune's arguments."""
    sweep = [arg for arg in argv if arg in MULTIRUN][:1]
    argv = [arg for arg in argv if arg not in MULTIRUN]
    for i, arg in enumerate(argv):
        if not arg.startswith("-") and "=" in arg:
            return argv[:i], sweep + argv[i:]
    return argv, sweep


def check_overrides(overrides: list[str]) -> None:
    """A bad key or value, or a logger whose package is missing, is one line and exit 2 before torchrun starts any
    rank (each would find it again, among torchrun's own lines); what needs the model or the data is checked by the
    ranks, as without the launcher."""
    from moe_tune.cli.train import fail
    from moe_tune.config import UserError
    from moe_tune.config.overrides import AUTO_KEYS, check, to_config
    from moe_tune.config.sweep import sweep_jobs
    from moe_tune.config.validate import check_values
    from moe_tune.loggers import require_logger

    multirun = bool(overrides) and overrides[0] in MULTIRUN
    # <key>=auto is each rank's to plan, for the world size torchrun gives it (moe_tune.plan.auto)
    overrides = [o for o in overrides[multirun:] if not (o.endswith("=auto") and o.split("=", 1)[0] in AUTO_KEYS)]
    try:
        cfg = to_config(check(overrides, multirun=multirun))
        for job_cfg in [to_config(check(job)) for job in sweep_jobs(overrides)] if multirun else [cfg]:
            check_values(job_cfg)
        require_logger(cfg.logger)
    except UserError as e:
        fail(str(e))


def main(argv: list[str] | None = None) -> int:
    from moe_tune.cli.train import honour_sigint, interrupted

    honour_sigint()
    try:
        return launch(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt as e:  # a stop before torchrun's agent took the signals over (it stops the ranks after)
        return interrupted(e)


# What the launcher adds to the ranks' own lines about a stop (it does not know whether they saved).
RANKS_SAID = "the ranks have stopped; their lines above say what each saved"


def _stop_with(signum: int, frame) -> None:
    """As torchrun's agent treats SIGTERM: its run stops, sends the signal on to every rank and waits for them."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    sigval = signal.Signals(signum)
    raise SignalException(f"launcher {os.getpid()} got {sigval.name}", sigval=sigval)


def launch(argv: list[str]) -> int:
    launcher, overrides = split_argv(argv)
    check_overrides(overrides)  # before torch is imported: a value to fix is said at once
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args([*launcher, "-m", "moe_tune", *overrides])
    signal.signal(signal.SIGUSR1, _stop_with)  # the agent handles TERM, INT, HUP and QUIT this way itself
    try:
        run(args)
    except SignalException as e:
        # The agent sent the signal on to every rank and waited for them: in training they saved the step they
        # agreed on and said so; a rank still starting said it saved nothing. Their lines say which.
        print(f"moe-tune: stopped by signal {e.sigval}; {RANKS_SAID}", file=sys.stderr)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, failure = first_failure(e.failures)
        code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode  # -N: killed by signal N
        if failure.exitcode < 0:
            name = signal.Signals(-failure.exitcode).name
            print(f"moe-tune: rank {rank} was killed by {name}; the launcher exits {code}", file=sys.stderr)
        elif failure.exitcode != 2:  # 2: the rank printed the one line that says why
            print(f"moe-tune: rank {rank} exited with code {failure.exitcode}", file=sys.stderr)
        return code
    return 0


def first_failure(failures: dict) -> tuple:
    """(rank, failure) of torchrun's failures that the launcher reports: the earliest; of those failing in the same
    second (torchrun's timestamps are whole seconds), a rank killed by a signal other than SIGTERM, then one that
    exited, then the lowest rank. A killed rank's peers fail on its closed connection, exit 1, within that second,
    and the ranks torchrun stops once one failed die of its SIGTERM: neither is the cause."""
    first = min(f.timestamp for f in failures.values())

    def cause(rank: int) -> tuple:
        code = failures[rank].exitcode
        return code == -signal.SIGTERM, code >= 0, rank

    rank = min((r for r, f in failures.items() if f.timestamp == first), key=cause)
    return rank, failures[rank]
