"""``optim.overlap_forward``: the AdamW update runs on a side CUDA stream beside the next step's forward.

The update is bound by memory (it reads and writes every parameter, gradient and moment once) and the forward by
its GEMMs, yet on one GPU the update otherwise runs alone between a step's backward and the next forward: at
micro-batch 1 it is about a third of the step's GPU time (benchmarks/README.md, "No GPU lent: the small step's
two variants and Unsloth's row made ready"). Here the update is issued
on a side stream in the forward's order, in buckets: first every parameter outside the decoder layers (embeddings,
final norm, lm_head), then each decoder layer's. An event marks each bucket's end; the model's forward waits, on
its own stream, for bucket 0 as it starts and for bucket i + 1 as decoder layer i starts (forward pre-hooks that
torch.compile leaves out of its graphs), so each layer computes with its updated weights while the later layers'
updates still run. Each bucket is one call of the run's optimizer with only that bucket's gradients in place (the
others set aside and put back): the optimizer and its state are the run's own, each parameter gets the same update
as in one call (AdamW's state and stochastic rounding's random bits are per parameter), and checkpoints are the
same.

The gradients are freed on the main stream after the step (``zero_grad``) while the side stream still reads them:
each is marked as used by the side stream, so the allocator hands its memory out only after (the gradients stay
allocated into the next forward, until their bucket is done: the peak can grow by up to their size). Anything else that
reads the parameters or the optimizer's state (checkpoints, evaluation's end, exports, the metrics) comes after
``settle``, which the trainer calls at every step that waits for the device anyway.

One rank without FSDP2 sharding only (``validate``): FSDP2 gathers a layer's parameters ahead of its forward, on
its own stream, where these waits would not reach. Off a GPU ``step`` is the optimizer's own.
"""

from __future__ import annotations

import torch
from torch import nn


class PlainUpdate:
    """The optimizer's step as it is (no overlap)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def step(self) -> None:
        self.optimizer.step()

    def settle(self) -> None:
        pass


def buckets(model: nn.Module) -> list[list[nn.Parameter]]:
    """The trained parameters in the forward's order: those outside the decoder layers, then each layer's."""
    in_layers = [[p for p in layer.parameters() if p.requires_grad] for layer in model.layers]
    seen = {id(p) for layer in in_layers for p in layer}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in seen]
    return [rest, *in_layers]


def step_in_buckets(optimizer: torch.optim.Optimizer, parts: list[list[nn.Parameter]], after_bucket=None) -> None:
    """``optimizer.step()`` once per bucket, each with only its parameters' gradients in place; ``after_bucket(b)``
    runs after bucket b's call. Every gradient is back in place at the end."""
    grads = [(p, p.grad) for part in parts for p in part if p.grad is not None]
    for p, _ in grads:
        p.grad = None
    try:
        for b, part in enumerate(parts):
            ids = {id(p) for p in part}
            held = [(p, g) for p, g in grads if id(p) in ids]
            for p, g in held:
                p.grad = g
            optimizer.step()
            for p, _ in held:
                p.grad = None
            if after_bucket is not None:
                after_bucket(b)
    finally:
        for p, g in grads:
            p.grad = g


class OverlappedUpdate(PlainUpdate):
    """The update on a side stream, bucket by bucket, each bucket's parameters waited for as the forward reaches
    them (see the module's docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module):
        super().__init__(optimizer)
        self.parts = buckets(model)
        self.stream = torch.cuda.Stream()
        self.events = [torch.cuda.Event() for _ in self.parts]
        model.model.register_forward_pre_hook(self._waiter(0))  # the transformers model under the LM head
        for i, layer in enumerate(model.layers):
            layer.register_forward_pre_hook(self._waiter(i + 1))

    def _waiter(self, bucket: int):
        event = self.events[bucket]

        @torch._dynamo.disable  # a compiled layer's hooks run inside its compiled call: this one stays eager
        def wait(module, args):
            torch.cuda.current_stream().wait_event(event)  # nothing to wait for before the first update

        return wait

    def step(self) -> None:
        main = torch.cuda.current_stream()
        self.stream.wait_stream(main)  # the gradients, the clipping divisor and the skip flag are ready
        for part in self.parts:
            for p in part:
                if p.grad is not None:
                    p.grad.record_stream(self.stream)  # freed on the main stream after the step
        with torch.cuda.stream(self.stream):
            step_in_buckets(self.optimizer, self.parts, lambda b: self.events[b].record(self.stream))

    def settle(self) -> None:
        torch.cuda.current_stream().wait_stream(self.stream)


def build_update(optimizer: torch.optim.Optimizer, model: nn.Module, overlap: bool, device: torch.device):
    """``OverlappedUpdate`` with ``optim.overlap_forward=true`` on a GPU, else the optimizer's own step."""
    if overlap and device.type == "cuda":
        return OverlappedUpdate(optimizer, model)
    return PlainUpdate(optimizer)
