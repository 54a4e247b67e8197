"""examples/finetune_llama.py end to end on the CPU with a tiny model: summary, losses, grad accumulation with fused
wgrad, checkpoint resume, .jsonl data, the chunked loss against the model's own, the greedy samples (BF16 weights, FP8
weights inside fp8_autocast) against the saved checkpoints' choices; bad arguments refused by the parser with the
flag named."""
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from tests.utils import checkout_env

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "finetune_llama.py"
TINY = ["--device", "cpu", "--seq-len", "32", "--batch-size", "2", "--sample-tokens", "0"]  # (samples: tested below)


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("finetune_llama", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_runs_both_precisions_and_writes_its_summary(example, tmp_path):
    example.main(["--device", "cpu", "--steps", "3", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    bf16, fp8 = summary["runs"]["bf16"], summary["runs"]["fp8"]
    for run in (bf16, fp8):
        assert len(run["losses"]) == 3 and all(math.isfinite(x) for x in run["losses"])
        assert math.isfinite(run["eval_loss"]) and run["tokens_per_s"] > 0
    assert bf16["fp8_modules"] == {}
    per_layer = {"LlamaTransformerLayer": 1, "TransformerLayer": 1, "MultiheadAttention": 1, "LayerNormLinear": 1,
                 "DotProductAttention": 1, "Linear": 1, "LayerNormMLP": 1}
    assert fp8["fp8_modules"] == {"RMSNorm": 1,  # the final norm; the tiny model has 2 layers
                                  **{name: 2 * n for name, n in per_layer.items()}}
    assert bf16["losses"][0] == pytest.approx(math.log(258), rel=0.05)  # random init over the 258 byte tokens
    assert bf16["losses"][-1] < bf16["losses"][0]
    for a, b in zip(bf16["losses"], fp8["losses"]):  # same init, same batches: FP8 tracks BF16
        assert abs(a - b) < 0.02 * a
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "loss.png").stat().st_size > 0
    for run, cast in ((bf16, 0), (fp8, 2 * 4)):  # (FP8: qkv, proj, fc1, fc2 of each layer as Float8Tensors)
        sample = run["sample"]  # (the default: 60 new tokens after the first 32 held-out tokens)
        assert sample["weights"] == run["precision"] and sample["fp8_weight_tensors"] == cast
        assert len(sample["prompt_ids"]) == 32 and isinstance(sample["prompt"], str) and sample["prompt"]
        assert sample["new_tokens"] == len(sample["token_ids"]) == 60 and all(0 <= t < 258 for t in sample["token_ids"])
        assert isinstance(sample["text"], str) and sample["text"] == bytes(
            t for t in sample["token_ids"] if t < 256).decode("utf-8", errors="replace")


@pytest.mark.parametrize("recipe", ["current", "block"])
def test_other_recipes_track_bf16(example, tmp_path, recipe):
    """--recipe current / block: the fp8 run uses that recipe (named in its summary) and its losses track BF16's
    (same init, same batches) as delayed scaling's do."""
    example.main(["--device", "cpu", "--steps", "3", "--recipe", recipe, "--sample-tokens", "0", "--out",
                  str(tmp_path)])
    runs = json.loads((tmp_path / "summary.json").read_text())["runs"]
    assert runs["fp8"]["recipe"] == recipe and runs["bf16"]["recipe"] is None
    for a, b in zip(runs["bf16"]["losses"], runs["fp8"]["losses"]):
        assert math.isfinite(b) and abs(a - b) < 0.02 * a
    assert math.isfinite(runs["fp8"]["eval_loss"])


@pytest.mark.parametrize("fp8_layers", ["transformer", "linear"])
def test_samples_are_the_greedy_choices_of_the_saved_models(example, tmp_path, fp8_layers):
    """Each run's sample, read back by plain transformers from the run's --save-hf checkpoint (its trained weights,
    saved before the FP8 run cast them): at every new token, the token sampled is the model's greedy choice up to
    BF16 roundings (BF16 run: KV-cache decode vs one full forward) or FP8 roundings (FP8 weights and activations)."""
    import torch
    from transformers import AutoModelForCausalLM

    summary = example.main(TINY + ["--fp8-layers", fp8_layers, "--steps", "3", "--sample-tokens", "24",
                                   "--save-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "out")])
    for precision, tolerance in (("bf16", 0.02), ("fp8", 0.1)):
        sample = summary["runs"][precision]["sample"]
        assert sample["new_tokens"] == len(sample["token_ids"]) == 24
        assert sample["fp8_weight_tensors"] == (0 if precision == "bf16" else 8 if fp8_layers == "transformer" else 14)
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / precision, dtype=torch.bfloat16).eval()
        prompt = len(sample["prompt_ids"])
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([sample["prompt_ids"] + sample["token_ids"]])).logits[0].float()
        logits = logits[prompt - 1:-1]
        chosen = logits.gather(-1, torch.tensor(sample["token_ids"])[:, None])[:, 0]
        gap = logits.max(-1).values - chosen
        assert (gap <= tolerance * logits.abs().amax()).all(), (precision, gap.max().item())
        assert len(set(sample["token_ids"])) > 1  # (not one token repeated: the comparison means something)


@pytest.mark.parametrize("fp8_layers", ["transformer", "linear"])
def test_resume_continues_exactly_with_grad_accum_and_fused_wgrad(example, tmp_path, fp8_layers):
    args = TINY + ["--precision", "fp8", "--fp8-layers", fp8_layers, "--steps", "4", "--grad-accum", "2",
                   "--fuse-wgrad"]
    full = example.main(args + ["--save", str(tmp_path / "ck"), "--save-every", "2", "--out", str(tmp_path / "a")])
    modules = full["runs"]["fp8"]["fp8_modules"]
    assert modules == {"Linear": 14} if fp8_layers == "linear" else modules["TransformerLayer"] == 2  # lm_head: BF16
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["fp8-step000002.pt", "fp8-step000004.pt"]
    (tmp_path / "ck" / "fp8-step000004.pt").unlink()
    resumed = example.main(args + ["--resume", str(tmp_path / "ck"), "--out", str(tmp_path / "b")])
    assert resumed["runs"]["fp8"]["losses"] == full["runs"]["fp8"]["losses"]
    assert resumed["runs"]["fp8"]["eval_loss"] == full["runs"]["fp8"]["eval_loss"]


@pytest.mark.parametrize("fp8_layers", ["transformer", "linear"])
def test_activation_checkpointing_gives_the_same_losses(example, tmp_path, fp8_layers):
    args = TINY + ["--fp8-layers", fp8_layers, "--steps", "3"]
    plain = example.main(args + ["--out", str(tmp_path / "a")])
    checkpointed = example.main(args + ["--activation-checkpointing", "--out", str(tmp_path / "b")])
    for precision in ("bf16", "fp8"):
        assert checkpointed["runs"][precision]["losses"] == plain["runs"][precision]["losses"]


def test_jsonl_documents_are_wrapped_in_bos_eos(example, tmp_path):
    data = tmp_path / "docs.jsonl"
    docs = ["first document " * 8, "second, longer document " * 8]
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tokenizer = example.ByteTokenizer()
    tokens = example.tokenize(example.read_documents(data), tokenizer).tolist()
    assert tokens == [256, *docs[0].encode(), 257, 256, *docs[1].encode(), 257]
    summary = example.main(TINY + ["--data", str(data), "--precision", "bf16", "--steps", "2",
                                   "--out", str(tmp_path / "out")])
    assert list(summary["runs"]) == ["bf16"] and len(summary["runs"]["bf16"]["losses"]) == 2
    assert "sample" not in summary["runs"]["bf16"]  # (--sample-tokens 0)


def test_chunked_loss_trains_as_the_models_own_loss(example, tmp_path):
    args = TINY + ["--precision", "bf16", "--steps", "3"]
    chunked = example.main(args + ["--out", str(tmp_path / "a")])["runs"]["bf16"]
    own = example.main(args + ["--loss", "model", "--out", str(tmp_path / "b")])["runs"]["bf16"]
    for a, b in zip(chunked["losses"] + [chunked["eval_loss"]], own["losses"] + [own["eval_loss"]]):
        assert a == pytest.approx(b, rel=1e-2)


def test_data_too_short_for_a_sequence_is_reported(example, tmp_path):
    data = tmp_path / "short.txt"
    data.write_text("too short")
    with pytest.raises(ValueError, match="data: .* need more than seq_len"):
        example.main(TINY + ["--data", str(data), "--precision", "bf16", "--steps", "1", "--out", str(tmp_path)])


def save_tiny_checkpoint(folder, text):
    """A local Hugging Face checkpoint: a tiny Llama and a word-level tokenizer trained on `text`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    word_level = Tokenizer(models.WordLevel(unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    word_level.train_from_iterator([text], trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=176, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def test_local_checkpoint_and_its_tokenizer(example, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    save_tiny_checkpoint(tmp_path / "ckpt", example.DEFAULT_DATA.read_text(encoding="utf-8"))
    summary = example.main(TINY + ["--model", str(tmp_path / "ckpt"), "--steps", "2", "--lr", "1e-3",
                                   "--sample-tokens", "6", "--out", str(tmp_path / "out")])
    assert summary["runs"]["fp8"]["fp8_modules"]["TransformerLayer"] == 1
    for run in summary["runs"].values():
        assert all(math.isfinite(x) for x in run["losses"])
        sample = run["sample"]  # (through the checkpoint's word-level tokenizer)
        assert sample["new_tokens"] == len(sample["token_ids"]) == 6 and isinstance(sample["text"], str)
        assert len(sample["prompt_ids"]) == 32 and isinstance(sample["prompt"], str)


# --- bad arguments are refused by the parser, naming the flag ---------------------------------------------------------

def refusal(example, capsys, argv):
    """The parser's error message for argv (argparse exits with status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        example.parse_args(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--steps", "--batch-size", "--seq-len", "--grad-accum", "--save-every",
                                  "--warmup-steps"])
@pytest.mark.parametrize("value", ["-3", "0", "1.5", "many"])
def test_non_positive_or_non_integer_counts_are_refused(example, capsys, flag, value):
    err = refusal(example, capsys, [f"{flag}={value}"])
    assert f"argument {flag}: expected a positive integer" in err


@pytest.mark.parametrize("value", ["-1", "2.5", "many"])
def test_negative_or_non_integer_sample_tokens_are_refused(example, capsys, value):
    err = refusal(example, capsys, [f"--sample-tokens={value}"])
    assert "argument --sample-tokens: expected an integer >= 0" in err


@pytest.mark.parametrize("flag", ["--lr", "--max-grad-norm"])
@pytest.mark.parametrize("value", ["-1e-3", "0", "nan", "inf"])
def test_non_positive_rates_are_refused(example, capsys, flag, value):
    err = refusal(example, capsys, [f"{flag}={value}"])
    assert f"argument {flag}: expected a finite number > 0" in err


def test_positive_values_are_accepted(example):
    args = example.parse_args(["--steps", "3", "--batch-size", "2", "--lr", "1e-4", "--device", "cpu"])
    assert (args.steps, args.batch_size, args.lr, args.device) == (3, 2, 1e-4, "cpu")


def test_missing_model_folder_is_named_not_taken_for_a_hub_id(example, capsys, tmp_path):
    err = refusal(example, capsys, ["--model", str(tmp_path / "nonexistent")])
    assert f"--model: the folder {tmp_path / 'nonexistent'} does not exist" in err
    (tmp_path / "empty").mkdir()
    assert "has no config.json" in refusal(example, capsys, ["--model", str(tmp_path / "empty")])
    (tmp_path / "file").write_text("x")
    assert "is a file" in refusal(example, capsys, ["--model", str(tmp_path / "file")])


def test_missing_data_and_resume_folder_are_named(example, capsys, tmp_path):
    assert "--data: the file" in refusal(example, capsys, ["--data", str(tmp_path / "none.txt")])
    assert "--resume: the folder" in refusal(example, capsys, ["--resume", str(tmp_path / "none")])


def test_cuda_without_a_gpu_says_so(example, capsys, monkeypatch):
    monkeypatch.setattr(example.torch.cuda, "is_available", lambda: False)
    err = refusal(example, capsys, ["--device", "cuda"])
    assert "--device cuda: no CUDA GPU is available here" in err


def test_unknown_device_is_refused(example, capsys):
    assert "argument --device: expected 'cpu', 'cuda' or 'cuda:N', got 'tpu'" in refusal(example, capsys,
                                                                                         ["--device", "tpu"])


def test_the_script_itself_reports_a_missing_model_folder(tmp_path):
    """As a user runs it: exit status 2 and one line naming the folder, no traceback, no Hub lookup."""
    missing = tmp_path / "nonexistent"
    result = subprocess.run([sys.executable, str(EXAMPLE), "--model", str(missing), "--steps", "-3"],
                            capture_output=True, text=True, timeout=300, env=checkout_env(HF_HUB_OFFLINE="1"))
    assert result.returncode == 2
    assert "argument --steps: expected a positive integer, got -3" in result.stderr  # the first error argparse meets
    assert "Traceback" not in result.stderr and "repo" not in result.stderr.lower()
    result = subprocess.run([sys.executable, str(EXAMPLE), "--model", str(missing)], capture_output=True, text=True,
                            timeout=300, env=checkout_env(HF_HUB_OFFLINE="1"))
    assert result.returncode == 2 and f"--model: the folder {missing} does not exist" in result.stderr
    assert "Traceback" not in result.stderr
