"""Timing helpers shared by the benchmarks (CUDA events, peak memory, host time)."""
import random
import statistics
import time

import torch


def gpu_time_ms(fn, warmup=5, iters=20):
    """Median GPU time of fn() in ms, CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def loop_time_ms(fn, warmup=10, iters=100, repeats=5):
    """Time per call of `iters` back-to-back calls between two CUDA events, median of `repeats` such loops (the GPU
    runs ahead of the host when the kernels are longer than the host work; otherwise this measures host time)."""
    for _ in range(warmup):
        fn()
    per_call = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / iters)
    return statistics.median(per_call)


def interleaved(measure, fns, rounds, shuffle=False):
    """Per fn, measure(fn) in each of `rounds` rounds; a round measures each fn in turn (with shuffle, in a new order
    each round, seeded: then no fn always follows the same one, say a power-hungry one that leaves the GPU's clock
    low). (The GPU's clock under its power cap and the host's speed drift over seconds: measured one after the
    other, the drift would read as a difference between the fns.)"""
    results = [[] for _ in fns]
    order, rng = list(range(len(fns))), random.Random(0)
    for _ in range(rounds):
        if shuffle:
            rng.shuffle(order)
        for i in order:
            results[i].append(measure(fns[i]))
    return results


def peak_gib(fn):
    """Peak memory of fn() above what was allocated before it, in GiB."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def host_time_us(step, iters=200):
    """Host time per call: issue `iters` calls without synchronising, divide the wall time."""
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / iters * 1e6
