"""examples/finetune_lora.py end to end on the CPU with a tiny model: both runs train, the adapters are saved in
PEFT's format and PEFT on the plain Hugging Face model computes what ours does; bad arguments refused by the parser."""
import importlib.util
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "finetune_lora.py"
TINY = ["--device", "cpu", "--seq-len", "32", "--batch-size", "2"]


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("finetune_lora", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_both_runs_train_save_and_reload_with_peft(example, tmp_path):
    summary = example.main(TINY + ["--steps", "6", "--lr", "3e-3", "--new-tokens", "8", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "summary.json").read_text())["runs"].keys() == {"bf16", "fp8"}
    bf16, fp8 = summary["runs"]["bf16"], summary["runs"]["fp8"]
    for run in (bf16, fp8):
        assert len(run["losses"]) == 6 and all(math.isfinite(x) for x in run["losses"])
        assert run["losses"][-1] < run["losses"][0]
        # r (in + out) per adapter, 2 layers of hidden 64, 4 heads and 2 KV heads of 16, ffn 176
        assert run["trainable_params"] == 2 * 16 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 3 * (64 + 176))
        folder = Path(run["adapter_dir"])
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA" and config["r"] == 16 and len(config["target_modules"]) == 7
        assert (folder / "adapter_model.safetensors").stat().st_size > 0
        assert run["peft_eval_loss"] == pytest.approx(run["eval_loss"], rel=0.01)
        assert isinstance(run["peft_sample"], str) and run["peft_sample"].startswith("The ")
    assert bf16["losses"][0] == pytest.approx(math.log(258), rel=0.05)  # random init over the 258 byte tokens
    assert bf16["peft_max_logit_difference"] < 0.05  # BF16 roundings of the same computation
    for a, b in zip(bf16["losses"], fp8["losses"]):  # same weights and batches: FP8 LoRA tracks BF16 LoRA
        assert abs(a - b) < 0.02 * a
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "loss.png").stat().st_size > 0


def test_one_precision_with_other_targets(example, tmp_path):
    summary = example.main(TINY + ["--precision", "fp8", "--steps", "2", "--targets", "q_proj,v_proj", "--rank", "4",
                                   "--adapter-dtype", "bfloat16", "--new-tokens", "4", "--out", str(tmp_path)])
    assert list(summary["runs"]) == ["fp8"]
    config = json.loads((tmp_path / "adapter-fp8" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["q_proj", "v_proj"] and config["r"] == 4
    assert summary["runs"]["fp8"]["trainable_params"] == 2 * (4 * 64 + 64 * 4 + 4 * 64 + 32 * 4)  # 2 layers


def refusal(example, capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        example.parse_args(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--rank", "0"], "argument --rank: expected a positive integer"),
    (["--alpha", "-1"], "argument --alpha: expected a finite number > 0"),
    (["--dropout", "1"], r"argument --dropout: expected a probability in [0, 1)"),
    (["--targets", ","], "argument --targets: expected comma-separated module names"),
    (["--adapter-dtype", "float8"], "argument --adapter-dtype: invalid choice"),
    (["--steps", "-2"], "argument --steps: expected a positive integer"),
])
def test_bad_arguments_are_refused_naming_the_flag(example, capsys, argv, message):
    assert message in refusal(example, capsys, argv)


def test_missing_model_folder_is_named(example, capsys, tmp_path):
    assert f"--model: the folder {tmp_path / 'none'} does not exist" in refusal(example, capsys,
                                                                                ["--model", str(tmp_path / "none")])


def test_unknown_target_is_refused_by_add_lora(example, tmp_path):
    with pytest.raises(ValueError, match=r"target_modules: \['qkv'\] match no projection"):
        example.main(TINY + ["--precision", "bf16", "--steps", "1", "--targets", "qkv", "--out", str(tmp_path)])
