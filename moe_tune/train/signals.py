"""Stopping on SIGTERM / SIGUSR1 (Slurm's time limit or preemption, torchrun's shutdown), SIGINT (Ctrl-C, which
torchrun passes on to its ranks), SIGHUP (the command's terminal gone, passed on likewise) or SIGQUIT (Ctrl-\\,
passed on likewise) at a step every rank agrees on."""

from __future__ import annotations

import logging
import signal

import torch
import torch.distributed as dist

log = logging.getLogger("moe_tune")

# What gloo says when a peer rank's process is gone (NCCL's equivalent raises torch.distributed.DistError).
PEER_GONE = "Connection closed by peer"


class PeerStopped(KeyboardInterrupt):
    """This rank's signal stop where a peer rank, signalled too, left before the ranks agreed (it was still
    starting): the collective that lost it failed. Handled as the command's stops outside training are
    (``cli.train.interrupted`` reads ``signum``): one line from the node's first rank, exit 128 + the signal."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class StopSignal:
    """SIGTERM, SIGUSR1, SIGINT, SIGHUP and SIGQUIT (these two unless inherited ignored: ``nohup``, a job started
    with ``&`` by a non-interactive shell) set a flag instead of killing the process;
    ``agreed`` tells every rank whether any rank got one (a MAX all-reduce of one int over all ranks, and a host sync
    to read it). A second SIGINT (Ctrl-C pressed again) raises KeyboardInterrupt: stop now, without saving.

    ``agreed`` is a collective: call it on the same steps on every rank (the trainer calls it on its logging and
    checkpoint steps, a pure function of the step, so a signal stops a run of several ranks at most
    ``train.log_every - 1`` steps after it landed). One process has no rank to agree with: the trainer stops it after
    the step a signal landed in (``received``). The handler's flag is never cleared: a signal landing while the
    ranks agree is counted at the next call."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    KEPT_IGNORED = (signal.SIGHUP, signal.SIGQUIT)  # as moe_tune.cli.train's, which imports no torch

    def __init__(self, enabled: bool):
        self.signum: int | None = None  # the agreed signal (any rank's), once every rank has seen it
        self._received = 0  # this rank's, set by the handler and never cleared
        self.enabled = enabled
        self._previous = {}
        if enabled:
            for sig in self.SIGNALS:
                if sig not in self.KEPT_IGNORED or signal.getsignal(sig) != signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGINT and self._received == signal.SIGINT:
            raise KeyboardInterrupt
        if not self._received:  # torchrun's agent passes on the signal its ranks got too: one line
            # info: rank 0's log only; the stop line after the save names the step
            again = "; Ctrl-C again stops at once, without saving" if signum == signal.SIGINT else ""
            log.info("signal %d received: stopping at the next step the ranks agree on%s", signum, again)
        self._received = signum

    @property
    def received(self) -> bool:
        """This process got a signal (its own view: not an agreement)."""
        return bool(self._received)

    def agreed(self, device) -> bool:
        if not self.enabled:
            return False
        got = self._received  # a signal landing after this read is counted at the next call, on every rank
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([got], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # mesh: all ranks (the default group)
            got = int(flag.item())  # host sync: the stop decision; called only on steps that sync anyway
        if got:
            self.signum = got
        return bool(got)

    def restore(self) -> None:
        """Put the previous handlers back."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __enter__(self) -> StopSignal:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """The previous handlers back. A collective that failed because a peer rank is gone, on a rank that got a
        signal, is that signal's stop (``PeerStopped``), not a crash: a rank signalled while it was still
        starting leaves at once, and the others, already training, lose it in their next collective."""
        self.restore()
        if self._received and exc is not None and _peer_gone(exc):
            raise PeerStopped(self._received) from None


def _peer_gone(exc: BaseException) -> bool:
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and PEER_GONE in str(exc))


__all__ = ["PeerStopped", "StopSignal"]
