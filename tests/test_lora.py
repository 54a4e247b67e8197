"""transformer_fp8.lora: adapter math against float64 per row slice of our fused GEMMs, gradients only on the adapters,
no wgrad work for frozen base weights, PEFT's format both ways (logits of peft.PeftModel on the plain Hugging Face
model), merge, FP8 base weights under fp8_autocast (CPU reference kernels; CUDA in the gpu tests), bad arguments."""
import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import transformer_fp8 as te
from tests.utils import assert_close_rel, check_against_float64
from transformer_fp8.float8_tensor import Float8Tensor
from transformer_fp8.integrations import (causal_lm_loss, convert_linear_layers, convert_llama,
                                          gradient_checkpointing_enable)
from transformer_fp8.lora import (LoraLayerNormLinear, LoraLayerNormMLP, LoraLinear, add_lora,
                                  cast_frozen_weights_to_fp8, find_projections, load_lora, lora_adapters,
                                  lora_parameters, lora_state_dict, merge_lora, remove_lora, save_lora)
from transformer_fp8.module import LayerNormLinear, LayerNormMLP, Linear

transformers = pytest.importorskip("transformers")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BATCH, SEQ = 2, 24  # 48 tokens: no weight dimension (64, 96, 128, 192) equals it (the op checks tell them apart)
TOKENS = BATCH * SEQ
RECIPE = te.recipe.DelayedScaling(amax_history_len=4)


def tiny_llama(dtype=torch.float32, device="cpu", hidden=64, ffn=96, heads=4):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def randomize_adapters(model, std=0.05):
    """B is zero at init (the adapted model equals the base one): give every B (and A) random values."""
    with torch.no_grad():
        for adapter in lora_adapters(model).values():
            adapter.lora_A.weight.normal_(0, std)
            adapter.lora_B.weight.normal_(0, std)


def adapted(hf, targets=ALL, r=4, alpha=8, **kwargs):
    model = convert_llama(copy.deepcopy(hf))
    add_lora(model, r=r, alpha=alpha, target_modules=targets, **kwargs)
    randomize_adapters(model)
    return model


def token_ids(device="cpu"):
    return torch.randint(0, 128, (BATCH, SEQ), device=device)


# --- adapter math against float64 ------------------------------------------------------------------------------------

def rmsnorm64(x, module):
    gamma = module.layer_norm_weight.detach().double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.eps) * gamma


def with_updates(y, x, adapters, weights):
    """y [..., out] plus scale * x Aᵀ Bᵀ in each adapter's rows (weights: its (A, B) as float64 leaves)."""
    y = y.clone()
    for adapter, (a, b) in zip(adapters, weights):
        y[..., adapter.row_start:adapter.row_end] += adapter.scale * (x @ a.t() @ b.t())
    return y


def adapter_leaves(module):
    adapters = list(module.lora.values())
    return adapters, [p for a in adapters for p in (a.lora_A.weight, a.lora_B.weight)]


def pairs(flat):
    return list(zip(flat[0::2], flat[1::2]))


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["k_proj"], ALL])
def test_qkv_adapters_add_to_their_rows_only(targets):
    model = adapted(tiny_llama(), targets)
    qkv = model.model.layers[0].layer.self_attention.layernorm_qkv
    assert isinstance(qkv, LoraLayerNormLinear) and sorted(qkv.lora) == sorted({"q_proj", "k_proj", "v_proj"} &
                                                                                 set(targets))
    rows = {a.hf_name.rsplit(".", 1)[-1]: (a.row_start, a.row_end) for a in qkv.lora.values()}
    expected = {"q_proj": (0, 64), "k_proj": (64, 96), "v_proj": (96, 128)}  # 4 heads, 2 KV heads of 16 channels
    assert rows == {t: expected[t] for t in rows}
    adapters, leaves = adapter_leaves(qkv)
    weight = qkv.weight.detach().double()
    x = torch.randn(BATCH, SEQ, 64, requires_grad=True)

    def reference(x64, *flat):
        ln = rmsnorm64(x64, qkv)
        return with_updates(ln @ weight.t(), ln, adapters, pairs(flat))

    check_against_float64(qkv(x), [x, *leaves], reference, 1e-6, 1e-5, names=["x"] + [f"w{i}" for i in range(9)])


def test_o_proj_and_mlp_adapters_match_float64():
    model = adapted(tiny_llama())
    attn, mlp = model.model.layers[1].layer.self_attention, model.model.layers[1].layer.layernorm_mlp
    proj = attn.proj
    assert isinstance(proj, LoraLinear) and isinstance(mlp, LoraLayerNormMLP)
    adapters, leaves = adapter_leaves(proj)
    x = torch.randn(BATCH, SEQ, 64, requires_grad=True)
    check_against_float64(proj(x), [x, *leaves],
                          lambda x64, *flat: with_updates(x64 @ proj.weight.detach().double().t(), x64, adapters,
                                                          pairs(flat)), 1e-6, 1e-5, names="xab")
    adapters, leaves = adapter_leaves(mlp)  # gate_proj, up_proj on fc1; down_proj on fc2
    assert sorted((a.gemm, a.row_start, a.row_end) for a in adapters) == [
        ("fc1_weight", 0, 96), ("fc1_weight", 96, 192), ("fc2_weight", 0, 64)]
    w1, w2 = mlp.fc1_weight.detach().double(), mlp.fc2_weight.detach().double()
    x = torch.randn(BATCH, SEQ, 64, requires_grad=True)

    def reference(x64, *flat):
        by_gemm = {"fc1_weight": [], "fc2_weight": []}
        for adapter, ab in zip(adapters, pairs(flat)):
            by_gemm[adapter.gemm].append((adapter, ab))
        ln = rmsnorm64(x64, mlp)
        fc1 = with_updates(ln @ w1.t(), ln, *zip(*by_gemm["fc1_weight"]))
        gate, up = fc1.chunk(2, dim=-1)
        act = F.silu(gate) * up
        return with_updates(act @ w2.t(), act, *zip(*by_gemm["fc2_weight"])) + x64  # (+ the residual)

    check_against_float64(mlp(x, residual=x), [x, *leaves], reference, 1e-6, 1e-5,
                          names=["x"] + [f"w{i}" for i in range(6)])


def test_mlp_adapters_with_layernorm_gelu_and_biases_match_float64():
    """The unfused LoRA MLP with the options convert_llama does not use: LayerNorm (with bias), GELU, GEMM biases,
    return_layernorm_output."""
    from transformer_fp8.lora.adapter import LoraAdapter
    from transformer_fp8.lora.layers import attach_adapter

    mlp = LayerNormMLP(64, 96, bias=True, normalization="LayerNorm", activation="gelu", return_layernorm_output=True,
                       params_dtype=torch.float32, device="cpu")
    with torch.no_grad():
        for p in (mlp.layer_norm_weight, mlp.layer_norm_bias, mlp.fc1_bias, mlp.fc2_bias):
            p.uniform_(-0.5, 0.5)
    for gemm, rows, start, inputs in (("fc1_weight", 48, 16, 64), ("fc2_weight", 64, 0, 96)):
        adapter = LoraAdapter(inputs, rows, 4, 8.0, 0.0, False, start, gemm, f"mlp.{gemm}_proj", torch.float32, "cpu")
        attach_adapter(mlp, adapter, "mlp")
    randomize_adapters(mlp)
    adapters, leaves = adapter_leaves(mlp)
    x = torch.randn(BATCH, SEQ, 64, requires_grad=True)
    out, ln_out = mlp(x)

    def layernorm64(x64):
        mean, var = x64.mean(-1, keepdim=True), x64.var(-1, unbiased=False, keepdim=True)
        return (x64 - mean) * torch.rsqrt(var + mlp.eps) * mlp.layer_norm_weight.double() + \
            mlp.layer_norm_bias.double()

    def reference(x64, *flat):
        w1, b1 = mlp.fc1_weight.detach().double(), mlp.fc1_bias.detach().double()
        w2, b2 = mlp.fc2_weight.detach().double(), mlp.fc2_bias.detach().double()
        (fc1_adapter, fc1_ab), (fc2_adapter, fc2_ab) = sorted(zip(adapters, pairs(flat)), key=lambda t: t[0].gemm)
        ln = layernorm64(x64)
        act = F.gelu(with_updates(ln @ w1.t() + b1, ln, [fc1_adapter], [fc1_ab]), approximate="tanh")
        return with_updates(act @ w2.t() + b2, act, [fc2_adapter], [fc2_ab])

    torch.testing.assert_close(ln_out.double(), layernorm64(x.detach().double()), rtol=1e-5, atol=1e-5)
    check_against_float64(out, [x, *leaves], reference, 1e-6, 1e-5, names=["x"] + [f"w{i}" for i in range(4)])


@pytest.mark.parametrize("fp8", [False, True])
def test_lora_mlp_keeps_fc1_output_but_not_the_activation(fp8):
    """For the backward the adapted MLP keeps FC1's output [tokens, 2 ffn] (the activation's backward needs it) and
    no [tokens, ffn] tensor (down_proj's A gets the activation recomputed)."""
    model = adapted(tiny_llama(torch.bfloat16), fp8_weights=fp8).train()
    mlp = model.model.layers[0].layer.layernorm_mlp
    x = torch.randn(BATCH, SEQ, 64, dtype=torch.bfloat16, requires_grad=True)
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), te.fp8_autocast(enabled=fp8, fp8_recipe=RECIPE):
        out = mlp(x, residual=x)
    kept = [s for s in shapes if math.prod(s) in (TOKENS * 96, TOKENS * 192)]
    assert kept == [(TOKENS, 192)], shapes
    out.float().sum().backward()
    assert all(a.lora_A.weight.grad is not None for a in mlp.lora.values())


# --- Hugging Face names, PEFT's format -------------------------------------------------------------------------------

def test_projections_name_hugging_face_modules_and_our_rows():
    model = convert_llama(tiny_llama())
    found = {p.hf_name: (p.module_name, p.gemm, p.row_start, p.row_end) for p in find_projections(model)}
    assert len(found) == 2 * 7
    assert found["model.layers.1.self_attn.k_proj"] == ("model.layers.1.layer.self_attention.layernorm_qkv",
                                                        "weight", 64, 96)
    assert found["model.layers.0.mlp.up_proj"] == ("model.layers.0.layer.layernorm_mlp", "fc1_weight", 96, 192)
    assert found["model.layers.0.mlp.down_proj"] == ("model.layers.0.layer.layernorm_mlp", "fc2_weight", 0, 64)


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ALL, r"model\.layers\.1\..*_proj"])
def test_saved_adapter_gives_peft_the_same_logits(targets, tmp_path):
    PeftModel = pytest.importorskip("peft").PeftModel

    hf = tiny_llama()
    ours = adapted(hf, targets, use_rslora=isinstance(targets, str))
    ids = token_ids()
    with torch.no_grad():
        logits = ours(input_ids=ids).logits
    save_lora(ours, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    with torch.no_grad():
        base = hf(input_ids=ids).logits
        peft_logits = PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path).eval()(input_ids=ids).logits
    assert (peft_logits - base).abs().max() > 1e-2  # (the adapters change the logits: the comparison means something)
    torch.testing.assert_close(peft_logits, logits, rtol=1e-5, atol=1e-5)
    reloaded = load_lora(convert_llama(copy.deepcopy(hf)), tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, logits, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3", "llama-attention-bias"])
def test_other_families_round_trip_through_peft(family, tmp_path):
    PeftModel = pytest.importorskip("peft").PeftModel

    from tests.test_families import tiny_model
    from transformer_fp8.integrations import convert_model

    hf = tiny_model(family)
    ours = convert_model(copy.deepcopy(hf))
    add_lora(ours, r=4, alpha=8, target_modules="all-linear")
    randomize_adapters(ours)
    assert len(lora_adapters(ours)) == 2 * 7
    ids = torch.randint(0, 96, (BATCH, SEQ))
    save_lora(ours, tmp_path)
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path).eval()(input_ids=ids).logits
        assert (peft_logits - hf(input_ids=ids).logits).abs().max() > 1e-2
        torch.testing.assert_close(ours(input_ids=ids).logits, peft_logits, rtol=1e-5, atol=1e-5)


def test_adapted_model_generates_what_peft_generates(tmp_path):
    """Greedy generation with the KV cache: our adapted converted model and PEFT on the plain model pick the same
    tokens (float32)."""
    PeftModel = pytest.importorskip("peft").PeftModel
    hf = tiny_llama()
    hf.config.use_cache = True
    ours = adapted(hf)
    save_lora(ours, tmp_path)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path).eval()
    prompt = torch.randint(0, 128, (2, 8))
    settings = dict(max_new_tokens=12, do_sample=False, use_cache=True, attention_mask=torch.ones_like(prompt),
                    pad_token_id=0)
    with torch.no_grad():
        ours_tokens = ours.generate(input_ids=prompt, **settings)
        assert torch.equal(ours_tokens, peft_model.generate(input_ids=prompt, **settings))
        assert not torch.equal(ours_tokens, hf.generate(input_ids=prompt, **settings))  # (the adapters matter)


def test_peft_saved_adapter_loads_into_a_converted_model(tmp_path):
    peft = pytest.importorskip("peft")
    LoraConfig, get_peft_model = peft.LoraConfig, peft.get_peft_model

    hf = tiny_llama()
    peft_model = get_peft_model(copy.deepcopy(hf), LoraConfig(r=8, lora_alpha=16, target_modules=["k_proj", "up_proj",
                                                                                                  "o_proj"]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.05)
    peft_model.save_pretrained(tmp_path)
    ids = token_ids()
    ours = load_lora(convert_llama(copy.deepcopy(hf)), tmp_path)
    assert sorted({a.hf_name.rsplit(".", 1)[-1] for a in lora_adapters(ours).values()}) == ["k_proj", "o_proj",
                                                                                              "up_proj"]
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, peft_model.eval()(input_ids=ids).logits, rtol=1e-5,
                                   atol=1e-5)


def test_linear_layers_of_convert_linear_layers_take_adapters(tmp_path):
    PeftModel = pytest.importorskip("peft").PeftModel

    hf = tiny_llama()
    ours = convert_linear_layers(copy.deepcopy(hf))
    add_lora(ours, r=4, alpha=4, target_modules=["q_proj", "down_proj"])
    randomize_adapters(ours)
    assert isinstance(ours.model.layers[0].self_attn.q_proj, LoraLinear)
    assert type(ours.model.layers[0].self_attn.k_proj) is Linear
    save_lora(ours, tmp_path)
    ids = token_ids()
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path).eval()(input_ids=ids).logits
        torch.testing.assert_close(ours(input_ids=ids).logits, peft_logits, rtol=1e-5, atol=1e-5)


def test_partial_targets_are_saved_by_full_name(tmp_path):
    ours = adapted(tiny_llama(), r"model\.layers\.0\.self_attn\.q_proj")
    save_lora(ours, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["target_modules"] == ["model.layers.0.self_attn.q_proj"]
    assert sorted(lora_state_dict(ours)) == ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                                             "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]


# --- training: gradients, frozen base weights, FP8 -------------------------------------------------------------------

@pytest.mark.parametrize("fp8_weights", [False, True])
def test_only_adapters_get_gradients(fp8_weights):
    model = adapted(tiny_llama(torch.bfloat16), fp8_weights=fp8_weights).train()
    adapter_ids = {id(p) for p in lora_parameters(model)}
    assert len(adapter_ids) == 2 * 7 * 2
    assert {id(p) for p in model.parameters() if p.requires_grad} == adapter_ids
    with te.fp8_autocast(fp8_recipe=RECIPE):
        loss = causal_lm_loss(model, token_ids())
    loss.backward()
    for name, param in model.named_parameters():
        if id(param) in adapter_ids:
            assert param.grad is not None and param.grad.abs().sum() > 0, name
        else:
            assert param.grad is None, name


def test_fp8_weights_halve_the_base_weights_and_keep_the_output():
    hf = tiny_llama(torch.bfloat16)
    model = adapted(hf)
    before = sum(p.numel() * p.element_size() for p in model.model.layers.parameters() if not p.requires_grad)
    ids = token_ids()
    with torch.no_grad():
        reference = model(input_ids=ids).logits.float()
    assert cast_frozen_weights_to_fp8(model) == 2 * 4  # per layer: qkv, proj, fc1, fc2
    weights = [m.weight for m in model.modules() if isinstance(m, (Linear, LayerNormLinear))] + \
        [w for m in model.modules() if isinstance(m, LayerNormMLP) for w in (m.fc1_weight, m.fc2_weight)]
    assert len(weights) == 8 and all(isinstance(w, Float8Tensor) and not w.requires_grad for w in weights)
    after = sum(w._data.numel() for w in weights) + sum(
        p.numel() * p.element_size() for p in model.model.layers.parameters()
        if not p.requires_grad and not isinstance(p, Float8Tensor))
    assert after < 0.55 * before
    with torch.no_grad():
        dequantized = model(input_ids=ids).logits.float()  # outside fp8_autocast: the dequantized weights
        with te.fp8_autocast(fp8_recipe=RECIPE):
            fp8 = model(input_ids=ids).logits.float()
    assert_close_rel(dequantized, reference, 0.06)  # (one E4M3 rounding of each weight)
    assert_close_rel(fp8, reference, 0.1)


class RecordedOps(TorchDispatchMode):
    """(phase, op name, {argument: value}) of every transformer_fp8 op called (composite ops' inner calls too)."""

    def __init__(self):
        super().__init__()
        self.phase, self.calls = "forward", []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "transformer_fp8":
            arguments = {a.name: args[i] if i < len(args) else kwargs.get(a.name, a.default_value)
                         for i, a in enumerate(func._schema.arguments)}
            self.calls.append((self.phase, func._schema.name.split("::")[1], arguments))
        return func(*args, **kwargs)


def rows(t):
    return t.shape[0] if isinstance(t, torch.Tensor) and t.dim() == 2 else None


def check_no_weight_gradient_work(calls, fp8_weights):
    """No wgrad GEMM (its operands are dyᵀ and xᵀ, [features, tokens]), no FP8 transpose of a GEMM input or
    gradient (rows = tokens), and with FP8 base weights no cast of a weight at all."""
    names = [name for _, name, _ in calls]
    assert "fp8_gemm" in names or "fp8_linear_bwd" in names
    assert "fp8_gemm_accumulate" not in names
    for phase, name, args in calls:
        if name == "fp8_gemm" and phase == "backward":
            assert rows(args["a"]) == TOKENS, "a backward GEMM over [features, tokens] operands: a wgrad"
        if name == "fp8_linear_bwd":
            assert args["x_t"] is None, "fp8_linear_bwd was given xᵀ: a wgrad"
        if name == "fp8_transpose":
            assert rows(args["input"]) != TOKENS, "an FP8 transpose of activations (only a wgrad reads them)"
        if name in ("cast_transpose", "cast_transpose_dbias", "dact_cast_transpose") and rows(
                args.get("input", args.get("grad", args.get("grad_out")))) == TOKENS:
            assert not args.get("transpose", True), f"{name} made a transpose"  # (cast_transpose_dbias: always)
        if name == "fp8_linear_fwd":
            assert not args["x_transpose"], "fp8_linear_fwd made xᵀ"
        if fp8_weights and name in ("quantize", "cast_transpose", "fp8_linear_fwd"):
            tensor = args.get("input", args.get("x"))
            assert rows(tensor) == TOKENS, f"{name} cast a weight ({tuple(tensor.shape)})"


@pytest.mark.parametrize("fp8_weights", [False, True])
def test_frozen_base_weights_get_no_wgrad_gemm_nor_input_transposes(fp8_weights):
    model = adapted(tiny_llama(torch.bfloat16), fp8_weights=fp8_weights).train()
    for step in range(2):  # (the first step calibrates the scales; the second runs the fused paths)
        recorder = RecordedOps()
        with recorder:
            with te.fp8_autocast(fp8_recipe=RECIPE):
                loss = causal_lm_loss(model, token_ids())
            recorder.phase = "backward"
            loss.backward()
        check_no_weight_gradient_work(recorder.calls, fp8_weights)
        norms = [name for phase, name, _ in recorder.calls if phase == "forward" and name == "rmsnorm_fwd"]
        assert len(norms) == 2 * 2 + 1  # each norm once (the adapters read its output), the final norm


def fp8_lora_steps(model, batches, between=None):
    """A training step (fp8_autocast forward, backward) of model per batch; returns, per step, the number of
    fp8_transpose calls and the adapters' gradients (zeroed after each step). between(step) runs before each step."""
    transposes, grads = [], []
    for step, ids in enumerate(batches):
        if between is not None:
            between(step)
        recorder = RecordedOps()
        with recorder:
            with te.fp8_autocast(fp8_recipe=RECIPE):
                loss = causal_lm_loss(model, ids)
            recorder.phase = "backward"
            loss.backward()
        check_no_weight_gradient_work(recorder.calls, fp8_weights=True)
        transposes.append(sum(name == "fp8_transpose" for _, name, _ in recorder.calls))
        grads.append([p.grad.clone() for p in lora_parameters(model)])
        model.zero_grad(set_to_none=True)
    return transposes, grads


def frozen_fp8_weights(model):
    return [p for p in model.parameters() if isinstance(p, Float8Tensor)]


@pytest.mark.parametrize("targets", [ALL, ["q_proj", "v_proj"]])  # (v_proj only: the fused MLP and o_proj too)
def test_cached_weight_transposes_make_no_transpose_after_the_first_step(targets):
    """One byte transpose per frozen FP8 weight per step without the option; with it, the first step's are kept (one
    more byte per weight element) and no later step transposes; the gradients are the same bit for bit."""
    hf = tiny_llama(torch.bfloat16)
    plain = adapted(hf, targets, fp8_weights=True).train()
    cached = copy.deepcopy(plain)
    cast_frozen_weights_to_fp8(cached, cache_weight_transpose=True)  # (the weights are FP8 already: flags only)
    weights = frozen_fp8_weights(cached)
    assert len(weights) == 2 * 4 and all(w._kept_transpose is None for w in weights)  # (made by the first backward)
    batches = [token_ids() for _ in range(3)]
    plain_counts, plain_grads = fp8_lora_steps(plain, batches)
    cached_counts, cached_grads = fp8_lora_steps(cached, batches)
    dgrads = len(weights) - 1  # (the first QKV GEMM's input, the frozen embedding's output, needs no gradient)
    assert plain_counts == [dgrads] * 3
    assert cached_counts == [dgrads, 0, 0]
    first_qkv = cached.model.layers[0].layer.self_attention.layernorm_qkv.weight
    assert first_qkv._kept_transpose is None
    for w in (w for w in weights if w is not first_qkv):
        kept = w._kept_transpose[2]
        assert kept.dtype == w._data.dtype and kept.shape == w.shape[::-1] and kept.numel() == w._data.numel()
        assert torch.equal(kept.float(), w._data.float().t())
    for a, b in zip(plain_grads, cached_grads):
        for p, q in zip(a, b):
            torch.testing.assert_close(q, p, rtol=0, atol=0)


WRITES = {  # in-place writes of an FP8 weight (to -0.5 times its value)
    "copy_": lambda module, w: w.copy_(w.dequantize() * -0.5),
    "mul_": lambda module, w: w.mul_(-0.5),
    "quantize_": lambda module, w: w.quantize_(w.dequantize() * -0.5),
    "load_state_dict": lambda module, w: module.load_state_dict({"fc2_weight": w.dequantize() * -0.5}, strict=False),
    "_data": lambda module, w: write_fp8_data(w, Float8Tensor.from_hp(w.dequantize() * -0.5)),
}


def write_fp8_data(weight, new):
    weight._data.copy_(new._data)
    weight._scale_inv.copy_(new._scale_inv)


@pytest.mark.parametrize("write", WRITES)
def test_cached_weight_transpose_follows_in_place_writes(write):
    """A weight written in place (copy_, load_state_dict, quantize_, ops, its data itself) gets a fresh transpose,
    once."""
    hf = tiny_llama(torch.bfloat16)
    plain = adapted(hf, fp8_weights=True).train()
    cached = adapted(hf, fp8_weights=True, cache_weight_transpose=True).train()
    cached.load_state_dict(plain.state_dict())  # (the same adapters: `adapted` draws new ones)
    batches = [token_ids()] * 4

    def rescale_one_weight(model):
        def act(step):
            if step == 2:
                with torch.no_grad():
                    mlp = model.model.layers[1].layer.layernorm_mlp
                    WRITES[write](mlp, mlp.fc2_weight)
        return act

    plain_counts, plain_grads = fp8_lora_steps(plain, batches, rescale_one_weight(plain))
    cached_counts, cached_grads = fp8_lora_steps(cached, batches, rescale_one_weight(cached))
    assert plain_counts == [7] * 4 and cached_counts == [7, 0, 1, 0]  # (7 dgrads: see the test above)
    assert not torch.equal(plain_grads[1][0], plain_grads[2][0])  # (the write changed the gradients)
    for a, b in zip(plain_grads, cached_grads):
        for p, q in zip(a, b):
            torch.testing.assert_close(q, p, rtol=0, atol=0)


@pytest.mark.parametrize("drop", [merge_lora, remove_lora])
def test_merge_and_remove_drop_the_cached_transposes(drop):
    model = adapted(tiny_llama(torch.bfloat16), ["q_proj"], fp8_weights=True, cache_weight_transpose=True).train()
    fp8_lora_steps(model, [token_ids()])
    assert sum(w._kept_transpose is not None for w in frozen_fp8_weights(model)) == 2 * 4 - 1
    drop(model)
    weights = frozen_fp8_weights(model)  # (merge_lora: the weights without adapters stay FP8)
    assert len(weights) == (2 * 4 if drop is remove_lora else 2 * 4 - 2)
    assert all(w._kept_transpose is None and not w._keep_transpose for w in weights)


def test_activation_checkpointing_gives_the_same_gradients():
    hf = tiny_llama(torch.bfloat16)
    plain, checkpointed = adapted(hf, fp8_weights=True).train(), None
    checkpointed = copy.deepcopy(plain)
    gradient_checkpointing_enable(checkpointed)
    ids = token_ids()
    for model in (plain, checkpointed):
        with te.fp8_autocast(fp8_recipe=RECIPE):
            causal_lm_loss(model, ids).backward()
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)


def test_fp8_training_on_cpu_lowers_the_loss_and_tracks_bf16():
    hf = tiny_llama(torch.bfloat16)
    runs = {}
    for fp8 in (False, True):
        torch.manual_seed(0)
        model = convert_llama(copy.deepcopy(hf)).train()
        add_lora(model, r=8, alpha=16, target_modules=ALL, fp8_weights=fp8)
        optimizer = torch.optim.AdamW(lora_parameters(model), lr=3e-3)
        batch, losses = token_ids(), []
        for _ in range(6):
            with te.fp8_autocast(enabled=fp8, fp8_recipe=RECIPE):
                loss = causal_lm_loss(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        assert len(optimizer.state) == len(lora_parameters(model))  # optimizer state for the adapters only
        runs[fp8] = losses
    for losses in runs.values():
        assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.05
    assert max(abs(a - b) for a, b in zip(runs[False], runs[True])) < 0.05 * runs[False][0]


# --- merge, remove ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fp8_weights", [False, True])
def test_merged_model_computes_what_the_adapted_one_did(fp8_weights):
    model = adapted(tiny_llama(), fp8_weights=fp8_weights)
    keys = set(convert_llama(tiny_llama()).state_dict())
    ids = token_ids()
    with torch.no_grad():
        unmerged = model(input_ids=ids).logits
        merge_lora(model)
        merged = model(input_ids=ids).logits
    torch.testing.assert_close(merged, unmerged, rtol=1e-5, atol=1e-5)
    assert not lora_adapters(model) and set(model.state_dict()) == keys
    assert not any(isinstance(m, (LoraLinear, LoraLayerNormLinear, LoraLayerNormMLP)) for m in model.modules())
    assert not any(isinstance(p, Float8Tensor) for p in model.parameters())  # (every GEMM weight had adapters)
    qkv = model.model.layers[0].layer.self_attention.layernorm_qkv
    assert not isinstance(qkv.weight, Float8Tensor) and qkv.return_layernorm_output is False


def test_merged_model_exports_a_plain_hugging_face_checkpoint():
    from transformer_fp8.integrations import to_hf_state_dict

    hf = tiny_llama()
    model = adapted(hf, fp8_weights=True)
    with pytest.raises(ValueError, match="has LoRA adapters.*merge_lora"):
        to_hf_state_dict(model)  # (exporting the base alone would drop the adapters without a word)
    ids = token_ids()
    with torch.no_grad():
        adapted_logits = model(input_ids=ids).logits
        exported = copy.deepcopy(hf)
        exported.load_state_dict(to_hf_state_dict(merge_lora(model)), strict=True)
        torch.testing.assert_close(exported(input_ids=ids).logits, adapted_logits, rtol=1e-5, atol=1e-5)


def test_save_pretrained_writes_the_adapters_until_they_are_merged(tmp_path):
    PeftModel = pytest.importorskip("peft").PeftModel
    hf = tiny_llama()
    model = adapted(hf)
    ids = token_ids()
    model.save_pretrained(tmp_path / "adapter", state_dict=None, safe_serialization=True)  # (as Trainer calls it)
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json",
                                                                       "adapter_model.safetensors"]
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "adapter").eval()(input_ids=ids).logits
        torch.testing.assert_close(model(input_ids=ids).logits, peft_logits, rtol=1e-5, atol=1e-5)
        merge_lora(model)
    model.save_pretrained(tmp_path / "merged")  # the converted model's own: a plain Hugging Face checkpoint
    reloaded = type(hf).from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, peft_logits, rtol=1e-5, atol=1e-5)


def test_fp8_trainer_trains_the_adapters_and_saves_them(tmp_path):
    from transformers import TrainingArguments

    from transformer_fp8.integrations import FP8Trainer

    hf = tiny_llama()
    model = convert_llama(copy.deepcopy(hf)).train()
    add_lora(model, r=4, alpha=8, target_modules=["q_proj", "down_proj"], fp8_weights=True)
    before = {name: t.clone() for name, t in lora_state_dict(model).items()}
    ids = [torch.randint(0, 128, (16,)) for _ in range(8)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3, save_steps=2,
                             learning_rate=1e-2, report_to=[], use_cpu=True)
    trainer = FP8Trainer(model=model, args=args, train_dataset=[{"input_ids": t, "labels": t} for t in ids])
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    for folder in ("checkpoint-2", "final"):
        assert (tmp_path / folder / "adapter_model.safetensors").is_file()
    changed = [name for name, t in lora_state_dict(model).items() if not torch.equal(t, before[name])]
    assert sorted(changed) == sorted(before)  # (every A and B trained)
    reloaded = load_lora(convert_llama(copy.deepcopy(hf)), tmp_path / "final", fp8_weights=True)  # (as trained)
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model.eval()(input_ids=ids).logits, rtol=1e-5,
                                   atol=1e-5)


def test_remove_lora_gives_back_the_base_model():
    hf = tiny_llama()
    base = convert_llama(copy.deepcopy(hf))
    model = adapted(hf)
    ids = token_ids()
    remove_lora(model)
    assert type(model.model.layers[0].layer.layernorm_mlp) is LayerNormMLP
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, base(input_ids=ids).logits, rtol=0, atol=0)


def test_dropout_acts_in_training_only():
    model = adapted(tiny_llama(), dropout=0.3)
    ids = token_ids()
    with torch.no_grad():
        eval_logits = model(input_ids=ids).logits
        no_dropout = copy.deepcopy(model)
        for adapter in lora_adapters(no_dropout).values():
            adapter.lora_dropout.p = 0.0
        torch.testing.assert_close(no_dropout(input_ids=ids).logits, eval_logits, rtol=0, atol=0)
        model.train()
        assert (model(input_ids=ids).logits - eval_logits).abs().max() > 1e-4


# --- bad arguments ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    (dict(target_modules=["q_proj", "qproj"]), ValueError, r"target_modules: \['qproj'\] match no projection"),
    (dict(target_modules=["lm_head"]), ValueError, r"lm_head.*cannot carry adapters"),
    (dict(target_modules=[]), ValueError, "target_modules: expected a non-empty list"),
    (dict(target_modules=r"nothing\.here"), ValueError, "matches no projection"),
    (dict(target_modules="q_proj[("), ValueError, "not a valid regular expression"),
    (dict(target_modules=3), TypeError, "target_modules: expected a list"),
    (dict(r=0), ValueError, "r: expected a positive int"),
    (dict(r=-4), ValueError, "r: expected a positive int"),
    (dict(r=True), ValueError, "r: expected a positive int"),
    (dict(r=4.0), ValueError, "r: expected a positive int"),
    (dict(alpha=0), ValueError, "alpha: expected a finite number > 0"),
    (dict(alpha=float("nan")), ValueError, "alpha: expected a finite number > 0"),
    (dict(dropout=1.0), ValueError, r"dropout: expected a probability in \[0, 1\)"),
    (dict(dropout=-0.1), ValueError, "dropout: expected a probability"),
    (dict(use_rslora="yes"), TypeError, "use_rslora: expected a bool"),
    (dict(dtype=torch.float8_e4m3fn), TypeError, "dtype: expected None or a high-precision"),
    (dict(fp8_weights=True, freeze_base=False), ValueError, "fp8_weights=True needs freeze_base=True"),
    (dict(cache_weight_transpose=True), ValueError, "cache_weight_transpose=True needs fp8_weights=True"),
    (dict(fp8_weights=True, cache_weight_transpose=1), TypeError, "cache_weight_transpose: expected a bool"),
])
def test_bad_arguments_are_refused_by_name(kwargs, error, match):
    model = convert_llama(tiny_llama())
    with pytest.raises(error, match=match):
        add_lora(model, **kwargs)
    assert not lora_adapters(model)


def test_unconverted_model_and_a_second_adapter_are_refused(tmp_path):
    with pytest.raises(ValueError, match="convert it first"):
        add_lora(tiny_llama(), target_modules=["q_proj"])
    model = adapted(tiny_llama(), ["q_proj"])
    with pytest.raises(ValueError, match="already have LoRA adapters"):
        add_lora(model, target_modules=["q_proj", "v_proj"])
    with pytest.raises(ValueError, match="has no LoRA adapters to merge"):
        merge_lora(convert_llama(tiny_llama()))
    with pytest.raises(ValueError, match="has no LoRA adapters to save"):
        save_lora(convert_llama(tiny_llama()), tmp_path)


def test_load_lora_refuses_what_it_cannot_honour(tmp_path):
    model = adapted(tiny_llama(), ["q_proj"])
    save_lora(model, tmp_path / "a")
    with pytest.raises(FileNotFoundError, match="no adapter_config.json"):
        load_lora(convert_llama(tiny_llama()), tmp_path)
    config_path = tmp_path / "a" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    for field, value in (("use_dora", True), ("bias", "all"), ("rank_pattern", {"q_proj": 8}),
                         ("modules_to_save", ["lm_head"]), ("peft_type", "IA3")):
        config_path.write_text(json.dumps({**config, field: value}))
        with pytest.raises(ValueError, match=field):
            load_lora(convert_llama(tiny_llama()), tmp_path / "a")
    config_path.write_text(json.dumps(config))
    other = adapted(tiny_llama(), ["v_proj"])  # adapters that are not the folder's
    with pytest.raises(ValueError, match="does not fit the model's adapters"):
        load_lora(other, tmp_path / "a")
    wrong_rank = adapted(tiny_llama(), ["q_proj"], r=2)
    with pytest.raises(ValueError, match="has shape"):
        load_lora(wrong_rank, tmp_path / "a")


# --- CUDA ------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("fp8_weights, cache_weight_transpose", [(False, False), (True, False), (True, True)])
def test_cuda_fp8_lora_step_tracks_bf16_and_skips_wgrad(fp8_weights, cache_weight_transpose):
    hf = tiny_llama(torch.bfloat16, "cuda", hidden=256, ffn=704, heads=8)  # (head_dim 32, as the other GPU tests)
    model = adapted(hf, fp8_weights=fp8_weights).train()
    reference = copy.deepcopy(model)
    if cache_weight_transpose:
        cast_frozen_weights_to_fp8(model, cache_weight_transpose=True)
    ids = token_ids("cuda")
    transposes = []
    for step in range(3):
        recorder = RecordedOps()
        with recorder:
            with te.fp8_autocast(fp8_recipe=RECIPE):
                loss = causal_lm_loss(model, ids)
            recorder.phase = "backward"
            loss.backward()
        check_no_weight_gradient_work(recorder.calls, fp8_weights)
        transposes.append(sum(name == "fp8_transpose" for _, name, _ in recorder.calls))
    if fp8_weights:  # (one per frozen FP8 weight whose dgrad runs: all 8 but the first QKV's)
        assert transposes == ([7, 0, 0] if cache_weight_transpose else [7, 7, 7])
    bf16_loss = causal_lm_loss(reference, ids)
    bf16_loss.backward()
    assert abs(loss.item() - bf16_loss.item()) < 0.02 * bf16_loss.item()
    pairs_ = [(name, p.grad / 3, q.grad) for (name, p), q in zip(model.named_parameters(), reference.parameters())
              if p.requires_grad]  # (three backwards accumulated)
    for name, ours, want in pairs_:  # (E5M2 gradients through FP8 dgrads of the layers above: CPU emulation 0.13)
        assert_close_rel(ours, want, 0.25, name)
    assert_close_rel(torch.cat([o.flatten() for _, o, _ in pairs_]), torch.cat([w.flatten() for _, _, w in pairs_]),
                     0.12, "all adapter gradients")  # (CPU emulation: 0.06-0.08)


@pytest.mark.gpu
def test_cuda_cached_weight_transposes_give_the_same_gradients():
    """On the CUDA kernels: the kept transposes (made once, by fp8_transpose) give the dgrads that the per-step
    transposes give, bit for bit, and no step after the first transposes a frozen weight."""
    hf = tiny_llama(torch.bfloat16, "cuda", hidden=256, ffn=704, heads=8)
    for targets in (ALL, ["q_proj", "v_proj"]):  # (the unfused LoRA MLP and the fused one)
        plain = adapted(hf, targets, fp8_weights=True).train()
        cached = copy.deepcopy(plain)
        cast_frozen_weights_to_fp8(cached, cache_weight_transpose=True)
        batches = [token_ids("cuda") for _ in range(3)]
        plain_counts, plain_grads = fp8_lora_steps(plain, batches)
        cached_counts, cached_grads = fp8_lora_steps(cached, batches)
        assert plain_counts == [7] * 3 and cached_counts == [7, 0, 0], targets
        for a, b in zip(plain_grads, cached_grads):
            for p, q in zip(a, b):
                torch.testing.assert_close(q, p, rtol=0, atol=0)
