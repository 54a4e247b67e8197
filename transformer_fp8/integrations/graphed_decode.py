"""Greedy decoding of a (converted) Hugging Face causal LM with a static KV cache, each decode step one CUDA graph.

`GreedyDecoder(model, max_new_tokens)(input_ids)` runs the prompts once (eagerly, into a transformers StaticCache
sized prompt + max_new_tokens), then decodes token by token. On CUDA with cuda_graph=True the decode step (the
model's forward on one token per sequence, inside fp8_autocast when fp8_enabled, whose exit runs the delayed-scaling
update, and the argmax) is captured once, after `warmup_steps` eager steps of the first call, and replayed from then
on: one launch per token instead of the hundreds of kernel launches a step issues from Python. Later calls with
prompts of the same shape reset the cache in place and replay the same graph (no capture). This works because a
step reads and writes fixed memory only: the token buffer, the static cache (its slots and its in-place length
counter, from which transformers derives the positions and the mask), the parameters and the FP8 scaling state.
The tokens equal model.generate(do_sample=False) with a static cache (no EOS stop: exactly max_new_tokens tokens).
`greedy_generate(model, input_ids, max_new_tokens)` is the one-call form.
"""
import inspect

import torch
import torch.nn as nn

from ..autocast import fp8_autocast
from ..recipe import DelayedScaling, Float8CurrentScaling
from ..graphs import _fp8_modules, _scale_inv_snapshots


def _cache_keyword(model: nn.Module) -> str:
    """The name under which this transformers version's model forward takes the KV cache."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class GreedyDecoder:
    """Greedy decoding with a static KV cache and (on CUDA) a CUDA graph of the decode step; see the module docstring.

    Attributes:
        model, max_new_tokens, fp8_enabled, fp8_recipe, cuda_graph, warmup_steps: as given.
        shape: (batch, prompt_len) of the first call's prompts, which later calls must have (None before it).
    """

    def __init__(self, model: nn.Module, max_new_tokens: int, fp8_enabled: bool = False,
                 fp8_recipe: DelayedScaling | Float8CurrentScaling | None = None, cuda_graph: bool = True,
                 warmup_steps: int = 2) -> None:
        """Args:
            model: a *ForCausalLM (converted by convert_model, or not), in eval mode.
            max_new_tokens: tokens to generate per sequence (>= 1).
            fp8_enabled, fp8_recipe: every forward runs inside fp8_autocast(enabled=fp8_enabled, fp8_recipe=...).
            cuda_graph: capture the decode step in a CUDA graph (CUDA only; else every step runs eagerly).
            warmup_steps: eager decode steps before the capture (library handles, FP8 scale calibration).
        Raises:
            ValueError: max_new_tokens or warmup_steps out of range.
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected a positive int, got {max_new_tokens!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"warmup_steps: expected a positive int, got {warmup_steps!r}")
        self.model, self.max_new_tokens = model, max_new_tokens
        self.fp8_enabled, self.fp8_recipe, self.cuda_graph, self.warmup_steps = \
            fp8_enabled, fp8_recipe, cuda_graph, warmup_steps
        self.shape = None
        self._cache = self._token = self._next = self._graph = None
        self._keep_alive = []  # what the captured step reads and writes besides the parameters and the cache
        self._keyword = _cache_keyword(model)

    def _forward_logits(self, ids: torch.Tensor) -> torch.Tensor:
        with fp8_autocast(enabled=self.fp8_enabled, fp8_recipe=self.fp8_recipe):
            return self.model(input_ids=ids, use_cache=True, **{self._keyword: self._cache}).logits[:, -1]

    def _step(self) -> None:
        """One decode step: the next tokens of the current ones, into the static buffer."""
        self._next.copy_(self._forward_logits(self._token).argmax(-1, keepdim=True))

    def _check(self, input_ids) -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
            raise ValueError(f"input_ids: expected a [batch, prompt_len] int64 tensor, got "
                             f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
        if self.shape is not None and tuple(input_ids.shape) != self.shape:
            raise ValueError(f"input_ids: this GreedyDecoder's cache and graph are for prompts of shape {self.shape} "
                             f"(its first call), got {tuple(input_ids.shape)}; make another decoder")

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Args:
            input_ids: the prompts [batch, prompt_len] (no padding: every prompt has prompt_len tokens).
        Returns:
            [batch, prompt_len + max_new_tokens] token ids: the prompts, then the generated tokens.
        Raises:
            ValueError: input_ids not int64 [batch, prompt_len], or of another shape than the first call's.
        """
        from transformers import StaticCache  # (only here: the rest of the integration does not import transformers)

        self._check(input_ids)
        if self._cache is None:
            self.shape = tuple(input_ids.shape)
            self._cache = StaticCache(config=self.model.config, max_cache_len=self.shape[1] + self.max_new_tokens)
        else:
            self._cache.reset()  # (in place: the graph's addresses stay valid)
        first = self._forward_logits(input_ids).argmax(-1, keepdim=True)
        if self._token is None:
            self._token, self._next = first, torch.empty_like(first)
        else:
            self._token.copy_(first)
        generated = [first.clone()]
        graphed = self.cuda_graph and input_ids.is_cuda
        if graphed and self._graph is None and self.max_new_tokens > 1:
            self._warm_up_and_capture(generated)
        while len(generated) < self.max_new_tokens:
            self._graph.replay() if graphed else self._step()
            generated.append(self._next.clone())
            self._token.copy_(self._next)
        return torch.cat([input_ids, *generated], dim=1)

    def _warm_up_and_capture(self, generated: list) -> None:
        """Eager decode steps on a side stream (their tokens count), then the capture of the step."""
        side_stream = torch.cuda.Stream()
        side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side_stream):
            for _ in range(min(self.warmup_steps, self.max_new_tokens - len(generated))):
                self._step()
                generated.append(self._next.clone())
                self._token.copy_(self._next)
        torch.cuda.current_stream().wait_stream(side_stream)
        # The step's FP8 casts write the scale_inv snapshots current at capture (the autocast exit inside the capture
        # hands the modules new ones) and may read FP8 weight caches: the replays use them, so they must stay alive.
        fp8_modules = _fp8_modules([self.model])
        self._keep_alive = [_scale_inv_snapshots(fp8_modules), [dict(m._weight_cache) for m in fp8_modules]]
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            self._step()


def greedy_generate(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int, fp8_enabled: bool = False,
                    fp8_recipe: DelayedScaling | Float8CurrentScaling | None = None, cuda_graph: bool = True,
                    warmup_steps: int = 2) -> torch.Tensor:
    """GreedyDecoder(model, max_new_tokens, ...)(input_ids): one call (the capture included).

    Args:
        model, max_new_tokens, fp8_enabled, fp8_recipe, cuda_graph, warmup_steps: see GreedyDecoder.
        input_ids: the prompts [batch, prompt_len].
    Returns:
        [batch, prompt_len + max_new_tokens] token ids.
    """
    return GreedyDecoder(model, max_new_tokens, fp8_enabled, fp8_recipe, cuda_graph, warmup_steps)(input_ids)

