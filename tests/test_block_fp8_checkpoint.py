"""Block-FP8 Hugging Face checkpoints (DeepSeek-V3 / Qwen3-FP8 format) loaded into converted models, bytes kept.

Each test writes its own tiny checkpoint: a random Llama or Qwen3 model (dims multiples of 128) whose decoder-layer
linear weights the test quantizes with its own plain-torch 128x128 block quantizer (loop over blocks), saved as
`weight` (E4M3) + `weight_scale_inv` [cdiv(out, 128), cdiv(in, 128)] with safetensors, and config.json with the
"fp8" quantization_config. The reference is the same Hugging Face model with the dequantized weights.
"""
import json

import pytest
import torch

import transformer_fp8 as te
from transformer_fp8 import Float8Tensor
from transformer_fp8.integrations.block_fp8_checkpoint import (block_fp8_state_dict, check_block_fp8_config,
                                                               load_block_fp8_pretrained)
from tests.test_block_fp8_weights import reference_quantize
from tests.utils import rel_error

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QUANT_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}


def reference_block_quantize(w):
    """The test's own block quantizer: one float32 scale per 128x128 block (scale = 448 / amax, 1 for an all-zero
    block), returned as a checkpoint stores it: (E4M3 data [N, K], scale_inv [cdiv(N, 128), cdiv(K, 128)])."""
    rows, cols = w.shape
    data = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty(-(-rows // 128), -(-cols // 128))
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            tile = w[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)].float()
            amax = tile.abs().max()
            scale = torch.tensor(448.0) / amax if amax > 0 else torch.tensor(1.0)
            data[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)] = (tile * scale).clamp(-448, 448).to(data.dtype)
            scale_inv[i, j] = 1.0 / scale
    return data, scale_inv


def reference_dequantize(data, scale_inv):
    full = scale_inv.repeat_interleave(128, 0)[:data.shape[0]].repeat_interleave(128, 1)[:, :data.shape[1]]
    return data.float() * full


def tiny_config(family, kv_head_dim=128, tie=False):
    common = dict(hidden_size=256, intermediate_size=384, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=kv_head_dim, num_hidden_layers=2, vocab_size=320, max_position_embeddings=64,
                  tie_word_embeddings=tie, rms_norm_eps=1e-6)
    return transformers.LlamaConfig(**common) if family == "llama" else transformers.Qwen3Config(**common)


def write_checkpoint(directory, config, quant_config=QUANT_CONFIG):
    """A random model saved as a block-FP8 checkpoint. Returns (the file's tensors, the Hugging Face model with the
    dequantized weights (float32): the reference)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = {}
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith(".weight") and name.split(".")[-2] in QUANTIZED:
                data, scale_inv = reference_block_quantize(tensor)
                tensors[name], tensors[name + "_scale_inv"] = data, scale_inv
                tensor.copy_(reference_dequantize(data, scale_inv))
            elif not (config.tie_word_embeddings and name == "lm_head.weight"):
                tensors[name] = tensor.to(torch.bfloat16).contiguous()
                tensor.copy_(tensors[name])
    safetensors_torch.save_file(tensors, str(directory / "model.safetensors"))
    saved = config.to_dict()
    saved.update(quantization_config=quant_config, torch_dtype="bfloat16")
    (directory / "config.json").write_text(json.dumps(saved))
    return tensors, model


def fused_parts():
    """Our fused parameters of a converted layer and the Hugging Face modules they are made of, in row order."""
    return {"layer.self_attention.layernorm_qkv.weight": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
            "layer.self_attention.proj.weight": ["self_attn.o_proj"],
            "layer.layernorm_mlp.fc1_weight": ["mlp.gate_proj", "mlp.up_proj"],
            "layer.layernorm_mlp.fc2_weight": ["mlp.down_proj"]}


def as_bytes(t):
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("family,tie", [("llama", False), ("qwen3", True)])
def test_weights_keep_the_checkpoint_bytes_and_scales(tmp_path, family, tie):
    tensors, _ = write_checkpoint(tmp_path, tiny_config(family, tie=tie))
    model = load_block_fp8_pretrained(tmp_path, dtype=torch.bfloat16)
    assert not hasattr(model.config, "quantization_config") and model.tfp8_conversion.family == family
    layers = model.model.layers
    for index, layer in enumerate(layers):
        params = dict(layer.named_parameters())
        for ours, parts in fused_parts().items():
            weight = params[ours]
            assert isinstance(weight, Float8Tensor) and weight.layout == "block_128x128"
            assert weight.dtype == torch.bfloat16
            names = [f"model.layers.{index}.{part}.weight" for part in parts]
            assert torch.equal(as_bytes(weight._data), as_bytes(torch.cat([tensors[n] for n in names])))
            scales = torch.cat([tensors[n + "_scale_inv"] for n in names])
            kb = scales.shape[1]
            assert torch.equal(weight._scale_inv[:, :kb], scales)
            assert torch.equal(weight._scale_inv[:, kb:], torch.ones_like(weight._scale_inv[:, kb:]))
    assert torch.equal(model.model.embed_tokens.weight, tensors["model.embed_tokens.weight"])
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_logits_match_the_dequantized_model_on_cpu(tmp_path, family):
    _, reference = write_checkpoint(tmp_path, tiny_config(family))
    model = load_block_fp8_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = reference(ids).logits, model(ids).logits
    assert rel_error(got, want) < 1e-5  # the same dequantized weights, float32 (outside fp8_autocast)


def test_logits_under_block_scaling_on_cpu(tmp_path):
    _, reference = write_checkpoint(tmp_path, tiny_config("llama"))
    model = load_block_fp8_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = reference(ids).logits
        with te.fp8_autocast(fp8_recipe=te.recipe.Float8BlockScaling()):
            got = model(ids).logits
            tokens = model.generate(ids[:1, :8], max_new_tokens=3, do_sample=False)  # (decode: one-token GEMMs)
    assert 1e-4 < rel_error(got, want) < 0.08  # FP8 activations (1x128 tiles), the checkpoint's weights
    assert tokens.shape == (1, 11) and torch.equal(tokens[:, :8], ids[:1, :8])


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_forward_and_generate_under_block_scaling_on_gpu(tmp_path, family):
    _, reference = write_checkpoint(tmp_path, tiny_config(family))
    reference = reference.to("cuda", torch.bfloat16)
    model = load_block_fp8_pretrained(tmp_path, dtype=torch.bfloat16, device="cuda")
    weight = model.model.layers[0].layer.layernorm_mlp.fc1_weight
    assert weight.device.type == "cuda" and weight.layout == "block_128x128"
    ids = torch.randint(0, 320, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    with torch.no_grad():
        want = reference(ids).logits.float()
        with te.fp8_autocast(fp8_recipe=te.recipe.Float8BlockScaling()):
            got = model(ids).logits.float()
            tokens = model.generate(ids[:1, :8], max_new_tokens=4, do_sample=False)
    assert 1e-4 < rel_error(got, want) < 0.08
    assert tokens.shape == (1, 12)


def test_misaligned_fused_parts_are_refused_or_requantized(tmp_path):
    tensors, reference = write_checkpoint(tmp_path, tiny_config("llama", kv_head_dim=64))  # k, v: 64 rows
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight \(64 rows"):
        load_block_fp8_pretrained(tmp_path, dtype=torch.float32)
    model = load_block_fp8_pretrained(tmp_path, dtype=torch.float32, requantize=True)
    qkv = model.model.layers[0].layer.self_attention.layernorm_qkv.weight
    assert isinstance(qkv, Float8Tensor) and qkv.layout == "block_128x128"
    mlp = model.model.layers[0].layer.layernorm_mlp.fc1_weight  # (aligned: still the file's bytes)
    assert torch.equal(as_bytes(mlp._data), as_bytes(torch.cat([tensors["model.layers.0.mlp.gate_proj.weight"],
                                                                tensors["model.layers.0.mlp.up_proj.weight"]])))
    ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert rel_error(model(ids).logits, reference(ids).logits) < 0.05  # the fused QKV re-quantized once


@pytest.mark.parametrize("field,value,message", [
    ("activation_scheme", "static", "activation_scheme: .* 'dynamic', got 'static'"),
    ("weight_block_size", [64, 64], r"weight_block_size: .*\[128, 128\], got \[64, 64\]"),
    ("quant_method", "fbgemm_fp8", "quant_method: .* 'fp8', got 'fbgemm_fp8'"),
    ("scale_fmt", "ue8m0", "scale_fmt: .*'float', got 'ue8m0'"),
    ("fmt", "e5m2", "fmt: .*'e4m3', got 'e5m2'"),
    ("modules_to_convert", ["embed_tokens"], "modules_to_convert"),
])
def test_other_quantization_configs_are_refused(tmp_path, field, value, message):
    config = dict(QUANT_CONFIG, **{field: value})
    with pytest.raises(ValueError, match=message):
        check_block_fp8_config(config)
    write_checkpoint(tmp_path, tiny_config("llama"), config)
    with pytest.raises(ValueError, match=message):
        load_block_fp8_pretrained(tmp_path)


def test_a_checkpoint_without_quantization_config_is_refused(tmp_path):
    write_checkpoint(tmp_path, tiny_config("llama"))
    saved = json.loads((tmp_path / "config.json").read_text())
    del saved["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="no quantization_config"):
        load_block_fp8_pretrained(tmp_path)


def test_bad_tensors_are_refused():
    data, scale_inv = reference_block_quantize(torch.randn(256, 384))
    assert isinstance(block_fp8_state_dict({"w.weight": data, "w.weight_scale_inv": scale_inv})["w.weight"],
                      Float8Tensor)
    with pytest.raises(ValueError, match="has no 'w.weight_scale_inv'"):
        block_fp8_state_dict({"w.weight": data})
    with pytest.raises(ValueError, match=r"expected float block scales of shape \(2, 3\)"):
        block_fp8_state_dict({"w.weight": data, "w.weight_scale_inv": scale_inv[:, :2]})
    with pytest.raises(ValueError, match="static activation scale"):
        block_fp8_state_dict({"w.weight": data, "w.weight_scale_inv": scale_inv, "w.activation_scale": scale_inv})
    with pytest.raises(ValueError, match="expected a 2-D torch.float8_e4m3fn weight"):
        block_fp8_state_dict({"w.weight": data.to(torch.float8_e5m2), "w.weight_scale_inv": scale_inv})
    with pytest.raises(ValueError, match="has no weight"):
        block_fp8_state_dict({"w.weight_scale_inv": scale_inv})


def test_the_way_back_writes_a_plain_checkpoint(tmp_path):
    (tmp_path / "fp8").mkdir()
    _, reference = write_checkpoint(tmp_path / "fp8", tiny_config("llama"))
    model = load_block_fp8_pretrained(tmp_path / "fp8", dtype=torch.float32)
    model.save_pretrained(tmp_path / "plain")
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain", dtype=torch.float32)
    assert getattr(plain.config, "quantization_config", None) is None
    ids = torch.randint(0, 320, (1, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert rel_error(plain(ids).logits, reference(ids).logits) < 1e-5


def test_unquantized_layers_and_sharded_files_load(tmp_path):
    """A decoder weight kept in BF16 (modules_to_not_convert) is quantized at the load (as fp8_model_init made the
    weight: Float8BlockScaling()'s power-of-2 weight scales); a checkpoint split into two safetensors files with an
    index loads as one."""
    config = tiny_config("llama")
    tensors, reference = write_checkpoint(tmp_path, config)
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = reference.state_dict()[name].to(torch.bfloat16)
    del tensors[name + "_scale_inv"]
    reference.state_dict()[name].copy_(tensors[name])
    (tmp_path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        safetensors_torch.save_file({k: tensors[k] for k in keys}, str(tmp_path / file))
    index = {"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    model = load_block_fp8_pretrained(tmp_path, dtype=torch.float32)
    fc2 = model.model.layers[1].layer.layernorm_mlp.fc2_weight
    assert isinstance(fc2, Float8Tensor) and fc2.layout == "block_128x128"
    data, scale_inv = reference_quantize(tensors[name], power_2_scale=True)  # the recipe's weight QParams
    assert torch.equal(as_bytes(fc2._data), as_bytes(data)) and torch.equal(fc2._scale_inv, scale_inv)
    ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert rel_error(model(ids).logits, reference(ids).logits) < 0.05
