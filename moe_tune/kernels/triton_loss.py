"""The cross-entropy's Triton kernel (``moe_tune.kernels.loss`` launches it; see there). A module-level function,
so that Triton's interpreter (``TRITON_INTERPRET=1``, how the CPU tests run it) resolves it by name; imported only
when the kernel is launched (CPU installs need not have Triton)."""

import triton
import triton.language as tl


@triton.jit
def softmax_grad_kernel(logits_ptr, labels_ptr, loss_ptr, row_stride, V, ignore_index, BLOCK: tl.constexpr):
    """One program per row of a chunk's logits, in place: the row's loss ``logsumexp(x) - x[label]`` into
    ``loss_ptr[row]``, and its gradient ``softmax(x) - onehot(label)`` over the logits, in their dtype; 0 for an
    ignored row (label == ignore_index). fp32 island: the log-sum-exp and softmax are computed in fp32 from the
    stored logits.

    Two passes over the row: the first keeps a running max and a sum of exponentials rescaled to it (one read);
    the second writes the gradient (a read and a write). Unfused, PyTorch ran seven such passes over an fp32
    copy of the logits."""
    row = tl.program_id(0).to(tl.int64)
    x_ptr = logits_ptr + row * row_stride
    label = tl.load(labels_ptr + row).to(tl.int32)
    valid = label != ignore_index
    # Labels are the next tokens' ids, which the embedding has already indexed: in range unless ignored.
    safe_label = tl.where(valid, label, 0)
    running_max = float("-inf")
    running_sum = 0.0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    picked = tl.load(x_ptr + safe_label).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - picked, 0.0))
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) - tl.where(cols == safe_label, 1.0, 0.0)
        g = tl.where(valid, g, 0.0)
        tl.store(x_ptr + cols, g.to(logits_ptr.dtype.element_ty), mask=mask)
