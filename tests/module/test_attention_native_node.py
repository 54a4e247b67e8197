"""cuDNN attention's C++ autograd node (attention_cudnn.NATIVE_NODE, csrc/autograd_attention.cpp) against its Python
autograd.Function: the same outputs and gradients bit for bit, gradients laid out as the Function lays them out (one
buffer for a fused QKV), on the CPU reference kernels and on the GPU's cuDNN."""
import math

import pytest
import torch

from tests.module.helpers import DEVICES
from transformer_fp8 import _C
from transformer_fp8.module import attention_cudnn
from transformer_fp8.module.attention import DotProductAttention

S, B, D = 24, 2, 64
HEAD_DIM = {"sbhd": 2, "bshd": 2, "bhsd": 1}


def make_inputs(device, qkv_format, heads, groups, fused):
    """(leaves, q, k, v): q, k, v in qkv_format, views of one fused QKV leaf or three leaves."""
    shape = {"sbhd": [S, B, 0, D], "bshd": [B, S, 0, D], "bhsd": [B, 0, S, D]}[qkv_format]
    dim = HEAD_DIM[qkv_format]

    def leaf(h):
        shape[dim] = h
        return torch.randn(*shape, dtype=torch.bfloat16, device=device).requires_grad_()

    if fused:
        qkv = leaf(heads + 2 * groups)
        return [qkv], *qkv.split([heads, groups, groups], dim)
    leaves = [leaf(heads), leaf(groups), leaf(groups)]
    return leaves, *leaves


def run(path, leaves, q, k, v, qkv_format, causal, grad):
    args = (q, k, v, qkv_format, 1 / math.sqrt(D), causal)
    if path == "native":
        out = _C.fused_attention(*args)
    else:
        out = attention_cudnn._FusedAttention.apply(*args, 0.0, None, None)
    out.backward(grad)
    return out, out.grad_fn.name(), [t.grad for t in leaves]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qkv_format", ["sbhd", "bshd", "bhsd"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2)])
@pytest.mark.parametrize("fused", [False, True])
def test_native_node_matches_function(device, qkv_format, causal, heads, groups, fused):
    leaves, q, k, v = make_inputs(device, qkv_format, heads, groups, fused)
    copies = [t.detach().clone().requires_grad_() for t in leaves]
    views = copies[0].split([heads, groups, groups], HEAD_DIM[qkv_format]) if fused else copies
    out_shape = {"sbhd": (S, B, heads * D), "bshd": (B, S, heads * D), "bhsd": (B, heads, S, D)}[qkv_format]
    grad_out = torch.randn(*out_shape, dtype=torch.bfloat16, device=device)
    out, name, grads = run("native", leaves, q, k, v, qkv_format, causal, grad_out)
    out_ref, name_ref, grads_ref = run("function", copies, *views, qkv_format, causal, grad_out)
    assert (name, name_ref) == ("FusedAttentionBackward", "_FusedAttentionBackward")
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    assert out.stride() == out_ref.stride()
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=0, atol=0)
        assert g.stride() == g_ref.stride()


@pytest.mark.parametrize("device", DEVICES)
def test_native_node_backward_twice_and_no_grad(device):
    leaves, q, k, v = make_inputs(device, "sbhd", 4, 4, fused=True)
    out = _C.fused_attention(q, k, v, "sbhd", 0.125, True)
    out.sum().backward(retain_graph=True)
    first = leaves[0].grad.clone()
    out.sum().backward()
    torch.testing.assert_close(leaves[0].grad, 2 * first, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.sum().backward()
    with torch.no_grad():
        again = _C.fused_attention(q, k, v, "sbhd", 0.125, True)
    assert again.grad_fn is None
    torch.testing.assert_close(again, out.detach(), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="qkv_format"):
        _C.fused_attention(q, k, v, "hsbd", 0.125, True)


@pytest.mark.gpu
@pytest.mark.skipif(not attention_cudnn.cudnn_attention_built(), reason="built without the attention family")
@pytest.mark.parametrize("dropout,native", [(0.0, True), (0.1, False)])
def test_dot_product_attention_takes_the_node_without_dropout(dropout, native):
    module = DotProductAttention(4, D, attention_dropout=dropout, attention_backend="cudnn").train()
    _, q, k, v = make_inputs("cuda", "sbhd", 4, 4, fused=True)
    out = module(q, k, v)
    assert out.grad_fn.name() == ("FusedAttentionBackward" if native else "_FusedAttentionBackward")


@pytest.mark.parametrize("device", DEVICES)
def test_native_node_saves_through_saved_tensor_hooks(device):
    """Saved-tensor hooks see what the node saves: the tensors the Function saves (q, k, v, out, softmax stats)."""
    packs = {}
    for path in ("native", "function"):
        leaves, q, k, v = make_inputs(device, "sbhd", 4, 2, fused=True)
        packed = []

        def pack(t):
            packed.append((t.numel(), str(t.dtype)))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if path == "native":
                out = _C.fused_attention(q, k, v, "sbhd", 0.125, False)
            else:
                out = attention_cudnn._FusedAttention.apply(q, k, v, "sbhd", 0.125, False, 0.0, None, None)
        out.sum().backward()
        packs[path] = sorted(packed)
    # (the Function saves [b, h, s, d] views of q, k, v and out, the node them as given: compared by size and dtype)
    assert len(packs["native"]) == 5 and packs["native"] == packs["function"]
