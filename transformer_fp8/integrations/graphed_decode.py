"""Greedy decoding of a (converted) Hugging Face causal LM with a static KV cache, each decode step one CUDA graph.

`greedy_generate(model, input_ids, max_new_tokens)` runs the prompt once (eagerly, into a transformers StaticCache
sized prompt + max_new_tokens), then decodes token by token. On CUDA with cuda_graph=True the decode step (the
model's forward on one token per sequence, inside fp8_autocast when fp8_enabled, whose exit runs the delayed-scaling
update, and the argmax) is captured once after `warmup_steps` eager steps and then replayed: one launch per token
instead of the hundreds of kernel launches a step issues from Python. This works because a step reads and writes
fixed memory only: the token buffer, the static cache (its slots and its in-place length counter, from which
transformers derives the positions and the mask), the parameters and the FP8 scaling state. The tokens equal
model.generate(do_sample=False) with a static cache (no EOS stopping: exactly max_new_tokens tokens).
"""
import contextlib
import inspect

import torch
import torch.nn as nn

from ..autocast import fp8_autocast
from ..graphs import _fp8_modules, _scale_inv_snapshots


def _cache_keyword(model: nn.Module) -> str:
    """The name under which this transformers version's model forward takes the KV cache."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def greedy_generate(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int, fp8_enabled: bool = False,
                    fp8_recipe=None, cuda_graph: bool = True, warmup_steps: int = 2) -> torch.Tensor:
    """Greedy decoding with a static KV cache (see the module docstring).

    Args:
        model: a *ForCausalLM (converted by convert_model, or not), in eval mode.
        input_ids: the prompts [batch, prompt_len] (no padding: every prompt has prompt_len tokens).
        max_new_tokens: tokens to generate per sequence (>= 1).
        fp8_enabled, fp8_recipe: run every forward inside fp8_autocast(enabled=fp8_enabled, fp8_recipe=fp8_recipe).
        cuda_graph: capture the decode step in a CUDA graph (CUDA only; else every step runs eagerly).
        warmup_steps: eager decode steps before the capture (library handles, FP8 scale calibration).
    Returns:
        [batch, prompt_len + max_new_tokens] token ids: the prompts, then the generated tokens.
    Raises:
        ValueError: bad input_ids or max_new_tokens.
    """
    from transformers import StaticCache  # (only here: the rest of the integration does not import transformers)

    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError(f"input_ids: expected a [batch, prompt_len] int64 tensor, got "
                         f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected a positive int, got {max_new_tokens!r}")
    batch, prompt_len = input_ids.shape
    cache = StaticCache(config=model.config, max_cache_len=prompt_len + max_new_tokens)
    keyword = _cache_keyword(model)

    def forward(ids):
        with fp8_autocast(enabled=fp8_enabled, fp8_recipe=fp8_recipe):
            return model(input_ids=ids, use_cache=True, **{keyword: cache}).logits[:, -1]

    token = forward(input_ids).argmax(-1, keepdim=True)  # [batch, 1]: the static input of the decode step
    generated = [token.clone()]
    next_token = torch.empty_like(token)

    def step():
        next_token.copy_(forward(token).argmax(-1, keepdim=True))

    graphed = cuda_graph and input_ids.is_cuda
    side_stream = torch.cuda.Stream() if graphed else None
    if graphed:
        side_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side_stream) if graphed else contextlib.nullcontext():
        for _ in range(min(warmup_steps if graphed else max_new_tokens - 1, max_new_tokens - 1)):
            step()
            generated.append(next_token.clone())
            token.copy_(next_token)
    if graphed:
        torch.cuda.current_stream().wait_stream(side_stream)
    if graphed and len(generated) < max_new_tokens:
        # The step's FP8 casts write the scale_inv snapshots current at capture (the autocast exit inside the capture
        # hands the modules new ones) and may read FP8 weight caches: the replays use them, so they must stay alive.
        fp8_modules = _fp8_modules([model])
        keep_alive = [_scale_inv_snapshots(fp8_modules), [dict(m._weight_cache) for m in fp8_modules]]  # noqa: F841
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        while len(generated) < max_new_tokens:
            graph.replay()
            generated.append(next_token.clone())
            token.copy_(next_token)
    return torch.cat([input_ids, *generated], dim=1)

