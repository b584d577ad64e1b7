"""Next-token cross-entropy that holds no more memory than the logits: the gradient is computed with the loss, a chunk
of tokens at a time, and written over the logits (the in-place backward of flash-attn's xentropy and Liger-Kernel's
cross-entropy; the idea, not their code).

    loss = in_place_cross_entropy(logits, targets)   # logits (N, V), targets (N,) ids or IGNORE_INDEX

The usual loss, F.cross_entropy(logits.float(), targets), keeps an fp32 copy of the logits, their log-softmax and, in
the backward, two more fp32 (N, V) tensors: 12 bytes a logit at its peak (planner/cost/memory_activations.py). Here the
forward runs each chunk of CHUNK_ELEMENTS logits in fp32 (log-sum-exp, the target's logit, softmax - one-hot) and
copies the gradient of the mean loss into that chunk of the logits, in their own dtype; the backward scales it by the
loss's incoming gradient (in fp16 a loss scale), a chunk at a time in fp32. So the logits' own storage is all that
lives from the loss to the head's backward (2 bytes a logit in bf16, 4 in fp32) plus one chunk's fp32 temporaries. The
logits must not be needed by anything else's backward: the head's matmul keeps its input, not its output; an op that
saved them would fail loudly at its backward (the in-place copy bumps their version counter).
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100  # F.cross_entropy's default: a target that adds nothing to the loss and gets no gradient
CHUNK_ELEMENTS = 2**24  # logits upcast at once: 64 MiB a fp32 temporary, three of them live in a chunk


class _InPlaceCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        rows, vocab = logits.shape
        valid = targets != IGNORE_INDEX
        count = valid.sum().clamp(min=1).to(torch.float32)  # the mean's denominator: the predicted tokens
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        step = max(1, CHUNK_ELEMENTS // max(vocab, 1))
        with torch.no_grad():
            for start in range(0, rows, step):
                chunk, target, keep = logits[start:start + step], targets[start:start + step], valid[start:start + step]
                upcast = chunk.float()  # (r, V)
                log_norm = torch.logsumexp(upcast, dim=-1)  # (r,)
                index = target.clamp(min=0).unsqueeze(1)  # (r, 1): an ignored row reads column 0, then is masked
                total += ((log_norm - upcast.gather(1, index).squeeze(1)) * keep).sum()
                grad = upcast.sub_(log_norm.unsqueeze(1)).exp_()  # softmax, in the upcast's storage
                grad.scatter_add_(1, index, -torch.ones_like(index, dtype=grad.dtype))  # - one-hot of the target
                grad.mul_((keep / count).unsqueeze(1))  # d(mean loss) / d(logits); 0 on ignored rows
                chunk.copy_(grad)
                del upcast, grad  # before the next chunk's upcast: one chunk's temporaries live at a time
        ctx.save_for_backward(logits)
        return total / count

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        # the logits' storage, holding d(loss) / d(logits) since the forward, scaled in place (one backward: the
        # graph is not retained)
        (grad,) = ctx.saved_tensors
        return scale_in_place(grad, grad_loss), None


def scale_in_place(grad: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """grad (N, V) *= factor (a 0-dim tensor: the loss's incoming gradient), each chunk of CHUNK_ELEMENTS multiplied in
    fp32 and rounded once into grad's dtype: fp16 cannot hold the factor itself (a loss scale starts at 2**16, over
    fp16's largest 65504, where grad * scale / tokens fits)."""
    if grad.dtype == torch.float32:
        return grad.mul_(factor)
    step = max(1, CHUNK_ELEMENTS // max(grad.shape[-1], 1))
    for start in range(0, grad.shape[0], step):
        chunk = grad[start:start + step]
        chunk.copy_(chunk.float().mul_(factor.float()))
    return grad


# The autograd nodes that may make the logits without keeping them for their own backward (the head's matmul and its
# reshape, a scale, a cast or a copy): logits made by anything else (a tanh, an exp, a softmax keeps its output) take
# the upcast loss, as would an op this list does not know
OVERWRITABLE_PRODUCERS = frozenset({"UnsafeViewBackward0", "ViewBackward0", "ReshapeAliasBackward0", "MmBackward0",
                                    "AddmmBackward0", "BmmBackward0", "MulBackward0", "DivBackward0", "AddBackward0",
                                    "ToCopyBackward0", "CloneBackward0", "LinearBackward0"})


def can_overwrite(logits: torch.Tensor) -> bool:
    """Whether the in-place loss may write over `logits`: they need a gradient, and neither they nor the tensor they
    view (a flatten's base) were made by an op that keeps them or by a custom autograd Function, whose outputs
    autograd forbids writing over (OVERWRITABLE_PRODUCERS)."""
    made = [logits] if logits._base is None else [logits, logits._base]
    return logits.requires_grad and all(type(t.grad_fn).__name__ in OVERWRITABLE_PRODUCERS for t in made)


def in_place_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of `logits` (N, V, contiguous: a view of the head's output) against `targets` (N,), rows whose
    target is IGNORE_INDEX left out, as F.cross_entropy(logits.float(), targets) computes it; the logits are
    overwritten by their gradient (module docstring)."""
    if not logits.is_contiguous():
        raise ValueError("in_place_cross_entropy writes the gradient over the logits: pass them contiguous "
                         "(e.g. logits.flatten(0, 1) of the head's (B, T, V) output, not of a slice of it)")
    return _InPlaceCrossEntropy.apply(logits, targets)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's parallel cross-entropy (Shoeybi et al. 2019, section 3), in place: each rank holds the logits of its
    V/tp vocabulary rows (N, V_local); the row maxima, the sums of exponentials and the targets' logits are
    all-reduced over the tensor-parallel group, (N,) fp32 each, and each rank writes the gradient of its own columns
    over its logits."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, group, vocab_start: int,
                grad_into: torch.Tensor | None) -> torch.Tensor:
        import torch.distributed as dist

        rows, local_vocab = logits.shape
        valid = targets != IGNORE_INDEX
        count = valid.sum().clamp(min=1).to(torch.float32)
        mine = valid & (targets >= vocab_start) & (targets < vocab_start + local_vocab)  # targets this rank holds
        index = (targets - vocab_start).clamp(0, max(local_vocab - 1, 0)).unsqueeze(1)  # (N, 1)
        step = max(1, CHUNK_ELEMENTS // max(local_vocab, 1))
        with torch.no_grad():
            row_max = torch.empty(rows, dtype=torch.float32, device=logits.device)
            picked = torch.zeros(rows, dtype=torch.float32, device=logits.device)
            for start in range(0, rows, step):  # pass 1: the row maxima and the targets' logits, this rank's columns
                upcast = logits[start:start + step].float()
                row_max[start:start + step] = upcast.amax(dim=-1) if local_vocab else float("-inf")
                if local_vocab:
                    picked[start:start + step] = upcast.gather(1, index[start:start + step]).squeeze(1)
                del upcast
            picked *= mine
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
            dist.all_reduce(picked, group=group)
            exp_sum = torch.zeros(rows, dtype=torch.float32, device=logits.device)
            for start in range(0, rows, step):  # pass 2: the sums of exponentials
                upcast = logits[start:start + step].float()
                exp_sum[start:start + step] = (upcast - row_max[start:start + step, None]).exp_().sum(dim=-1)
                del upcast
            dist.all_reduce(exp_sum, group=group)
            log_norm = row_max + exp_sum.log()  # (N,) the log of each row's softmax denominator
            total = ((log_norm - picked) * valid).sum()
            for start in range(0, rows, step) if grad_into is not None else ():  # pass 3: softmax - one-hot
                grad = logits[start:start + step].float().sub_(log_norm[start:start + step, None]).exp_()
                grad.scatter_add_(1, index[start:start + step], -mine[start:start + step, None].to(grad.dtype))
                grad.mul_((valid[start:start + step] / count).unsqueeze(1))
                grad_into[start:start + step].copy_(grad)
                del grad
        if grad_into is not None:
            ctx.save_for_backward(grad_into)
        return total / count

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        (grad,) = ctx.saved_tensors  # the logits' storage, holding d(loss) / d(logits), scaled in place
        return scale_in_place(grad, grad_loss), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group, vocab_start: int) -> torch.Tensor:
    """Mean cross-entropy over the whole vocabulary of `logits` (N, V_local: this rank's columns, the vocabulary rows
    vocab_start.. of the tensor-parallel `group`) against `targets` (N,) (IGNORE_INDEX rows left out), the same on
    every rank of the group. The gradient is made with the loss: written over the logits where they may be
    overwritten (can_overwrite), else (a tensor-parallel head's logits, a view that DTensor's to_local() made, which
    autograd forbids writing) into a buffer of their size; none without a gradient (validation)."""
    grad_into = None
    if logits.requires_grad:
        grad_into = logits if can_overwrite(logits) and logits.is_contiguous() else torch.empty_like(logits)
    return _VocabParallelCrossEntropy.apply(logits, targets, group, vocab_start, grad_into)


def shifted_targets(tokens: torch.Tensor) -> torch.Tensor:
    """Next-token targets of ids (B, T) for every position, flattened to (B*T,): token t+1 for position t, IGNORE_INDEX
    for each sequence's last position (nothing follows it). With the whole (B, T, V) logits flattened, no slice of them
    is copied."""
    ignore = torch.full_like(tokens[:, :1], IGNORE_INDEX)
    return torch.cat([tokens[:, 1:], ignore], dim=1).flatten()
