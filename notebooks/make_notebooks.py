"""Write the notebooks of this folder from the cell sources below (outputs empty): `python notebooks/make_notebooks.py`.

Edit the cells here, not in the .ipynb files; tests/test_notebooks.py checks that the files match this script and
executes each notebook with TFP8_NOTEBOOK_TINY=1 (tiny sizes, CPU reference kernels when there is no GPU).
"""
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

SETUP = '''import os
import time

import torch

import transformer_fp8 as te
from transformer_fp8 import recipe

TINY = os.environ.get("TFP8_NOTEBOOK_TINY") == "1"  # CI: tiny sizes, seconds on a CPU
DEVICE = "cuda" if torch.cuda.is_available() and te.cuda_kernels_available() else "cpu"
DTYPE = torch.bfloat16
print(f"device {DEVICE}, tiny sizes: {TINY}")'''

# The notebooks' small Llama (random init) and the byte-level corpus: one definition for the Llama and LoRA notebooks.
SMALL_LLAMA = '''if TINY:
    sizes = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    seq_len, batch_size, steps = 64, 4, 8
else:
    sizes = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
                 num_key_value_heads=4)
    seq_len, batch_size, steps = 1024, 16, 100

text = (Path.cwd().parent / "examples" / "data" / "corpus.txt").read_text(encoding="utf-8")
tokens = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)  # bytes as token ids: no tokenizer download
config = LlamaConfig(vocab_size=256, max_position_embeddings=seq_len, use_cache=False, **sizes)
torch.manual_seed(0)
base_model = LlamaForCausalLM(config).to(DEVICE, DTYPE)
print(f"{sum(p.numel() for p in base_model.parameters()) / 1e6:.1f}M parameters, {tokens.numel():,} tokens")'''

TIMER = '''def time_ms(fn, iters=3 if TINY else 20):
    """Mean wall time of fn() in ms after one warm-up call (synchronised on the GPU)."""
    fn()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - start) / iters


def rel_error(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()'''

QUICKSTART = [
    new_markdown_cell("""# Quickstart: FP8 training with transformer_fp8

From a plain PyTorch model to FP8 GEMMs on Hopper: swap `nn.Linear` for `te.Linear`, run the forward inside
`te.fp8_autocast`, pick a scaling recipe, and keep the weights themselves in FP8 with `te.fp8_model_init`.
Without a GPU everything runs on the CPU reference kernels (emulated FP8: same numbers, not the speed)."""),
    new_code_cell(SETUP),
    new_code_cell(TIMER),
    new_markdown_cell("""## 1. From `nn.Linear` to `te.Linear`

`te.Linear` takes `nn.Linear`'s arguments (plus `params_dtype` and `device`) and computes the same thing outside
`fp8_autocast`. `convert_linear_layers` swaps every `nn.Linear` of an existing model, keeping its weights."""),
    new_code_cell('''from torch import nn
from transformer_fp8.integrations import convert_linear_layers

hidden, ffn, tokens = (64, 256, 32) if TINY else (4096, 16384, 8192)
torch.manual_seed(0)
mlp = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(approximate="tanh"), nn.Linear(ffn, hidden)).to(DEVICE, DTYPE)
x = torch.randn(tokens, hidden, device=DEVICE, dtype=DTYPE)
reference = mlp(x)

fp8_mlp = convert_linear_layers(mlp, exclude=())  # in place: mlp now holds te.Linear layers
print(fp8_mlp)
print("same output outside fp8_autocast:", torch.equal(fp8_mlp(x), reference))'''),
    new_markdown_cell("""## 2. `fp8_autocast`

Inside the context every GEMM of our modules runs in FP8: inputs and weights are cast to E4M3 with per-tensor
scales, gradients to E5M2 (the HYBRID format). The backward runs in FP8 too; call it outside the context."""),
    new_code_cell('''fp8_recipe = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
x.requires_grad_(True)
for step in range(3):  # delayed scaling: the scales of step n come from the amaxes of the steps before
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        out = fp8_mlp(x)
    out.float().square().mean().backward()
    print(f"step {step}: relative error of the FP8 output vs BF16 {rel_error(out, reference):.4f}")'''),
    new_markdown_cell("""## 3. Recipes

* `DelayedScaling`: each tensor's scale comes from the history of its past amaxes (`amax_history_len`,
  `amax_compute_algo="max"` or `"most_recent"`, `margin`): no extra pass over the data. Formats: `Format.HYBRID`
  (E4M3 forward, E5M2 gradients) or `Format.E4M3` everywhere.
* `Float8CurrentScaling`: the scale of each tensor from its own amax, computed right before the cast."""),
    new_code_cell('''recipes = {
    "DelayedScaling HYBRID, max of 16": recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16),
    "DelayedScaling E4M3, most recent": recipe.DelayedScaling(fp8_format=recipe.Format.E4M3, amax_history_len=1,
                                                              amax_compute_algo="most_recent"),
    "DelayedScaling HYBRID, margin 1": recipe.DelayedScaling(margin=1, amax_history_len=16),
    "Float8CurrentScaling HYBRID": recipe.Float8CurrentScaling(),
}
x = x.detach()
for name, r in recipes.items():
    layer = te.Linear(hidden, ffn, params_dtype=DTYPE, device=DEVICE)
    with torch.no_grad():
        exact = layer(x)
        for _ in range(2):  # a second call, so that delayed scaling has seen the tensors once
            with te.fp8_autocast(enabled=True, fp8_recipe=r):
                out = layer(x)
    print(f"{name:<36} relative error {rel_error(out, exact):.4f}")'''),
    new_markdown_cell("""## 4. FP8 weights: `fp8_model_init`

Modules created inside `te.fp8_model_init()` hold their GEMM weights as `Float8Tensor`s (FP8 data + a scale):
half the memory of BF16 weights, and no weight cast in the forward. Biases and norm weights stay in high precision.
Useful for inference, or with an optimizer that keeps high-precision master weights elsewhere."""),
    new_code_cell('''with te.fp8_model_init():
    fp8_weights = te.Linear(hidden, ffn, params_dtype=DTYPE, device=DEVICE)
bf16_weights = te.Linear(hidden, ffn, params_dtype=DTYPE, device=DEVICE)
w = fp8_weights.weight
print(type(w).__name__, "of", w.dtype, "storing", w._data.dtype)
print(f"weight bytes: FP8 {w._data.nbytes:,} vs BF16 {bf16_weights.weight.nbytes:,}")
with torch.no_grad(), te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
    out = fp8_weights(x)
print("output", tuple(out.shape), out.dtype, "finite:", bool(out.isfinite().all()))'''),
    new_markdown_cell("""## 5. Calibrating FP8 scales from a high-precision run

`te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=...)` (TE's argument) runs the modules in high
precision, unchanged, while they record the amaxes of the tensors their FP8 path would cast; at the exit those become
delayed scales. A model trained in BF16 can so be prepared for FP8 inference: its first FP8 call already quantizes
with scales from real data."""),
    new_code_cell('''layer = te.Linear(hidden, ffn, params_dtype=DTYPE, device=DEVICE)
calibration = recipe.DelayedScaling(fp8_format=recipe.Format.E4M3, amax_history_len=16)
with torch.no_grad():
    exact = layer(x)
    for batch in range(4):  # calibration batches, run in high precision
        with te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=calibration):
            assert torch.equal(layer(x), exact)
    print("calibrated input / weight scales:", [round(s, 2) for s in layer.fp8_fwd.scale.tolist()])
    with te.fp8_autocast(enabled=True, fp8_recipe=calibration):
        out = layer(x)
print(f"first FP8 call, relative error vs high precision {rel_error(out, exact):.4f}")'''),
]

PERFORMANCE = [
    new_markdown_cell("""# Performance optimizations

Each section times one technique on a `TransformerLayer` training step: FP8 itself, fusing the weight-gradient
accumulation into an FP32 `main_grad`, caching the FP8 weights across micro-batches, the multi-GPU layout and
activation checkpointing.
With `TFP8_NOTEBOOK_TINY=1` (CI) the sizes are tiny and the times mean nothing: run it on an H100 for numbers."""),
    new_code_cell(SETUP),
    new_code_cell(TIMER),
    new_code_cell('''hidden, ffn, heads, seq, batch = (64, 256, 4, 32, 2) if TINY else (4096, 16384, 32, 2048, 2)
fp8_recipe = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max")


def make_layer(**kwargs):
    torch.manual_seed(0)
    return te.TransformerLayer(hidden, ffn, heads, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=DTYPE,
                               device=DEVICE, **kwargs)


x = torch.randn(seq, batch, hidden, device=DEVICE, dtype=DTYPE, requires_grad=True)
dy = torch.randn_like(x)
timings = {}'''),
    new_markdown_cell("""## 1. BF16 vs FP8

The same layer, without and with `fp8_autocast`. Measured on one H100 (hidden 4096, ffn 16384, 32 heads, 2048 × 2
tokens, forward + backward): BF16 8.39 ms, FP8 6.72 ms, 1.25x faster (at 2048 × 4 tokens
`benchmarks/bench_transformer_layer.py` measures 1.50x: larger GEMMs gain more)."""),
    new_code_cell('''layer = make_layer()


def train_step(fp8):
    with te.fp8_autocast(enabled=fp8, fp8_recipe=fp8_recipe):
        y = layer(x)
    y.backward(dy)


timings["BF16"] = time_ms(lambda: train_step(False))
timings["FP8"] = time_ms(lambda: train_step(True))
print({k: f"{v:.2f} ms" for k, v in timings.items()})'''),
    new_markdown_cell("""## 2. Gradient accumulation: FP8 weight caching and wgrad fusion

With gradient accumulation the weights do not change between the micro-batches of a step, so:

* `is_first_microbatch=True` on the first micro-batch casts each weight to FP8 and caches it; `False` on the others
  reuses the cache (no weight cast, no amax of the weights);
* `fuse_wgrad_accumulation=True` makes the weight-gradient GEMM accumulate straight into `weight.main_grad`
  (FP32, `beta = 1` in the GEMM) instead of writing `weight.grad` and adding it in a separate kernel. The optimizer
  then reads `main_grad` (here: a plain SGD step on it).

Measured on one H100 (4 micro-batches of the layer above, per optimizer step):

| | ms |
|---|---|
| FP8, 4 micro-batches | 25.91 |
| + FP8 weight caching | 22.70 (−12%) |
| + FP32 `main_grad`, each micro-batch's `.grad` added by a hook | 26.52 |
| + wgrad fusion into `main_grad` | 24.89 (−6% against the hook) |

Caching saves three of the four weight casts. Accumulating in FP32 costs time against BF16 `.grad`s (4-byte
accumulator traffic); the fused GEMM epilogue costs 57% of what the separate adds cost (2.19 against 3.82 ms), and
it keeps no BF16 `.grad` at all."""),
    new_code_cell('''micro_batches = 4


def accumulation_step(layer, cache_weights, uses_main_grad):
    for i in range(micro_batches):
        flag = (i == 0) if cache_weights else None
        with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
            y = layer(x, is_first_microbatch=flag)
        y.backward(dy)
    with torch.no_grad():
        for p in layer.parameters():
            grad = p.main_grad if uses_main_grad and hasattr(p, "main_grad") else p.grad
            if grad is not None:
                p.sub_(1e-6 * grad.to(p.dtype))
                grad.zero_()


def gemm_weights(layer):
    return [p for p in layer.parameters() if p.dim() == 2]


def add_into_main_grad(p):  # the unfused way to an FP32 main_grad: add each micro-batch's .grad, then drop it
    p.main_grad.add_(p.grad)
    p.grad = None


plain, hooked = make_layer(), make_layer()
fused = make_layer(fuse_wgrad_accumulation=True)
for layer in (hooked, fused):  # an FP32 main_grad for each GEMM weight
    for p in gemm_weights(layer):
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
for p in gemm_weights(hooked):
    p.register_post_accumulate_grad_hook(add_into_main_grad)

timings["FP8, 4 micro-batches"] = time_ms(lambda: accumulation_step(plain, False, False))
timings["+ FP8 weight caching"] = time_ms(lambda: accumulation_step(plain, True, False))
timings["+ FP32 main_grad (hook adds)"] = time_ms(lambda: accumulation_step(hooked, True, True))
timings["+ wgrad fusion into main_grad"] = time_ms(lambda: accumulation_step(fused, True, True))
for name in list(timings)[2:]:
    print(f"{name:<32} {timings[name]:8.2f} ms")'''),
    new_markdown_cell("""## 3. The multi-GPU layout

Data parallel training keeps one copy of each layer per GPU; with delayed scaling the amaxes must agree across the
copies, or each GPU would quantize with its own scales. `fp8_autocast(fp8_group=group)` all-reduces (MAX) the
newest amaxes over `group` once per step, before the fused scale update.

Tensor parallelism splits each layer's GEMMs across the GPUs of a `tp_group`: `Linear(..., tp_group=g,
tp_size=n, parallel_mode="column" | "row", sequence_parallel=...)`, and `set_parallel_mode=True` on `LayerNormMLP`,
`MultiheadAttention` and `TransformerLayer` (QKV and FC1 column-parallel, projection and FC2 row-parallel). It is
tested on 2 GPUs (NCCL) and with 2 CPU processes (gloo); `benchmarks/bench_distributed.py` times it. Below, the
data-parallel layout runs in a single process: a process group of one rank, so the code is the one each rank of a
`torchrun` job would run. Measured on one H100: 7.09 ms a step against 6.72 ms without DDP (DDP's gradient
buckets and the amax all-reduce, with one rank)."""),
    new_code_cell('''import tempfile

import torch.distributed as dist

backend = "nccl" if DEVICE == "cuda" else "gloo"
store = tempfile.NamedTemporaryFile(delete=False)
dist.init_process_group(backend, init_method=f"file://{store.name}", rank=0, world_size=1)
data_parallel_group = dist.new_group(ranks=[0])

layer = make_layer()
model = torch.nn.parallel.DistributedDataParallel(layer) if DEVICE == "cuda" else layer


def dp_step():
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe, fp8_group=data_parallel_group):
        y = model(x)
    y.backward(dy)


timings["FP8, data parallel (1 rank)"] = time_ms(dp_step)
print(f"{timings['FP8, data parallel (1 rank)']:.2f} ms")
dist.destroy_process_group()'''),
    new_markdown_cell("""## 4. Activation checkpointing

`te.checkpoint(function, *args)` keeps only the inputs of `function` between the forward and the backward and runs
it again in the backward to rebuild what the backward needs. The FP8 modules inside recompute in FP8 with the scales
their forward used, so the gradients equal those of the step without checkpointing, bit for bit
(`torch.utils.checkpoint` would recompute outside `fp8_autocast`: our modules refuse that with a clear error). For
Hugging Face models: `transformer_fp8.integrations.gradient_checkpointing_enable(model)`. Measured by
`benchmarks/bench_llama.py` on one H100 (Llama 1.1B, 4 × 2048 tokens a step): 96.3k tokens/s at 14.78 GiB peak
without, 75.9k at 8.94 GiB with checkpointing; Hugging Face BF16 with its own checkpointing: 43.3k at 9.80 GiB."""),
    new_code_cell('''stack = torch.nn.ModuleList(make_layer() for _ in range(4))


def stack_step(checkpointed):
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        h = x
        for layer in stack:
            h = te.checkpoint(layer, h) if checkpointed else layer(h)
    h.backward(dy)


for checkpointed in (False, True):
    name = "FP8, 4 layers" + (", te.checkpoint" if checkpointed else "")
    timings[name] = time_ms(lambda: stack_step(checkpointed))
    if DEVICE == "cuda":  # (the step's peak above what was allocated before it)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        stack_step(checkpointed)
        print(f"{name:<32} peak {(torch.cuda.max_memory_allocated() - before) / 2**30:.2f} GiB")
    print(f"{name:<32} {timings[name]:8.2f} ms")'''),
    new_markdown_cell("## Summary"),
    new_code_cell('''for name, ms in timings.items():
    print(f"{name:<32} {ms:8.2f} ms")'''),
]

LLAMA = [
    new_markdown_cell("""# Fine-tuning a Llama model in FP8

`convert_llama` replaces each Hugging Face `LlamaDecoderLayer` by our `TransformerLayer` (RMSNorm, SwiGLU, GQA,
RoPE) with the same weights; training then runs its GEMMs in FP8 inside `fp8_autocast`. Here a small Llama is
initialised locally (no download) and trained on the public-domain text shipped in `examples/data`, in BF16 and in
FP8 from the same initial weights, then exported as a plain Hugging Face checkpoint and used to generate text.
`examples/finetune_llama.py` is the full script (checkpoints, gradient accumulation, local Hugging Face
checkpoints)."""),
    new_code_cell(SETUP),
    new_code_cell('''import copy
from pathlib import Path

import matplotlib.pyplot as plt
from transformers import LlamaConfig, LlamaForCausalLM

from transformer_fp8.integrations import convert_llama

''' + SMALL_LLAMA),
    new_markdown_cell("""## The conversion

Outside `fp8_autocast` the converted model computes what the Hugging Face model computes (up to BF16 rounding);
inside it, its GEMMs run in FP8."""),
    new_code_cell('''fp8_model = convert_llama(copy.deepcopy(base_model))
print(fp8_model.model.layers[0])
ids = tokens[:2 * seq_len].view(2, seq_len).to(DEVICE)
with torch.no_grad():
    hf_logits = base_model(input_ids=ids).logits.float()
    our_logits = fp8_model(input_ids=ids).logits.float()
    with te.fp8_autocast(enabled=True):
        fp8_logits = fp8_model(input_ids=ids).logits.float()
for name, logits in (("converted, BF16", our_logits), ("converted, FP8", fp8_logits)):
    err = ((logits - hf_logits).norm() / hf_logits.norm()).item()
    print(f"{name:<16} logits vs Hugging Face BF16: relative difference {err:.4f}")'''),
    new_markdown_cell("""## A short fine-tune, BF16 vs FP8

The same batches for both runs; AdamW on the BF16 parameters."""),
    new_code_cell('''fp8_recipe = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max")


def finetune(model, fp8):
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3 if TINY else 3e-4, fused=DEVICE == "cuda")
    losses, start = [], time.perf_counter()
    for _ in range(steps):
        starts = torch.randint(0, tokens.numel() - seq_len, (batch_size,), generator=generator).tolist()
        batch = torch.stack([tokens[s:s + seq_len] for s in starts]).to(DEVICE)
        with te.fp8_autocast(enabled=fp8, fp8_recipe=fp8_recipe):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    losses = torch.stack(losses).float().tolist()  # one host sync, at the end
    tokens_per_s = steps * batch_size * seq_len / (time.perf_counter() - start)
    return losses, tokens_per_s


fp8_model = convert_llama(copy.deepcopy(base_model))  # (kept: exported and generating below)
runs = {"BF16 (Hugging Face)": finetune(copy.deepcopy(base_model), fp8=False),
        "FP8 (transformer_fp8)": finetune(fp8_model, fp8=True)}
for name, (losses, tokens_per_s) in runs.items():
    print(f"{name:<22} loss {losses[0]:.3f} -> {losses[-1]:.3f}   {tokens_per_s:,.0f} tokens/s")'''),
    new_code_cell('''fig, ax = plt.subplots(figsize=(7, 4))
for name, (losses, _) in runs.items():
    ax.plot(range(1, steps + 1), losses, label=name)
ax.set_xlabel("step")
ax.set_ylabel("training loss")
ax.legend()
plt.show()'''),
    new_markdown_cell("""## The way back: a plain Hugging Face checkpoint

`save_pretrained` of a converted model writes a standard transformers checkpoint (it calls
`transformer_fp8.integrations.save_hf_pretrained`): our fused weights are split back into the Hugging Face tensors
(q/k/v, gate/up) and our FP8 scaling state is left out. Plain transformers loads it with `from_pretrained`, without
transformer_fp8, and computes what the FP8-trained model computes outside `fp8_autocast` (BF16)."""),
    new_code_cell('''import tempfile

from transformers import AutoModelForCausalLM

export_dir = Path(tempfile.mkdtemp()) / "llama-fp8-finetuned"
fp8_model.config.use_cache = True  # (off for training; the checkpoint's users generate with the KV cache)
fp8_model.save_pretrained(export_dir)
print(sorted(p.name for p in export_dir.iterdir()))
hf_model = AutoModelForCausalLM.from_pretrained(export_dir, dtype=DTYPE).to(DEVICE).eval()
fp8_model.eval()
with torch.no_grad():
    ours = fp8_model(input_ids=ids).logits.float()  # outside fp8_autocast: BF16
    theirs = hf_model(input_ids=ids).logits.float()
err = ((theirs - ours).norm() / ours.norm()).item()
print(f"plain transformers from the checkpoint vs our converted model: relative logit difference {err:.4f}")
assert err < 0.02, err  # (BF16 roundings of two implementations)'''),
    new_markdown_cell("""## Generation

`generate()` runs on the converted model: its layers keep the KV cache in transformers' `Cache` objects. For
inference the fine-tuned weights can be stored in FP8 (frozen, then `cast_frozen_weights_to_fp8`: one byte each, no
weight cast per token) and the model generates inside `fp8_autocast`. Next to it, plain transformers generates from
the exported checkpoint (BF16). Greedy decoding; where an FP8 rounding changes a choice the texts part ways."""),
    new_code_cell('''from transformer_fp8.lora import cast_frozen_weights_to_fp8

for param in fp8_model.parameters():
    param.requires_grad_(False)
print("GEMM weights stored in FP8:", cast_frozen_weights_to_fp8(fp8_model))
start = max(bytes(tokens[:4096].tolist()).find(b"From fairest"), 0)
prompt = tokens[start:start + 24].view(1, -1).to(DEVICE)  # (24 + 32 tokens: within the model's 64 positions)
settings = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, use_cache=True,
                attention_mask=torch.ones_like(prompt), pad_token_id=0)
with torch.no_grad():
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        fp8_tokens = fp8_model.generate(input_ids=prompt, **settings)
    hf_tokens = hf_model.generate(input_ids=prompt, **settings)


def text_of(ids):
    return bytes(ids.tolist()).decode("utf-8", errors="replace")


new = prompt.shape[1]
print("prompt:                  ", repr(text_of(prompt[0])))
print("converted, FP8 weights:  ", repr(text_of(fp8_tokens[0, new:])))
print("plain transformers, BF16:", repr(text_of(hf_tokens[0, new:])))
same = (fp8_tokens[0, new:] == hf_tokens[0, new:]).float().mean().item()
print(f"same tokens: {same:.0%}" + (" (a few steps of a tiny model: it writes noise)" if TINY else ""))'''),
]

LORA = [
    new_markdown_cell("""# LoRA on FP8 base weights

`transformer_fp8.lora` adds LoRA adapters to a converted model, targeted by Hugging Face module names as in PEFT
(`q_proj`, `gate_proj`, ...). The frozen base weights are stored in FP8 (one byte each) and their GEMMs run in FP8
inside `fp8_autocast` with no weight-gradient work; only the BF16/FP32 adapters train. The adapters save in PEFT's
format, so `peft.PeftModel.from_pretrained` puts them on the plain Hugging Face model. A small Llama is initialised
locally (no download); `examples/finetune_lora.py` is the full script (local checkpoints, BF16 vs FP8 runs)."""),
    new_code_cell(SETUP),
    new_code_cell(TIMER),
    new_code_cell('''import copy
import json
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from transformer_fp8.integrations import causal_lm_loss, convert_llama
from transformer_fp8.lora import add_lora, lora_parameters, merge_lora, save_lora

''' + SMALL_LLAMA),
    new_markdown_cell("""## Convert, add adapters, store the base in FP8

`add_lora` freezes every parameter but the adapters. On our fused GEMMs an adapter adds to its own rows only:
q_proj, k_proj and v_proj are row blocks of the QKV GEMM, gate_proj and up_proj of the MLP's first GEMM."""),
    new_code_cell('''targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
model = convert_llama(copy.deepcopy(base_model))
bf16_bytes = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
add_lora(model, r=16, alpha=32, target_modules=targets, fp8_weights=True, dtype=torch.float32)
stored = [getattr(p, "_data", p) for p in model.model.layers.parameters() if not p.requires_grad]  # (FP8 bytes)
fp8_bytes = sum(t.numel() * t.element_size() for t in stored)
trainable = sum(p.numel() for p in lora_parameters(model))
print(f"trainable (adapters): {trainable:,} parameters; frozen decoder layers: {bf16_bytes / 2**20:.1f} MiB in "
      f"BF16 -> {fp8_bytes / 2**20:.1f} MiB with FP8 weights")
print(model.model.layers[0].layer.self_attention.layernorm_qkv)'''),
    new_markdown_cell("""## Train the adapters

AdamW on the adapters only; the base GEMMs run in FP8 inside `fp8_autocast`, the loss by `causal_lm_loss`
(LM head and cross-entropy chunk by chunk)."""),
    new_code_cell('''fp8_recipe = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16,
                                    amax_compute_algo="max")
optimizer = torch.optim.AdamW(lora_parameters(model), lr=3e-3 if TINY else 1e-3)
generator = torch.Generator().manual_seed(0)
model.train()
losses = []
for step in tqdm(range(steps), desc="LoRA, FP8 base"):
    starts = torch.randint(0, tokens.numel() - seq_len, (batch_size,), generator=generator).tolist()
    batch = torch.stack([tokens[s:s + seq_len] for s in starts]).to(DEVICE)
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        loss = causal_lm_loss(model, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    losses.append(loss.detach())
losses = torch.stack(losses).float().tolist()  # one host sync, at the end
print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
fig, ax = plt.subplots(figsize=(7, 4))
ax.plot(range(1, steps + 1), losses)
ax.set_xlabel("step")
ax.set_ylabel("training loss")
plt.show()'''),
    new_markdown_cell("""## Save in PEFT's format, reload on the plain Hugging Face model

The folder holds `adapter_config.json` and `adapter_model.safetensors` under Hugging Face module names. PEFT
loads it onto the original model, with no transformer_fp8 involved, and generates from it."""),
    new_code_cell('''from peft import PeftModel

adapter_dir = Path(tempfile.mkdtemp()) / "adapter"
save_lora(model, adapter_dir)
print(json.loads((adapter_dir / "adapter_config.json").read_text())["target_modules"])
peft_model = PeftModel.from_pretrained(copy.deepcopy(base_model), adapter_dir).eval()
model.eval()
ids = tokens[-seq_len:].view(1, -1).to(DEVICE)
with torch.no_grad():
    ours = model(input_ids=ids).logits.float()  # outside fp8_autocast: the dequantized FP8 base weights
    theirs = peft_model(input_ids=ids).logits.float()
print(f"PEFT on the plain model vs ours: relative logit difference {rel_error(ours, theirs):.4f} "
      f"(our base weights are the FP8 copies)")
prompt = torch.tensor([list("The ".encode())], device=DEVICE)
with torch.no_grad():
    sample = peft_model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40,
                                 do_sample=False, use_cache=True)
print(repr(bytes(sample[0].tolist()).decode("utf-8", errors="replace")), "(a random-init model writes noise)")'''),
    new_markdown_cell("""## Merge for export

`merge_lora` folds each adapter into its base weight (dequantized from FP8: the merged weights are BF16) and removes
the adapters: the model computes the same, as a plain converted model."""),
    new_code_cell('''with torch.no_grad():
    before = model(input_ids=ids).logits.float()
    merge_lora(model)
    after = model(input_ids=ids).logits.float()
print(f"merged vs adapted: relative difference {rel_error(after, before):.5f}")
print(model.model.layers[0].layer.self_attention.layernorm_qkv)'''),
]

NOTEBOOKS = {"quickstart.ipynb": QUICKSTART, "performance_optimizations.ipynb": PERFORMANCE,
             "llama_finetune.ipynb": LLAMA, "lora_finetune.ipynb": LORA}


def build(cells):
    notebook = new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for i, cell in enumerate(notebook.cells):
        cell["id"] = f"cell-{i}"  # stable ids: regenerating gives the same files
    return notebook


def main():
    for name, cells in NOTEBOOKS.items():
        nbformat.write(build(cells), HERE / name)
        print(f"wrote {HERE / name}")


if __name__ == "__main__":
    main()
