"""TransformerLayer forward+backward: ours (FP8 under fp8_autocast, and BF16 without) vs the same pre-LN layer in
plain PyTorch BF16 (SDPA), eager and torch.compile; then attention alone, our DotProductAttention vs torch SDPA
(default choice and each fused backend, on bhsd tensors; and the cuDNN backend on the sbhd views ours takes), each
side also on the other's layout (ours with qkv_format "bhsd"). Prints
tables and writes JSON (--json).

Each step starts with the gradients set to None, as after optimizer.zero_grad() (no accumulation adds).
Every table's variants are timed in turn, round after round, in a seeded new order each round (--rounds for the layer
table, --attention-rounds for the attention table), so that the GPU clock's drift under its power cap lands on all of
them alike; the tables print the median and the range over the rounds, the JSON keeps every round. Two times per
step: "ms b2b", GPU time per step (CUDA events around 10 layer steps, 20 attention steps, issued back to back as a
training loop issues them: the host runs ahead while the GPU works), and "ms alone", one step from an idle,
synchronised GPU (timing.step_alone_ms: the host's launch latency before the first kernel counts; not GPU time).
TFLOP/s from b2b. "host ms": the host's time to issue one step (3 issued without waiting, timing.host_time_us): a
step whose host ms is below its b2b ms is GPU-bound. "ms graph": where the step can be captured, the same step
replayed from a CUDA graph (timing.graph_time_ms; no host work in it), in the same rounds; "host-bound" marks a
variant whose b2b median exceeds its graph median by more than 10% (timing.host_bound): its b2b figure is then the
host's rate, not GPU time. Peak GiB: above what was allocated before a step, once per variant.
--graphed adds ours FP8 captured with te.make_graphed_callables to the layer table.
--kernels adds, per attention variant, the GPU kernel time of one step (torch.profiler, mean of 10 steps) split by
kernel: whether two variants differ in their kernels or only in the host time around them.
Configs (no mask, no dropout, sbhd): guide = hidden 4096, ffn 16384, 32 heads, seq 2048, batch 4;
gqa = the same with 8 GQA groups, kv_channels 128, seq 1024, batch 32, bias; tiny = a smoke-test size
(`--device cpu --configs tiny --no-compile --rounds 1 --attention-rounds 1` checks the script without a GPU).
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import transformer_fp8 as te
from timing import (gpu_time_ms, graph_capture_error, graph_time_ms, host_bound, host_time_us, interleaved, peak_gib,
                    spread, step_alone_ms)
from transformer_fp8 import recipe
from transformer_fp8.module.attention import DotProductAttention
from transformer_fp8.module.attention_cudnn import cudnn_attention_built
from transformer_fp8.module.transformer import TransformerLayer

DEV, DT = "cuda", torch.bfloat16  # (main sets DEV from --device; the functions read it when called)
OUR_DEFAULT = "cudnn" if cudnn_attention_built() else "torch"  # DotProductAttention's default attention_backend
CONFIGS = {
    "guide": dict(hidden=4096, ffn=16384, heads=32, groups=32, d=128, seq=2048, batch=4),
    "gqa": dict(hidden=4096, ffn=16384, heads=32, groups=8, d=128, seq=1024, batch=32),
    "tiny": dict(hidden=64, ffn=128, heads=4, groups=2, d=16, seq=16, batch=2),  # (smoke tests)
}
ATTENTION_VARIANTS = ("ours, PyTorch SDPA inside", "ours DotProductAttention", "ours, bhsd", "torch SDPA default",
                      "torch SDPA CUDNN_ATTENTION", "torch SDPA FLASH_ATTENTION", "torch SDPA EFFICIENT_ATTENTION",
                      "torch SDPA CUDNN_ATTENTION, sbhd")  # (the two "ours" cuDNN rows need the attention family)
LAYER_ROUNDS = 5  # per round and variant: 3 steps alone, 10 back to back
ATTENTION_ROUNDS = 9  # per round and variant: 5 steps alone, 20 back to back


class TorchPreLNLayer(nn.Module):
    """The BF16 layer a user already has: LayerNorm -> QKV -> SDPA -> proj, LayerNorm -> fc1 -> GELU -> fc2."""

    def __init__(self, hidden, ffn, heads, groups, d):
        super().__init__()
        self.heads, self.groups, self.d = heads, groups, d
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, (heads + 2 * groups) * d)
        self.proj = nn.Linear(heads * d, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x):  # x [s, b, hidden]
        s, b, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split([self.heads * self.d, self.groups * self.d, self.groups * self.d], -1)
        q, k, v = (t.reshape(s, b, -1, self.d).permute(1, 2, 0, 3) for t in (q, k, v))
        ctx = F.scaled_dot_product_attention(q, k, v, enable_gqa=self.groups != self.heads)
        x = x + self.proj(ctx.permute(2, 0, 1, 3).reshape(s, b, -1))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


def train_step(layer, x, dy, fp8=False, fp8_dpa=False, attention_backend=None):
    """One training step's forward and backward, gradients starting from None (optimizer.zero_grad's default).
    attention_backend: set on the layer's DotProductAttention for this step ("torch" / "cudnn"); None keeps it."""
    attentions = [m for m in layer.modules() if isinstance(m, DotProductAttention)]
    fp8_recipe = recipe.DelayedScaling(fp8_dpa=fp8_dpa)  # (one recipe for the run, as a training loop holds one)

    def step():
        for m in attentions:
            m.attention_backend = attention_backend or m.attention_backend
        layer.zero_grad(set_to_none=True)
        x.grad = None
        with te.fp8_autocast(enabled=fp8, fp8_recipe=fp8_recipe):
            y = layer(x)
        y.backward(dy)
    return step


def graphed_variant(c, x, dy):
    """("ours FP8, make_graphed_callables", step): a second layer of ours captured with te.make_graphed_callables (FP8
    and its scaling updates inside the graphs), stepped on its own input leaf."""
    layer = TransformerLayer(c["hidden"], c["ffn"], c["heads"], num_gqa_groups=c["groups"], kv_channels=c["d"],
                             hidden_dropout=0.0, attention_dropout=0.0, self_attn_mask_type="no_mask",
                             params_dtype=DT, device=DEV)
    x_graphed = x.detach().clone().requires_grad_()
    graphed = te.make_graphed_callables(layer, (x_graphed,), fp8_enabled=True, fp8_recipe=recipe.DelayedScaling())
    return "ours FP8, make_graphed_callables", train_step(graphed, x_graphed, dy)


def layer_rows(name, c, compile_torch, rounds, graphed=False):
    x = torch.randn(c["seq"], c["batch"], c["hidden"], device=DEV, dtype=DT, requires_grad=True)
    dy = torch.randn_like(x)
    ours = TransformerLayer(c["hidden"], c["ffn"], c["heads"], num_gqa_groups=c["groups"], kv_channels=c["d"],
                            hidden_dropout=0.0, attention_dropout=0.0, self_attn_mask_type="no_mask",
                            params_dtype=DT, device=DEV)
    plain = TorchPreLNLayer(c["hidden"], c["ffn"], c["heads"], c["groups"], c["d"]).to(DEV, DT)
    variants = [("ours FP8", train_step(ours, x, dy, fp8=True, attention_backend=OUR_DEFAULT))]
    if cudnn_attention_built():  # (else these would time the PyTorch fallback under their names)
        variants += [("ours FP8, PyTorch SDPA", train_step(ours, x, dy, fp8=True, attention_backend="torch")),
                     ("ours FP8, FP8 attention", train_step(ours, x, dy, fp8=True, fp8_dpa=True))]
    variants += [("ours BF16", train_step(ours, x, dy, attention_backend=OUR_DEFAULT)),
                 ("torch BF16 eager", train_step(plain, x, dy))]
    if compile_torch:
        variants.append(("torch BF16 compile", train_step(torch.compile(plain), x, dy)))
    if graphed:
        try:
            variants.append(graphed_variant(c, x, dy))
        except Exception as err:  # reported as the variant's error
            message = f"{type(err).__name__}: {err}"[:300]

            def failed():
                raise RuntimeError(f"make_graphed_callables failed: {message}")
            variants.append(("ours FP8, make_graphed_callables", failed))
    rows = timed_rows(name, variants, rounds, alone_iters=3, b2b_iters=10, memory=True)
    for row in rows:
        print(row_text(row), flush=True)
    return rows


def timed_rows(name, variants, rounds, alone_iters, b2b_iters, memory=False, flops=None):
    """Rows of (variant, step) timed in turn over `rounds` rounds in a seeded new order each round: per round and
    variant `alone_iters` steps alone (median), `b2b_iters` steps back to back, and (where the step can be captured)
    the step replayed from a CUDA graph. A variant whose first step fails is reported with its error. memory: also the
    peak GiB of one step (once per variant, before the rounds). Also per round "host_ms": the host's time to issue one
    step (3 steps issued without waiting for the GPU, wall time / 3)."""
    if DEV != "cuda":  # (a smoke test of the script: fewest steps)
        alone_iters, b2b_iters = 1, 2
    rows, runnable = {}, []
    for variant, step in variants:
        try:
            step()
            row = dict(config=name, variant=variant)
            if memory:
                row["peak_gib"] = round(peak_gib(step), 2)
            row["graph_error"] = graph_capture_error(step)
            rows[variant] = row
            runnable.append((variant, step))
        except Exception as err:  # report and go on with the other variants
            rows[variant] = dict(config=name, variant=variant, error=f"{type(err).__name__}: {err}"[:300])
    capturable = {id(step) for variant, step in runnable if rows[variant]["graph_error"] is None}

    def measure(step):
        graph = graph_time_ms(step, calls=3, warmup=1, repeats=3) if id(step) in capturable else None
        return (step_alone_ms(step, warmup=1, iters=alone_iters), gpu_time_ms(step, warmup=1, iters=b2b_iters),
                host_time_us(step, iters=3, warmup=1) / 1e3, graph)

    times = interleaved(measure, [step for _, step in runnable], rounds, shuffle=True)
    for (variant, _), per_round in zip(runnable, times):
        alone, b2b, host = (spread([t[i] for t in per_round], 3) for i in range(3))
        rows[variant].update(host_ms=host["median"], rounds_host_ms=host["rounds"])
        rows[variant].update(ms=alone["median"], ms_range=[alone["min"], alone["max"]], ms_b2b=b2b["median"],
                             ms_b2b_range=[b2b["min"], b2b["max"]], rounds_ms=alone["rounds"],
                             rounds_ms_b2b=b2b["rounds"], ms_spread=alone, ms_b2b_spread=b2b)
        if rows[variant]["graph_error"] is None:
            graph = spread([t[3] for t in per_round], 3)
            rows[variant].update(ms_graph=graph["median"], ms_graph_range=[graph["min"], graph["max"]],
                                 rounds_ms_graph=graph["rounds"])
        rows[variant]["host_bound"] = host_bound(b2b["median"], rows[variant].get("ms_graph"))
        if flops:
            rows[variant]["tflops"] = round(flops / b2b["median"] / 1e9, 1)
    return [rows[variant] for variant, _ in variants]


def row_text(row):
    """One row as printed while the benchmark runs (the round lists left out)."""
    return str({k: v for k, v in row.items() if not k.startswith("rounds")})


def attention_rows(name, c, rounds, variant_filter=None, kernels=False):
    """fwd+bwd of attention alone at the config's shape: ours (sbhd in, [s, b, h*d] out; and qkv_format "bhsd" on the
    torch rows' tensors) vs torch SDPA (bhsd; and its cuDNN backend on ours' sbhd views)."""
    s, b, h, g, d = c["seq"], c["batch"], c["heads"], c["groups"], c["d"]

    def leaf(*shape):
        return torch.randn(*shape, device=DEV, dtype=DT, requires_grad=True)

    q, k, v = leaf(s, b, h, d), leaf(s, b, g, d), leaf(s, b, g, d)
    dy = torch.randn(s, b, h * d, device=DEV, dtype=DT)
    torch_dpa = DotProductAttention(h, d, num_gqa_groups=g, attn_mask_type="no_mask", attention_backend="torch")
    qt, kt, vt = leaf(b, h, s, d), leaf(b, g, s, d), leaf(b, g, s, d)
    dyt = torch.randn(b, h, s, d, device=DEV, dtype=DT)

    def backward(out, grad, leaves):
        """out.backward(grad), then the leaves' gradients dropped: no gradient accumulation kernels timed."""
        out.backward(grad)
        for t in leaves:
            t.grad = None

    def torch_sdpa(backend=None):
        def step():
            if backend is None:
                out = F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=g != h)
            else:
                with sdpa_kernel(backend):
                    out = F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=g != h)
            backward(out, dyt, (qt, kt, vt))
        return step

    def torch_cudnn_sbhd():
        """PyTorch's cuDNN backend on ours' inputs and output layout (sbhd views in, [s, b, h*d] out)."""
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), enable_gqa=g != h)
        backward(out.permute(2, 0, 1, 3).reshape(s, b, h * d), dy, (q, k, v))

    cudnn_dpa = DotProductAttention(h, d, num_gqa_groups=g, attn_mask_type="no_mask", attention_backend="cudnn")
    bhsd_dpa = DotProductAttention(h, d, num_gqa_groups=g, attn_mask_type="no_mask", attention_backend="cudnn",
                                   qkv_format="bhsd")  # (the torch rows' inputs and output layout)

    variants = [("ours, PyTorch SDPA inside", lambda: backward(torch_dpa(q, k, v), dy, (q, k, v)))]
    if cudnn_attention_built():
        variants += [("ours DotProductAttention", lambda: backward(cudnn_dpa(q, k, v), dy, (q, k, v))),
                     ("ours, bhsd", lambda: backward(bhsd_dpa(qt, kt, vt), dyt, (qt, kt, vt)))]
    variants.append(("torch SDPA default", torch_sdpa()))
    variants += [(f"torch SDPA {bk.name}", torch_sdpa(bk)) for bk in
                 (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)]
    variants.append(("torch SDPA CUDNN_ATTENTION, sbhd", torch_cudnn_sbhd))
    if variant_filter:
        unknown = set(variant_filter) - {v for v, _ in variants}
        if unknown:
            raise ValueError(f"--attention-variants: unknown {sorted(unknown)}; expected some of "
                             f"{[v for v, _ in variants]}")
        variants = [(v, step) for v, step in variants if v in variant_filter]
    flops = 4 * b * h * s * s * d * 3.5  # fwd 2 GEMMs, bwd 5: 3.5x the forward's 4*b*h*s*s*d
    rows = timed_rows(name, variants, rounds, alone_iters=5, b2b_iters=20, flops=flops)
    if kernels:
        for row, (_, step) in zip(rows, variants):
            if "error" not in row:
                row["kernel_us"], row["kernels"] = kernel_split(step)
    for row in rows:
        print(row_text(row), flush=True)
    return rows


def kernel_split(step, steps=10):
    """GPU kernel time of one step() under torch.profiler, mean of `steps` steps -> (total µs per step, {kernel name:
    µs per step}, the longest first)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_kernel = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[e.name[:100]] = per_kernel.get(e.name[:100], 0.0) + e.time_range.elapsed_us() / steps
    ordered = dict(sorted(((k, round(v, 1)) for k, v in per_kernel.items()), key=lambda kv: -kv[1]))
    return round(sum(per_kernel.values()), 1), ordered


def cell(row, col):
    """A table cell: "median (min-max)" for a timed column with its range, else the value."""
    if col in row and f"{col}_range" in row:
        low, high = row[f"{col}_range"]
        return f"{row[col]:.3f} ({low:.3f}-{high:.3f})"
    if col == "host_bound":
        return {True: "HOST-BOUND", False: "no", None: "n/a"}[row.get(col)]
    return str(row.get(col, "-"))


def print_table(title, rows, cols):
    print(f"\n{title}")
    widths = [8 if c == "config" else 32 if c == "variant" else 23 if c.startswith("ms") else 10 for c in cols]
    print(" | ".join(f"{c:>{w}}" for c, w in zip(cols, widths)))
    for r in rows:
        print(" | ".join(f"{cell(r, c):>{w}}" for c, w in zip(cols, widths)))
        if "error" in r:
            print(f"    error: {r['error']}")


def print_kernels(rows, top=8):
    for r in rows:
        if "kernels" in r:
            print(f"\n{r['config']} {r['variant']}: {r['kernel_us']} us of kernels per step (profiler, mean of 10)")
            for name, us in list(r["kernels"].items())[:top]:
                print(f"  {us:9.1f} us  {name}")


def names(text):
    """A comma-separated list -> its non-empty items."""
    return [item.strip() for item in text.split(",") if item.strip()]


def main(argv=None):
    """Runs the layer and attention tables for the chosen configs; prints them and writes the JSON.

    Args:
        argv: the command line's arguments (default sys.argv[1:]).
    """
    global DEV
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--configs", default="guide,gqa", help=f"comma-separated, from {sorted(CONFIGS)}")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    parser.add_argument("--attention-only", action="store_true", help="only the attention-alone table")
    parser.add_argument("--no-attention", action="store_true", help="skip the attention-alone table")
    parser.add_argument("--rounds", type=int, default=LAYER_ROUNDS, help="rounds of the layer table")
    parser.add_argument("--attention-rounds", type=int, default=ATTENTION_ROUNDS, help="rounds of the attention table")
    parser.add_argument("--attention-variants", nargs="+", default=None, metavar="NAME",
                        help="attention variant names to time (an A/B; each name one argument, quoted); default all")
    parser.add_argument("--graphed", action="store_true",
                        help="layer table: also ours FP8 captured with te.make_graphed_callables")
    parser.add_argument("--kernels", action="store_true",
                        help="per attention variant, the GPU kernel time of a step split by kernel (torch.profiler)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: a smoke test of the script (with --configs tiny)")
    args = parser.parse_args(argv)
    unknown = set(names(args.configs)) - set(CONFIGS)
    if unknown:
        parser.error(f"--configs: unknown {sorted(unknown)}; expected some of {sorted(CONFIGS)}")
    for flag in ("rounds", "attention_rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: expected at least 1, got {getattr(args, flag)}")
    unknown = set(args.attention_variants or ()) - set(ATTENTION_VARIANTS)
    if unknown:
        parser.error(f"--attention-variants: unknown {sorted(unknown)}; expected some of {list(ATTENTION_VARIANTS)}")
    if args.attention_only and args.no_attention:
        parser.error("--attention-only and --no-attention: nothing left to run")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_transformer_layer.py needs a CUDA GPU (or --device cpu --configs tiny to check it)")
    DEV = args.device
    torch.manual_seed(0)
    layers, attention = [], []
    for name in names(args.configs):
        if not args.attention_only:
            layers += layer_rows(name, CONFIGS[name], not args.no_compile, args.rounds, args.graphed)
            if DEV == "cuda":
                torch.cuda.empty_cache()
        if not args.no_attention:
            attention += attention_rows(name, CONFIGS[name], args.attention_rounds, args.attention_variants,
                                        args.kernels and DEV == "cuda")
            if DEV == "cuda":
                torch.cuda.empty_cache()
    device_name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
    print(f"\n{device_name}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}; "
          f"medians (min-max) over {args.rounds} (layer) / {args.attention_rounds} (attention) interleaved rounds")
    if layers:
        print_table("TransformerLayer fwd+bwd", layers,
                    ["config", "variant", "ms", "ms_b2b", "ms_graph", "host_bound", "host_ms", "peak_gib"])
    if attention:
        print_table("Attention alone fwd+bwd", attention,
                    ["config", "variant", "ms", "ms_b2b", "ms_graph", "host_bound", "host_ms", "tflops"])
        print_kernels(attention)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name, "torch": torch.__version__,
                       "rounds": args.rounds, "attention_rounds": args.attention_rounds, "layer": layers,
                       "attention": attention}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
