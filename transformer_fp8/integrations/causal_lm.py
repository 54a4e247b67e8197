"""The training loss of a Hugging Face causal language model through linear_cross_entropy: no [tokens, vocab] logits.

`causal_lm_loss(model, input_ids)` computes what `model(input_ids=input_ids, labels=input_ids).loss` does (next-token
cross-entropy, the mean over the tokens whose label is not ignore_index; float32 logits, where a BF16 Hugging Face
model rounds them to BF16 first) for models whose logits are `lm_head(decoder output)`, without scaling or
soft-capping (Llama, Mistral, Qwen2, ...; converted or not). transformers is imported only to register the
attention name of `_causal_without_mask_builder` (below).

Why the mask builder is bypassed: for a batch without attention_mask, transformers' `create_causal_mask` looks for
packed sequences in the position_ids it made itself (`find_packed_sequence_indices`, whose `if tensor.all()` reads a
value on the host): one GPU synchronisation per forward. It drains the queue the host had built up during the previous
step's backward and optimizer, so the forward starts with the GPU waiting on the host for every launch. When nothing
can need a mask (no attention_mask / position_ids / cache given, the model's attention is "sdpa" — our converted
models' setting —, no sliding-window or chunked attention), the decoder runs under an attention name that transformers
knows for attention (SDPA's function) but not for masks, so the builder returns None at once: causal attention, the
same result without the read.
"""
import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .linear_cross_entropy import DEFAULT_CHUNK_SIZE, linear_cross_entropy

LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")  # config fields we do not apply


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                   ignore_index: int = -100, chunk_size: int = DEFAULT_CHUNK_SIZE, **model_kwargs: Any) -> torch.Tensor:
    """Mean next-token loss of a *ForCausalLM `model` on input_ids [b, s] (labels [b, s], default input_ids; label
    i is predicted from positions < i, as the Hugging Face loss shifts them). model_kwargs (attention_mask,
    position_ids, ...) go to the decoder, `model.get_decoder()`; the head is `model.get_output_embeddings()`, a
    Linear without bias.

    Args:
        model: a Hugging Face *ForCausalLM model (converted or not).
        input_ids: token ids [b, s].
        labels: target ids [b, s] (default: input_ids); shifted by one position as Hugging Face does.
        ignore_index: labels equal to it do not count.
        chunk_size: tokens per chunk of linear_cross_entropy.
        **model_kwargs: passed to the decoder (attention_mask, position_ids, ...).

    Returns:
        The mean loss, a float32 scalar.
    """
    config = getattr(model, "config", None)
    for field in LOGIT_TRANSFORMS:
        if getattr(config, field, None) not in (None, 1, 1.0):
            raise NotImplementedError(f"model.config.{field}: causal_lm_loss computes plain lm_head logits; this "
                                      f"model transforms them ({field}={getattr(config, field)!r})")
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise NotImplementedError("model.lm_head: causal_lm_loss supports a head without bias")
    labels = input_ids if labels is None else labels
    decoder = model.get_decoder()
    with _causal_without_mask_builder(decoder, model_kwargs):
        hidden = decoder(input_ids=input_ids, **model_kwargs).last_hidden_state
    targets = F.pad(labels[:, 1:], (0, 1), value=ignore_index)  # the last position predicts nothing
    return linear_cross_entropy(hidden, head.weight, targets, ignore_index=ignore_index, chunk_size=chunk_size)


CAUSAL_SDPA_NAME = "sdpa_causal_without_mask_builder"  # registered for attention, never for mask building
_MASK_INPUTS = ("attention_mask", "position_ids", "past_key_values", "cache_position", "inputs_embeds")
_LOCAL_ATTENTION_FIELDS = ("sliding_window", "attention_chunk_size", "local_attention_size")


def _register_causal_sdpa() -> bool:
    """Register CAUSAL_SDPA_NAME as transformers' SDPA attention function; False where transformers lacks the
    registries (then nothing is bypassed)."""
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        return False
    if CAUSAL_SDPA_NAME in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:  # (someone registered a mask for it)
        return False
    if CAUSAL_SDPA_NAME not in ALL_ATTENTION_FUNCTIONS._global_mapping:
        ALL_ATTENTION_FUNCTIONS.register(CAUSAL_SDPA_NAME, ALL_ATTENTION_FUNCTIONS["sdpa"])
    return True


def _mask_free(config: Any, model_kwargs: dict) -> bool:
    """True when the decoder's mask would be plain causal: SDPA attention, no mask-shaping inputs, no local
    attention in the config."""
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if any(model_kwargs.get(name) is not None for name in _MASK_INPUTS):
        return False
    if any(getattr(config, field, None) is not None for field in _LOCAL_ATTENTION_FIELDS):
        return False
    layer_types = getattr(config, "layer_types", None)
    return layer_types is None or all(kind == "full_attention" for kind in layer_types)


@contextlib.contextmanager
def _causal_without_mask_builder(decoder: nn.Module, model_kwargs: dict) -> Iterator[None]:
    """Run the decoder with config._attn_implementation = CAUSAL_SDPA_NAME when `_mask_free` (see the module
    docstring), restoring it after; otherwise change nothing."""
    config = getattr(decoder, "config", None)
    if not (_mask_free(config, model_kwargs) and _register_causal_sdpa()):
        yield
        return
    config._attn_implementation = CAUSAL_SDPA_NAME
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
