"""examples/stdlib_corpus.py (the example's no-download corpus from the Python stdlib) and finetune_llama.py's
--precision converted (the FP8 run's converted model trained in BF16), on the CPU."""
import importlib.util
import json
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def corpus():
    return _load("stdlib_corpus")


def test_corpus_is_deterministic_and_readable_by_the_example(corpus, tmp_path):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    info = corpus.main([str(first), "--max-bytes", "300000", "--max-file-bytes", "50000"])
    corpus.main([str(second), "--max-bytes", "300000", "--max-file-bytes", "50000"])
    assert first.read_bytes() == second.read_bytes()
    lines = [json.loads(line) for line in first.read_text(encoding="utf-8").splitlines()]
    assert info["documents"] == len(lines) > 1 and info["bytes"] >= 300000
    assert all(len(d["text"].encode()) <= 50000 and d["path"].endswith(".py") for d in lines)
    assert len({d["path"] for d in lines}) == len(lines)
    pytest.importorskip("transformers")
    example = _load("finetune_llama")
    assert [d["text"] for d in lines] == example.read_documents(first)


def test_corpus_refuses_bad_arguments(corpus, tmp_path, capsys):
    for argv, match in (([str(tmp_path / "a.txt")], "expected a path ending in .jsonl"),
                        ([str(tmp_path / "a.jsonl"), "--max-bytes", "0"], "expected positive integers")):
        with pytest.raises(SystemExit):
            corpus.main(argv)
        assert match in capsys.readouterr().err


def test_example_trains_the_converted_model_in_bf16(tmp_path):
    pytest.importorskip("transformers")
    example = _load("finetune_llama")
    summary = example.main(["--device", "cpu", "--seq-len", "32", "--batch-size", "2", "--sample-tokens", "0",
                            "--precision", "converted", "--steps", "2", "--out", str(tmp_path)])
    run = summary["runs"]["converted"]
    assert run["recipe"] is None and run["fp8_modules"].get("TransformerLayer") == 2
    assert len(run["losses"]) == 2 and all(loss == loss for loss in run["losses"])
