"""The numerics tools of issue 21 on the CPU: the example's --warmup-steps, the loss driver's Transformer Engine layer
swap (checked with our own package standing in for TE: the same API, so the swapped model must compute the same
loss bit for bit) and its high-precision parts (those modules run no FP8 call inside fp8_autocast)."""
import copy
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import loss_numerics as ln  # noqa: E402

ex, te = ln.ex, ln.te
TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)


def _args(tmp_path, *extra):
    data = tmp_path / "data.txt"
    data.write_text("def f(x):\n    return x * 2\n" * 200)
    return ex.parse_args(["--device", "cpu", "--data", str(data), "--steps", "40", "--lr", "1e-3", "--seq-len", "32",
                          "--batch-size", "2", *extra])


def _model(args):
    model = ex.build_model(args, TINY, ex.ByteTokenizer.vocab_size, torch.device("cpu"))
    ex.convert_to_fp8(model, args)
    return model


def test_warmup_steps_sets_the_linear_warmup(tmp_path):
    default, longer = _args(tmp_path), _args(tmp_path, "--warmup-steps", "10")
    assert [ex.lr_at(s, default) for s in (0, 3, 7)] == pytest.approx([1.25e-4, 5e-4, 1e-3])  # 20% of 40 steps: 8
    assert [ex.lr_at(s, longer) for s in (0, 4, 9)] == pytest.approx([1e-4, 5e-4, 1e-3])
    assert ex.lr_at(10, longer) == pytest.approx(1e-3)  # the cosine starts at the peak
    assert ex.lr_at(39, longer) < ex.lr_at(20, longer) < 1e-3


@pytest.mark.parametrize("recipe", [None, "delayed"])
def test_swapped_layers_compute_the_same_loss(tmp_path, recipe):
    args = _args(tmp_path)
    model = _model(args)
    swapped = copy.deepcopy(model)
    assert ln.swap_layers(swapped, te) == 2
    assert all(layer.layer is not orig.layer for layer, orig in zip(swapped.model.layers, model.model.layers))
    batch = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for m in (model, swapped):
        with ex.fp8_context(recipe is not None, recipe or "delayed"):
            losses.append(ex.training_loss(m, batch, args))
        losses[-1].backward()
    assert losses[0].item() == losses[1].item()
    qkv = "layer.self_attention.layernorm_qkv.weight"
    assert torch.equal(model.model.layers[0].get_parameter(qkv).grad, swapped.model.layers[0].get_parameter(qkv).grad)


def test_high_precision_parts_run_no_fp8(tmp_path):
    args = _args(tmp_path)
    ours = ex.convert_to_fp8
    try:
        ln.keep_parts_high_precision(["qkv", "mlp"])
        model = _model(args)
    finally:
        ex.convert_to_fp8 = ours
    with ex.fp8_context(True, "delayed"):
        ex.training_loss(model, torch.randint(0, 256, (2, 32)), args)
    attention = model.model.layers[0].layer.self_attention
    assert attention.layernorm_qkv._fp8_call_counts == [0, 1]
    assert attention.proj._fp8_call_counts == [1, 0]
    assert model.model.layers[1].layer.layernorm_mlp._fp8_call_counts == [0, 1]
