"""A converted model against its Hugging Face original (shared by the dense and MoE conversion tests): random norm
weights and biases for the original, logits and every gradient under Hugging Face parameter names."""
import torch
import torch.nn as nn

from transformer_fp8.integrations import LlamaTransformerLayer, layer_weight_map
from tests.utils import rel_error
from transformer_fp8.integrations.hf_mapping import split_fused_weights


@torch.no_grad()
def randomize_norms_and_biases(model: nn.Module, router_std: float | None = None) -> None:
    """Give a random-init Hugging Face model random norm weights (in [0.5, 1.5]) and biases (in [-0.2, 0.2]; large
    q/k biases would saturate the softmax): they start at 1 and 0, where a wrong mapping would not show.

    Args:
        model: the model, changed in place.
        router_std: when given, the MoE routers' weights (`mlp.gate.weight`) are drawn from N(0, router_std) (large:
            decisive routing, which rounding differences do not flip).
    """
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.uniform_(0.5, 1.5)
        elif name.endswith(".bias"):
            p.uniform_(-0.2, 0.2)
        elif router_std is not None and name.endswith("mlp.gate.weight"):
            p.normal_(0, router_std)


def grads_under_hf_names(converted: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gradient of a converted model, keyed by the Hugging Face parameter name.

    Args:
        converted: a model converted by transformer_fp8.integrations.convert_model, after a backward.
    Returns:
        {hf_name: gradient}; a decoder-layer parameter without a gradient (an expert no token went to) gives zeros,
        as transformers' stacked expert tensors have.
    """
    out = {}
    for name, module in converted.named_modules():
        if isinstance(module, LlamaTransformerLayer):
            grads = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in module.named_parameters()}
            out.update({f"{name}.{k}": g for k, g in split_fused_weights(grads, layer_weight_map(module)).items()})
    layer_names = tuple(name + "." for name, m in converted.named_modules() if isinstance(m, LlamaTransformerLayer))
    out.update({n: p.grad for n, p in converted.named_parameters() if not n.startswith(layer_names)})
    return out


def check_logits_and_gradients(model: nn.Module, converted: nn.Module, ids: torch.Tensor, logits_tol: float = 1e-5,
                               grad_tol: float = 1e-4) -> None:
    """Assert that `converted` (convert_model of a copy of `model`) gives model's logits and, after the backward of
    the causal-LM loss on `ids` (labels = ids), the gradient of every Hugging Face parameter, within relative errors
    logits_tol and grad_tol.

    Args:
        model: the Hugging Face model (float32). converted: its conversion. ids: [batch, seq] token ids.
        logits_tol: the logits' bound on ||ours - theirs|| / ||theirs||. grad_tol: each gradient's.
    """
    ref, out = model(input_ids=ids, labels=ids), converted(input_ids=ids, labels=ids)
    assert rel_error(out.logits, ref.logits) < logits_tol
    ref.loss.backward()
    out.loss.backward()
    ours = grads_under_hf_names(converted)
    theirs = {n: p.grad for n, p in model.named_parameters()}
    assert ours.keys() == theirs.keys()
    for name, grad in theirs.items():
        assert rel_error(ours[name], grad) < grad_tol, name
