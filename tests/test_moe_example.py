"""examples/moe_finetune.py end to end on the CPU with its tiny models: the loss falls from ln(vocab), the aux loss is
reported, the MoE blocks became LayerNormMoE with grouped FP8 experts, FP8 tracks the high-precision run, the saved
Hugging Face checkpoint loads with plain transformers; bad arguments are refused naming the flag. GPU: the default
model runs a few steps."""
import importlib.util
import json
import math
import time
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "moe_finetune.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("moe_finetune", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_default_run_trains_in_fp8_within_a_minute(example, tmp_path):
    start = time.perf_counter()
    summary = example.main(["--device", "cpu", "--summary", str(tmp_path / "summary.json")])
    assert time.perf_counter() - start < 60
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert summary["model_type"] == "mixtral" and summary["fp8"] and summary["steps"] == 8
    modules = summary["fp8_modules"]
    assert modules["MoETransformerLayer"] == modules["LayerNormMoE"] == 2 and modules["GroupedLinear"] == 4
    losses = [h["loss"] for h in summary["history"]]
    assert all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(258), rel=0.05)  # random init over the 258 byte tokens
    assert losses[-1] < losses[0] - 0.3
    assert all(1.0 <= h["aux_loss"] < 4.0 for h in summary["history"])  # (2 experts of 4 per token: ~2 balanced)


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_fp8_tracks_the_high_precision_run(example, family):
    args = ["--device", "cpu", "--family", family, "--steps", "3", "--recipe", "current"]
    fp8 = [h["loss"] for h in example.main(args)["history"]]
    high = [h["loss"] for h in example.main(args + ["--no-fp8"])["history"]]
    for a, b in zip(fp8, high):  # same init, same batches
        assert abs(a - b) < 0.02 * b


def test_save_hf_writes_a_checkpoint_plain_transformers_loads(example, tmp_path):
    example.main(["--device", "cpu", "--steps", "2", "--save-hf", str(tmp_path)])
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded).__name__ == "MixtralForCausalLM"
    with torch.no_grad():
        assert loaded(input_ids=torch.randint(0, 258, (1, 16))).logits.isfinite().all()


@pytest.mark.parametrize("argv, flag", [
    (["--steps", "0"], "--steps"), (["--model", "/no/such/dir"], "--model"), (["--data", "/no/such/file"], "--data"),
    (["--family", "llama"], "--family"),
])
def test_bad_arguments_are_refused_naming_the_flag(example, argv, flag, capsys):
    with pytest.raises(SystemExit):
        example.main(["--device", "cpu", *argv])
    assert flag in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_default_model_runs(example):
    summary = example.main(["--device", "cuda", "--steps", "4"])
    losses = [h["loss"] for h in summary["history"]]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
