"""The benchmark scripts keep working: benchmarks/reproduce.sh --smoke runs each changed script's CPU smoke mode in
its own process, and their JSON must carry the median / min / max of interleaved rounds. Also the reproduce runner's
own behaviour (time limits, the summary) and timing.host_bound."""
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def load(name):
    """A module of benchmarks/ by file name (the folder is not a package; its scripts import `timing` directly)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def is_spread(value):
    """A timing.spread / run_rounds entry with real numbers: median inside [min, max]."""
    return (isinstance(value, dict) and {"median", "min", "max", "rounds"} <= value.keys()
            and value["min"] <= value["median"] <= value["max"] and len(value["rounds"]) >= 1)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One `reproduce.sh --smoke` run: {benchmark: its JSON}, plus the summary under "__summary__"."""
    out = tmp_path_factory.mktemp("reproduce_smoke")
    done = subprocess.run(["bash", str(BENCH / "reproduce.sh"), "--smoke", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    failed = {name: r["status"] for name, r in summary["benchmarks"].items() if r["status"] != "ok"}
    logs = {name: (out / f"{name}.log").read_text()[-3000:] for name in failed if (out / f"{name}.log").exists()}
    assert done.returncode == 0 and not failed, f"failed: {failed}\n{logs}\n{done.stdout[-2000:]}"
    result = {name: json.loads((out / r["json"]).read_text()) for name, r in summary["benchmarks"].items()}
    result["__summary__"] = summary
    return result


def test_modules_training_and_host_rows_have_spreads(smoke):
    data = smoke["bench_modules"]
    assert data["device"] == "cpu" and data["training"] and data["host_overhead"]
    for row in data["training"]:
        for case in ("fp8", "bf16_eager"):
            assert is_spread(row[f"{case}_ms"]), row
            assert row[f"{case}_host_bound"] is None and row[f"{case}_graph_ms"] is None  # (no CUDA graphs on CPU)
        assert "bf16_compile_ms" not in row  # (--no-compile)
        assert is_spread(row["speedup_vs_eager"])
    for row in data["host_overhead"]:
        assert is_spread(row["fp8_us"]) and is_spread(row["bf16_us"]) and is_spread(row["fp8_ratio"])
        assert is_spread(row["fp8_python_updates_us"]) and is_spread(row["fp8_python_updates_ratio"])


def test_transformer_layer_rows_have_spreads_and_host_bound_flag(smoke):
    rows = [r for r in smoke["bench_transformer_layer"]["layer"] if "error" not in r]
    assert {r["variant"] for r in rows} >= {"ours FP8", "ours BF16", "torch BF16 eager"}
    for row in rows:
        assert is_spread(row["ms_spread"]) and is_spread(row["ms_b2b_spread"])
        assert row["ms_b2b_range"] == [row["ms_b2b_spread"]["min"], row["ms_b2b_spread"]["max"]]
        assert "host_bound" in row and row["graph_error"] == "no CUDA device"


def test_overhead_modes_have_spreads(smoke):
    for row in smoke["bench_overhead"]["stack"]:
        assert is_spread(row["eager"]["host_us"]) and is_spread(row["eager"]["wall_us"]), row
        assert isinstance(row["graph"], str)  # (CUDA only: reported as not measured)


def test_gemm_rows_have_spreads(smoke):
    for row in smoke["bench_gemm"]["rows"]:
        for name in ("ours_fast", "scaled_mm_fast", "ours_split", "scaled_mm_split", "bf16_mm"):
            assert is_spread(row[f"{name}_spread"]) and row[name] == row[f"{name}_spread"]["median"]


def test_quantize_and_op_host_cost_have_spreads(smoke):
    ops = {row["op"] for row in smoke["bench_quantize"]["rows"]}
    assert {"copy_ (bf16 -> bf16)", "quantize", "cast_transpose"} <= ops
    assert all(is_spread(row["ms"]) for row in smoke["bench_quantize"]["rows"])
    costs = smoke["op_host_cost"]
    assert all(is_spread(v) for v in costs["us"].values()), costs["us"]
    assert is_spread(costs["ratios"]["te.Linear / nn.Linear fwd+bwd"])


def test_guide_recipes_rows_have_spreads_and_peaks(smoke):
    variants = smoke["bench_guide_recipes"]["variants"]
    assert set(variants) == {"ours/bf16", "ours/delayed", "ours/current", "ours/block"}
    for key, row in variants.items():
        assert is_spread(row) and len(row["rounds"]) == 2 and row["median"] > 0, key
        assert "peak_gib" in row, key


def test_summary_lists_every_smoke_benchmark(smoke):
    reproduce = load("reproduce")
    summary = smoke["__summary__"]
    assert summary["mode"] == "smoke"
    assert set(summary["benchmarks"]) == {b.name for b in reproduce.SMOKE}
    assert all(r["medians"] for r in summary["benchmarks"].values())


def test_every_mode_names_scripts_that_exist():
    reproduce = load("reproduce")
    for benches in (reproduce.QUICK, reproduce.FULL, reproduce.SMOKE):
        assert len({b.name for b in benches}) == len(benches)
        for b in benches:
            script = next(part for part in b.command if part.endswith(".py"))
            assert (ROOT / script).exists(), script
            assert b.json_name or "{json}" in b.command, b.name


def test_run_one_kills_a_benchmark_past_its_limit(tmp_path):
    reproduce = load("reproduce")
    slow = reproduce.Benchmark("sleeper", ["-c", "import time; time.sleep(60)"], 1, "test", gpus=0)
    result = reproduce.run_one(slow, tmp_path, timeout_s=1)
    assert result["status"] == "timed out after 1 s" and result["seconds"] < 30 and "json" not in result
    failing = reproduce.Benchmark("failing", ["-c", "raise SystemExit(3)"], 30, "test", gpus=0)
    assert reproduce.run_one(failing, tmp_path, timeout_s=30)["status"] == "failed (rc 3)"
    assert (tmp_path / "failing.log").read_text().startswith("$ ")


def test_medians_finds_spreads_with_their_paths():
    reproduce = load("reproduce")
    data = {"rows": [{"variant": "a", "ms": {"median": 2.0, "min": 1.0, "max": 3.0, "rounds": [1.0, 2.0, 3.0]}}]}
    assert reproduce.medians(data) == ["/rows[a]/ms: 2 [1, 3]"]


@pytest.mark.parametrize("gpu_ms, graph_ms, expected", [(1.2, 1.0, True), (1.05, 1.0, False), (1.0, None, None)])
def test_host_bound_flags_back_to_back_times_past_the_graph_time(gpu_ms, graph_ms, expected):
    assert load("timing").host_bound(gpu_ms, graph_ms) is expected


@pytest.mark.parametrize("kind", ["skewed", "router"])
@pytest.mark.parametrize("groups, rows, align", [(64, 49152, 1), (64, 49152, 16), (8, 16384, 1), (5, 80, 16)])
def test_moe_group_sizes_sum_to_rows_in_multiples_of_align(kind, groups, rows, align):
    bench_moe = load("bench_moe")
    draw = bench_moe.uneven_splits if kind == "skewed" else bench_moe.router_splits
    sizes = draw(groups, rows, align)
    assert len(sizes) == groups and sum(sizes) == rows
    assert all(size >= 0 and size % align == 0 for size in sizes)
    assert draw(groups, rows, align) == sizes  # (seeded: the same sizes every run)


def test_moe_router_sizes_are_near_balanced_and_skewed_ones_are_not():
    bench_moe = load("bench_moe")
    router = bench_moe.router_splits(64, 49152, top_k=6)
    skewed = bench_moe.uneven_splits(64, 49152)
    mean = 49152 / 64
    assert max(router) < 1.25 * mean and min(router) > 0.75 * mean
    assert min(skewed) == 0 and max(skewed) > 2 * mean


def test_gpu_time_ms_lengthens_short_loops_to_the_window():
    timing = load("timing")
    calls = []

    def work():
        calls.append(None)
        time.sleep(0.0005)

    ms = timing.gpu_time_ms(work, warmup=0, iters=1, min_window_ms=50.0)
    sized = len(calls) - 1  # (the first loop of 1 call sized the second)
    assert ms >= 0.5 and sized > 1 and sized * ms >= 0.5 * 50.0
    calls.clear()
    timing.gpu_time_ms(work, warmup=0, iters=3)
    assert len(calls) == 3  # (no window: one loop of iters calls, as before)
    with pytest.raises(ValueError, match="min_window_ms"):
        timing.gpu_time_ms(work, min_window_ms=-1.0)
