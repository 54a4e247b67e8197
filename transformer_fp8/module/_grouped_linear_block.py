"""GroupedLinear's FP8 path under recipe.Float8BlockScaling: 1x128 tiles for the input and the output gradient, 128x128
blocks for the weights, the block-scaled grouped GEMMs (transformer_fp8/grouped_block_gemm.py) in every direction.

- Forward: one block cast of the whole input (1x128 tiles along in_features: they never cross a group, whose rows are
  whole rows), one of all the weights stacked [G * out_features, in_features] (128x128 blocks: out_features must be a
  multiple of 128 so that no block holds two experts' rows), one grouped GEMM.
- Dgrad: the gradient cast once (1x128 tiles), the weights' FP8 transpose with their block scales transposed.
- Wgrad (dW_g = dy_gᵀ x_g contracts over the group's rows): the transposed copies carry their own 1x128 tiles along
  the rows, and a tile must not straddle two groups. Rather than restart tiles at each group's first row (a cast
  kernel that knows the groups), every group is padded to start at a multiple of 128 rows: groups given as a host list
  of multiples of 128 run as they are (the transposed copies come from the forward's and backward's casts), any
  other sizes (and every device m_splits, whose sizes the host never reads) through padded high-precision copies of x
  and dy (zero rows between the groups; one gather each, made on the device), cast to their transposed FP8 copies.
  The padding adds up to 127 zero rows per group to the wgrad's contraction (zeros add nothing).
Gradients are E4M3 (the grouped kernel's only FP8 type) under every recipe format, as on the per-tensor path.
"""
import torch

from .. import autocast
from ..grouped_gemm import group_offsets, padded_groups
from ..ops import activation_high_precision, tfp8
from ..quantization import Role
from ..recipe import Float8BlockScaling
from .base import main_grad_of

BLOCK = 128  # the scales' granularity: the weights' blocks and the tiles the wgrad's groups must start on
WGRAD_ALIGN = BLOCK


def check_block_recipe(recipe: Float8BlockScaling, out_features: int) -> None:
    """Refuse what GroupedLinear's block path does not build (NotImplementedError naming the recipe field).

    Args:
        recipe: the Float8BlockScaling recipe of the autocast.
        out_features: the module's N.
    """
    dims = (recipe.x_block_scaling_dim, recipe.w_block_scaling_dim, recipe.grad_block_scaling_dim)
    if dims != (1, 2, 1):
        raise NotImplementedError(f"GroupedLinear with recipe.Float8BlockScaling: only x_block_scaling_dim=1, "
                                  f"w_block_scaling_dim=2, grad_block_scaling_dim=1 (the defaults) are built, got "
                                  f"{dims}")
    if out_features % BLOCK:
        raise NotImplementedError(f"GroupedLinear with recipe.Float8BlockScaling: out_features must be a multiple of "
                                  f"{BLOCK} (the weights' 128x128 blocks must not span two experts), got "
                                  f"{out_features}")


class BlockWeights:
    """The experts' weights in FP8 128x128 blocks for the grouped GEMMs.

    Attributes:
        data: [G, N, K] FP8.
        scale_inv: [G, cdiv(N, 128), cdiv(K, 128)] float32 (a view).
        data_t: [G, K, N] FP8 (a view with a contiguous last dim: the dgrad's Wᵀ), or None.
        scale_inv_t: [G, cdiv(K, 128), cdiv(N, 128)] (scale_inv transposed, a view), or None.
    """

    __slots__ = ("data", "scale_inv", "data_t", "scale_inv_t")

    def __init__(self, data, scale_inv, data_t):
        self.data, self.scale_inv, self.data_t = data, scale_inv, data_t
        self.scale_inv_t = scale_inv.transpose(1, 2) if data_t is not None else None


def cast_block_weights(module, weights, stacked: torch.Tensor | None, need_t: bool) -> BlockWeights:
    """The module's weights in 128x128 blocks: block Float8Tensor weights (fp8_model_init with this recipe) stacked
    with their own scales, high-precision ones cast in one pass over `stacked` [G, N, K] (the WEIGHT role).

    Args:
        module: the GroupedLinear.
        weights: its weight parameters.
        stacked: the high-precision weights as one [G, N, K] tensor (None for Float8Tensor weights).
        need_t: whether the dgrad's transposed copy is needed.

    Returns:
        BlockWeights.
    """
    g, n, k = module.num_gemms, module.out_features, module.in_features
    k_blocks = -(-k // BLOCK)
    if stacked is None:
        layouts = {w.layout for w in weights}
        if layouts != {"block_128x128"}:
            raise TypeError(f"GroupedLinear: recipe.Float8BlockScaling needs high-precision or 128x128 block-scaled "
                            f"FP8 weights (fp8_model_init(recipe=Float8BlockScaling())), got Float8Tensor weights "
                            f"of layouts {sorted(layouts)}")
        data = torch.stack([w._data for w in weights])
        scale_inv = torch.stack([w._scale_inv for w in weights])[:, :, :k_blocks]
        data_t = torch.stack([w.transpose_data() for w in weights]) if need_t else None
        return BlockWeights(data, scale_inv, data_t)
    op = module.quantizers[Role.WEIGHT].cast(stacked.reshape(g * n, k), rowwise=True, transpose=need_t)
    scale_inv = op.scale_inv.view(g, n // BLOCK, -1)[:, :, :k_blocks]
    data_t = op.data_t.view(k, g, n).permute(1, 0, 2) if need_t else None
    return BlockWeights(op.data.view(g, n, k), scale_inv, data_t)


def _padded_copy(t: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """t's rows in the padded group layout (zero rows where source is -1)."""
    return tfp8.moe_permute_rows(t, source, 1, None)


class GroupedLinearBlockFP8(torch.autograd.Function):
    """x [M, K] (contiguous), m_splits (int32 tensor [G] on x's device), host_splits (the same sizes as a list when the
    caller gave one, else None), module, training (grad mode at the call), activation (or None), is_first_microbatch,
    then weight0..weight{G-1} and bias0..bias{G-1} (if any) -> [M, N] (activated: [M, N/2] for swiglu)."""

    @staticmethod
    def forward(ctx, x, m_splits, host_splits, module, training, activation, is_first_microbatch, *params):
        g = module.num_gemms
        weights, biases = params[:g], params[g:]
        need_dgrad = training and ctx.needs_input_grad[0]
        need_wgrad = training and any(ctx.needs_input_grad[7:7 + g])
        qset = module.quantizers
        offs = group_offsets(m_splits)
        aligned = host_splits is not None and all(s % WGRAD_ALIGN == 0 for s in host_splits)
        x_op = qset[Role.INPUT].cast(x, rowwise=True, transpose=need_wgrad and aligned)
        w = module._fp8_block_weights(weights, need_dgrad, is_first_microbatch)
        out = tfp8.grouped_block_fp8_gemm(x_op.data, x_op.scale_inv, w.data, w.scale_inv, offs, x.dtype)
        group = None
        if biases:
            position = torch.arange(x.shape[0], dtype=torch.int32, device=x.device)
            group = torch.searchsorted(offs, position, right=True).clamp_(max=g - 1)
            out += torch.stack(biases).to(out.dtype)[group]
        pre_activation = out if activation else None
        if activation:
            out = activation_high_precision(out, activation)
        source = wgrad_offs = None
        x_t = None
        if need_wgrad:
            if aligned:
                x_t, wgrad_offs = (x_op.data_t, x_op.scale_inv_t), offs
            else:
                source, wgrad_offs = padded_groups(m_splits, x.shape[0], WGRAD_ALIGN)
                op = qset[Role.INPUT].cast(_padded_copy(x, source), rowwise=False, transpose=True)
                x_t = (op.data_t, op.scale_inv_t)
        ctx.module, ctx.activation, ctx.dtype, ctx.need = module, activation, x.dtype, (need_dgrad, need_wgrad)
        ctx.aligned, ctx.group_ids, ctx.group = aligned, group, autocast.STATE.group
        ctx.weights = weights if need_wgrad and module.fuse_wgrad_accumulation else None
        ctx.weight_dtype = weights[0].dtype
        ctx.bias_dtype = biases[0].dtype if biases else None
        ctx.x_t = x_t
        ctx.w_t = (w.data_t, w.scale_inv_t) if need_dgrad else None
        ctx.save_for_backward(offs, source, wgrad_offs, pre_activation)
        return out

    @staticmethod
    def backward(ctx, grad):
        offs, source, wgrad_offs, pre_activation = ctx.saved_tensors
        module, g = ctx.module, ctx.module.num_gemms
        need_dgrad, need_wgrad = ctx.need
        dy = grad.contiguous()
        if pre_activation is not None:
            dy = tfp8.activation_bwd(dy, pre_activation, ctx.activation)
        quantizer = module.quantizers[Role.GRAD_OUTPUT]
        dy_op = None
        if need_dgrad or (need_wgrad and ctx.aligned):
            dy_op = quantizer.cast(dy, rowwise=need_dgrad, transpose=need_wgrad and ctx.aligned)
        dx = None
        if need_dgrad:
            w_t, w_scale_t = ctx.w_t
            dx = tfp8.grouped_block_fp8_gemm(dy_op.data, dy_op.scale_inv, w_t, w_scale_t, offs, ctx.dtype)
        dws = (None,) * g
        if need_wgrad:
            if ctx.aligned:
                dy_t = (dy_op.data_t, dy_op.scale_inv_t)
            else:
                op = quantizer.cast(_padded_copy(dy, source), rowwise=False, transpose=True)
                dy_t = (op.data_t, op.scale_inv_t)
            dws = _weight_grads(ctx, dy_t, wgrad_offs)
        dbiases = ()
        if ctx.group_ids is not None:
            sums = torch.zeros(g, dy.shape[1], dtype=torch.float32, device=dy.device)
            dbiases = tuple(sums.index_add_(0, ctx.group_ids, dy.float()).to(ctx.bias_dtype).unbind(0))
        module.quantizers.register_backward(ctx.group)
        ctx.x_t = ctx.w_t = None
        return (dx, None, None, None, None, None, None, *dws, *dbiases)


def _weight_grads(ctx, dy_t: tuple, wgrad_offs: torch.Tensor) -> tuple:
    """dW_g = dy_gᵀ x_g from one block-scaled grouped wgrad GEMM; with fuse_wgrad_accumulation the results go into
    each weight's main_grad (float32) and None is returned for them."""
    fuse = ctx.weights is not None
    out_dtype = torch.float32 if fuse or ctx.weight_dtype == torch.float32 else ctx.weight_dtype
    (a_t, a_scale), (b_t, b_scale) = dy_t, ctx.x_t
    dw = tfp8.grouped_block_fp8_gemm_wgrad(a_t, a_scale, b_t, b_scale, wgrad_offs, out_dtype)
    if not fuse:
        return tuple(dw.to(ctx.weight_dtype).unbind(0))
    for weight, grad in zip(ctx.weights, dw.unbind(0)):
        main_grad_of(weight).add_(grad)
    return (None,) * len(ctx.weights)


def is_block(recipe) -> bool:
    """Whether `recipe` is a block-scaling recipe (GroupedLinear's block path)."""
    return isinstance(recipe, Float8BlockScaling)

