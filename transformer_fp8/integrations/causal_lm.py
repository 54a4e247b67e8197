"""The training loss of a Hugging Face causal language model through linear_cross_entropy: no [tokens, vocab] logits.

`causal_lm_loss(model, input_ids)` computes what `model(input_ids=input_ids, labels=input_ids).loss` does (next-token
cross-entropy, the mean over the tokens whose label is not ignore_index; float32 logits, where a BF16 Hugging Face
model rounds them to BF16 first) for models whose logits are `lm_head(decoder output)`, without scaling or
soft-capping (Llama, Mistral, Qwen2, ...; converted or not). Nothing here imports transformers.
"""
from typing import Any

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
    hidden = model.get_decoder()(input_ids=input_ids, **model_kwargs).last_hidden_state
    targets = F.pad(labels[:, 1:], (0, 1), value=ignore_index)  # the last position predicts nothing
    return linear_cross_entropy(hidden, head.weight, targets, ignore_index=ignore_index, chunk_size=chunk_size)
