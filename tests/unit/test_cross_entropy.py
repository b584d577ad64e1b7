"""The in-place cross-entropy (model/cross_entropy.py) against F.cross_entropy: the same loss and the same gradient,
chunked or not, with ignored targets, in fp32 and bf16; and the memory it holds, counted on fake tensors."""

import pytest
import torch
import torch.nn.functional as F

from zplan.model import cross_entropy
from zplan.model.cross_entropy import IGNORE_INDEX, in_place_cross_entropy, shifted_targets


def reference(logits: torch.Tensor, targets: torch.Tensor):
    """F.cross_entropy on an fp32 upcast: (loss, gradient of the logits)."""
    leaf = logits.detach().clone().requires_grad_(True)
    loss = F.cross_entropy(leaf.float(), targets)
    loss.backward()
    return loss.detach(), leaf.grad


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("chunk_elements", [2**24, 3 * 97])  # one chunk; three rows a chunk, a partial last one
def test_loss_and_gradient_equal_f_cross_entropy(monkeypatch, dtype, tolerance, chunk_elements):
    monkeypatch.setattr(cross_entropy, "CHUNK_ELEMENTS", chunk_elements)
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(10, 97, generator=generator) * 3).to(dtype)
    targets = torch.randint(0, 97, (10,), generator=generator)
    targets[[2, 7]] = IGNORE_INDEX
    want_loss, want_grad = reference(logits, targets)

    head_output = logits.clone().requires_grad_(True)
    work = head_output * 1  # the logits as an op's output, which the loss overwrites
    loss = in_place_cross_entropy(work, targets)
    (loss * 0.5).backward()  # a scaled loss (1 / micro-batches) scales the gradient
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(want_loss.item(), rel=tolerance)
    torch.testing.assert_close(head_output.grad.float(), 0.5 * want_grad.float(), rtol=tolerance, atol=tolerance)
    assert not head_output.grad[[2, 7]].any()  # ignored rows get no gradient


def test_next_token_targets_give_the_sliced_loss_without_slicing_the_logits():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 8, 50, generator=generator)
    tokens = torch.randint(0, 50, (3, 8), generator=generator)
    sliced = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    whole = in_place_cross_entropy(logits.clone().flatten(0, 1), shifted_targets(tokens))
    assert whole.item() == pytest.approx(sliced.item(), rel=1e-6)


def test_a_slice_of_the_logits_is_refused():
    with pytest.raises(ValueError, match="contiguous"):
        in_place_cross_entropy(torch.randn(4, 6, 10)[:, :-1].flatten(0, 1).t(), torch.zeros(10, dtype=torch.long))


def test_an_op_that_saved_the_logits_fails_loudly_not_silently():
    """The loss overwrites the logits: a backward that needs them (here exp's, which saves its output) sees their
    version changed and raises, instead of using the gradient as if it were the logits."""
    x = torch.randn(4, 10, requires_grad=True)
    saved = x.exp()
    loss = in_place_cross_entropy(saved, torch.zeros(4, dtype=torch.long))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_the_default_loss_overwrites_only_logits_nothing_keeps():
    """next_token_loss takes the in-place loss for a head's matmul output, the upcast one for logits a tanh keeps
    (the loss would otherwise fail its backward) and for logits without a gradient (validation): the same value."""
    from zplan.model.model_file import next_token_loss

    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 6, 8, generator=generator, requires_grad=True)
    weight = torch.randn(40, 8, generator=generator, requires_grad=True)
    tokens = torch.randint(0, 40, (2, 6), generator=generator)
    want = F.cross_entropy((hidden @ weight.t())[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    made = hidden @ weight.t()
    assert cross_entropy.can_overwrite(made) and not cross_entropy.can_overwrite(torch.tanh(made))
    for logits in (made, torch.tanh(hidden @ weight.t()) * 1, (hidden @ weight.t()).detach()):
        reference_value = F.cross_entropy(logits.detach()[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        loss = next_token_loss(logits, tokens)
        assert loss.item() == pytest.approx(reference_value.item(), rel=1e-6)
        if loss.requires_grad:
            loss.backward()  # no "modified by an inplace operation"
    assert want.item() == pytest.approx(next_token_loss(hidden @ weight.t(), tokens).item(), rel=1e-6)



@pytest.fixture
def world_of_one():
    """A gloo group of this process alone, destroyed after the test (a later test, a dry run's fake world, needs a
    process without one)."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()


@pytest.mark.parametrize("split", [False, True])
def test_an_fp16_loss_scale_over_fp16s_range_scales_the_gradient_in_fp32(split, request):
    """A loss scaler's fp16 backward: (loss * 2**16).backward(), a factor fp16 cannot hold (its largest is 65504),
    though the scaled gradient, 2**16 * (softmax - one-hot) / tokens, fits. The in-place gradient is scaled in fp32 and
    rounded once, as F.cross_entropy on the fp32 upcast rounds it: finite, and equal to the reference's within fp16's
    rounding. The split loss on a tp group of one rank too."""
    scale = 2.0**16
    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(64, 512, generator=generator) * 2).half()
    targets = torch.randint(0, 512, (64,), generator=generator)
    _, want = reference(logits, targets)
    head_output = logits.clone().requires_grad_(True)
    if split:
        group = request.getfixturevalue("world_of_one")
        loss = cross_entropy.vocab_parallel_cross_entropy(head_output * 1, targets, group, 0)
    else:
        loss = in_place_cross_entropy(head_output * 1, targets)
    (loss * scale).backward()
    got = head_output.grad.float() / scale
    assert torch.isfinite(head_output.grad).all()
    torch.testing.assert_close(got, want.float(), rtol=2e-3, atol=1e-7)
