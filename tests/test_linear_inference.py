"""The inference path of a Linear with FP8 weights (fp8_model_init) under no_grad: module.linear.INFERENCE_PATH,
the op fp8_linear_inference (csrc/linear_inference.cpp).

- The op: bit for bit the sequence of ops it stands for (delayed: one cast with the known scale, with the state's
  update when given; current: amax, the scale's update, the cast), the scaling tensors written as those ops write
  them, opcheck, clear errors.
- The module: outputs and scaling state bit for bit those of the autograd Function's path (INFERENCE_PATH False)
  under delayed and current scaling, with and without bias, 2-D and 3-D inputs, float16 / bfloat16 / float32; within
  FP8 tolerance of float64; the path is taken exactly where it should be (no_grad, calibrated delayed state) and the
  Function's path everywhere else; delayed scaling records the input's amax for the next update (the op updates the
  state inline; several calls in one autocast, a training forward among them, and nested autocasts end in the
  state the exit's one update gives); bad inputs get clear errors.
"""
import pytest
import torch

import transformer_fp8 as te
from tests.test_inference_cast import make_state
from tests.utils import FP8_RTOL, OpNames, rel_error, scalar
from transformer_fp8 import recipe
from transformer_fp8.module import linear as linear_module

ops = torch.ops.transformer_fp8
E4M3 = torch.float8_e4m3fn
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
RECIPES = {"delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling}


# --- the op ---------------------------------------------------------------------------------------------------------
def op_args(device, current, m=24, k=48, n=32, dtype=torch.bfloat16, bias=True, lead=()):
    """fp8_linear_inference's arguments: a random x [*lead, m, k], an FP8 weight [n, k] with its scale_inv."""
    w = torch.randn(n, k, device=device) / k ** 0.5
    w_scale_inv = scalar(w.abs().max().item() / 448.0, device)
    return dict(x=torch.randn(*lead, m, k, dtype=dtype, device=device) * 3, w=(w / w_scale_inv).to(E4M3),
                w_scale_inv=w_scale_inv, x_scale=scalar(1.0 if current else 100.0, device), fp8_dtype=E4M3,
                x_amax=scalar(0.0, device), x_scale_inv=scalar(0.0, device),
                bias=torch.randn(n, dtype=dtype, device=device) if bias else None, current_scaling=current,
                fp8_max=448.0)


def stepwise(a):
    """fp8_linear_inference's contract, op by op (as the module's Function path runs them)."""
    x = a["x"].reshape(-1, a["x"].shape[-1])
    amax = a["x_amax"]
    if a["current_scaling"]:
        ops.compute_amax(x, amax)
        ops.delayed_scaling_update([amax.view(1, 1)], [a["x_scale"]], [a["x_scale_inv"]], a["fp8_max"], 0.0,
                                   "most_recent")
        amax = None
    xq = ops.cast_transpose(x, a["x_scale"], a["fp8_dtype"], True, False, amax, a["x_scale_inv"])[0]
    bias = a["bias"]
    out_dtype = a["x"].dtype
    out = ops.fp8_gemm(xq, a["x_scale_inv"], a["w"], a["w_scale_inv"], out_dtype,
                       None if bias is None or out_dtype == torch.float32 else bias.to(out_dtype),
                       use_split_accumulator=False)[0]
    if bias is not None and out_dtype == torch.float32:
        out = out + bias
    return out.view(*a["x"].shape[:-1], out.shape[-1])


def clone_args(args):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("current", [False, True])
@pytest.mark.parametrize("dtype,bias,lead", [(torch.bfloat16, True, ()), (torch.float16, False, (3,)),
                                             (torch.float32, True, (2,))])
def test_op_equals_its_op_sequence(device, current, dtype, bias, lead):
    args = op_args(device, current, dtype=dtype, bias=bias, lead=lead)
    ref_args = clone_args(args)
    out = ops.fp8_linear_inference(**args)
    ref = stepwise(ref_args)
    assert out.dtype == dtype and out.shape == ref.shape == (*lead, 24, 32)
    assert torch.equal(out, ref)
    for name in ("x_scale", "x_amax", "x_scale_inv"):
        assert torch.equal(args[name], ref_args[name]), name
    x64 = args["x"].double()
    if current:  # the scale came from this x's amax; the update zeroed the amax again
        assert args["x_scale"].item() == pytest.approx(448.0 / x64.abs().max().item(), rel=1e-6)
        assert args["x_amax"].item() == 0.0
    else:  # the known scale kept, the amax max-accumulated
        assert args["x_scale"].item() == 100.0
        assert args["x_amax"].item() == pytest.approx(x64.abs().max().item(), rel=1e-6)
    assert args["x_scale_inv"].item() == pytest.approx(1.0 / args["x_scale"].item(), rel=1e-6)
    # and it is a linear layer: within FP8 tolerance of the float64 result (current scaling: E4M3 fits this x)
    w64 = args["w"].double() * args["w_scale_inv"].double()
    ref64 = x64 @ w64.t() + (args["bias"].double() if bias else 0)
    if current:
        assert rel_error(out, ref64) < FP8_RTOL[E4M3]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_op_with_the_delayed_update(device, dtype):
    # the state's update in the op's cast launch: the op sequence, then delayed_scaling_update of the whole state
    args = op_args(device, False, dtype=dtype, lead=(2,))
    state, ref_state = make_state(device, 4), make_state(device, 4)
    args.update(x_scale=state.scales[0], x_amax=state.amaxes[0])
    backup = torch.zeros(4, 3, device=device)
    out = ops.fp8_linear_inference(**args, history=state.amax_history, state_scale=state.scale,
                                   state_scale_inv=state.scale_inv, backup=backup, margin=1.0,
                                   amax_compute_algo="most_recent")
    ref_args = clone_args(args)
    ref_args.update(x_scale=ref_state.scales[0], x_amax=ref_state.amaxes[0])
    ref = stepwise(ref_args)
    h = ref_state.amax_history
    ref_backup = torch.stack([h[0], h[-1], ref_state.scale, ref_state.scale_inv])
    ops.delayed_scaling_update([h], [ref_state.scale], [ref_state.scale_inv], 448.0, 1.0, "most_recent")
    assert torch.equal(out, ref) and torch.equal(backup, ref_backup)
    assert torch.equal(args["x_scale_inv"], ref_args["x_scale_inv"])
    for name in ("amax_history", "scale", "scale_inv"):
        assert torch.equal(getattr(state, name), getattr(ref_state, name)), name


def entry_args(a, state=None, backup=None):
    """_C.linear_inference's positional arguments from op_args' dict (+ a delayed state's update arguments)."""
    update = (None, None, None, None, 0.0, True) if state is None else (
        state.amax_history, state.scale, state.scale_inv, backup, 1.0, False)
    return (a["x"], a["w"], a["w_scale_inv"], a["x_scale"], a["fp8_dtype"], a["x_amax"], a["x_scale_inv"], a["bias"],
            a["current_scaling"], a["fp8_max"], *update)




@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("current", [False, True])
@pytest.mark.parametrize("dtype,bias,k,n,lead", [
    (torch.bfloat16, True, 64, 32, ()), (torch.float16, True, 48, 128, (2,)), (torch.bfloat16, False, 64, 32, ()),
    (torch.float32, True, 64, 32, ()),   # float32 output: bias added after the GEMM
    (torch.bfloat16, True, 40, 24, ()),  # K, N to pad: the direct GEMM declines, fp8_gemm pads
])
@pytest.mark.parametrize("delayed_update", [False, True])
def test_direct_entry_equals_the_dispatcher_path(device, current, dtype, bias, k, n, lead, delayed_update):
    # _C.linear_inference calls the CUDA kernels' entries without the dispatcher (plain CUDA tensors, no dispatch
    # mode, no profiler): output, scaling tensors, state and backup bit for bit those of the dispatcher's op, which
    # runs under a dispatch mode (that sees our ops) and under the profiler (that records the op). (On the CPU every
    # call takes the dispatcher: there the test checks itself.)
    if current and delayed_update:
        pytest.skip("the state's update is delayed scaling's")
    from transformer_fp8 import _C
    torch.manual_seed(0)
    base = op_args(device, current, k=k, n=n, dtype=dtype, bias=bias, lead=lead)
    runs = []
    for how in ("direct", "op", "mode", "profiler"):
        a = clone_args(base)
        state = make_state(device, 4) if delayed_update else None
        backup = torch.zeros(4, 3, device=device) if delayed_update else None
        if state is not None:
            a.update(x_scale=state.scales[0], x_amax=state.amaxes[0])
        if how == "direct":
            out = _C.linear_inference(*entry_args(a, state, backup))
        elif how == "op":
            update = {} if state is None else dict(history=state.amax_history, state_scale=state.scale,
                                                   state_scale_inv=state.scale_inv, backup=backup, margin=1.0,
                                                   amax_compute_algo="most_recent")
            out = ops.fp8_linear_inference(**a, **update)
        elif how == "mode":
            with OpNames() as seen:
                out = _C.linear_inference(*entry_args(a, state, backup))
            # (the mode sees the composite op or, where it decomposes first, the ops inside it)
            assert any("transformer_fp8" in name for name in seen.names), seen.names
        else:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                out = _C.linear_inference(*entry_args(a, state, backup))
            names = {e.key for e in prof.key_averages()}
            assert "transformer_fp8::fp8_linear_inference" in names, sorted(names)
        kept = [a["x_scale"], a["x_amax"], a["x_scale_inv"]]
        if state is not None:
            kept += [state.amax_history, state.scale, state.scale_inv, backup]
        runs.append((how, out, kept))
    _, ref, ref_kept = runs[1]
    assert ref.dtype == dtype and ref.shape == (*lead, 24, n)
    for how, out, kept in runs:
        assert torch.equal(out, ref), how
        for got, want in zip(kept, ref_kept):
            assert torch.equal(got, want), how


@pytest.mark.parametrize("current", [False, True])
def test_opcheck_cpu(current):
    # (test_schema compares inputs with torch.allclose, which has no float8 kernel; see test_gemm.py)
    torch.library.opcheck(ops.fp8_linear_inference.default, (), op_args("cpu", current, lead=(2,)),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(w=a["w"].float()), "w: expected an FP8"),
    (lambda a: a.update(x=a["x"][:, :40].contiguous()), "x: expected last dim 48"),
    (lambda a: a.update(x=a["x"].t().contiguous().t()), "x: expected a contiguous tensor"),
    (lambda a: a.update(x=a["x"].to(torch.int32)), "x: expected float32, float16 or bfloat16"),
    (lambda a: a.update(bias=a["bias"][:5]), r"bias: expected shape \[32\]"),
    (lambda a: a.update(w_scale_inv=torch.ones(2)), "w_scale_inv: expected one float32 element"),
])
def test_op_bad_arguments(change, message):
    args = op_args("cpu", False)
    change(args)
    with pytest.raises(RuntimeError, match=message):
        ops.fp8_linear_inference(**args)


# --- the module -----------------------------------------------------------------------------------------------------
class _CountingC:
    """Stands in for transformer_fp8._C in module.linear: counts linear_inference calls, forwards everything."""

    def __init__(self, real):
        self.real, self.inference_calls = real, 0

    def linear_inference(self, *args):
        self.inference_calls += 1
        return self.real.linear_inference(*args)

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.fixture
def counting_c(monkeypatch):
    counter = _CountingC(linear_module._C)
    monkeypatch.setattr(linear_module, "_C", counter)
    return counter


def fp8_linears(device, dtype, bias, count=2, **kwargs):
    """`count` te.Linear(64, 48) with FP8 weights and the same values (the first one's state dict)."""
    with te.fp8_model_init(enabled=True):
        modules = [te.Linear(64, 48, bias=bias, params_dtype=dtype, device=device, **kwargs) for _ in range(count)]
    if bias:
        with torch.no_grad():
            modules[0].bias.normal_()
    for other in modules[1:]:
        other.load_state_dict(modules[0].state_dict())
    return modules


def run_calls(module, xs, fp8_recipe, inference_path, monkeypatch):
    """module(x) for each x, each call in its own fp8_autocast under no_grad, with INFERENCE_PATH set.
    Returns the outputs."""
    monkeypatch.setattr(linear_module, "INFERENCE_PATH", inference_path)
    outs = []
    with torch.no_grad():
        for x in xs:
            with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
                outs.append(module(x))
    return outs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize("dtype,bias,lead", [(torch.bfloat16, True, (16,)), (torch.float16, False, (2, 8)),
                                             (torch.float16, True, (3, 5)), (torch.float32, True, (16,))])
def test_same_as_the_function_path(device, recipe_name, dtype, bias, lead, counting_c, monkeypatch):
    fp8_recipe = RECIPES[recipe_name]()
    new, old = fp8_linears(device, dtype, bias)
    # (growing and shrinking inputs: the delayed scale moves between calls)
    xs = [torch.randn(*lead, 64, dtype=dtype, device=device) * scale for scale in (1.0, 4.0, 0.5, 2.0)]
    outs_new = run_calls(new, xs, fp8_recipe, True, monkeypatch)
    calls = counting_c.inference_calls
    outs_old = run_calls(old, xs, fp8_recipe, False, monkeypatch)
    # the first delayed call calibrates in Python (the Function's path); every other call is one op call
    assert calls == (3 if recipe_name == "delayed" else 4) and counting_c.inference_calls == calls
    for ours, theirs in zip(outs_new, outs_old):
        assert ours.dtype == dtype and ours.shape == (*lead, 48)
        assert torch.equal(ours, theirs)
    for direction in ("fp8_fwd", "fp8_bwd"):
        state_new, state_old = getattr(new, direction).state_dict(), getattr(old, direction).state_dict()
        for name in state_new:
            assert torch.equal(state_new[name], state_old[name]), (direction, name)
    assert new._fp8_call_counts == old._fp8_call_counts == [4, 0]
    # within FP8 tolerance of the float64 result with the FP8 weight's values (delayed: not the second call, whose
    # 4x larger input saturates at the first call's scale, as delayed scaling does)
    w64 = new.weight.dequantize(torch.float32).double()
    for i, (x, out) in enumerate(zip(xs, outs_new)):
        if recipe_name == "delayed" and i == 1:
            continue
        ref = x.double() @ w64.t() + (new.bias.double() if bias else 0)
        assert rel_error(out, ref) < FP8_RTOL[E4M3]


@pytest.mark.parametrize("device", DEVICES)
def test_delayed_scaling_records_the_input_amax(device, counting_c):
    (module,) = fp8_linears(device, torch.bfloat16, True, count=1)
    fp8_recipe = recipe.DelayedScaling(amax_history_len=4)
    with torch.no_grad():
        for scale in (1.0, 1.0, 8.0):
            x = torch.randn(16, 64, dtype=torch.bfloat16, device=device) * scale
            with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
                module(x)
            # the update (the exit's, or the op's own inline one) rolled the input's amax into the history
            assert module.fp8_fwd.amax_history[1, 0].item() == x.abs().max().float().item()
            assert module.fp8_fwd.amax_history[0].abs().sum().item() == 0
            assert not module.fp8_fwd.updated_inline and not te.autocast.STATE.inline_updated
    assert counting_c.inference_calls == 2
    # and made the next scale from it
    amax = x.abs().max().float().item()
    assert module.fp8_fwd.scale[0].item() == pytest.approx(448.0 / amax, rel=1e-6)


def calls_in_one_autocast(module, xs, fp8_recipe, inference_path, monkeypatch, grad_at=None):
    """Several calls of module inside ONE fp8_autocast (the first step outside it, to calibrate the delayed state),
    with INFERENCE_PATH set; call number grad_at runs with grad (a training forward and its backward, after the
    autocast). Returns the outputs and the weight's gradient (None without a training call)."""
    monkeypatch.setattr(linear_module, "INFERENCE_PATH", inference_path)
    with torch.no_grad(), te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        module(xs[0])
    outs, trained = [], None
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        for i, x in enumerate(xs[1:]):
            if i == grad_at:
                trained = module(x)
                outs.append(trained.detach())
            else:
                with torch.no_grad():
                    outs.append(module(x))
    grad = None
    if trained is not None:
        trained.float().square().sum().backward()
        grad = module.weight.grad
    return outs, grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_at", [None, 0, 1, 2])
@pytest.mark.parametrize("history_len,algo", [(1, "max"), (4, "max"), (3, "most_recent")])
def test_several_calls_in_one_autocast(device, grad_at, history_len, algo, counting_c, monkeypatch):
    # The inline update of the first inference call is undone when the state is registered again in the same
    # autocast (a second inference call, or a training forward): outputs, gradients and state as the Function's path.
    fp8_recipe = recipe.DelayedScaling(amax_history_len=history_len, amax_compute_algo=algo)
    new, old = fp8_linears(device, torch.bfloat16, True)
    if grad_at is not None:
        new.weight.requires_grad_(True), old.weight.requires_grad_(True)
    xs = [torch.randn(16, 64, dtype=torch.bfloat16, device=device) * s for s in (1.0, 3.0, 0.25, 6.0)]
    outs_new, grad_new = calls_in_one_autocast(new, xs, fp8_recipe, True, monkeypatch, grad_at)
    outs_old, grad_old = calls_in_one_autocast(old, xs, fp8_recipe, False, monkeypatch, grad_at)
    assert counting_c.inference_calls == (3 if grad_at is None else 2)
    for ours, theirs in zip(outs_new, outs_old):
        assert torch.equal(ours, theirs)
    if grad_at is not None:
        assert torch.equal(grad_new, grad_old)
    for direction in ("fp8_fwd", "fp8_bwd"):
        state_new, state_old = getattr(new, direction).state_dict(), getattr(old, direction).state_dict()
        for name in state_new:
            assert torch.equal(state_new[name], state_old[name]), (direction, name)
    assert not new.fp8_fwd.updated_inline and not te.autocast.STATE.inline_updated


@pytest.mark.parametrize("device", DEVICES)
def test_nested_autocasts_update_once(device, counting_c, monkeypatch):
    fp8_recipe = recipe.DelayedScaling(amax_history_len=4)
    new, old = fp8_linears(device, torch.bfloat16, True)
    xs = [torch.randn(16, 64, dtype=torch.bfloat16, device=device) * s for s in (1.0, 2.0, 0.5)]
    for module, path in ((new, True), (old, False)):
        monkeypatch.setattr(linear_module, "INFERENCE_PATH", path)
        with torch.no_grad():
            with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
                module(xs[0])
            with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
                with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
                    module(xs[1])
                assert module.fp8_fwd.updated_inline == path  # (the flag lasts until the outermost exit)
                with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
                    module(xs[2])
    assert counting_c.inference_calls == 2
    for name, tensor in new.fp8_fwd.state_dict().items():
        assert torch.equal(tensor, old.fp8_fwd.state_dict()[name]), name


@pytest.mark.parametrize("device", DEVICES)
def test_return_bias(device, counting_c, monkeypatch):
    new, old = fp8_linears(device, torch.bfloat16, True, return_bias=True)
    xs = [torch.randn(16, 64, dtype=torch.bfloat16, device=device) for _ in range(2)]
    fp8_recipe = recipe.Float8CurrentScaling()
    monkeypatch.setattr(linear_module, "INFERENCE_PATH", True)
    with torch.no_grad(), te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        out, bias = new(xs[0])
    monkeypatch.setattr(linear_module, "INFERENCE_PATH", False)
    with torch.no_grad(), te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        out_old, bias_old = old(xs[0])
    assert counting_c.inference_calls == 1 and bias is new.bias
    assert torch.equal(out, out_old) and torch.equal(bias, bias_old)


@pytest.mark.parametrize("device", DEVICES)
def test_the_function_path_where_a_gradient_is_needed(device, counting_c):
    (module,) = fp8_linears(device, torch.bfloat16, True, count=1)
    fp8_recipe = recipe.Float8CurrentScaling()
    x = torch.randn(16, 64, dtype=torch.bfloat16, device=device)
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        out = module(x)  # grad mode on: the weight requires grad
    assert out.requires_grad and counting_c.inference_calls == 0
    out.float().sum().backward()
    assert module.weight.grad is not None
    with torch.no_grad(), te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        module(x)
    assert counting_c.inference_calls == 1
    with torch.inference_mode(), te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        module(x)
    assert counting_c.inference_calls == 2
    # frozen weight and bias, input without grad: no gradient needed even with grad mode on
    module.requires_grad_(False)
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        assert not module(x).requires_grad
    assert counting_c.inference_calls == 3
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        module(x.requires_grad_()).sum().backward()  # (dx needed: the Function's path)
    assert counting_c.inference_calls == 3 and x.grad is not None


def test_high_precision_weights_and_outside_autocast_are_untouched(counting_c):
    plain = te.Linear(64, 48, params_dtype=torch.bfloat16, device="cpu")
    (fp8,) = fp8_linears("cpu", torch.bfloat16, True, count=1)
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        with te.fp8_autocast(enabled=True, fp8_recipe=recipe.Float8CurrentScaling()):
            plain(x)
        fp8(x)  # outside fp8_autocast: the dequantized weight's F.linear, as before
    assert counting_c.inference_calls == 0


def test_block_scaled_weights_take_the_block_path(counting_c):
    block_recipe = recipe.Float8BlockScaling()
    with te.fp8_model_init(enabled=True, recipe=block_recipe):
        module = te.Linear(128, 128, params_dtype=torch.bfloat16, device="cpu")
    x = torch.randn(16, 128, dtype=torch.bfloat16)
    with torch.no_grad(), te.fp8_autocast(enabled=True, fp8_recipe=block_recipe):
        out = module(x)
    assert counting_c.inference_calls == 0
    w64 = module.weight.dequantize(torch.float32).double()
    assert rel_error(out, x.double() @ w64.t() + module.bias.double()) < 0.06


@pytest.mark.parametrize("bad,error,message", [
    (lambda x: x[..., :32].contiguous(), ValueError, "inp: expected last dim 64"),
    (lambda x: x.tolist(), TypeError, "inp: expected a tensor"),
    (lambda x: x.to(torch.int32), RuntimeError, "x: expected float32, float16 or bfloat16"),
])
def test_bad_inputs(bad, error, message):
    (module,) = fp8_linears("cpu", torch.bfloat16, True, count=1)
    fp8_recipe = recipe.Float8CurrentScaling()
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    with torch.no_grad(), te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        module(x)  # (adopts the recipe: the next calls take the inference path)
        with pytest.raises(error, match=message):
            module(bad(x))


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
def test_cuda_graph_replay(recipe_name, counting_c, monkeypatch):
    # the whole call (autocast included) captured and replayed: each replay as one eager call of the Function's path
    fp8_recipe = RECIPES[recipe_name]()
    new, old = fp8_linears("cuda", torch.bfloat16, True)
    xs = [torch.randn(16, 64, dtype=torch.bfloat16, device="cuda") * s for s in (1.0, 2.0, 0.5, 4.0, 1.5)]
    static_x = xs[0].clone()

    def call(module):
        with torch.no_grad(), te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
            return module(static_x)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # (the delayed state calibrated; the same calls made on the reference below)
            call(new)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = call(new)
    monkeypatch.setattr(linear_module, "INFERENCE_PATH", False)
    for _ in range(2):  # (the warm-up calls; the capture recorded its launches without running them)
        call(old)
    for x in xs[1:]:
        static_x.copy_(x)
        graph.replay()
        ref = call(old)
        assert torch.equal(static_out, ref)
        for name, tensor in new.fp8_fwd.state_dict().items():
            assert torch.equal(tensor, old.fp8_fwd.state_dict()[name]), name
    assert counting_c.inference_calls >= 2
