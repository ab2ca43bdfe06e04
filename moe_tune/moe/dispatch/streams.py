"""A side CUDA stream for expert-parallel communication, and ``Pending``: its result, waited for by event.

Why a stream of our own: ``all_to_all_single`` (async_op=False) makes the stream that called it wait for NCCL's
internal stream. Called from the compute stream, every kernel queued after it waits for the exchange; called
from the side stream, only the side stream waits, and the compute stream runs on until it waits on the
exchange's event (``Pending.wait``, a device-side wait: the host does not block).

Autograd runs each backward node on the stream its forward ran on and orders streams by events (recording
the gradients' streams for the allocator), so a differentiable exchange launched here also runs its backward
exchange on the side stream, beside the compute stream's backward kernels.

Allocator rules (the caching allocator reuses a block once its own stream is done with it): what the side
stream reads was made on the compute stream, so it is recorded on the side stream; what the side stream
makes is read on the compute stream, so it is recorded there.

Without CUDA (gloo on CPU) there is no stream: ``launch`` runs in place and ``wait`` returns at once, so the
same code runs sequentially with the same results. DeepEP would use the same shape: its Function launched
here, DeepEP's own comm stream waiting on this one (``previous_event``), ``async_finish`` left off so the
side stream, not the compute stream, waits for DeepEP.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# One side stream per device, shared by every layer's dispatcher and reused across steps (a cache keyed by
# device index, not a process-group singleton). Sharing keeps the exchanges in issue order on one stream.
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


@dataclass
class Pending:
    """An exchange launched on the side stream: ``wait()`` makes the current stream wait for it, then runs
    ``finish`` on its result (compute-stream work, e.g. a permutation) and returns that."""

    value: Any
    event: torch.cuda.Event | None = None
    finish: Callable[[Any], Any] | None = None

    @torch.compiler.disable  # stream and event calls stay eager under kernels.compile=true
    def wait(self) -> Any:
        if self.event is not None:
            torch.cuda.current_stream(self.event.device).wait_event(self.event)
        return self.value if self.finish is None else self.finish(self.value)


def side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


@torch.compiler.disable
def launch(fn: Callable[..., torch.Tensor], x: torch.Tensor, *args) -> Pending:
    """``fn(x, *args)`` on the side stream of ``x``'s device, after everything queued so far on the current
    (compute) stream; returns its tensor as ``Pending``. On CPU: ``fn(x, *args)`` now."""
    if x.device.type != "cuda":
        return Pending(fn(x, *args))
    compute = torch.cuda.current_stream(x.device)
    side = side_stream(x.device)
    side.wait_stream(compute)  # x (the rows to send) is made on the compute stream
    with torch.cuda.stream(side):
        out = fn(x, *args)  # autograd records this stream: fn's backward runs on it too
        event = torch.cuda.Event()
        event.record(side)
    x.record_stream(side)
    out.record_stream(compute)
    return Pending(out, event)
