"""``moe-tune`` / ``python -m moe_tune``: the only place a DictConfig exists.

Overrides are composed once up front so that a bad key or value is reported as one line with exit code 2
(Hydra's own handler would print a multi-line error and exit 1); then Hydra runs the job as usual, which
keeps multirun and launchers (``hydra/launcher=submitit_slurm ... -m``) working.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

# compose and to_config: tests and the benchmark compose through moe_tune.cli
from moe_tune.config.overrides import CONF_DIR, compose, to_config  # noqa: F401

QUIET_EXIT_DELAY_S = 5.0
LAUNCHER_POLL_S = 1.0
INTERRUPTED = "moe-tune: interrupted; nothing saved since the last checkpoint"
# Stops besides Ctrl-C: Slurm's TERM and USR1, HUP (the terminal or ssh session of the command gone) and QUIT
# (Ctrl-\); torchrun's agent passes HUP and QUIT on to the ranks, which would otherwise die of them without saving.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGQUIT)
# Stop signals a process may inherit ignored on purpose, and keeps so: HUP under nohup, QUIT in a job a
# non-interactive shell started with &.
KEPT_IGNORED = (signal.SIGHUP, signal.SIGQUIT)


class StopRequested(KeyboardInterrupt):
    """A stop signal (``STOP_SIGNALS``) outside training (the run starting, or writing its outputs): handled as Ctrl-C
    is."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop_requested(signum: int, frame) -> None:
    raise StopRequested(signum)


def honour_sigint() -> None:
    """Ctrl-C stops the process from its start to its exit, whatever SIGINT disposition it inherited. A process
    started with ``&`` by a non-interactive shell (a script, a CI step, a wrapper that backgrounds the run) inherits
    SIGINT ignored, and Python keeps that: Ctrl-C would be dropped while the run starts and obeyed once
    ``StopSignal`` takes it over for training. Here it raises KeyboardInterrupt (one line, exit 130) until then.
    SIGTERM, SIGUSR1 (Slurm's), SIGHUP and SIGQUIT would end the process without a word before training: they raise
    StopRequested (one line, exit 128 + the signal) outside training likewise. A SIGHUP or SIGQUIT inherited ignored
    (``KEPT_IGNORED``) stays ignored."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in STOP_SIGNALS:
        if taken(signum):
            signal.signal(signum, _stop_requested)


def taken(signum: int) -> bool:
    """Whether moe-tune handles ``signum``: every stop signal but one of ``KEPT_IGNORED`` that is ignored."""
    return signum not in KEPT_IGNORED or signal.getsignal(signum) != signal.SIG_IGN


def watch_launcher() -> None:
    """A rank that torchrun's agent started stops as on SIGTERM once that agent is gone (killed with SIGKILL, or by
    the kernel's out-of-memory killer): the SIGTERM the agent would have sent. It saves at the step the ranks agree
    on and exits, where an orphan would train on, hold its GPU and write into output_dir beside a run started again
    there. The agent is the rank's parent: the parent's death reparents the rank, which a thread polls for."""
    parent = os.getppid()
    if "TORCHELASTIC_RUN_ID" not in os.environ or parent == 1:
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(LAUNCHER_POLL_S)
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:  # the run is over, its outputs written
            return
        # Said by each rank that sees it: another may stop by the ranks' agreement before its own poll.
        rank = os.environ.get("RANK", "0")
        print(f"moe-tune: rank {rank}: the launcher (pid {parent}) is gone: stopping as on SIGTERM", file=sys.stderr)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="moe-tune-launcher-watch", daemon=True).start()


def restore_default_signals() -> None:
    """SIGINT and ``STOP_SIGNALS`` back to the system's default action once the run is over (its outputs written,
    or its error or stop said), before Hydra's and the interpreter's teardown: a signal then ends the process as
    it ends any program, by that signal (a shell reads 128 + signal), where ``StopRequested`` raised in an atexit
    callback would print its traceback and exit 0. Buffered output is flushed first: such an end drops it."""
    sys.stdout.flush()
    sys.stderr.flush()
    for signum in (signal.SIGINT, *STOP_SIGNALS):
        if taken(signum):
            signal.signal(signum, signal.SIG_DFL)


def interrupted(e: KeyboardInterrupt) -> int:
    """The line for a stop outside training (Ctrl-C or ``StopRequested``), printed by the node's first rank (the
    launcher passes the signal to every rank: one line, not one a rank); returns the exit code."""
    signum = getattr(e, "signum", signal.SIGINT)
    for again in (signal.SIGINT, *STOP_SIGNALS):  # the stop is said once: a repeat (scancel retries its signal)
        signal.signal(again, signal.SIG_IGN)  # would raise again in the middle of the line
    if first_rank_of_node():
        stopped = f"moe-tune: stopped by signal {int(signum)}; nothing saved since the last checkpoint"
        print(INTERRUPTED if signum == signal.SIGINT else stopped, file=sys.stderr)
    return 128 + int(signum)


def leave(code: int) -> None:
    """Exit with ``code`` after a stop outside training. A second Ctrl-C leaves the run mid-way: its process group
    and a checkpoint writer may still be alive. Python's own exit would wait for the writer (no stop "at once") and
    then tear the groups' C++ threads down with the interpreter, which aborts the process at times (SIGABRT,
    "terminate called without an active exception", exit 134). Such a process flushes its logs and leaves now; the
    checkpoint in flight stays without ``COMPLETE``, which a resume passes over."""
    distributed = sys.modules.get("torch.distributed")
    if threading.active_count() > 1 or (
        distributed is not None and distributed.is_available() and distributed.is_initialized()
    ):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)


def fail(message: str, quiet: bool = False) -> None:
    """Print the one line and exit 2. ``quiet``: the node's first rank found the same error and prints it; this
    rank waits, so that rank exits first and torchrun stops this one before it prints (an earlier exit here could
    cut the printing rank short). A rank still running after the wait found the error alone: it prints it. Under
    torchrun, whose SIGTERM stops the other ranks once one fails, the wait ends by that signal without a word (no
    "stopped by signal" line beside the error's); under Slurm or submitit the signal keeps its handler."""
    if quiet:
        if "TORCHELASTIC_RUN_ID" in os.environ:  # set by torchrun's agent for its ranks
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(QUIET_EXIT_DELAY_S)
    print(f"moe-tune: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def precheck(argv: list[str]) -> list[str]:
    """Check the command line before Hydra sees it: one line and exit 2 for a bad key, value or model file, before
    anything is written. Returns the arguments Hydra gets (``--help`` is answered here)."""
    from moe_tune.cli.inputs import check_inputs
    from moe_tune.config import UserError
    from moe_tune.config import overrides as cli_args
    from moe_tune.config.override_forms import expand_home, repeated_keys
    from moe_tune.config.sweep import jobs_run_here, sweep_jobs

    try:
        args, argv = cli_args.parse(argv)
        if args.hydra_help:
            return ["--hydra-help"]  # Hydra's own help composes without the app's config: overrides would fail it
        if cli_args.composed_by_hydra_alone(args) or args.shell_completion:
            return argv
        source = cli_args.ConfigSource.of(args)  # the packaged config, or --config-dir/--config-name's
        if args.help:
            print(cli_args.help_text(args.overrides, source))
            raise SystemExit(0)
        flags = argv[: len(argv) - len(args.overrides)]
        args.overrides = [expand_home(o) for o in args.overrides]
        for note in repeated_keys(args.overrides) if first_rank_of_node() else []:
            print(f"moe-tune: note: {note}", file=sys.stderr)
        argv = flags + args.overrides
        argv = plan_auto(args, argv)
        cfg = cli_args.check(args.overrides, multirun=args.multirun, source=source)
        if cli_args.runs_job(args):  # a sweep's runs each, with their swept values (data.path=a.jsonl,b.jsonl)
            jobs = sweep_jobs(args.overrides) if args.multirun else []
            for job_cfg in [cli_args.check(job, source=source) for job in jobs] or [cfg]:
                check_inputs(job_cfg, world_known=not args.multirun, here=jobs_run_here(args.overrides))
    except UserError as e:
        # Before any process group: every rank reads the same command line and files and finds the same error,
        # so the first rank of each node says it (2 ranks on one node: one line, not two).
        fail(str(e), quiet=not first_rank_of_node())
    return argv


def plan_auto(args, argv: list[str]) -> list[str]:
    """``parallel.ep=auto``, ``parallel.activation_checkpointing=auto``, ``train.micro_batch_size=auto``: the
    planner's choice in their place (``moe_tune.plan.auto``), in ``args.overrides`` and the returned command line
    (its flags first, then the overrides, as ``parse`` gives it). Nothing is imported when no value is auto."""
    if not any(o.endswith("=auto") for o in args.overrides):
        return argv
    from moe_tune.plan.auto import resolve

    flags = argv[: len(argv) - len(args.overrides)]
    args.overrides = resolve(args.overrides, multirun=args.multirun)
    return flags + args.overrides


def first_rank_of_node() -> bool:
    """Whether this process is its node's first rank (a lone process is). A process no launcher started answers
    without importing moe_tune.distributed (and torch): a bad value is said at once."""
    if "RANK" not in os.environ and "SLURM_PROCID" not in os.environ:
        return True
    from moe_tune.distributed.env import dist_env

    return dist_env().local_rank == 0


def run(dict_cfg) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from moe_tune.checkpoint import RunFinished
    from moe_tune.checkpoint.safe import disk_full_ends_run
    from moe_tune.cli.inputs import restore_output_dir
    from moe_tune.config import UserError

    cfg = to_config(dict_cfg)
    sweep = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    if sweep:
        # Each job of a sweep (or of a launcher such as submitit_slurm) gets its own run directory.
        cfg.output_dir = HydraConfig.get().runtime.output_dir
    from moe_tune.distributed.process_group import destroy_distributed, dist_env
    from moe_tune.train import Trainer
    from moe_tune.train.lock import release_held

    # The process group (if the trainer made one) is torn down where every rank leaves together: a bad value
    # found once the model or data is known (exit 2, one line), a finished run, a stop on a signal. Not after
    # an error on one rank, where NCCL could wait for the others: torchrun ends those jobs.
    try:
        # Building writes too (the lock, base_model/, metrics.jsonl cut back, config.json): a full disk is one line.
        with disk_full_ends_run(cfg.output_dir, settle=lambda: None):
            trainer = Trainer(cfg)
    except RunFinished as e:  # the same command after the run ended: every rank reads the same summary.json
        if dist_env().rank == 0:
            logging.getLogger("moe_tune").info("%s", e)
        release_held()
        destroy_distributed()
        return
    except UserError as e:
        if os.path.abspath(cfg.output_dir) in release_held():  # only a run that held output_dir wrote to it
            restore_output_dir(cfg.output_dir)
        destroy_distributed()
        # Every rank finds it (the lock's verdict is broadcast, checksums gathered, the model and data the same on
        # each): under torchrun the node's first rank says it, as before the group. Not under submitit, whose
        # submitter joins the ranks' lines into one (a waiting rank would be stopped there without its line).
        env = dist_env()
        fail(str(e), quiet=env.launcher == "torchrun" and env.local_rank > 0)
    try:
        with disk_full_ends_run(cfg.output_dir, trainer.saver.wait):  # exit 1, one line
            trainer.fit()
    except UserError as e:  # found while training (a streamed record): on this rank alone, so no group teardown
        release_held()
        fail(str(e))
    except SystemExit:
        release_held()
        destroy_distributed()
        raise
    release_held()  # the run lock on output_dir
    destroy_distributed()
    if not sweep:  # a sweep's next job starts as this one did: main restores them after the last
        restore_default_signals()


def register_launcher() -> None:
    """Hydra finds launchers by listing the ``hydra_plugins`` namespace package, and an editable install
    (setuptools' import hook, ``pip install -e .``) is invisible to that listing although the module imports:
    register moe_tune's launcher by its class, so ``hydra/launcher=submitit_slurm`` works from any install."""
    from hydra.core.plugins import Plugins

    from hydra_plugins.moe_tune_launcher.slurm import SlurmLauncher

    Plugins.instance().register(SlurmLauncher)


def main() -> None:
    honour_sigint()
    watch_launcher()
    code = 0
    try:
        import hydra

        from moe_tune.config import register_configs

        sys.argv[1:] = precheck(sys.argv[1:])
        register_configs()
        register_launcher()
        hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")(run)()
    except KeyboardInterrupt as e:  # Ctrl-C (or SIGTERM) before training started, or a second one while it stopped
        leave(interrupted(e))
    except SystemExit as e:  # an error's exit (its line said), a stop's, --help's
        code = e.code
    finally:
        restore_default_signals()
    end_rank(code)


def end_rank(code) -> None:
    """Exit with ``code``; a rank of a launched run (world size above 1) leaves without the interpreter's
    teardown. Its process groups' gloo worker threads outlive ``destroy_process_group`` while the trainer's mesh
    still references the groups, and a worker that drops a finished collective's tensors (the last reference,
    the caller having returned) or runs a work's callback once the teardown began needs the GIL it can no longer
    take: Python ends the thread inside a noexcept C++ destructor and the process aborts ("terminate called
    without an active exception", exit 134 in place of the run's 0, 1 or 2). A loaded machine, which delays the
    worker, makes that likely. What the interpreter's exit does before its teardown still happens here: the
    non-daemon threads (a checkpoint writer) finish and the atexit callbacks run, logging's flush among them."""
    if code is None:
        code = 0
    if not isinstance(code, int) or not launched_ranks():  # one process (or a test calling main): Python's exit
        raise SystemExit(code)
    import atexit

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launched_ranks() -> bool:
    """Whether this process is one of several ranks that torch.distributed joined (it cannot have a process group
    without having imported it)."""
    if "torch.distributed" not in sys.modules:
        return False
    from moe_tune.distributed.env import dist_env

    return dist_env().world_size > 1


if __name__ == "__main__":
    main()
