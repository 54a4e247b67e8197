"""Timing helpers shared by the benchmarks. Each measure is named for what it measures:

- `gpu_time_ms`: time per call of many calls issued back to back between two CUDA events, no host synchronisation
  between them: the GPU's time per call when the host keeps ahead of it (what a training loop sees); where the host
  is slower than the kernels it is the host's rate instead, and `graph_time_ms` tells the two apart.
- `graph_time_ms`: time per call of fn captured in a CUDA graph and replayed: GPU time with no host work at all
  (only for callables that can be captured: static shapes, no host synchronisation, no CPU-side decisions).
- `step_alone_ms`: one call from an idle, synchronised GPU: its launch latency on the host counts (a step that starts
  after a data loader or a logging sync). Named so because it is *not* GPU time.
- `host_time_us`: host time per call, without waiting for the GPU.
- `host_bound`: whether a back-to-back time (`gpu_time_ms`) exceeds the graph time of the same work by more than
  `HOST_BOUND_MARGIN` (10%): then the figure is the host's issue rate, not GPU time, and tables label it so.
- `run_rounds`: several variants measured in turn, round after round, in a seeded new order each round, so that the
  GPU clock's drift under its power cap (and the host's speed drift) lands on every variant alike; returns the median
  and spread per variant and every round's value.

On a machine without CUDA the GPU measures fall back to the wall clock (smoke tests of the scripts only).
"""
import contextlib
import math
import os
import random
import statistics
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch


def _cuda() -> bool:
    return torch.cuda.is_available()


def _synchronize() -> None:
    if _cuda():
        torch.cuda.synchronize()


def _check_counts(**counts: int) -> None:
    for name, value in counts.items():
        if not isinstance(value, int) or value < (0 if name == "warmup" else 1):
            raise ValueError(f"{name}: expected an int >= {0 if name == 'warmup' else 1}, got {value!r}")


def _elapsed_ms(run: Callable[[], None]) -> float:
    """Milliseconds that run() takes: between two CUDA events recorded around it (CUDA), else the wall clock."""
    if not _cuda():
        _synchronize()
        start = time.perf_counter()
        run()
        return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


MAX_SIZED_ITERS = 10000  # (gpu_time_ms's min_window_ms never times more calls than this in one loop)


def gpu_time_ms(fn: Callable[[], object], warmup: int = 5, iters: int = 20, repeats: int = 1,
                min_window_ms: float = 0.0) -> float:
    """GPU time per call of fn: `iters` calls back to back between two CUDA events, no synchronisation between calls.

    Args:
        fn: the work of one call (no arguments).
        warmup: untimed calls first.
        iters: calls between the two events.
        repeats: such timed loops; their median is returned.
        min_window_ms: when > 0, the loop is lengthened until it spans at least this long (sized from a first loop of
            `iters` calls, at most MAX_SIZED_ITERS calls): in a short window one stall of the host thread that
            enqueues the calls can leave the GPU idle for a visible part of it (bench_moe's 10-call loops of ~80 µs
            GEMMs had single rounds at 0.3-0.5x of the others; the cause was not isolated).
    Returns:
        milliseconds per call (median over the repeats).
    """
    _check_counts(warmup=warmup, iters=iters, repeats=repeats)
    if not isinstance(min_window_ms, (int, float)) or min_window_ms < 0:
        raise ValueError(f"min_window_ms: expected a number >= 0, got {min_window_ms!r}")
    for _ in range(warmup):
        fn()
    _synchronize()

    def loop(calls):
        def run():
            for _ in range(calls):
                fn()
        return run
    if min_window_ms > 0:
        first = _elapsed_ms(loop(iters))
        if first < min_window_ms:
            iters = min(MAX_SIZED_ITERS, max(iters, math.ceil(iters * min_window_ms / max(first, 1e-6))))
    return statistics.median(_elapsed_ms(loop(iters)) / iters for _ in range(repeats))


def loop_time_ms(fn: Callable[[], object], warmup: int = 10, iters: int = 100, repeats: int = 5) -> float:
    """The same measure as `gpu_time_ms` (kept under its old name): median over `repeats` loops of `iters` back-to-back
    calls between CUDA events, ms per call.

    Args:
        fn: the work of one call. warmup, iters, repeats: as in `gpu_time_ms`.
    Returns:
        milliseconds per call.
    """
    return gpu_time_ms(fn, warmup=warmup, iters=iters, repeats=repeats)


def step_alone_ms(fn: Callable[[], object], warmup: int = 5, iters: int = 20) -> float:
    """Latency of one call started on an idle GPU: synchronise, CUDA events around the one call; median of `iters`.
    The host's launch latency before the first kernel counts (this is the measure the benchmarks' "step alone"
    columns used to call GPU time).

    Args:
        fn: the work of one call. warmup: untimed calls first. iters: timed calls.
    Returns:
        milliseconds, the median over the timed calls.
    """
    _check_counts(warmup=warmup, iters=iters)
    for _ in range(warmup):
        fn()
    _synchronize()
    return statistics.median(_elapsed_ms(fn) for _ in range(iters))


def graph_time_ms(fn: Callable[[], object], calls: int = 10, warmup: int = 3, repeats: int = 5) -> float:
    """GPU time per call of fn captured `calls` times in one CUDA graph (after `warmup` eager calls on a side stream),
    the replays timed between CUDA events: no host work in the figure. fn must be capturable.

    Args:
        fn: the work of one call. calls: calls captured in the graph. warmup: eager calls before the capture.
        repeats: timed replays; their median is returned.
    Returns:
        milliseconds per call.
    Raises:
        RuntimeError: without CUDA (a CUDA graph needs a GPU).
    """
    _check_counts(calls=calls, warmup=warmup, repeats=repeats)
    if not _cuda():
        raise RuntimeError("graph_time_ms: CUDA graphs need a CUDA device")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    return statistics.median(_elapsed_ms(graph.replay) / calls for _ in range(repeats))


def graph_capture_error(fn: Callable[[], object], calls: int = 1) -> Optional[str]:
    """Whether fn can be captured in a CUDA graph: one trial capture and replay (after two eager calls).

    Args:
        fn: the work of one call. calls: calls in the trial graph.
    Returns:
        None when it can, else why not (the exception's text; "no CUDA device" without CUDA).
    """
    if not _cuda():
        return "no CUDA device"
    try:
        graph_time_ms(fn, calls=calls, warmup=2, repeats=1)
        return None
    except Exception as err:  # noqa: BLE001  (any failure means: not capturable; reported, not fatal)
        try:
            torch.cuda.synchronize()
        except RuntimeError as sticky:  # (a CUDA error that outlives the capture: the caller's next call will say so)
            return f"{type(err).__name__}: {err}; then {sticky}"[:300]
        return f"{type(err).__name__}: {err}"[:300]


# A back-to-back time more than this fraction above the same work's CUDA-graph time is the host's rate, not GPU time.
HOST_BOUND_MARGIN = 0.10


def host_bound(gpu_ms: Optional[float], graph_ms: Optional[float], margin: float = HOST_BOUND_MARGIN) -> Optional[bool]:
    """Whether a back-to-back time is host-bound: gpu_ms above graph_ms (the same work with no host in it) by more
    than `margin`.

    Args:
        gpu_ms: `gpu_time_ms` of the work (median). graph_ms: `graph_time_ms` of it (median), None if not capturable.
        margin: the fraction allowed for a graph's own savings (launch gaps between kernels).
    Returns:
        True / False, or None when there is no graph time to compare with.
    """
    if gpu_ms is None or graph_ms is None or graph_ms <= 0:
        return None
    return gpu_ms > graph_ms * (1 + margin)


def host_time_us(step: Callable[[], object], iters: int = 200, warmup: int = 20) -> float:
    """Host time per call: issue `iters` calls without synchronising, divide the wall time (the GPU's completion not
    awaited inside the measure).

    Args:
        step: the work of one call. iters: timed calls. warmup: untimed calls first.
    Returns:
        microseconds per call.
    """
    _check_counts(warmup=warmup, iters=iters)
    for _ in range(warmup):
        step()
    _synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    elapsed = time.perf_counter() - start
    _synchronize()
    return elapsed / iters * 1e6


def peak_gib(fn: Callable[[], object]) -> float:
    """Peak memory of fn() above what was allocated before it, in GiB (one untimed call first); NaN without CUDA.

    Args:
        fn: the work of one call.
    Returns:
        GiB.
    """
    fn()
    if not _cuda():
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def interleaved(measure: Callable, fns: Sequence, rounds: int, shuffle: bool = False, seed: int = 0) -> List[list]:
    """Per fn, measure(fn) in each of `rounds` rounds; a round measures each fn in turn (with shuffle, in a new order
    each round, seeded: then no fn always follows the same one, say a power-hungry one that leaves the GPU's clock
    low). Measured one after the other instead, the GPU clock's and the host's drift over seconds would read as a
    difference between the fns.

    Args:
        measure: fn -> one measurement (any value).
        fns: the things to measure.
        rounds: how many times each is measured.
        shuffle: a new order each round (random.Random(seed)).
        seed: the order's seed.
    Returns:
        per fn (in fns' order), the list of its measurements, one per round.
    """
    _check_counts(rounds=rounds)
    results = [[] for _ in fns]
    order, rng = list(range(len(fns))), random.Random(seed)
    for _ in range(rounds):
        if shuffle:
            rng.shuffle(order)
        for i in order:
            results[i].append(measure(fns[i]))
    return results


def spread(values: Sequence[float], digits: int = 4) -> Dict[str, object]:
    """Median and spread of a variant's per-round values.

    Args:
        values: one value per round (at least one).
        digits: rounding of the returned figures.
    Returns:
        {"median", "min", "max", "q1", "q3" (quartiles; equal to min/max below 4 values), "rounds": the values}.
    """
    if not values:
        raise ValueError("spread: expected at least one value")
    ordered = sorted(values)
    q1, q3 = (statistics.quantiles(ordered, n=4, method="inclusive")[i] for i in (0, 2)) if len(values) >= 4 else \
        (ordered[0], ordered[-1])
    return {"median": round(statistics.median(ordered), digits), "min": round(ordered[0], digits),
            "max": round(ordered[-1], digits), "q1": round(q1, digits), "q3": round(q3, digits),
            "rounds": [round(v, digits) for v in values]}


def run_rounds(measures: Dict[str, Callable[[], float]], rounds: int, seed: int = 0,
               on_error: str = "record") -> Dict[str, Dict[str, object]]:
    """Measure every variant once per round, the variants in a new seeded order each round.

    Args:
        measures: {variant name: a function taking no argument that measures it once and returns a number}.
        rounds: how many rounds.
        seed: seeds the per-round order (random.Random(seed)), so a run can be repeated in the same order.
        on_error: "record": a variant whose measure raises is dropped from later rounds and reported with "error";
            "raise": the exception propagates.
    Returns:
        {variant: spread(its values) plus "order" (its position in each round)}, or {"error": message} for a variant
        that failed (with the rounds it completed, if any).
    """
    _check_counts(rounds=rounds)
    if on_error not in ("record", "raise"):
        raise ValueError(f"on_error: expected 'record' or 'raise', got {on_error!r}")
    names = list(measures)
    values: Dict[str, list] = {n: [] for n in names}
    positions: Dict[str, list] = {n: [] for n in names}
    errors: Dict[str, str] = {}
    rng = random.Random(seed)
    for _ in range(rounds):
        order = [n for n in names if n not in errors]
        rng.shuffle(order)
        for position, name in enumerate(order):
            try:
                values[name].append(float(measures[name]()))
                positions[name].append(position)
            except Exception as err:  # noqa: BLE001  (reported per variant; the others go on)
                if on_error == "raise":
                    raise
                errors[name] = f"{type(err).__name__}: {err}"[:300]
    result = {}
    for name in names:
        if name in errors:
            result[name] = {"error": errors[name], "rounds": values[name]}
        else:
            result[name] = {**spread(values[name]), "order": positions[name]}
    return result


def fmt_spread(stats: Dict[str, object], digits: int = 2) -> str:
    """'median (min–max)' of a `spread` result, or its error.

    Args:
        stats: a `spread` / `run_rounds` entry. digits: decimals shown.
    Returns:
        the text.
    """
    if "error" in stats:
        return f"error: {stats['error']}"
    return f"{stats['median']:.{digits}f} ({stats['min']:.{digits}f}-{stats['max']:.{digits}f})"


@contextlib.contextmanager
def environment(values: Dict[str, str]) -> Iterator[None]:
    """Sets the environment variables `values` inside the block and restores their former values after it (a
    variant that switches a library setting read from the environment at each call, e.g. TFP8_BLOCK_WIDE).

    Args:
        values: variable name -> value.
    """
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
