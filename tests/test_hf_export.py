"""The way back to Hugging Face: a converted (and FP8-trained) model of every family saved with save_pretrained loads
with plain transformers (AutoModelForCausalLM, also in a process that never imports transformer_fp8) and gives the
converted model's logits; to_hf_state_dict has exactly the Hugging Face model's names; tied embeddings, FP8 weights
(fp8_model_init) and GPT-2's Conv1D layers (convert_linear_layers fallback) come back too."""
import copy
import subprocess
import sys
import textwrap

import pytest
import torch

import transformer_fp8 as te
from tests.test_families import FAMILIES, VOCAB, tiny_model
from tests.utils import checkout_env, rel_error
from transformer_fp8 import recipe
from transformer_fp8.integrations import convert_model, save_hf_pretrained, to_hf_state_dict

transformers = pytest.importorskip("transformers")


def fp8_trained(model, steps=2):
    """convert_model(model) after `steps` FP8 SGD steps: its weights differ from the Hugging Face model's."""
    converted = convert_model(copy.deepcopy(model)).train()
    optimizer = torch.optim.SGD(converted.parameters(), lr=0.5)
    ids = torch.randint(0, VOCAB, (2, 16))
    for _ in range(steps):
        with te.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling(amax_history_len=4)):
            loss = converted(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return converted.eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_save_pretrained_round_trip_through_plain_transformers(family, tmp_path):
    model = tiny_model(family)
    converted = fp8_trained(model)
    state = to_hf_state_dict(converted)
    assert state.keys() == model.state_dict().keys()
    converted.save_pretrained(tmp_path)  # (convert_model routes it to save_hf_pretrained)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(loaded) is type(model)
    ids = torch.randint(0, VOCAB, (2, 24))
    with torch.no_grad():
        ours, theirs = converted(input_ids=ids).logits, loaded(input_ids=ids).logits
        before = model(input_ids=ids).logits
    assert rel_error(theirs, ours) < 1e-5
    assert rel_error(theirs, before) > 1e-3  # the training changed the weights: the export carries them


def test_a_process_without_transformer_fp8_loads_the_checkpoint(tmp_path):
    converted = fp8_trained(tiny_model("qwen3"))
    save_hf_pretrained(converted, tmp_path / "ckpt")
    ids = torch.randint(0, VOCAB, (2, 12))
    torch.save(ids, tmp_path / "ids.pt")
    script = textwrap.dedent(f"""
        import sys, torch, transformers
        model = transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path / "ckpt")!r}, dtype=torch.float32)
        with torch.no_grad():
            logits = model(input_ids=torch.load({str(tmp_path / "ids.pt")!r})).logits
        torch.save(logits, {str(tmp_path / "logits.pt")!r})
        assert not any(name.startswith("transformer_fp8") for name in sys.modules)
    """)
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path, env=checkout_env())
    with torch.no_grad():
        ours = converted(input_ids=ids).logits
    assert rel_error(torch.load(tmp_path / "logits.pt"), ours) < 1e-5


def test_tied_embeddings_and_a_bf16_copy(tmp_path):
    model = tiny_model("llama", tie_word_embeddings=True)
    converted = fp8_trained(model)
    assert converted.lm_head.weight is converted.model.embed_tokens.weight
    save_hf_pretrained(converted, tmp_path, dtype=torch.bfloat16)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.model.embed_tokens.weight, converted.model.embed_tokens.weight.bfloat16())
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        assert rel_error(loaded.float()(input_ids=ids).logits, converted(input_ids=ids).logits) < 2e-2


def test_fp8_weights_are_dequantized(tmp_path):
    model = tiny_model("qwen2")
    with te.fp8_model_init(enabled=True):
        converted = convert_model(copy.deepcopy(model))
    weight = converted.model.layers[0].layer.self_attention.layernorm_qkv.weight
    assert isinstance(weight, te.Float8Tensor)
    state = to_hf_state_dict(converted)
    assert all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in state.values())
    q_rows = model.config.num_attention_heads * 16
    assert torch.equal(state["model.layers.0.self_attn.q_proj.weight"], weight.dequantize()[:q_rows])
    assert rel_error(state["model.layers.0.self_attn.q_proj.weight"], model.model.layers[0].self_attn.q_proj.weight) \
        < 0.05  # (one FP8 rounding)
    converted.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        assert rel_error(loaded(input_ids=ids).logits, converted(input_ids=ids).logits) < 1e-5


def test_gpt2_linear_layers_from_conv1d_are_transposed_back(tmp_path):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    converted = fp8_trained(model)
    state = to_hf_state_dict(converted)
    assert state.keys() == model.state_dict().keys()
    assert state["transformer.h.0.attn.c_attn.weight"].shape == (64, 192)  # Conv1D's [in, out]
    converted.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        assert rel_error(loaded(input_ids=ids).logits, converted(input_ids=ids).logits) < 1e-5
        assert rel_error(loaded(input_ids=ids).logits, model(input_ids=ids).logits) > 1e-3


def test_save_hf_pretrained_refuses_what_it_cannot_save(tmp_path):
    with pytest.raises(TypeError, match="model: expected a transformers PreTrainedModel"):
        save_hf_pretrained(torch.nn.Linear(16, 16), tmp_path)


def test_finetune_example_save_hf_writes_loadable_checkpoints(tmp_path):
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "examples" / "finetune_llama.py"
    spec = importlib.util.spec_from_file_location("finetune_llama_save_hf", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main(["--device", "cpu", "--steps", "2", "--seq-len", "32", "--batch-size", "2", "--out",
                  str(tmp_path / "out"), "--save-hf", str(tmp_path / "hf")])
    ids = torch.randint(0, 258, (1, 8))
    logits = {}
    for precision in ("bf16", "fp8"):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / precision)
        assert type(loaded) is transformers.LlamaForCausalLM and loaded.config.use_cache
        with torch.no_grad():
            logits[precision] = loaded.float()(input_ids=ids).logits
        assert logits[precision].isfinite().all()
    assert 0 < rel_error(logits["fp8"], logits["bf16"]) < 0.05  # the same init and batches, FP8 vs BF16 training


def test_a_hugging_face_state_dict_loads_into_a_converted_model_and_a_given_one_is_translated(tmp_path):
    """Checkpoints under Hugging Face names (what save_pretrained writes, and what transformers' Trainer resumes
    from) load into a converted model; save_hf_pretrained translates a state dict given under our names (as Trainer
    passes one)."""
    trained = fp8_trained(tiny_model("qwen2"))
    fresh = convert_model(tiny_model("qwen2"))
    missing, unexpected = fresh.load_state_dict(to_hf_state_dict(trained), strict=False)
    assert not unexpected and all(key.endswith("_extra_state") for key in missing), (missing, unexpected)
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, trained(input_ids=ids).logits)
    with pytest.raises(KeyError, match="self_attn.k_proj.weight"):  # an incomplete layer is named
        state = to_hf_state_dict(trained)
        del state["model.layers.1.self_attn.k_proj.weight"]
        fresh.load_state_dict(state, strict=False)
    trained.save_pretrained(tmp_path, state_dict=trained.state_dict())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        assert rel_error(loaded(input_ids=ids).logits, trained(input_ids=ids).logits) < 1e-5


def test_gpt2_checkpoints_load_into_the_converted_model_either_way(tmp_path):
    """Linear layers from Conv1D keep Conv1D's weight layout in their state dict: a Hugging Face GPT-2 state dict
    loads into the converted model (square c_proj weights included), and the converted model's own state dict
    round-trips."""
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    fresh = convert_model(transformers.GPT2LMHeadModel(config).eval())
    missing, unexpected = fresh.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all(key.endswith("_extra_state") for key in missing), (missing, unexpected)
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        assert rel_error(fresh(input_ids=ids).logits, model(input_ids=ids).logits) < 1e-5
        again = convert_model(transformers.GPT2LMHeadModel(config).eval())
        again.load_state_dict(fresh.state_dict())
        assert torch.equal(again(input_ids=ids).logits, fresh(input_ids=ids).logits)
