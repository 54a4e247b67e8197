"""TransformerLayer forward+backward: ours (FP8 under fp8_autocast, and BF16 without) vs the same pre-LN layer in
plain PyTorch BF16 (SDPA), eager and torch.compile; then attention alone, our DotProductAttention vs torch SDPA
(default choice and each fused backend, on bhsd tensors; and the cuDNN backend on the sbhd views ours takes), each
side also on the other's layout (ours with qkv_format "bhsd"). Prints
tables and writes JSON (--json).

Each step starts with the gradients set to None, as after optimizer.zero_grad() (no accumulation adds).
Two times per layer step: "ms", each step alone (synchronised before it: the host's launch latency at the start of
the step counts), and "ms b2b", steps back to back (10 between two CUDA events, as a training loop issues them: the
host runs ahead while the GPU works). The attention table has both too (b2b: 20 steps), and TFLOP/s from b2b; its
variants are timed in turn over ATTENTION_ROUNDS rounds, in a new order each round (medians over the rounds).
Configs (no mask, no dropout, sbhd): guide = hidden 4096, ffn 16384, 32 heads, seq 2048, batch 4;
gqa = the same with 8 GQA groups, kv_channels 128, seq 1024, batch 32, bias.
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import transformer_fp8 as te
from timing import gpu_time_ms, interleaved, loop_time_ms, peak_gib
from transformer_fp8 import recipe
from transformer_fp8.module.attention import DotProductAttention
from transformer_fp8.module.attention_cudnn import cudnn_attention_built
from transformer_fp8.module.transformer import TransformerLayer

DEV, DT = "cuda", torch.bfloat16
OUR_DEFAULT = "cudnn" if cudnn_attention_built() else "torch"  # DotProductAttention's default attention_backend
CONFIGS = {
    "guide": dict(hidden=4096, ffn=16384, heads=32, groups=32, d=128, seq=2048, batch=4),
    "gqa": dict(hidden=4096, ffn=16384, heads=32, groups=8, d=128, seq=1024, batch=32),
}
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

    def step():
        for m in attentions:
            m.attention_backend = attention_backend or m.attention_backend
        layer.zero_grad(set_to_none=True)
        x.grad = None
        with te.fp8_autocast(enabled=fp8, fp8_recipe=recipe.DelayedScaling(fp8_dpa=fp8_dpa)):
            y = layer(x)
        y.backward(dy)
    return step


def layer_rows(name, c, compile_torch):
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
    rows = []
    for variant, step in variants:
        try:
            ms, b2b, gib = gpu_time_ms(step), loop_time_ms(step, warmup=3, iters=10, repeats=3), peak_gib(step)
            rows.append(dict(config=name, variant=variant, ms=round(ms, 2), ms_b2b=round(b2b, 2),
                             peak_gib=round(gib, 2)))
        except Exception as err:  # report and go on with the other variants
            rows.append(dict(config=name, variant=variant, error=f"{type(err).__name__}: {err}"[:300]))
        print(rows[-1], flush=True)
    return rows


def attention_rows(name, c):
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
    flops = 4 * b * h * s * s * d * 3.5  # fwd 2 GEMMs, bwd 5: 3.5x the forward's 4*b*h*s*s*d
    rows, runnable = {}, []
    for variant, step in variants:
        try:
            step()
            runnable.append((variant, step))
        except Exception as err:
            rows[variant] = dict(config=name, variant=variant, error=f"{type(err).__name__}: {err}"[:300])
    # (the variants within a few % of each other: timed in turn over rounds, in a new order each round, so that the
    # GPU clock's drift under its power cap lands on all of them alike)
    times = interleaved(lambda step: (gpu_time_ms(step, warmup=2, iters=5), loop_time_ms(step, 2, 20, 1)),
                        [step for _, step in runnable], ATTENTION_ROUNDS, shuffle=True)
    for (variant, _), per_round in zip(runnable, times):
        ms = statistics.median(t for t, _ in per_round)
        ms_b2b = statistics.median(t for _, t in per_round)
        rows[variant] = dict(config=name, variant=variant, ms=round(ms, 3), ms_b2b=round(ms_b2b, 3),
                             tflops=round(flops / ms_b2b / 1e9, 1))
    rows = [rows[variant] for variant, _ in variants]
    for row in rows:
        print(row, flush=True)
    return rows


def print_table(title, rows, cols):
    print(f"\n{title}")
    widths = [8 if c == "config" else 30 if c == "variant" else 9 for c in cols]
    print(" | ".join(f"{c:>{w}}" for c, w in zip(cols, widths)))
    for r in rows:
        print(" | ".join(f"{str(r.get(c, '-')):>{w}}" for c, w in zip(cols, widths)))
        if "error" in r:
            print(f"    error: {r['error']}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--configs", default="guide,gqa")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    parser.add_argument("--attention-only", action="store_true", help="only the attention-alone table")
    args = parser.parse_args()
    torch.manual_seed(0)
    layers, attention = [], []
    for name in args.configs.split(","):
        if not args.attention_only:
            layers += layer_rows(name, CONFIGS[name], not args.no_compile)
            torch.cuda.empty_cache()
        attention += attention_rows(name, CONFIGS[name])
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print_table("TransformerLayer fwd+bwd", layers, ["config", "variant", "ms", "ms_b2b", "peak_gib"])
    print_table("Attention alone fwd+bwd", attention, ["config", "variant", "ms", "ms_b2b", "tflops"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "layer": layers, "attention": attention}, f, indent=1)


if __name__ == "__main__":
    main()
