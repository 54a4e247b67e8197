"""Every FP8 module's per-role scaling bookkeeping against a plain-Python model of the recipe.

For Linear, LayerNormLinear, LayerNormMLP (gelu and swiglu), MultiheadAttention and TransformerLayer, a few training
steps run under DelayedScaling (amax_history_len 3 over 4 steps, "max" and "most_recent", margin 1 and 2) and
Float8CurrentScaling, with input, output-gradient and weight magnitudes that change every step. Beside them a float64
model runs the same steps: the module's math written out in plain PyTorch (norms, activations, attention, residuals)
with every GEMM operand cast to FP8 by `SlotsModel.cast`, which keeps its own amax history and scale per slot and
updates them as docs/numerics.md says (first step calibrated from the tensor's own amax, margin not applied; then
scale = fp8_max / amax / 2**margin over the history; current scaling: each tensor's own amax). Autograd carries the
gradients through the model, so each backward slot sees the gradient its GEMM receives (e.g. fc1's grad_output is
act'(fc1 out) * (dy_fp8 @ fc2_weight_fp8)).

The model keeps its numbers per role (quantization.Role: INPUT, WEIGHT, GRAD_OUTPUT; FC1_INPUT ... FC2_GRAD_OUTPUT;
the ten ATTENTION_* roles). After every step, each role's amax history, scale and scale_inv in every FP8 sub-module
(read through the module's quantizer of that role) must equal the model's, with the role named in the failure. A
bookkeeping mistake that keeps the numerics plausible, such as casting LayerNormMLP's fc2 weight with fc1's weight
quantizer, fails here (see the last test). The
same runs with cached FP8 weights over micro-batches (is_first_microbatch True / False: no weight cast, no weight
amax on the False steps), and with FP8 attention (fp8_dpa=True: the attention's ten slots, emulated as
transformer_fp8/cpu/attention_fp8.py computes them; no first-step calibration there, the casts start at scale 1).
The roles each module kind casts are listed here (ROLES), independently of the modules' own declarations, which must
match them.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import transformer_fp8 as te
from transformer_fp8 import recipe
from transformer_fp8.module.base import FP8ModuleBase
from transformer_fp8.quantization import Role

S, B, HIDDEN, FFN, HEADS, GROUPS = 8, 2, 32, 64, 4, 2
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# Magnitudes per step (input, output gradient, weight factor): not monotonic, so that "max" over a history of 3 and
# "most_recent" pick different amaxes, and the history rolls past its length.
STEPS = [(1.0, 1.0, 1.0), (3.0, 0.25, 0.5), (0.5, 4.0, 2.0), (2.0, 0.5, 0.75)]
RECIPES = {
    "delayed-max-margin1-HYBRID": recipe.DelayedScaling(margin=1, amax_history_len=3, amax_compute_algo="max"),
    "delayed-most_recent-margin2-E4M3": recipe.DelayedScaling(
        margin=2, amax_history_len=3, amax_compute_algo="most_recent", fp8_format=recipe.Format.E4M3),
    "current-HYBRID": recipe.Float8CurrentScaling(),
}
# The model's tensors differ from the module's by float32 rounding only (both cast with the same float32 scales, so
# the FP8 values agree); amaxes of downstream tensors (after FP8 GEMMs, attention) differ by up to 4e-7 relative
# (measured on the CPU). On CUDA the forward GEMMs accumulate with FP8 fast accumulation and attention runs in BF16
# (float32 inputs are cast around it): ~1e-3 expected there (not yet measured). A mixed-up slot is off by tens of
# percent.
RTOL = {"cpu": 1e-4, "cuda": 3e-2}
# The roles each module kind casts: (forward roles, backward roles). LayerNormLinear's INPUT is the norm output (its
# GEMM's input); LayerNormMLP's FC1_INPUT the norm output, FC2_INPUT the activation.
GEMM = ((Role.INPUT, Role.WEIGHT), (Role.GRAD_OUTPUT,))
ROLES = {
    te.Linear: GEMM,
    te.LayerNormLinear: GEMM,
    te.LayerNormMLP: ((Role.FC1_INPUT, Role.FC1_WEIGHT, Role.FC2_INPUT, Role.FC2_WEIGHT),
                      (Role.FC1_GRAD_OUTPUT, Role.FC2_GRAD_OUTPUT)),
    te.DotProductAttention: ((Role.ATTENTION_Q, Role.ATTENTION_K, Role.ATTENTION_V, Role.ATTENTION_S,
                              Role.ATTENTION_O),
                             (Role.ATTENTION_DO, Role.ATTENTION_DP, Role.ATTENTION_DQ, Role.ATTENTION_DK,
                              Role.ATTENTION_DV)),
}
# (input role, weight role, grad_output role) of each GEMM of a module kind, in order
GEMM_ROLES = {"linear": (Role.INPUT, Role.WEIGHT, Role.GRAD_OUTPUT),
              "fc1": (Role.FC1_INPUT, Role.FC1_WEIGHT, Role.FC1_GRAD_OUTPUT),
              "fc2": (Role.FC2_INPUT, Role.FC2_WEIGHT, Role.FC2_GRAD_OUTPUT)}


def _f32(value):
    """value rounded to float32, as a Python float (the module's scales are float32)."""
    return float(torch.tensor(value, dtype=torch.float32))


class SlotsModel:
    """float64 model of one direction's roles of a module (its forward or its backward roles) under a recipe. Its
    methods take a role; `roles` gives each role's column in `history` and `scale`."""

    def __init__(self, roles, fp8_recipe, forward, calibrates=True):
        """roles: the Roles; fp8_recipe: DelayedScaling or Float8CurrentScaling; forward: the forward (True) or
        gradient (False) roles, which pick the format's forward or backward dtype; calibrates: whether casts before
        the first update take their scale from the tensor's own amax (the modules' GEMM roles) or keep scale 1 (FP8
        attention's roles)."""
        self.roles = tuple(roles)
        n = len(self.roles)
        self.current = isinstance(fp8_recipe, recipe.Float8CurrentScaling)
        fmt = fp8_recipe.fp8_format
        self.fp8_dtype = fmt.fwd_dtype if forward else fmt.bwd_dtype
        self.fp8_max = FP8_MAX[self.fp8_dtype]
        self.margin = 0 if self.current else fp8_recipe.margin
        self.algo = None if self.current else fp8_recipe.amax_compute_algo
        self.history = torch.zeros(1 if self.current else fp8_recipe.amax_history_len, n, dtype=torch.float64)
        self.scale = [1.0] * n
        self.calibrated = not calibrates
        self.used = False

    def record(self, x, role):
        """Max-accumulate amax(x) into the role's history row 0 (what a cast, or a kernel making x, does)."""
        i = self.roles.index(role)
        self.history[0, i] = max(self.history[0, i].item(), x.detach().abs().max().item())
        self.used = True

    def round_trip(self, x, role):
        """x rounded to FP8 with the role's current scale and read back (float64); no amax."""
        scale = torch.tensor(self.scale[self.roles.index(role)], dtype=torch.float32)
        q = (x.detach().float() * scale).clamp(-self.fp8_max, self.fp8_max).to(self.fp8_dtype)
        return q.double() * torch.reciprocal(scale).double()

    def cast(self, x, role):
        """x (float64) cast as the role and dequantized: float64 of the FP8 value times scale_inv."""
        i = self.roles.index(role)
        amax = x.detach().abs().max().item()
        if self.current and math.isfinite(amax) and amax > 0:
            self.scale[i] = _f32(self.fp8_max / amax)
        elif not self.calibrated and math.isfinite(amax) and amax > 0:  # the first step's calibration: no margin
            # (ScalingState.calibrate_scale's `fp8_max / amax`, a Python number over a tensor, is computed by torch as
            # fp8_max * (1 / amax), each rounded to float32: up to one float32 ulp off the quotient. Inputs that lie
            # on FP8 values, such as an FP8 attention's output, land on rounding ties, so the model does the same.)
            self.scale[i] = _f32(self.fp8_max * _f32(1 / _f32(amax)))
        if not self.current:
            self.record(x, role)
        self.used = True
        return self.round_trip(x, role)

    def update(self):
        """The delayed-scaling update after a forward (or backward) that used these slots."""
        if self.current or not self.used:
            return
        newest = self.history[0].clone()
        amax = self.history.amax(0) if self.algo == "max" else newest
        self.history = torch.cat([torch.zeros_like(newest)[None], self.history[:-1]])
        for i, a in enumerate(amax.tolist()):
            if a > 0:
                self.scale[i] = _f32(_f32(self.fp8_max / a) / 2 ** self.margin)
        self.calibrated, self.used = True, False

    def scale_inv(self):
        return [_f32(1 / _f32(s)) for s in self.scale]


class _ModelGemm(torch.autograd.Function):
    """y = cast(x) wqᵀ + bias in float64 (wq: the weight as cast, [N, K]); backward casts dy into the gradient slot."""

    @staticmethod
    def forward(ctx, x, wq, bias, fwd, bwd, roles):
        xq = fwd.cast(x.reshape(-1, x.shape[-1]), roles[0])
        ctx.save_for_backward(xq, wq)
        ctx.bwd, ctx.grad_role, ctx.x_shape = bwd, roles[1], x.shape
        out = xq @ wq.t() + (0 if bias is None else bias)
        return out.view(*x.shape[:-1], wq.shape[0])

    @staticmethod
    def backward(ctx, dy):
        xq, wq = ctx.saved_tensors
        dyq = ctx.bwd.cast(dy.reshape(-1, dy.shape[-1]), ctx.grad_role)
        return (dyq @ wq).view(ctx.x_shape), None, None, None, None, None


def _expand(t, groups):
    return t.repeat_interleave(groups, dim=1)


class _ModelFP8Attention(torch.autograd.Function):
    """FP8 attention (causal, [b, h, s, d] float64; k, v with h / groups heads) as docs/numerics.md and
    transformer_fp8/cpu/attention_fp8.py describe it: q, k, v cast (roles ATTENTION_Q, _K, _V); the probabilities P
    recorded in ATTENTION_S and rounded with its scale before P v; the output recorded and cast as ATTENTION_O.
    Backward: dO cast (ATTENTION_DO); dS recorded in ATTENTION_DP and rounded with its scale before the dq, dk
    products; dq, dk, dv recorded and cast (ATTENTION_DQ, _DK, _DV)."""

    @staticmethod
    def forward(ctx, q, k, v, fwd, bwd, scale):
        groups = q.shape[1] // k.shape[1]
        qf, kf, vf = fwd.cast(q, Role.ATTENTION_Q), fwd.cast(k, Role.ATTENTION_K), fwd.cast(v, Role.ATTENTION_V)
        scores = (qf @ _expand(kf, groups).transpose(-1, -2)) * scale
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        fwd.record(probs, Role.ATTENTION_S)
        o = fwd.cast(fwd.round_trip(probs, Role.ATTENTION_S) @ _expand(vf, groups), Role.ATTENTION_O)
        ctx.save_for_backward(qf, kf, vf, probs, o)
        ctx.bwd, ctx.scale, ctx.fwd = bwd, scale, fwd
        return o

    @staticmethod
    def backward(ctx, grad):
        qf, kf, vf, probs, o = ctx.saved_tensors
        bwd, scale, groups = ctx.bwd, ctx.scale, qf.shape[1] // kf.shape[1]
        g = bwd.cast(grad, Role.ATTENTION_DO)
        p8 = ctx.fwd.round_trip(probs, Role.ATTENTION_S)
        dv = (p8.transpose(-1, -2) @ g).unflatten(1, (kf.shape[1], groups)).sum(2)
        d_scores = probs * (g @ _expand(vf, groups).transpose(-1, -2) - (g * o).sum(-1, keepdim=True)) * scale
        bwd.record(d_scores, Role.ATTENTION_DP)
        d_scores = bwd.round_trip(d_scores, Role.ATTENTION_DP)
        dq = d_scores @ _expand(kf, groups)
        dk = (d_scores.transpose(-1, -2) @ qf).unflatten(1, (kf.shape[1], groups)).sum(2)
        return (bwd.cast(dq, Role.ATTENTION_DQ), bwd.cast(dk, Role.ATTENTION_DK), bwd.cast(dv, Role.ATTENTION_DV),
                None, None, None)


class RecipeModel:
    """The float64 model of a module tree: SlotsModels for every FP8 sub-module, and its forward written out."""

    def __init__(self, module, fp8_recipe):
        self.module = module
        self.states = {m: (SlotsModel(_roles(m)[0], fp8_recipe, True), SlotsModel(_roles(m)[1], fp8_recipe, False))
                       for m in module.modules() if isinstance(m, FP8ModuleBase)}
        if getattr(fp8_recipe, "fp8_dpa", False):  # FP8 attention: its own roles, no first-step calibration
            self.states.update({m: (SlotsModel(_roles(m)[0], fp8_recipe, True, calibrates=False),
                                    SlotsModel(_roles(m)[1], fp8_recipe, False, calibrates=False))
                                for m in module.modules() if isinstance(m, te.DotProductAttention)})
        self.is_first_microbatch, self.weight_cache = None, {}

    def gemm(self, m, x, weight_name, bias_name, gemm):
        """The FP8 GEMM `gemm` ("linear", "fc1", "fc2": its roles in GEMM_ROLES) of FP8 module m. The weight is
        cast, or with is_first_microbatch False taken as cast at the last True (no cast, no amax)."""
        fwd, bwd = self.states[m]
        input_role, weight_role, grad_role = GEMM_ROLES[gemm]
        wq = self.weight_cache.get((m, weight_name)) if self.is_first_microbatch is False else None
        if wq is None:
            wq = fwd.cast(_p(m, weight_name), weight_role)
            if self.is_first_microbatch is not None:
                self.weight_cache[m, weight_name] = wq
        return _ModelGemm.apply(x, wq, _p(m, bias_name), fwd, bwd, (input_role, grad_role))

    def linear(self, m, x):
        return self.gemm(m, x, "weight", "bias", "linear")

    def layernorm_linear(self, m, x):
        return self.gemm(m, _norm(m, x), "weight", "bias", "linear")

    def layernorm_mlp(self, m, x):
        h = self.gemm(m, _norm(m, x), "fc1_weight", "fc1_bias", "fc1")
        if m.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            act = F.silu(gate) * up
        else:
            act = {"gelu": lambda t: F.gelu(t, approximate="tanh"), "relu": F.relu}[m.activation](h)
        return self.gemm(m, act, "fc2_weight", "fc2_bias", "fc2")

    def attention(self, m, x):
        """MultiheadAttention (sbhd, interleaved QKV: per group [its q heads, k, v]; causal)."""
        qkv = self.layernorm_linear(m.layernorm_qkv, x) if m.input_layernorm else self.linear(m.qkv, x)
        s, b = qkv.shape[:2]
        per_group = qkv.view(s, b, m.groups, m.heads // m.groups + 2, m.head_dim)
        q = per_group[..., :-2, :].reshape(s, b, m.heads, m.head_dim)
        k, v = per_group[..., -2, :], per_group[..., -1, :]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        if m.core_attention in self.states:
            context = _ModelFP8Attention.apply(q, k, v, *self.states[m.core_attention], m.core_attention.softmax_scale)
        else:
            context = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.linear(m.proj, context.permute(2, 0, 1, 3).reshape(s, b, -1))

    def forward(self, x):
        m = self.module
        if isinstance(m, te.TransformerLayer):
            hidden = x + self.attention(m.self_attention, x)
            return hidden + self.layernorm_mlp(m.layernorm_mlp, hidden)
        run = {te.Linear: self.linear, te.LayerNormLinear: self.layernorm_linear,
               te.LayerNormMLP: self.layernorm_mlp, te.MultiheadAttention: self.attention}[type(m)]
        return run(m, x)

    def step(self, x, dy, is_first_microbatch=None):
        """One forward (then the forward update) and backward (then the gradient update) of the model."""
        self.is_first_microbatch = is_first_microbatch
        out = self.forward(x.detach().double().requires_grad_())
        for fwd, _ in self.states.values():
            fwd.update()
        out.backward(dy.double())
        for _, bwd in self.states.values():
            bwd.update()


def _p(m, name):
    p = getattr(m, name)
    return None if p is None else p.detach().cpu().double()


def _norm(m, x):
    gamma = _p(m, "layer_norm_weight") + (1 if m.zero_centered_gamma else 0)
    if m.normalization == "LayerNorm":
        return F.layer_norm(x, x.shape[-1:], gamma, _p(m, "layer_norm_bias"), m.eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.eps) * gamma


def _roles(m):
    if type(m) in ROLES:
        return ROLES[type(m)]
    raise AssertionError(f"no roles known for {type(m).__name__}: add it to ROLES")


def assert_slots_match(module, model, step, rtol):
    """Every FP8 sub-module's amax history, scale and scale_inv equal the model's (to rtol), role by role: the
    module's numbers read through its quantizer of the role."""
    names = {m: name or type(m).__name__ for name, m in module.named_modules()}
    for m, (fwd_model, bwd_model) in model.states.items():
        quantizers = m.fp8_scaling.quantizers if isinstance(m, te.DotProductAttention) else m.quantizers
        assert quantizers is not None, f"{names[m]}: no quantizers after an FP8 step"
        for kind, slots, declared in (("forward", fwd_model, quantizers.forward_roles),
                                      ("backward", bwd_model, quantizers.backward_roles)):
            assert set(declared) == set(slots.roles), f"{names[m]} {kind}: roles {declared}, expected {slots.roles}"
            want = {"amax_history": slots.history, "scale": torch.tensor(slots.scale, dtype=torch.float64),
                    "scale_inv": torch.tensor(slots.scale_inv(), dtype=torch.float64)}
            for i, role in enumerate(slots.roles):
                quantizer = quantizers[role]
                for what, expected in want.items():
                    got = getattr(quantizer.state, what).detach().cpu().double()[..., quantizer.slot]
                    e = expected[..., i]
                    ok = got.shape == e.shape and torch.allclose(got, e, rtol=rtol, atol=0)
                    assert ok, (f"step {step}, {names[m]} {kind} role {role.value}: {what} {got.tolist()}, the "
                                f"recipe model says {e.tolist()}")


def _build(kind, activation="gelu", device="cpu"):
    common = dict(params_dtype=torch.float32, device=device)
    if kind == "Linear":
        return te.Linear(HIDDEN, FFN, **common)
    if kind == "LayerNormLinear":
        return te.LayerNormLinear(HIDDEN, FFN, **common)
    if kind == "LayerNormMLP":
        return te.LayerNormMLP(HIDDEN, FFN, activation=activation, **common)
    if kind == "MultiheadAttention":
        return te.MultiheadAttention(HIDDEN, HEADS, num_gqa_groups=GROUPS, attention_dropout=0.0, **common)
    return te.TransformerLayer(HIDDEN, FFN, HEADS, num_gqa_groups=GROUPS, hidden_dropout=0.0, attention_dropout=0.0,
                               **common)


def _randomize(module):
    """Random biases and norm weights (zeros and ones would hide a mixed-up slot), fc2's weight larger than fc1's."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
            elif "fc2" in name or "proj" in name:
                p.mul_(3.0)


def run_and_check(module, fp8_recipe, out_width, device="cpu", steps=STEPS, rtol=None):
    """Training steps of module (on device) and of its recipe model, checking every slot after each.
    steps: [(input magnitude, output-gradient magnitude, weight factor[, is_first_microbatch])]; rtol: RTOL[device]
    unless given."""
    _randomize(module)
    weights = [p for p in module.parameters() if p.dim() == 2]
    model = RecipeModel(module, fp8_recipe)
    for step, (x_mag, dy_mag, w_factor, *micro) in enumerate(steps):
        micro = dict(is_first_microbatch=micro[0]) if micro else {}
        with torch.no_grad():
            for w in weights:  # (weights whose amax changes from step to step, as training moves them)
                w.mul_(w_factor)
        x = torch.randn(S, B, HIDDEN) * x_mag
        dy = torch.randn(S, B, out_width) * dy_mag
        module.zero_grad(set_to_none=True)
        with te.fp8_autocast(fp8_recipe=fp8_recipe):
            out = module(x.to(device).requires_grad_(), **micro)
        out.backward(dy.to(device))
        model.step(x, dy, **micro)
        assert_slots_match(module, model, step, RTOL[device] if rtol is None else rtol)


MODULES = [("Linear", "gelu", FFN), ("LayerNormLinear", "gelu", FFN), ("LayerNormMLP", "gelu", HIDDEN),
           ("LayerNormMLP", "swiglu", HIDDEN), ("MultiheadAttention", "gelu", HIDDEN),
           ("TransformerLayer", "gelu", HIDDEN)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("label", RECIPES)
@pytest.mark.parametrize("kind, activation, out_width", MODULES,
                         ids=[k if k != "LayerNormMLP" else f"{k}-{a}" for k, a, _ in MODULES])
def test_every_slot_follows_the_recipe_model(kind, activation, out_width, label, device):
    run_and_check(_build(kind, activation, device), RECIPES[label], out_width, device)


# Gradient accumulation with cached FP8 weights: True casts and caches, False reuses the cache (no weight cast, so no
# weight amax that step); the weights change only at a True step, as an optimizer step would change them.
MICROBATCH_STEPS = [(1.0, 1.0, 1.0, True), (3.0, 0.25, 1.0, False), (0.5, 4.0, 1.0, False), (2.0, 0.5, 0.5, True),
                    (1.5, 2.0, 1.0, False)]


@pytest.mark.parametrize("label", RECIPES)
@pytest.mark.parametrize("kind, out_width", [("Linear", FFN), ("LayerNormMLP", HIDDEN), ("TransformerLayer", HIDDEN)])
def test_cached_weights_over_microbatches_follow_the_recipe_model(kind, out_width, label):
    run_and_check(_build(kind), RECIPES[label], out_width, steps=MICROBATCH_STEPS)


FP8_DPA = recipe.DelayedScaling(margin=1, amax_history_len=3, amax_compute_algo="max", fp8_dpa=True)
# FP8 attention rounds P and dS inside its kernel (float32 there, float64 in the model): an entry that sits within
# float32 noise of a rounding boundary can round the other way, moving downstream amaxes by up to ~0.6% (measured);
# a mixed-up slot is off by far more.
FP8_DPA_RTOL = 2e-2


@pytest.mark.parametrize("kind", ["MultiheadAttention", "TransformerLayer"])
def test_fp8_attention_slots_follow_the_recipe_model(kind):
    """fp8_dpa=True (CPU: the emulated FP8 attention): the attention's ten slots beside every GEMM slot."""
    module = _build(kind)
    run_and_check(module, FP8_DPA, HIDDEN, rtol=FP8_DPA_RTOL)
    attention = next(m for m in module.modules() if isinstance(m, te.DotProductAttention))
    assert attention.fp8_scaling.fwd is not None and (attention.fp8_scaling.fwd.scale != 1).all()  # (it ran FP8)


def test_the_check_catches_fc2_weight_cast_in_fc1s_slot(monkeypatch):
    """A planted bookkeeping bug, LayerNormMLP casting its fc2 weight with fc1's weight quantizer, must fail the
    check, naming the role (the bug leaves the outputs plausible: fc2's weight is cast with a valid scale)."""
    from transformer_fp8.module import layernorm_mlp
    original = layernorm_mlp.fp8_weight
    quantizer_of = {}  # id(fc2 weight quantizer's state) -> the fc1 weight quantizer of the same module

    def fc2_with_fc1s_quantizer(cache, name, weight, quantizer, *args):
        if name == "fc1_weight":
            quantizer_of[id(quantizer.state)] = quantizer
        elif name == "fc2_weight":
            quantizer = quantizer_of[id(quantizer.state)]
        return original(cache, name, weight, quantizer, *args)

    monkeypatch.setattr(layernorm_mlp, "fp8_weight", fc2_with_fc1s_quantizer)
    for label in ("delayed-max-margin1-HYBRID", "current-HYBRID"):
        with pytest.raises(AssertionError, match=r"forward role fc[12]_weight"):
            run_and_check(_build("LayerNormMLP"), RECIPES[label], HIDDEN)
