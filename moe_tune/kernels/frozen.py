"""What the frozen base's quantized GEMMs (``fp8_frozen``, ``nf4_frozen``) share: a custom op ``op(x, *frozen)``
differentiable in ``x`` only, whose backward is another custom op ``input_grad(dy, *frozen)``."""

from __future__ import annotations


def register_input_grad(op, input_grad) -> None:
    """Give custom op ``op(x, *frozen) -> y`` the autograd ``dx = input_grad(dy, *frozen)``; no gradient reaches the
    frozen tensors, and only they are saved for backward."""

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[1:])

    def backward(ctx, dy):
        frozen = ctx.saved_tensors
        return input_grad(dy.contiguous(), *frozen), *([None] * len(frozen))

    op.register_autograd(backward, setup_context=setup_context)
