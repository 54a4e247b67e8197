"""cross_entropy_chunk: the CPU reference and the CUDA kernel against float64 log-softmax math, ignored rows, the
gradient's dtypes and layouts, bad inputs, opcheck."""
import pytest
import torch

import transformer_fp8  # noqa: F401  (registers the ops)
from tests.utils import assert_close_rel

ops = torch.ops.transformer_fp8
IGNORE = -100
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The gradient is rounded once to its dtype; float32: a few ulps of exp / log.
GRAD_RTOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def reference(logits, targets, ignore_index):
    """float64 (loss_rows, dlogits): -log_softmax at the target and softmax - onehot; 0 and zeros for ignored rows."""
    x = logits.double()
    logprobs = torch.log_softmax(x, dim=-1)
    counted = targets != ignore_index
    index = torch.where(counted, targets, 0)[:, None]
    loss = torch.where(counted, -logprobs.gather(1, index).squeeze(1), 0.0)
    onehot = torch.zeros_like(x).scatter_(1, index, counted.double()[:, None])
    return loss, torch.where(counted[:, None], logprobs.exp() - onehot, 0.0)


def random_case(rows, cols, device, spread=4.0):
    logits = torch.randn(rows, cols, device=device) * spread
    targets = torch.randint(0, cols, (rows,), device=device)
    targets[::3] = IGNORE  # every third row ignored
    return logits, targets


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("rows, cols", [(7, 4096), (5, 1001), (64, 32000), (1, 3)])
def test_matches_float64(device, grad_dtype, rows, cols):
    """Fresh random logits (4-wide rows and rows of an odd width), every third row ignored: the loss per row within
    float32 ulps of float64, the gradient within one rounding to its dtype, ignored rows' loss 0 and gradient zeros."""
    torch.manual_seed(rows * cols)
    logits, targets = random_case(rows, cols, device)
    loss_rows, dlogits = ops.cross_entropy_chunk(logits, targets, IGNORE, grad_dtype)
    ref_loss, ref_grad = reference(logits, targets, IGNORE)
    assert loss_rows.dtype == torch.float32 and dlogits.dtype == grad_dtype and dlogits.shape == logits.shape
    assert_close_rel(loss_rows, ref_loss, 1e-5, "loss_rows")
    assert torch.all(loss_rows[targets == IGNORE] == 0) and torch.all(dlogits[targets == IGNORE] == 0)
    assert_close_rel(dlogits, ref_grad, GRAD_RTOL[grad_dtype], "dlogits")
    # each row of the gradient sums to 0, up to its rounding
    sums = dlogits.double().sum(-1)
    assert torch.allclose(sums, torch.zeros_like(sums), atol=cols * GRAD_RTOL[grad_dtype] / 4 + 1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_target_column_rounded_once(device):
    """A target holding almost all the probability: its gradient p - 1 is formed in float32 before rounding, so the
    bf16 value is the float32 one rounded (p rounded to bf16 first would give exactly 0). (p itself is a float32 a few
    ulps below 1: p - 1 is within one float32 spacing at 1 of the exact value.)"""
    logits = torch.full((2, 64), -20.0, device=device)
    logits[:, 5] = 0.0
    targets = torch.tensor([5, 5], device=device)
    _, dlogits = ops.cross_entropy_chunk(logits, targets, IGNORE, torch.bfloat16)
    p = torch.softmax(logits.double(), -1)[0, 5]
    assert dlogits[0, 5].item() != 0.0
    assert abs(dlogits[0, 5].item() - (p - 1).item()) <= 2**-24 + 8e-3 * abs((p - 1).item())


@pytest.mark.parametrize("device", DEVICES)
def test_loss_only_and_strided_rows(device):
    """grad_dtype None: the loss alone and an empty gradient; rows of a wider buffer (row stride > classes)."""
    torch.manual_seed(1)
    wide = torch.randn(6, 300, device=device)
    logits = wide[:, :256]
    targets = torch.randint(0, 256, (6,), device=device)
    loss_rows, dlogits = ops.cross_entropy_chunk(logits, targets, IGNORE, None)
    assert dlogits.numel() == 0
    assert_close_rel(loss_rows, reference(logits, targets, IGNORE)[0], 1e-5, "loss_rows")


@pytest.mark.parametrize("device", DEVICES)
def test_nan_poisons_only_its_row(device):
    logits = torch.randn(3, 128, device=device)
    logits[1, 7] = float("nan")
    targets = torch.tensor([1, 2, 3], device=device)
    loss_rows, dlogits = ops.cross_entropy_chunk(logits, targets, IGNORE, torch.float32)
    assert torch.isnan(loss_rows[1]) and torch.isfinite(loss_rows[[0, 2]]).all()
    assert torch.isnan(dlogits[1]).any() and torch.isfinite(dlogits[[0, 2]]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_empty_rows(device):
    loss_rows, dlogits = ops.cross_entropy_chunk(torch.empty(0, 10, device=device),
                                                 torch.empty(0, dtype=torch.long, device=device), IGNORE,
                                                 torch.bfloat16)
    assert loss_rows.shape == (0,) and dlogits.shape == (0, 10)


@pytest.mark.gpu
def test_cuda_matches_cpu_reference():
    torch.manual_seed(2)
    logits, targets = random_case(33, 32000, "cpu")
    cpu_loss, cpu_grad = ops.cross_entropy_chunk(logits, targets, IGNORE, torch.bfloat16)
    loss, grad = ops.cross_entropy_chunk(logits.cuda(), targets.cuda(), IGNORE, torch.bfloat16)
    assert_close_rel(loss.cpu(), cpu_loss, 2e-6, "loss_rows")
    flipped = (grad.cpu() != cpu_grad).float().mean().item()
    assert flipped < 1e-3, f"{flipped:.2e} of the bf16 gradient differs from the CPU reference's"


def _bad():
    logits, targets = torch.randn(4, 16), torch.tensor([1, 2, 3, 4])
    return [
        (lambda: ops.cross_entropy_chunk(logits.double(), targets, IGNORE, None), "logits: expected a float32"),
        (lambda: ops.cross_entropy_chunk(logits[0], targets, IGNORE, None), r"logits: expected a 2-D tensor"),
        (lambda: ops.cross_entropy_chunk(logits, targets.int(), IGNORE, None), "targets: expected an int64"),
        (lambda: ops.cross_entropy_chunk(logits, targets[:3], IGNORE, None), r"targets: expected shape \(4,\)"),
        (lambda: ops.cross_entropy_chunk(logits, targets, IGNORE, torch.float8_e4m3fn), "grad_dtype: expected"),
        (lambda: ops.cross_entropy_chunk(logits, torch.tensor([1, 2, 16, 4]), IGNORE, None),
         r"targets: expected values in \[0, 16\)"),
        (lambda: ops.cross_entropy_chunk(torch.randn(2, 0), torch.tensor([0, 0]), IGNORE, None),
         "logits: expected at least one class"),
    ]


@pytest.mark.parametrize("case", range(len(_bad())))
def test_bad_inputs_raise(case):
    call, match = _bad()[case]
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        call()


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    logits, targets = random_case(8, 96, device)
    for grad_dtype in (None, torch.bfloat16):
        torch.library.opcheck(ops.cross_entropy_chunk.default, (logits, targets, IGNORE, grad_dtype))
