"""integrations.linear_cross_entropy: the loss and the gradients of F.cross_entropy on hidden @ weightᵀ, chunk by
chunk: float32 to 1e-5; bfloat16 as close to float64 as F.cross_entropy on bfloat16 logits upcast to float32 (what
Hugging Face computes); ignored targets, reductions, frozen weights, no-grad, bad arguments; on the GPU, a
32000-class head and its peak memory."""
import pytest
import torch
import torch.nn.functional as F

from tests.utils import rel_error
from transformer_fp8.integrations import linear_cross_entropy


def reference(hidden, weight, targets, **kwargs):
    """(loss, dhidden, dweight) of F.cross_entropy on the logits upcast to float32, as Hugging Face computes them."""
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    loss = F.cross_entropy((hidden @ weight.t()).float().flatten(0, -2), targets.flatten(), **kwargs)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


def ours(hidden, weight, targets, **kwargs):
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    loss = linear_cross_entropy(hidden, weight, targets, **kwargs)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


def problem(shape=(3, 50), hidden_size=32, vocab=300, dtype=torch.float32, device="cpu", ignored=7):
    hidden = torch.randn(*shape, hidden_size, device=device).to(dtype)
    weight = (torch.randn(vocab, hidden_size, device=device) * 2 / hidden_size ** 0.5).to(dtype)
    targets = torch.randint(0, vocab, shape, device=device)
    targets.view(-1)[torch.randperm(targets.numel(), device=device)[:ignored]] = -100
    return hidden, weight, targets


@pytest.mark.parametrize("chunk_size", [1, 16, 37, 150, 1000])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_float32_equals_cross_entropy_at_every_chunk_size(chunk_size, reduction):
    hidden, weight, targets = problem()
    expected = reference(hidden, weight, targets, reduction=reduction)
    got = ours(hidden, weight, targets, reduction=reduction, chunk_size=chunk_size)
    assert got[0].dtype == torch.float32 and got[1].shape == hidden.shape and got[2].shape == weight.shape
    for what, a, b in zip(("loss", "dhidden", "dweight"), got, expected):
        assert rel_error(a, b) < 1e-5, what


def test_ignored_tokens_get_no_gradient_and_count_for_nothing():
    hidden, weight, targets = problem(shape=(40,), ignored=0)
    targets[:10] = 5
    targets[30:] = -1
    loss, dhidden, _ = ours(hidden, weight, targets, ignore_index=-1, chunk_size=16)
    assert torch.equal(dhidden[30:], torch.zeros_like(dhidden[30:]))
    assert rel_error(loss, F.cross_entropy((hidden[:30] @ weight.t()), targets[:30])) < 1e-6


def test_bfloat16_as_close_to_float64_as_the_unchunked_bfloat16_loss():
    hidden, weight, targets = problem(shape=(4, 256), hidden_size=64, vocab=2000, dtype=torch.bfloat16)
    exact = reference(hidden.double(), weight.double(), targets)
    unchunked = reference(hidden, weight, targets)
    got = ours(hidden, weight, targets, chunk_size=128)  # 8 chunks: dweight summed with 8 bfloat16 roundings
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    assert rel_error(got[0], exact[0]) < 2 * rel_error(unchunked[0], exact[0]) + 1e-5
    for what, i in (("dhidden", 1), ("dweight", 2)):
        assert rel_error(got[i], exact[i]) < 2 * rel_error(unchunked[i], exact[i]), what


def test_frozen_weight_no_grad_and_all_ignored():
    hidden, weight, targets = problem()
    leaf = hidden.clone().requires_grad_()
    loss = linear_cross_entropy(leaf, weight, targets, chunk_size=64)  # weight does not require grad
    loss.backward()
    assert weight.grad is None and rel_error(leaf.grad, reference(hidden, weight, targets)[1]) < 1e-5
    with torch.no_grad():
        assert torch.equal(linear_cross_entropy(leaf, weight, targets, chunk_size=64), loss.detach())
    nothing = torch.full_like(targets, -100)
    loss, dhidden, dweight = ours(hidden, weight, nothing)
    assert loss.isnan() and not dhidden.any() and not dweight.any()  # as F.cross_entropy


def test_a_second_backward_through_one_forward_is_refused():
    hidden, weight, targets = problem()
    loss = linear_cross_entropy(hidden.requires_grad_(), weight, targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


@pytest.mark.parametrize("change, error, match", [
    (dict(weight=torch.randn(10, 31)), ValueError, "weight: expected \\[V, 32\\]"),
    (dict(weight=torch.randn(10, 32, dtype=torch.float64)), TypeError, "weight: expected torch.float32"),
    (dict(hidden=torch.randint(0, 5, (3, 50, 32))), TypeError, "hidden: expected a floating-point"),
    (dict(targets=torch.zeros(3, 50, dtype=torch.int32)), TypeError, "targets: expected an int64"),
    (dict(targets=torch.zeros(150, dtype=torch.long)), ValueError, "targets: expected shape \\(3, 50\\)"),
    (dict(reduction="none"), ValueError, "reduction"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
])
def test_bad_arguments_are_named(change, error, match):
    hidden, weight, targets = problem()
    args = {**dict(hidden=hidden, weight=weight, targets=targets), **change}
    with pytest.raises(error, match=match):
        linear_cross_entropy(**args)


@pytest.mark.gpu
def test_cuda_lm_head_of_32000_classes_matches_and_holds_no_logits():
    hidden, weight, targets = problem(shape=(4, 1024), hidden_size=1024, vocab=32000, dtype=torch.bfloat16,
                                      device="cuda", ignored=100)
    exact = reference(hidden.double(), weight.double(), targets)
    unchunked = reference(hidden, weight, targets)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    got = ours(hidden, weight, targets)  # 4 chunks of 1024 tokens
    extra = torch.cuda.max_memory_allocated() - before
    logits_fp32 = 4096 * 32000 * 4
    # expected ~0.65 (two float32 chunk buffers, the gradients); F.cross_entropy holds ~3.5
    assert extra < logits_fp32, extra / 2**20
    assert rel_error(got[0], exact[0]) < 2 * rel_error(unchunked[0], exact[0]) + 1e-5
    for what, i in (("dhidden", 1), ("dweight", 2)):
        assert rel_error(got[i], exact[i]) < 2 * rel_error(unchunked[i], exact[i]) + 1e-3, what
