"""The op inference_cast (csrc/quantize_inference.cu, CPU reference transformer_fp8/cpu/inference.py): the input
cast of an FP8-weight Linear's inference with its scaling bookkeeping in one launch.

- Bit for bit the sequence of ops it stands for (current: compute_amax, delayed_scaling_update, cast_transpose;
  delayed: cast_transpose, then with the state arguments the backup copies and delayed_scaling_update), every
  tensor it writes included, on the CPU and on the GPU, over dtypes, sizes that do and do not fill whole 16-element
  chunks, many blocks (the cooperative launch's barriers), history lengths, both amax algorithms, a margin, inputs
  whose amax is zero or NaN (the scale kept), aliasing slots (scale and amax as elements of the state, as the module
  passes them).
- ScalingState.undo_inline_update puts back exactly what the update replaced.
- opcheck, clear errors.
"""
import pytest
import torch

from tests.utils import scalar
from transformer_fp8.recipe import DelayedScaling
from transformer_fp8.quantization.state import ScalingState

ops = torch.ops.transformer_fp8
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}


def make_state(device, history_len, slots=3, seed=0):
    """A forward state as a module holds it, with a random history (row 0: this step's amaxes so far) and scales."""
    g = torch.Generator().manual_seed(seed)
    state = ScalingState(slots, history_len, device)
    state.amax_history.copy_(torch.rand(history_len, slots, generator=g).to(device) * 4)
    state.scale.copy_(torch.rand(slots, generator=g).to(device) * 100 + 1)
    state.scale_inv.copy_(1.0 / state.scale)
    return state


def reference(x, scale, fp8_dtype, amax, scale_inv, current, fp8_max, state=None, margin=0.0, algo="max"):
    """inference_cast's contract, op by op."""
    x2 = x.reshape(-1, x.shape[-1])
    if current:
        ops.compute_amax(x2, amax)
        ops.delayed_scaling_update([amax.view(1, 1)], [scale.view(1)], [scale_inv.view(1)], fp8_max, 0.0,
                                   "most_recent")
    q = ops.cast_transpose(x2, scale, fp8_dtype, True, False, None if current else amax, scale_inv)[0]
    backup = None
    if state is not None:
        h = state.amax_history
        backup = torch.stack([h[0], h[-1], state.scale, state.scale_inv])
        ops.delayed_scaling_update([h], [state.scale], [state.scale_inv], fp8_max, margin, algo)
    return q.view(x.shape), backup


def bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(24, 48), (7, 13), (512, 1280)])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_current_scaling_equals_its_op_sequence(device, dtype, shape, fp8_dtype):
    x = torch.randn(*shape, device=device).to(dtype) * 3
    fp8_max = FP8_MAX[fp8_dtype]
    args = [scalar(7.0, device), scalar(0.0, device), scalar(0.5, device)]
    ref_args = [t.clone() for t in args]
    q = ops.inference_cast(x, args[0], fp8_dtype, args[1], args[2], True, fp8_max)
    ref, _ = reference(x, ref_args[0], fp8_dtype, ref_args[1], ref_args[2], True, fp8_max)
    assert q.dtype == fp8_dtype and q.shape == x.shape
    assert torch.equal(bits(q), bits(ref))
    for ours, theirs in zip(args, ref_args):
        assert torch.equal(bits(ours), bits(theirs))
    assert args[1].item() == 0.0  # (the amax zeroed again for the next call)
    assert args[0].item() == pytest.approx(fp8_max / x.double().abs().max().item(), rel=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fill", [0.0, float("nan")])
def test_current_scaling_keeps_the_scale_without_a_usable_amax(device, fill):
    x = torch.full((16, 64), fill, device=device, dtype=torch.bfloat16)
    scale, amax, scale_inv = scalar(5.0, device), scalar(0.0, device), scalar(0.0, device)
    q = ops.inference_cast(x, scale, E4M3, amax, scale_inv, True, 448.0)
    ref_scale, ref_amax, ref_scale_inv = scalar(5.0, device), scalar(0.0, device), scalar(0.0, device)
    ref, _ = reference(x, ref_scale, E4M3, ref_amax, ref_scale_inv, True, 448.0)
    assert scale.item() == 5.0 and scale_inv.item() == pytest.approx(0.2) and amax.item() == 0.0
    assert torch.equal(scale_inv, ref_scale_inv) and torch.equal(amax, ref_amax)
    assert torch.equal(bits(q), bits(ref))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(24, 48), (3, 7, 13), (512, 5120)])
@pytest.mark.parametrize("history_len,algo,margin", [(1, "max", 0.0), (4, "max", 0.0), (16, "most_recent", 1.0),
                                                     (2, "max", 2.0)])
def test_delayed_update_equals_its_op_sequence(device, dtype, shape, history_len, algo, margin):
    x = torch.randn(*shape, device=device).to(dtype) * 5
    state, ref_state = make_state(device, history_len), make_state(device, history_len)
    slot = 1  # (scale and amax: elements of the state, as the module passes them)
    snapshot, ref_snapshot = scalar(0.0, device), scalar(0.0, device)
    backup = torch.full((4, 3), -1.0, device=device)
    q = ops.inference_cast(x, state.scales[slot], E4M3, state.amaxes[slot], snapshot, False, 448.0,
                           state.amax_history, state.scale, state.scale_inv, backup, margin, algo)
    ref, ref_backup = reference(x, ref_state.scales[slot], E4M3, ref_state.amaxes[slot], ref_snapshot, False, 448.0,
                                ref_state, margin, algo)
    assert torch.equal(bits(q), bits(ref))
    assert torch.equal(bits(backup), bits(ref_backup))
    assert torch.equal(bits(snapshot), bits(ref_snapshot))
    for name in ("amax_history", "scale", "scale_inv"):
        assert torch.equal(bits(getattr(state, name)), bits(getattr(ref_state, name))), name
    # the cast's amax went into the history before the roll
    newest = max(make_state(device, history_len).amax_history[0, slot].item(), x.double().abs().max().item())
    row = 1 if history_len > 1 else 0
    assert state.amax_history[row, slot].item() == (pytest.approx(newest, rel=1e-6) if row else 0.0)


@pytest.mark.parametrize("device", DEVICES)
def test_delayed_cast_without_state_is_the_plain_cast(device):
    x = torch.randn(40, 96, device=device, dtype=torch.bfloat16)
    scale, amax, snapshot = scalar(30.0, device), scalar(1.0, device), scalar(0.0, device)
    q = ops.inference_cast(x, scale, E4M3, amax, snapshot, False, 448.0)
    ref_amax, ref_snapshot = scalar(1.0, device), scalar(0.0, device)
    ref = ops.cast_transpose(x, scalar(30.0, device), E4M3, True, False, ref_amax, ref_snapshot)[0]
    assert torch.equal(bits(q), bits(ref)) and torch.equal(amax, ref_amax) and torch.equal(snapshot, ref_snapshot)
    assert scale.item() == 30.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("history_len", [1, 2, 5])
@pytest.mark.parametrize("nan_input", [False, True])
def test_undo_puts_back_the_state(device, history_len, nan_input):
    state = make_state(device, history_len)
    before = {name: getattr(state, name).clone() for name in ("amax_history", "scale", "scale_inv")}
    x = torch.randn(16, 64, device=device, dtype=torch.bfloat16)
    if nan_input:
        x[3, 5] = float("nan")
    snapshot = scalar(0.0, device)
    ops.inference_cast(x, state.scales[0], E4M3, state.amaxes[0], snapshot, False, 448.0,
                       *state.inline_update_args(DelayedScaling())[:4], 0.0, "max")
    state.updated_inline = True
    # what the cast alone leaves (the amax accumulated into row 0, NaN included), which the exit's update would see
    expected = before["amax_history"].clone()
    ops.compute_amax(x, expected[0, 0:1])
    state.undo_inline_update()
    assert not state.updated_inline
    assert torch.equal(bits(state.amax_history), bits(expected))
    assert torch.equal(state.scale, before["scale"]) and torch.equal(state.scale_inv, before["scale_inv"])


@pytest.mark.parametrize("device", DEVICES)
def test_empty_input(device):
    x = torch.empty(0, 32, device=device, dtype=torch.bfloat16)
    scale, amax, scale_inv = scalar(4.0, device), scalar(0.0, device), scalar(0.0, device)
    assert ops.inference_cast(x, scale, E4M3, amax, scale_inv, True, 448.0).shape == (0, 32)
    assert scale.item() == 4.0 and scale_inv.item() == 0.25
    state, ref_state = make_state(device, 3), make_state(device, 3)
    backup = torch.empty(4, 3, device=device)
    ops.inference_cast(x, state.scales[0], E4M3, state.amaxes[0], scale_inv, False, 448.0, state.amax_history,
                       state.scale, state.scale_inv, backup, 0.0, "max")
    _, ref_backup = reference(x, ref_state.scales[0], E4M3, ref_state.amaxes[0], scalar(0.0, device), False, 448.0,
                              ref_state)
    assert torch.equal(backup, ref_backup) and torch.equal(state.amax_history, ref_state.amax_history)
    assert torch.equal(state.scale, ref_state.scale)


def opcheck_args(device, with_state):
    state = make_state(device, 4)
    args = (torch.randn(16, 64, device=device, dtype=torch.bfloat16), scalar(3.0, device), E4M3,
            scalar(0.0, device), scalar(0.0, device), not with_state, 448.0)
    if with_state:  # (separate tensors here: opcheck clones arguments, which would break the aliasing)
        args += (state.amax_history, state.scale, state.scale_inv, torch.zeros(4, 3, device=device), 0.0, "max")
    return args


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_state", [False, True])
def test_opcheck(device, with_state):
    # (test_schema compares inputs with torch.allclose, which has no float8 kernel; see test_gemm.py)
    torch.library.opcheck(ops.inference_cast.default, opcheck_args(device, with_state),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(x=a["x"].t()), "x: expected a contiguous"),
    (lambda a: a.update(x=a["x"][0, 0]), "x: expected a .*at least one dim"),
    (lambda a: a.update(x=a["x"].to(torch.int32)), "x: expected"),
    (lambda a: a.update(fp8_dtype=torch.float16), "fp8_dtype"),
    (lambda a: a.update(scale=torch.ones(2, device=a["x"].device)), "scale: expected one element"),
    (lambda a: a.update(amax=torch.ones(1, dtype=torch.float16, device=a["x"].device)), "amax: expected a float32"),
    (lambda a: a.update(backup=None), "expected all four"),
    (lambda a: a.update(current_scaling=True), "for delayed scaling"),
    (lambda a: a.update(amax_compute_algo="mean"), "amax_compute_algo: expected one of"),
    (lambda a: a.update(backup=torch.zeros(3, 3, device=a["x"].device)), r"backup: expected a contiguous float32"),
    (lambda a: a.update(state_scale=torch.zeros(2, device=a["x"].device)), "state_scale: expected"),
])
def test_bad_arguments(device, change, message):
    state = make_state(device, 4)
    args = dict(x=torch.randn(16, 64, device=device, dtype=torch.bfloat16), scale=scalar(3.0, device),
                fp8_dtype=E4M3, amax=scalar(0.0, device), scale_inv=scalar(0.0, device), current_scaling=False,
                fp8_max=448.0, history=state.amax_history, state_scale=state.scale, state_scale_inv=state.scale_inv,
                backup=torch.zeros(4, 3, device=device), margin=0.0, amax_compute_algo="max")
    change(args)
    with pytest.raises((RuntimeError, ValueError, TypeError), match=message):
        ops.inference_cast(**args)
