"""TransformerLayer and MultiheadAttention against a plain PyTorch pre-LN layer with copied weights, computed in
float64: outputs and every parameter's gradient, without and with fp8_autocast (FP8 tolerances), plus dropout."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.module.test_attention import random_padding_mask, reference_attention
from tests.utils import rel_error
from transformer_fp8 import recipe
from transformer_fp8.autocast import fp8_autocast
from transformer_fp8.module.attention import DotProductAttention, MultiheadAttention
from transformer_fp8.module.rope import RotaryPositionEmbedding
from transformer_fp8.module.transformer import TransformerLayer

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def rotate(t, freqs):
    """Rotate-half RoPE on t [s, b, h, d] with angles freqs [s, 1, 1, d]."""
    x1, x2 = t.chunk(2, dim=-1)
    return t * freqs.cos() + torch.cat((-x2, x1), dim=-1) * freqs.sin()


class PlainPreLNLayer(nn.Module):
    """The same layer in plain PyTorch, sbhd: x + proj(attn(qkv(norm1(x)))), then + fc2(act(fc1(norm2(.)))).
    qkv rows are [all q | all k | all v]; swiglu's fc1 rows are [gate | up]."""

    def __init__(self, hidden, ffn, heads, groups, d, normalization, activation, eps, bias):
        super().__init__()
        norm = nn.LayerNorm if normalization == "LayerNorm" else nn.RMSNorm
        self.heads, self.groups, self.d, self.activation = heads, groups, d, activation
        self.norm1, self.norm2 = norm(hidden, eps), norm(hidden, eps)
        self.qkv = nn.Linear(hidden, (heads + 2 * groups) * d, bias=bias)
        self.proj = nn.Linear(heads * d, hidden, bias=bias)
        self.fc1 = nn.Linear(hidden, 2 * ffn if activation == "swiglu" else ffn, bias=bias)
        self.fc2 = nn.Linear(ffn, hidden, bias=bias)

    def attention(self, x, mask_type, pad_mask, freqs):
        s, b = x.shape[:2]
        q, k, v = self.qkv(x).split([self.heads * self.d, self.groups * self.d, self.groups * self.d], dim=-1)
        q, k, v = q.view(s, b, -1, self.d), k.view(s, b, -1, self.d), v.view(s, b, -1, self.d)
        if freqs is not None:
            q, k = rotate(q, freqs[:s]), rotate(k, freqs[:s])
        return self.proj(reference_attention(q, k, v, mask_type, pad_mask, self.d ** -0.5, "sbhd"))

    def mlp(self, x):
        h = self.fc1(x)
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh") if self.activation == "gelu" else F.relu(h)
        return self.fc2(h)

    def forward(self, x, mask_type="causal", pad_mask=None, freqs=None, post_ln_residual=False):
        ln1 = self.norm1(x)
        x = (ln1 if post_ln_residual else x) + self.attention(ln1, mask_type, pad_mask, freqs)
        ln2 = self.norm2(x)
        return (ln2 if post_ln_residual else x) + self.mlp(ln2)


def deinterleave_qkv(t, heads, groups, d):
    """QKV rows ordered per group [q.., k, v] -> [all q | all k | all v] (any trailing dims)."""
    per_group = t.reshape(groups, heads // groups + 2, d, *t.shape[1:])
    q = per_group[:, :-2].reshape(heads * d, *t.shape[1:])
    return torch.cat((q, per_group[:, -2].reshape(-1, *t.shape[1:]), per_group[:, -1].reshape(-1, *t.shape[1:])))


def param_pairs(ours, plain, interleaved):
    """(our parameter, plain parameter, our layout -> plain layout) for every parameter of ours."""
    attn, mlp = ours.self_attention, ours.layernorm_mlp
    qkv_layout = (lambda t: deinterleave_qkv(t, plain.heads, plain.groups, plain.d)) if interleaved else \
        (lambda t: t)
    same = lambda t: t  # noqa: E731
    ln_qkv, norm1_bias, norm2_bias = attn.layernorm_qkv, getattr(plain.norm1, "bias", None), \
        getattr(plain.norm2, "bias", None)
    pairs = [(ln_qkv.layer_norm_weight, plain.norm1.weight, same), (ln_qkv.layer_norm_bias, norm1_bias, same),
             (ln_qkv.weight, plain.qkv.weight, qkv_layout), (ln_qkv.bias, plain.qkv.bias, qkv_layout),
             (attn.proj.weight, plain.proj.weight, same), (attn.proj.bias, plain.proj.bias, same),
             (mlp.layer_norm_weight, plain.norm2.weight, same), (mlp.layer_norm_bias, norm2_bias, same),
             (mlp.fc1_weight, plain.fc1.weight, same), (mlp.fc1_bias, plain.fc1.bias, same),
             (mlp.fc2_weight, plain.fc2.weight, same), (mlp.fc2_bias, plain.fc2.bias, same)]
    pairs = [p for p in pairs if p[0] is not None]
    assert len(pairs) == len(list(ours.parameters())), "every parameter of ours has a counterpart"
    return pairs


def plain_copy(ours, cfg, zero_centered_gamma=False, interleaved=True):
    """A float64 PlainPreLNLayer holding ours' weights (norm weights + 1 when zero-centered)."""
    plain = PlainPreLNLayer(cfg["hidden"], cfg["ffn"], cfg["heads"], cfg["groups"], cfg["d"], cfg["normalization"],
                            cfg["activation"], 1e-5, cfg["bias"]).double().to(ours_device(ours))
    with torch.no_grad():
        for mine, theirs, layout in param_pairs(ours, plain, interleaved):
            value = layout(mine.double())
            if zero_centered_gamma and any(theirs is w for w in (plain.norm1.weight, plain.norm2.weight)):
                value = value + 1
            theirs.copy_(value)
    return plain


def ours_device(module):
    return next(module.parameters()).device


def build_layer(cfg, device, dtype, **extra):
    layer = TransformerLayer(cfg["hidden"], cfg["ffn"], cfg["heads"], num_gqa_groups=cfg["groups"],
                             kv_channels=cfg["d"], hidden_dropout=0.0, attention_dropout=0.0, bias=cfg["bias"],
                             activation=cfg["activation"], normalization=cfg["normalization"], params_dtype=dtype,
                             device=device, **extra)
    with torch.no_grad():  # non-trivial norm parameters
        for name, p in layer.named_parameters():
            if "layer_norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return layer


CONFIGS = {
    "gpt": dict(hidden=64, ffn=128, heads=4, groups=4, d=16, normalization="LayerNorm", activation="gelu", bias=True),
    "relu_rms": dict(hidden=64, ffn=96, heads=4, groups=2, d=16, normalization="RMSNorm", activation="relu",
                     bias=True),
    "ln_swiglu": dict(hidden=48, ffn=64, heads=3, groups=3, d=16, normalization="LayerNorm", activation="swiglu",
                      bias=True),
    "llama": dict(hidden=64, ffn=160, heads=8, groups=2, d=16, normalization="RMSNorm", activation="swiglu",
                  bias=False),
}
CASES = [  # (config, extra TransformerLayer args, mask type, rope, b, s)
    ("gpt", {}, "causal", False, 2, 16),
    ("gpt", dict(apply_residual_connection_post_layernorm=True, zero_centered_gamma=True), "padding", False, 3, 17),
    ("relu_rms", dict(qkv_weight_interleaved=False), "padding_causal", False, 2, 24),
    ("ln_swiglu", {}, "no_mask", False, 2, 9),
    ("llama", dict(qkv_weight_interleaved=False), "causal", True, 2, 32),
    ("llama", {}, "padding_causal", True, 3, 15),
]


def run_case(device, dtype, case, fp8_recipe=None, warmup_steps=0):
    """(rel error of the block's contribution out - x, {parameter: rel error of its gradient}) vs float64."""
    name, extra, mask_type, rope, b, s = case
    cfg = CONFIGS[name]
    layer = build_layer(cfg, device, dtype, self_attn_mask_type=mask_type, **extra)
    plain = plain_copy(layer, cfg, extra.get("zero_centered_gamma", False), extra.get("qkv_weight_interleaved", True))
    x = torch.randn(s, b, cfg["hidden"], device=device).to(dtype).requires_grad_()
    pad_mask = random_padding_mask(b, s, device) if "padding" in mask_type else None
    freqs = RotaryPositionEmbedding(cfg["d"], device=device)(s) if rope else None
    grad = torch.randn(s, b, cfg["hidden"], device=device).to(dtype)
    for _ in range(warmup_steps + 1):
        layer.zero_grad()
        x.grad = None
        with fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
            out = layer(x, attention_mask=pad_mask, rotary_pos_emb=freqs)
        out.backward(grad)
    x64 = x.detach().double().requires_grad_()
    post_ln = extra.get("apply_residual_connection_post_layernorm", False)
    ref = plain(x64, mask_type, pad_mask, freqs, post_ln)
    ref.backward(grad.double())
    residual_free = (lambda o, xx: o) if post_ln else (lambda o, xx: o - xx)
    out_err = rel_error(residual_free(out.detach().double(), x64.detach()), residual_free(ref.detach(), x64.detach()))
    grad_errs = {"x": rel_error(x.grad, x64.grad)}
    for i, (mine, theirs, layout) in enumerate(param_pairs(layer, plain, extra.get("qkv_weight_interleaved", True))):
        grad_errs[f"param{i} {tuple(mine.shape)}"] = rel_error(layout(mine.grad.double()), theirs.grad)
    return out_err, grad_errs


def assert_errors(out_err, grad_errs, tol, grad_tol):
    assert out_err <= tol, f"output: {out_err:.2e}"
    bad = {k: f"{v:.2e}" for k, v in grad_errs.items() if not v <= grad_tol}
    assert not bad, f"gradients over {grad_tol}: {bad}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[2]}-{'-'.join(c[1]) or 'default'}")
def test_matches_plain_layer(device, case):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    tol = 1e-5 if device == "cpu" else 3e-2
    assert_errors(*run_case(device, dtype, case), tol, 2 * tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[4]], ids=["gpt", "relu_rms", "llama"])
@pytest.mark.parametrize("fp8_recipe,warmup", [(recipe.Float8CurrentScaling(), 0), (recipe.DelayedScaling(), 2)],
                         ids=["current", "delayed"])
def test_matches_plain_layer_in_fp8(device, case, fp8_recipe, warmup):
    """FP8 GEMMs (E4M3 forward, E5M2 gradients): errors of a few FP8 roundings, not of a broken layer (~1)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    assert_errors(*run_case(device, dtype, case, fp8_recipe, warmup), 0.1, 0.25)


@pytest.mark.gpu
def test_float32_params_on_cuda_use_fused_attention():
    """FP32 parameters: attention still runs a fused kernel (in BF16), and the layer matches within BF16 error."""
    case = CASES[4]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out_err, grad_errs = run_case("cuda", torch.float32, case)
    names = {event.name for event in prof.events()}
    assert "aten::_scaled_dot_product_attention_math" not in names
    assert any("scaled_dot_product" in n and ("flash" in n or "cudnn" in n or "efficient" in n)
               or n == "transformer_fp8::fused_attn_fwd" for n in names)
    assert_errors(out_err, grad_errs, 3e-2, 6e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_hidden_dropout_statistics(device):
    """With fc2 = 0 the output is x + dropout(attention): about p of its elements equal x, the others are
    x + attention / (1 - p) (attention from the same layer in eval mode)."""
    p, cfg = 0.3, CONFIGS["gpt"]
    layer = TransformerLayer(cfg["hidden"], cfg["ffn"], cfg["heads"], hidden_dropout=p, attention_dropout=0.0,
                             params_dtype=torch.float32, device=device)
    with torch.no_grad():
        layer.layernorm_mlp.fc2_weight.zero_()
        layer.layernorm_mlp.fc2_bias.zero_()
    x = torch.randn(64, 8, cfg["hidden"], device=device)
    with torch.no_grad():
        attn = layer.eval()(x) - x
        delta = layer.train()(x) - x
    dropped = delta == 0
    assert abs(dropped.float().mean().item() - p) < 0.02
    assert torch.allclose(delta[~dropped], attn[~dropped] / (1 - p), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_drop_path_drops_whole_samples_of_each_branch(device, fmt):
    """drop_path_rate: in training each branch output is kept per sample (batch element) with probability 1 - p and
    scaled by 1 / (1 - p), with masks drawn in order from torch's random state (replayed here on the layer's own
    branches); in eval mode the layer is the plain one. Gradients flow through the kept samples."""
    p, cfg, batch = 0.5, CONFIGS["gpt"], 16
    torch.manual_seed(0)
    layer = TransformerLayer(cfg["hidden"], cfg["ffn"], cfg["heads"], hidden_dropout=0.0, attention_dropout=0.0,
                             drop_path_rate=p, params_dtype=torch.float32, device=device, attn_input_format=fmt)
    torch.manual_seed(0)
    plain = TransformerLayer(cfg["hidden"], cfg["ffn"], cfg["heads"], hidden_dropout=0.0, attention_dropout=0.0,
                             params_dtype=torch.float32, device=device, attn_input_format=fmt)
    batch_dim = 1 if fmt == "sbhd" else 0
    x = torch.randn(*((12, batch) if fmt == "sbhd" else (batch, 12)), cfg["hidden"], device=device)
    assert torch.equal(layer.eval()(x), plain.eval()(x))
    layer.train()
    torch.manual_seed(1)
    out = layer(x.requires_grad_())

    def mask():
        shape = [1, 1, 1]
        shape[batch_dim] = batch
        return torch.empty(shape, device=device).bernoulli_(1 - p) / (1 - p)

    torch.manual_seed(1)
    with torch.no_grad():
        hidden = x + layer.self_attention(x) * mask()
        ref = hidden + layer.layernorm_mlp(hidden) * mask()
    assert torch.equal(out, ref)
    kept = (out - hidden).abs().amax(dim=[d for d in range(3) if d != batch_dim]) > 0
    assert 0 < int(kept.sum()) < batch  # (some samples drop the MLP branch, some keep it)
    out.sum().backward()
    assert x.grad is not None and layer.layernorm_mlp.fc1_weight.grad.abs().sum() > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interleaved", [True, False])
def test_multihead_attention_without_norm(device, interleaved):
    """input_layernorm=False, bshd, return_bias: out + bias equals plain qkv -> attention -> proj."""
    cfg = CONFIGS["llama"]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    mha = MultiheadAttention(cfg["hidden"], cfg["heads"], kv_channels=cfg["d"], num_gqa_groups=cfg["groups"],
                             attention_dropout=0.0,
                             qkv_weight_interleaved=interleaved, return_bias=True, attn_input_format="bshd",
                             params_dtype=dtype, device=device)
    plain = PlainPreLNLayer(cfg["hidden"], cfg["ffn"], cfg["heads"], cfg["groups"], cfg["d"], "LayerNorm", "gelu",
                            1e-5, True).double().to(device)
    layout = (lambda t: deinterleave_qkv(t, cfg["heads"], cfg["groups"], cfg["d"])) if interleaved else \
        (lambda t: t)
    with torch.no_grad():
        for mine, theirs, fn in ((mha.qkv.weight, plain.qkv.weight, layout), (mha.qkv.bias, plain.qkv.bias, layout),
                                 (mha.proj.weight, plain.proj.weight, None), (mha.proj.bias, plain.proj.bias, None)):
            theirs.copy_(fn(mine.double()) if fn else mine.double())
    x = torch.randn(2, 20, cfg["hidden"], device=device).to(dtype)
    freqs = RotaryPositionEmbedding(cfg["d"], device=device)(20)
    out, bias = mha(x, rotary_pos_emb=freqs)
    ref = plain.attention(x.double().transpose(0, 1), "causal", None, freqs.double()).transpose(0, 1)
    assert rel_error(out + bias, ref) <= (1e-5 if device == "cpu" else 3e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask_type", ["causal", "no_mask"])
def test_multihead_attention_folds_interleaved_gqa_groups(device, mask_type, monkeypatch):
    """Interleaved GQA, sbhd, no mask tensor, no RoPE: q, k, v reach the attention as views of the QKV output with
    the groups folded into the batch; the output and the QKV weight's gradient equal the plain layer's."""
    calls = []
    real = DotProductAttention.forward
    monkeypatch.setattr(DotProductAttention, "forward", lambda self, q, *a, **kw: calls.append(
        (q._base is not None, kw["gqa_groups_folded"])) or real(self, q, *a, **kw))
    cfg = CONFIGS["llama"]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    mha = MultiheadAttention(cfg["hidden"], cfg["heads"], kv_channels=cfg["d"], num_gqa_groups=cfg["groups"],
                             attention_dropout=0.0, attn_mask_type=mask_type, params_dtype=dtype, device=device)
    plain = PlainPreLNLayer(cfg["hidden"], cfg["ffn"], cfg["heads"], cfg["groups"], cfg["d"], "LayerNorm", "gelu",
                            1e-5, True).double().to(device)
    layout = lambda t: deinterleave_qkv(t, cfg["heads"], cfg["groups"], cfg["d"])  # noqa: E731
    with torch.no_grad():
        for mine, theirs, fn in ((mha.qkv.weight, plain.qkv.weight, layout), (mha.qkv.bias, plain.qkv.bias, layout),
                                 (mha.proj.weight, plain.proj.weight, None), (mha.proj.bias, plain.proj.bias, None)):
            theirs.copy_(fn(mine.double()) if fn else mine.double())
    x = torch.randn(24, 3, cfg["hidden"], device=device).to(dtype)
    out = mha(x)
    ref = plain.attention(x.double(), mask_type, None, None)
    assert calls == [(True, True)]
    grad = torch.randn_like(ref)
    out.backward(grad.to(dtype))
    ref.backward(grad)
    tol = 1e-5 if device == "cpu" else 3e-2
    assert rel_error(out, ref) <= tol
    assert rel_error(layout(mha.qkv.weight.grad.double()), plain.qkv.weight.grad) <= tol


def test_multihead_attention_folds_groups_under_fp8_attention_too(monkeypatch):
    """Interleaved GQA's q, k, v go to FP8 attention (fp8_dpa) folded, as outside it, and run in FP8."""
    calls = []
    real = DotProductAttention.forward
    monkeypatch.setattr(DotProductAttention, "forward", lambda self, q, *a, **kw: calls.append(
        kw["gqa_groups_folded"]) or real(self, q, *a, **kw))
    mha = MultiheadAttention(64, 4, kv_channels=16, num_gqa_groups=2, attention_dropout=0.0, attn_mask_type="causal",
                             params_dtype=torch.bfloat16, device="cpu")
    x = torch.randn(16, 2, 64, dtype=torch.bfloat16)
    with fp8_autocast(fp8_recipe=recipe.DelayedScaling(fp8_dpa=True)):
        mha(x)
    mha(x)
    assert calls == [True, True]
    assert mha.core_attention.fp8_scaling.fwd is not None  # (the first call ran in FP8)


def test_bad_arguments():
    with pytest.raises(ValueError, match="tp_group"):
        TransformerLayer(64, 128, 4, tp_size=2, device="cpu")
    with pytest.raises(NotImplementedError, match="output_layernorm"):
        TransformerLayer(64, 128, 4, output_layernorm=True, device="cpu")
    for bad in (1.0, -0.1, "0.1"):
        with pytest.raises(ValueError, match="drop_path_rate"):
            TransformerLayer(64, 128, 4, drop_path_rate=bad, device="cpu")
    with pytest.raises(ValueError, match="num_gqa_groups"):
        TransformerLayer(64, 128, 4, num_gqa_groups=3, device="cpu")
    with pytest.raises(NotImplementedError, match="attention_type"):
        MultiheadAttention(64, 4, attention_type="cross", device="cpu")
    with pytest.raises(ValueError, match="return_layernorm_output"):
        MultiheadAttention(64, 4, return_layernorm_output=True, device="cpu")
