"""Kernel time per host operator and input shapes, from a Chrome trace of profile_gaps.py (recorded with --shapes).

For the last profiled step (kernels launched after the last "phase::forward" range began), each kernel, memset and
memcpy is charged to the innermost host operator running on the launching thread when it was launched (runtime or
driver API launch, matched by correlation id), and grouped by (operator, kernel name, the operator's input shapes).
Prints the step's kernel count, span and summed kernel time, then the groups by GPU time (ms, launches).
This is the table that says which casts, copies and small kernels a step spends its time on, and with which shapes
(bytes moved follow from them).

Run: python benchmarks/profile_ops.py TRACE.json[.gz] [--top 90]
"""
import argparse
import collections
import gzip
import json


def load(path: str) -> list:
    """The complete ("X") events of a Chrome trace file (gzipped or not)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def kernel_table(events: list) -> dict:
    """-> {kernels, span_ms, kernel_ms, rows: [(gpu ms, launches, operator, kernel name, input shapes)]} of the last
    profiled step."""
    marks = sorted((e for e in events if e["name"] == "phase::forward" and e.get("cat") in
                    ("user_annotation", "cpu_op")), key=lambda e: e["ts"])
    start = marks[-1]["ts"] if marks else float("-inf")
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    device = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")
                     and launches.get(e["args"].get("correlation"), {"ts": float("-inf")})["ts"] >= start),
                    key=lambda e: e["ts"])
    ops = sorted((e for e in events if e.get("cat") == "cpu_op" and e["ts"] + e["dur"] >= start),
                 key=lambda e: e["ts"])
    groups = collections.defaultdict(lambda: [0.0, 0])
    for e in device:
        launch = launches.get(e["args"].get("correlation"))
        op = None
        if launch is not None:
            for candidate in ops:
                if candidate["ts"] > launch["ts"]:
                    break
                if candidate["tid"] == launch["tid"] and candidate["ts"] + candidate["dur"] >= launch["ts"] and \
                        (op is None or candidate["dur"] <= op["dur"]):
                    op = candidate
        key = (op["name"] if op else "-", e["name"][:60], str(op["args"].get("Input Dims", ""))[:90] if op else "")
        groups[key][0] += e["dur"] / 1e3
        groups[key][1] += 1
    rows = sorted(((round(ms, 3), n, *key) for key, (ms, n) in groups.items()), reverse=True)
    span = (max(e["ts"] + e["dur"] for e in device) - device[0]["ts"]) / 1e3 if device else 0.0
    return dict(kernels=len(device), span_ms=round(span, 2), kernel_ms=round(sum(e["dur"] for e in device) / 1e3, 2),
                rows=rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--top", type=int, default=90)
    args = parser.parse_args()
    table = kernel_table(load(args.trace))
    print(f"last step: {table['kernels']} kernels, span {table['span_ms']} ms, kernel time {table['kernel_ms']} ms")
    for ms, n, op, kernel, shapes in table["rows"][:args.top]:
        print(f"{ms:8.3f} {n:4d} {op[:45]:45s} {kernel[:50]:50s} {shapes}")


if __name__ == "__main__":
    main()
