"""optim.overlap_forward: the update issued bucket by bucket (the parameters outside the decoder layers, then each
layer's), on a GPU beside the next forward. The buckets' calls must give every parameter the update one call gives
(the optimizer's state and stochastic rounding's bits are per parameter), and leave every gradient in place."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from moe_tune.config import OptimConfig
from moe_tune.optim import build_optimizer
from moe_tune.optim.overlap import buckets, step_in_buckets


class Stack(nn.Module):
    """The shape the update's buckets follow: ``layers`` plus parameters outside them (before and after)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, 16, dtype=dtype)
        self.layers = nn.ModuleList(nn.Linear(16, 16, dtype=dtype) for _ in range(3))
        self.frozen = nn.Linear(16, 16, dtype=dtype).requires_grad_(False)
        self.head = nn.Linear(16, 32, bias=False, dtype=dtype)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(self.frozen(h))


def _run(model: nn.Module, cfg: OptimConfig, bucketed: bool, steps: int = 3) -> nn.Module:
    opt = build_optimizer(model.named_parameters(), cfg, lr=1e-2, seed=3)
    opt.grad_scale = torch.tensor(2.0)  # clipping's divisor reaches every bucket's call
    for step in range(steps):
        ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(step))
        model(ids).float().square().mean().backward()
        if step == 1:  # a parameter without a gradient this step: its bucket skips it, the others go on
            model.layers[1].bias.grad = None
        grads = {id(p): p.grad for p in model.parameters()}
        if bucketed:
            step_in_buckets(opt, buckets(model))
        else:
            opt.step()
        assert all(p.grad is grads[id(p)] for p in model.parameters())  # every gradient back in place
        opt.zero_grad(set_to_none=True)
    return model, opt


@pytest.mark.parametrize(
    "dtype, stochastic, compiled",
    [
        (torch.bfloat16, True, True),  # StochasticRoundingAdamW (eager on the CPU)
        (torch.float32, None, True),  # CompiledAdamW
        (torch.float32, None, False),  # torch's fused AdamW
    ],
)
def test_buckets_update_each_parameter_as_one_step(dtype, stochastic, compiled):
    cfg = OptimConfig(stochastic_rounding=stochastic, compiled=compiled, weight_decay=0.1)
    model = Stack(dtype)
    one, opt_one = _run(copy.deepcopy(model), cfg, bucketed=False)
    parts, opt_parts = _run(copy.deepcopy(model), cfg, bucketed=True)
    for (name, a), b in zip(one.named_parameters(), parts.parameters()):
        assert torch.equal(a, b), name
    for (name, a), b in zip(one.named_parameters(), parts.parameters()):
        if a.requires_grad:
            state_a, state_b = opt_one.state[a], opt_parts.state[b]
            assert all(torch.equal(state_a[k], state_b[k]) for k in state_a), name
    assert not torch.equal(model.layers[0].weight, one.layers[0].weight)  # the steps moved the weights


def test_buckets_follow_the_forward_and_hold_each_trained_parameter_once():
    model = Stack(torch.float32)
    parts = buckets(model)
    assert [len(p) for p in parts] == [
        2,
        2,
        2,
        2,
    ]  # the embedding and the head (not the frozen linear), then each layer's two
    assert parts[0][0] is model.embed.weight and parts[1] == [model.layers[0].weight, model.layers[0].bias]
    held = [id(p) for part in parts for p in part]
    assert sorted(held) == sorted(id(p) for p in model.parameters() if p.requires_grad)


class _Inner(nn.Module):
    """A transformers-like body: the embedding, then the layers (what ``model.model`` runs)."""

    def __init__(self, outer: Stack):
        super().__init__()
        self.outer = [outer]  # not a submodule: the parameters stay the outer model's

    def forward(self, ids):
        h = self.outer[0].embed(ids)
        for layer in self.outer[0].layers:
            h = torch.tanh(layer(h))
        return h


def test_each_layer_waits_for_its_own_bucket(monkeypatch):
    """The wiring, with CUDA's stream calls recorded instead of run (no GPU here; the GPU test runs them): the update
    waits for the main stream, marks every gradient as read by the side stream, records bucket b's event after
    bucket b's call; the forward waits for bucket 0 as the body starts and for bucket i + 1 as layer i starts."""
    from moe_tune.optim import overlap

    calls = []

    class Event:
        def __init__(self):
            self.index = len(events)
            events.append(self)

        def record(self, stream):
            calls.append(("record", self.index, stream))

    class Stream:
        def __init__(self, name="side"):
            self.name = name

        def wait_stream(self, other):
            calls.append(("wait_stream", self.name, other.name))

        def wait_event(self, event):
            calls.append(("wait_event", self.name, event.index))

        def __repr__(self):
            return self.name

    events: list[Event] = []
    main = Stream("main")
    monkeypatch.setattr(overlap.torch.cuda, "Stream", Stream)
    monkeypatch.setattr(overlap.torch.cuda, "Event", Event)
    monkeypatch.setattr(overlap.torch.cuda, "current_stream", lambda: main)
    monkeypatch.setattr(overlap.torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: calls.append(("record_stream", s.name)))
    model = Stack(torch.float32)
    model.model = _Inner(model)
    opt = build_optimizer(model.named_parameters(), OptimConfig(compiled=False), lr=1e-2)
    update = overlap.OverlappedUpdate(opt, model)
    model.model(torch.zeros(2, 3, dtype=torch.long))
    assert calls == [("wait_event", "main", b) for b in range(4)]  # body, then layers 0-2 in order
    calls.clear()
    model(torch.zeros(2, 3, dtype=torch.long)).sum().backward()
    calls.clear()
    update.step()
    assert calls[0] == ("wait_stream", "side", "main")
    assert calls[1:9] == [("record_stream", "side")] * 8  # every gradient: embedding, head, 3 x (weight, bias)
    assert calls[9:] == [("record", b, update.stream) for b in range(4)]
    calls.clear()
    update.settle()
    assert calls == [("wait_stream", "main", "side")]
