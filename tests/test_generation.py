"""Generation with converted models: our decoder layers keep transformers' KV cache (DynamicCache and StaticCache,
under either keyword: `cache=` in transformers 5.2x, `past_key_values=` before). Greedy generate() gives the Hugging
Face model's tokens for every family (float32; BF16 with a decisive head), with left padding too; each cached decode
step gives the logits of a full forward without a cache; under fp8_autocast generation runs and stays close to the
Hugging Face model; bad caches are refused."""
import copy

import pytest
import torch

import transformer_fp8 as te
from tests.test_families import FAMILIES, VOCAB, tiny_model
from tests.utils import FP8_RTOL, rel_error
from transformer_fp8 import recipe
from transformer_fp8.integrations import GreedyDecoder, convert_model, greedy_generate
from transformer_fp8.integrations.graphed_decode import _cache_keyword

transformers = pytest.importorskip("transformers")

CACHES = ("dynamic", "static")
PROMPT, NEW = 7, 12


def generate(model, ids, cache, **kwargs):
    extra = dict(cache_implementation="static") if cache == "static" else {}
    return model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0, **extra, **kwargs)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_gives_the_hugging_face_tokens_in_fp32(family, cache):
    model = tiny_model(family)
    converted = convert_model(copy.deepcopy(model))
    assert converted.config.use_cache == model.config.use_cache
    ids = torch.randint(1, VOCAB, (3, PROMPT))
    ref = generate(model, ids, cache)
    assert ref.shape == (3, PROMPT + NEW)
    assert torch.equal(generate(converted, ids, cache), ref)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("family", ["llama", "llama3.1", "qwen2", "qwen3"])
def test_greedy_generation_in_bf16_picks_the_hugging_face_models_choices(family, cache):
    """BF16: every token we pick is the Hugging Face model's greedy choice for that prefix, or loses to it by less
    than BF16 roundings of the logits (a random model's logits have near ties, so whole sequences may part)."""
    model = tiny_model(family, torch.bfloat16)
    converted = convert_model(copy.deepcopy(model))
    ids = torch.randint(1, VOCAB, (4, PROMPT))  # (0 is the pad token)
    ours = generate(converted, ids, cache)
    with torch.no_grad():
        logits = model(input_ids=ours).logits[:, PROMPT - 1:-1].float()  # the HF model on our prefixes
    picked = logits.gather(-1, ours[:, PROMPT:, None])[..., 0]
    gap = logits.max(-1).values - picked
    assert (gap <= 0.02 * logits.abs().amax()).all(), gap.max()
    assert (gap == 0).float().mean() > 0.8


@pytest.mark.parametrize("cache", CACHES)
def test_left_padded_batch(cache):
    model = tiny_model("qwen3")
    converted = convert_model(copy.deepcopy(model))
    ids = torch.randint(1, VOCAB, (3, PROMPT))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding, as a tokenizer pads prompts for generation
    mask[2, :1] = 0
    ids[mask == 0] = 0
    ref = generate(model, ids, cache, attention_mask=mask)
    assert torch.equal(generate(converted, ids, cache, attention_mask=mask), ref)


@pytest.mark.parametrize("cache_class", ["DynamicCache", "StaticCache"])
def test_each_decode_step_gives_the_logits_of_a_full_forward(cache_class):
    converted = convert_model(tiny_model("llama3.1"))
    ids = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        full = converted(input_ids=ids, use_cache=False).logits
        kwargs = dict(max_cache_len=32) if cache_class == "StaticCache" else {}
        cache = getattr(transformers, cache_class)(config=converted.config, **kwargs)
        with_cache = {_cache_keyword(converted): cache, "use_cache": True}  # (cache= in 5.2x, past_key_values= before)
        steps = [converted(input_ids=ids[:, :12], **with_cache).logits]
        steps += [converted(input_ids=ids[:, 12:16], **with_cache).logits]  # a chunk of 4
        steps += [converted(input_ids=ids[:, i:i + 1], **with_cache).logits for i in range(16, 20)]
    assert rel_error(torch.cat(steps, dim=1), full) < 1e-5


def test_the_layer_takes_the_cache_under_either_keyword_and_refuses_bad_ones():
    converted = convert_model(tiny_model("qwen2"))
    layer = converted.model.layers[0]
    hidden = torch.randn(2, 5, 64)
    positions = torch.arange(5)[None]
    outs = []
    for keyword in ("cache", "past_key_values"):
        cache = transformers.DynamicCache(config=converted.config)
        with torch.no_grad():
            layer(hidden[:, :4], position_ids=positions[:, :4], **{keyword: cache})
            outs.append(layer(hidden[:, 4:], position_ids=positions[:, 4:], **{keyword: cache}))
        assert cache.get_seq_length(0) == 5
    with torch.no_grad():
        assert rel_error(outs[1], outs[0]) == 0
        assert rel_error(outs[0], layer(hidden, position_ids=positions)[:, 4:]) < 1e-5
    with pytest.raises(ValueError, match="cache, past_key_values: got two different caches"):
        layer(hidden, cache=transformers.DynamicCache(), past_key_values=transformers.DynamicCache())
    with pytest.raises(TypeError, match="cache: expected a transformers Cache"):
        layer(hidden, cache=((torch.zeros(1), torch.zeros(1)),))


@pytest.mark.parametrize("cache", CACHES)
def test_fp8_generation_runs_and_stays_close(cache):
    model = tiny_model("llama", torch.bfloat16)
    converted = convert_model(copy.deepcopy(model))
    ids = torch.randint(1, VOCAB, (2, PROMPT))
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe.Float8CurrentScaling()):
        out = generate(converted, ids, cache, output_logits=True, return_dict_in_generate=True)
    assert out.sequences.shape == (2, PROMPT + NEW) and torch.equal(out.sequences[:, :PROMPT], ids)
    with torch.no_grad():  # the Hugging Face model's logits for the same tokens
        ref = model(input_ids=out.sequences).logits[:, PROMPT - 1:-1]
    assert rel_error(torch.stack(out.logits, dim=1), ref) < 2 * FP8_RTOL[torch.float8_e4m3fn]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_generate_with_a_static_cache_gives_the_tokens_of_generate(family):
    model = tiny_model(family)
    converted = convert_model(copy.deepcopy(model))
    ids = torch.randint(1, VOCAB, (3, PROMPT))
    ref = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(greedy_generate(converted, ids, NEW), ref)
    assert torch.equal(greedy_generate(model, ids, NEW), ref)  # (a plain Hugging Face model works too)
    with pytest.raises(ValueError, match="max_new_tokens: expected a positive int"):
        greedy_generate(converted, ids, 0)
    decoder = GreedyDecoder(converted, NEW)  # reused: the cache is reset for the next prompts
    other = torch.randint(1, VOCAB, (3, PROMPT))
    assert torch.equal(decoder(ids), ref)
    assert torch.equal(decoder(other), model.generate(other, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                                      pad_token_id=0))
    with pytest.raises(ValueError, match=r"input_ids: this GreedyDecoder's cache and graph are for prompts of shape"):
        decoder(ids[:2])


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_graph_decode_gives_the_eager_tokens(fp8, batch):
    """On the GPU: the decode step captured in a CUDA graph gives the tokens of the same loop run eagerly (BF16; FP8
    weights under fp8_autocast), and our BF16 tokens are the Hugging Face model's choices up to roundings."""
    torch.manual_seed(0)
    settings = dict(hidden_size=256, intermediate_size=704, num_attention_heads=8, num_key_value_heads=2,
                    num_hidden_layers=2)
    model = tiny_model("llama", torch.bfloat16, **settings).cuda()
    with te.fp8_model_init(enabled=fp8):
        converted = convert_model(copy.deepcopy(model))
    ids = torch.randint(1, VOCAB, (batch, 16), device="cuda")  # (batch 1: FP8 GEMMs of one row)
    run = dict(fp8_enabled=fp8, fp8_recipe=recipe.Float8CurrentScaling())
    eager = greedy_generate(converted, ids, 24, cuda_graph=False, **run)
    decoder = GreedyDecoder(converted, 24, cuda_graph=True, **run)
    graphed = decoder(ids)
    assert decoder._graph is not None and torch.equal(graphed, eager)
    other = torch.randint(1, VOCAB, (batch, 16), device="cuda")  # a second call replays the same graph
    assert torch.equal(decoder(other), greedy_generate(converted, other, 24, cuda_graph=False, **run))
    if not fp8:
        with torch.no_grad():
            logits = model(input_ids=graphed).logits[:, 15:-1].float()
        gap = logits.max(-1).values - logits.gather(-1, graphed[:, 16:, None])[..., 0]
        assert (gap <= 0.02 * logits.abs().amax()).all(), gap.max()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama3.1", "qwen2", "qwen3"])
def test_cuda_generate_picks_the_hugging_face_choices_and_fp8_runs(family):
    """On the GPU (cuDNN prefill, SDPA decode over the DynamicCache): our BF16 tokens are the Hugging Face model's
    greedy choices up to roundings; with FP8 weights inside fp8_autocast generation runs and stays close."""
    torch.manual_seed(0)
    settings = dict(hidden_size=256, intermediate_size=704, num_attention_heads=8, num_key_value_heads=2,
                    **(dict(head_dim=64) if family == "qwen3" else {}))  # (FAMILIES sets 32)
    model = tiny_model(family, torch.bfloat16, **settings).cuda()
    converted = convert_model(copy.deepcopy(model))
    ids = torch.randint(1, VOCAB, (4, 32), device="cuda")
    ours = converted.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        logits = model(input_ids=ours).logits[:, 31:-1].float()
    gap = logits.max(-1).values - logits.gather(-1, ours[:, 32:, None])[..., 0]
    assert (gap <= 0.02 * logits.abs().amax()).all(), gap.max()
    with te.fp8_model_init(enabled=True):
        fp8_model = convert_model(copy.deepcopy(model))
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling()):
        out = fp8_model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None,
                                 output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref = model(input_ids=out.sequences).logits[:, 31:-1].float()
    assert rel_error(torch.stack(out.logits, dim=1), ref) < 2 * FP8_RTOL[torch.float8_e4m3fn]


def test_transformers_compiled_static_cache_generate_traces_our_layers_as_one_graph():
    """generate(cache_implementation="static") compiles the decode step (on CUDA by default; forced here on the
    CPU with dynamo's eager backend): our converted layers trace without a graph break (fullgraph=True) and give the
    Hugging Face tokens."""
    model = tiny_model("qwen3")
    converted = convert_model(copy.deepcopy(model))
    ids = torch.randint(1, VOCAB, (2, PROMPT))
    graphs = []

    def counting_backend(graph_module, example_inputs):  # dynamo's eager backend, counting the graphs
        graphs.append(graph_module)
        return graph_module.forward

    compile_config = transformers.CompileConfig(backend=counting_backend, fullgraph=True, mode=None)
    compile_config._compile_all_devices = True  # (transformers compiles on accelerators only, unless told)
    torch._dynamo.reset()
    out = generate(converted, ids, "static", compile_config=compile_config)
    assert len(graphs) >= 1  # (the decode steps ran compiled)
    assert torch.equal(out, generate(model, ids, "static"))
