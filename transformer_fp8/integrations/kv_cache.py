"""The KV cache of a converted decoder layer, kept in the caller's transformers Cache object.

transformers passes the cache to a decoder layer as `cache=` (5.2x) or `past_key_values=` (earlier), and, before
5.2x, a `cache_position` tensor that static caches need to know where to write. `update_cache` speaks both protocols
through `Cache.update(key, value, layer_idx, cache_kwargs)`, so DynamicCache and StaticCache both work. The keys it
returns may be longer than the query (decode) and, for a static cache, include unwritten slots that the attention
mask of transformers hides; `cached_attention_mask` turns that mask (or its absence) into SDPA's boolean form and
`cached_attention` attends over the cached keys. Nothing here imports transformers.
"""
from typing import Any

import torch
import torch.nn.functional as F

from ..attention.sdpa import scaled_dot_product_attention


def pick_cache(cache: Any, past_key_values: Any) -> Any:
    """The Cache object, whichever keyword carried it.

    Args:
        cache: the `cache=` argument (transformers >= 5.2x) or None.
        past_key_values: the `past_key_values=` argument (earlier versions) or None.
    Returns:
        The one that is not None, or None.
    Raises:
        ValueError: both given, as different objects.
    """
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("cache, past_key_values: got two different caches; pass one (transformers >= 5.2x calls "
                         "it cache, earlier versions past_key_values)")
    cache = cache if cache is not None else past_key_values
    if cache is not None and not hasattr(cache, "update"):
        raise TypeError(f"cache: expected a transformers Cache (DynamicCache, StaticCache, ...), got "
                        f"{type(cache).__name__} (legacy tuples of tensors are not supported)")
    return cache


def update_cache(cache: Any, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
                 cache_position: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Append this step's key and value [b, g, s, d] to layer `layer_idx` of `cache`.

    Args:
        cache: a transformers Cache.
        key, value: the new keys (after RoPE) and values, [batch, kv heads, new tokens, head_dim].
        layer_idx: the decoder layer's index in the model.
        cache_position: where the new tokens go (transformers < 5.2x passes it; static caches need it there),
            or None (newer caches track their length themselves).
    Returns:
        (keys, values) [b, g, s_kv, d] the attention reads: all cached tokens (static cache: all its slots).
    """
    cache_kwargs = {} if cache_position is None else {"cache_position": cache_position}
    return cache.update(key, value, layer_idx, cache_kwargs)


def cached_attention_mask(attention_mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int,
                          past_len: int | torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """transformers' 4-D mask for a query of q_len tokens over kv_len cached keys -> SDPA's bool mask (True = attend)
    [b or 1, 1, q_len, kv_len], or None (attend to every key).

    Args:
        attention_mask: None (transformers gives none for causal attention without padding: query i, at position
            past_len + i, then sees keys 0 .. past_len + i; a static cache's later slots are empty), or a bool (True =
            attend) or additive float (0 = attend) [b or 1, 1, q_len, kv_len] tensor.
        batch, q_len, kv_len: sizes of this step.
        past_len: tokens cached before this step (int or 0-d tensor), or None: kv_len - q_len (a dynamic cache).
        device: where the mask goes.
    Returns:
        The mask; rows with no key to attend to (padding queries) attend to every key so that they stay finite.
    Raises:
        ValueError: a mask of another shape.
    """
    if attention_mask is None:
        if past_len is None:
            return None if q_len == 1 else \
                torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)[None, None]
        last_key = torch.arange(q_len, device=device)[:, None] + past_len  # [q_len, 1]
        return (torch.arange(kv_len, device=device) <= last_key)[None, None]
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4 or \
            attention_mask.shape[-2:] != (q_len, kv_len) or attention_mask.shape[0] not in (1, batch):
        got = f"shape {tuple(attention_mask.shape)}" if isinstance(attention_mask, torch.Tensor) else \
            type(attention_mask).__name__
        raise ValueError(f"attention_mask: expected None or a [{batch} or 1, 1, {q_len}, {kv_len}] tensor (the 'sdpa' "
                         f"or 'eager' mask of transformers, over the cached keys), got {got}")
    allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    return allowed | ~allowed.any(dim=-1, keepdim=True)


def cached_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    """Attention of this step's queries over the cached keys (GQA: fewer key/value heads than query heads).

    Args:
        q: [b, heads, q_len, d]. keys, values: [b, kv heads, kv_len, d] (from update_cache).
        mask: SDPA's bool mask (True = attend) [b or 1, 1, q_len, kv_len], or None (every key).
        scale: softmax scale.
    Returns:
        [b, heads, q_len, d] in q's dtype. On CUDA: PyTorch's SDPA picks its kernel (flash, memory-efficient or,
        for what they do not take, math), with no backend forcing or retries on the host: a decode step is
        host-bound. Elsewhere: our float32 reference (attention.sdpa.scaled_dot_product_attention).
    """
    if q.device.type != "cuda":
        return scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                          enable_gqa=q.shape[1] != keys.shape[1])
