"""StopSignal: every rank agrees on the same step, whichever rank got the signal and whenever it landed."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from moe_tune.train import Cadence, StopSignal
from tests.harness import run_ranks


def _stop_where_agreed(rank: int, out_dir: str, signal_rank: int, signal_step: int) -> None:
    """A loop of 20 steps that agrees only on the cadence's sync steps (log_every=4, checkpoints every 6);
    one rank gets SIGUSR1 after ``signal_step``. Each rank writes the step it stopped after and the signal."""
    cadence = Cadence(steps=20, log_every=4, checkpoint_every=6)
    stopped = None
    with StopSignal(enabled=True) as stop:
        for step in range(1, 21):
            if rank == signal_rank and step == signal_step:
                os.kill(os.getpid(), signal.SIGUSR1)
            if cadence.syncs(step) and stop.agreed(torch.device("cpu")):
                stopped = step
                break
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(f"{stopped} {stop.signum}")


@pytest.mark.dist
@pytest.mark.parametrize("signal_rank, signal_step, stop_step", [(1, 5, 6), (0, 9, 12), (1, 12, 12)])
def test_every_rank_stops_after_the_same_sync_step(tmp_path, signal_rank, signal_step, stop_step):
    run_ranks(_stop_where_agreed, 2, str(tmp_path), signal_rank, signal_step)
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}").read_text() == f"{stop_step} {int(signal.SIGUSR1)}"


def test_disabled_installs_no_handler_and_never_stops():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignal(enabled=False) as stop:
        assert signal.getsignal(signal.SIGTERM) == before
        assert stop.agreed(torch.device("cpu")) is False


def test_one_process_sees_its_own_signal_and_restores_handlers():
    before = signal.getsignal(signal.SIGUSR1)
    with StopSignal(enabled=True) as stop:
        assert stop.agreed(torch.device("cpu")) is False
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.agreed(torch.device("cpu")) is True and stop.signum == signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) == before


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGQUIT], ids=["hup", "quit"])
def test_a_hang_up_or_quit_stops_and_saves_unless_ignored(signum):
    """SIGHUP (the terminal or ssh session gone) and SIGQUIT (Ctrl-\\): torchrun's agent passes both on to the ranks,
    which died of them without saving while the launcher said checkpoint.resume=auto continues. Each is a stop like
    SIGTERM's. Inherited ignored (nohup; a job a non-interactive shell starts with &), it stays ignored."""
    before = signal.getsignal(signum)
    try:
        with StopSignal(enabled=True) as stop:
            assert signal.getsignal(signum) == stop._on_signal  # not the default, which kills the process
            os.kill(os.getpid(), signum)
            assert stop.agreed(torch.device("cpu")) is True and stop.signum == signum
        assert signal.getsignal(signum) == before
        signal.signal(signum, signal.SIG_IGN)
        with StopSignal(enabled=True) as stop:
            assert signal.getsignal(signum) == signal.SIG_IGN
            os.kill(os.getpid(), signum)
            assert stop.agreed(torch.device("cpu")) is False
    finally:
        signal.signal(signum, before)


def test_a_signal_during_the_agreement_is_counted_at_the_next_step(monkeypatch):
    """The handler's flag is never cleared by the all-reduce: a signal that lands while the ranks agree on the
    previous step's flags stops every rank one step later instead of being lost."""
    import torch.distributed as dist

    before = signal.getsignal(signal.SIGTERM)
    stop = StopSignal(enabled=True)
    assert signal.getsignal(signal.SIGTERM) == stop._on_signal
    try:
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)

        def all_reduce(flag, op=None, group=None):
            stop._on_signal(signal.SIGUSR1, None)  # arrives while the collective runs; the other rank had none

        monkeypatch.setattr(dist, "all_reduce", all_reduce)
        assert stop.agreed("cpu") is False and stop.signum is None
        assert stop.agreed("cpu") is True and stop.signum == signal.SIGUSR1
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) == before  # the previous handlers are back


def test_ctrl_c_stops_at_an_agreed_step_and_again_at_once():
    """The first SIGINT is a stop like SIGTERM's (a checkpoint of the agreed step follows); a second one raises
    KeyboardInterrupt, for a user who will not wait for the save."""
    before = signal.getsignal(signal.SIGINT)
    with StopSignal(enabled=True) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.agreed(torch.device("cpu")) is True and stop.signum == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) == before


def test_a_second_sigterm_during_the_stops_save_does_not_cut_it_short(tmp_path, monkeypatch):
    """Preemption under Slurm can deliver SIGTERM twice (Slurm's own and the batch script's, or torchrun's and a
    rank's watch of its launcher): the second lands while the stop's checkpoint is written. That save runs under
    the stop's handlers, which only count a signal: the checkpoint completes and the run exits 143. (It ran under
    the command's handlers, whose StopRequested ended the save halfway, and the other ranks' with it.)"""
    import moe_tune.checkpoint as ckpt
    from moe_tune.cli.train import StopRequested, honour_sigint, restore_default_signals
    from tests.harness import FAST_TRAINER, train_run

    real_save, signalled = ckpt.save, []

    def save_signalled_again(state, step, path, saver=None):
        if not signalled:  # the second SIGTERM, once, as the stop's save starts
            signalled.append(step)
            os.kill(os.getpid(), signal.SIGTERM)
        return real_save(state, step, path, saver)

    monkeypatch.setattr(ckpt, "save", save_signalled_again)
    first = {"sent": False}
    original_agreed = StopSignal.agreed

    def agreed_after_a_sigterm(self, device):
        if not first["sent"]:
            first["sent"] = True
            os.kill(os.getpid(), signal.SIGTERM)
        return original_agreed(self, device)

    monkeypatch.setattr(StopSignal, "agreed", agreed_after_a_sigterm)
    honour_sigint()  # the command's handlers around training, as moe-tune's main installs them
    try:
        with pytest.raises(SystemExit) as e:
            train_run([f"output_dir={tmp_path}", "train.steps=50", "checkpoint.every=1000", *FAST_TRAINER])
    except StopRequested:
        pytest.fail("the second SIGTERM cut the stop's save short")
    finally:
        restore_default_signals()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert e.value.code == 143 and signalled
    assert (tmp_path / "checkpoints" / f"step_{signalled[0]}" / "COMPLETE").exists()


def test_a_collective_lost_to_a_peer_that_left_on_the_signal_is_the_stop(kept_signals):
    """Two ranks, SIGTERM to both while rank 0 still starts: rank 0 leaves at once (one line), rank 1, training
    already, loses it in its next collective. On a rank that got a signal that failure is the stop (exit 143,
    the node's one line), not a traceback; without a signal, or another error, it stays what it is."""
    from moe_tune.cli.train import interrupted
    from moe_tune.train.signals import PEER_GONE, PeerStopped

    lost = RuntimeError(f"[third_party/gloo/gloo/transport/tcp/pair.cc:553] {PEER_GONE} [127.0.0.1]:60556")
    with pytest.raises(PeerStopped) as stopped:
        with StopSignal(enabled=True):
            os.kill(os.getpid(), signal.SIGTERM)
            raise lost
    assert stopped.value.signum == signal.SIGTERM and interrupted(stopped.value) == 143
    with pytest.raises(RuntimeError, match=PEER_GONE):
        with StopSignal(enabled=True):  # no signal: a peer that crashed
            raise lost
    with pytest.raises(ValueError):
        with StopSignal(enabled=True):
            os.kill(os.getpid(), signal.SIGTERM)
            raise ValueError("not a collective")
