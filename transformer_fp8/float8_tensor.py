"""Float8Tensor: FP8 data + scale_inv that behaves as a tensor of a high-precision ("fake") dtype.

    value = _data.float() * _scale_inv        _data: FP8 [*shape], _scale_inv: float32 [1], dtype: the fake dtype

Our modules read `_data` / `_scale_inv` straight into the FP8 GEMM. detach, clone and device moves keep the
Float8Tensor, and so do the view ops FSDP2 shards and unshards with (split/chunk, view, as_strided, the narrow
method: views of the FP8 data sharing the scale_inv) and new_zeros; every other aten op (indexing included) runs on
the dequantized value
and returns plain tensors, except in-place ops on a Float8Tensor (copy_, add_, ..., and the _foreach_ ones of an
optimizer step; load_state_dict), which compute in high precision and re-quantize the result into it with a fresh
per-tensor scale (current scaling). That scale is shared with its views: re-quantize whole tensors (or FSDP2 shards,
whose scale_inv is their own), not part of one.

FSDP2 (torch.distributed.fsdp.fully_shard): each rank keeps its shard as a Float8Tensor with its own scale_inv, and
the all-gather moves FP8 bytes plus one scale_inv per rank (fsdp_pre_all_gather / fsdp_post_all_gather); the
unsharded weight is re-expressed in the largest scale_inv of the ranks (bytes unchanged where the scales agree).
Shards must be even (dim 0 divisible by the world size).

Block-scaled weights (layout "block_128x128", made by fp8_model_init(recipe=Float8BlockScaling()) or loaded from a
block-FP8 checkpoint): the same type with a 2-D scale_inv, one float32 scale per 128x128 block in the operand layout
of float8_block.py / quantization/block.py. One type rather than a sibling class because everything that handles FP8
weights (modules, LoRA, the exporter, debug) asks `isinstance(w, Float8Tensor)` and reads `_data` / `_scale_inv`;
what differs is which GEMM reads them (`layout`). For block weights: re-quantizing computes a scale per block,
copy_ from a block Float8Tensor of the same shape copies bytes and scales, torch.cat along dim 0 of block weights
whose row counts (all but the last) are multiples of 128 concatenates data and scales (a fused QKV or gate/up
weight), views along dim 0 (split, chunk, narrow: FSDP2's shards) must start and end on 128-row boundaries (others
are refused). FSDP2 is refused for block weights: fully_shard keeps a flattened view of each shard, which a block
weight cannot be (its scales follow its 2-D shape).
"""
import torch
from torch.utils._pytree import tree_map

from . import float8_block as block
from .ops import tfp8
from .recipe import FP8_MAX

aten = torch.ops.aten


class Float8Tensor(torch.Tensor):
    _keep_transpose = False  # (see transpose_data)
    _kept_transpose = None

    @staticmethod
    def __new__(cls, data, scale_inv, dtype, requires_grad=False):
        if data.dtype not in FP8_MAX:
            raise TypeError(f"data: expected torch.float8_e4m3fn or torch.float8_e5m2, got {data.dtype}")
        if not dtype.is_floating_point or dtype in FP8_MAX:
            raise TypeError(f"dtype: expected a high-precision floating dtype, got {dtype}")
        if scale_inv.dim() == 2:  # 128x128 blocks
            expected = block.block_scale_shape(data.shape) if data.dim() == 2 else None
            if expected is None or tuple(scale_inv.shape) != expected or scale_inv.dtype != torch.float32:
                raise ValueError(f"scale_inv: block scales of a 2-D weight [N, K] {tuple(data.shape)} must be float32 "
                                 f"{expected} ([cdiv(N, 128), pad4(cdiv(K, 128))]), got {scale_inv.dtype} "
                                 f"{tuple(scale_inv.shape)}")
        self = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=dtype, device=data.device,
                                                   requires_grad=requires_grad)
        self._data = data
        self._scale_inv = scale_inv
        return self

    @classmethod
    def from_hp(cls, tensor, fp8_dtype=torch.float8_e4m3fn, layout=block.LAYOUT_TENSOR, power_2_scale=False,
                amax_epsilon=0.0):
        """Quantize a high-precision tensor with a scale from its own amax ("tensor"), or a 2-D weight with one scale
        per 128x128 block from each block's amax ("block_128x128"; power_2_scale and amax_epsilon as the recipe's
        QParams, see float8_block.py)."""
        if layout == block.LAYOUT_BLOCK:
            data, scale_inv = block.quantize_blocks(tensor.detach(), fp8_dtype, power_2_scale, amax_epsilon)
            return cls(data, scale_inv, tensor.dtype)
        if layout != block.LAYOUT_TENSOR:
            raise ValueError(f"layout: expected {block.LAYOUT_TENSOR!r} or {block.LAYOUT_BLOCK!r}, got {layout!r}")
        data = torch.empty_like(tensor, dtype=fp8_dtype)
        out = cls(data, torch.ones(1, dtype=torch.float32, device=tensor.device), tensor.dtype)
        out.quantize_(tensor)
        return out

    @classmethod
    def from_block_scaled(cls, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> "Float8Tensor":
        """A block-scaled weight from FP8 bytes and 128x128 block scales as a block-FP8 checkpoint stores them
        (Hugging Face `weight` + `weight_scale_inv`): `data` is kept as it is (no copy on its device), the scales are
        padded to the operand layout.

        Args:
            data: FP8 [N, K]. scale_inv: float32 (or any float) [cdiv(N, 128), cdiv(K, 128)], or already padded to
                [cdiv(N, 128), pad4(cdiv(K, 128))]. dtype: the high-precision dtype the tensor stands for.
        Returns:
            A Float8Tensor with layout "block_128x128", value = data * scale_inv per block.
        """
        if data.dim() != 2:
            raise ValueError(f"data: expected a 2-D FP8 weight [N, K], got shape {tuple(data.shape)}")
        if scale_inv.dim() != 2 or scale_inv.shape[0] != block.cdiv(data.shape[0], block.BLOCK):
            raise ValueError(f"scale_inv: expected [{block.cdiv(data.shape[0], block.BLOCK)}, "
                             f"{block.cdiv(data.shape[1], block.BLOCK)}] block scales for data of shape "
                             f"{tuple(data.shape)}, got shape {tuple(scale_inv.shape)}")
        return cls(data, block.pad_block_scales(scale_inv.to(data.device), data.shape[1]), dtype)

    @property
    def layout(self) -> str:
        """Returns: "tensor" (one scale_inv) or "block_128x128" (a scale_inv per 128x128 block), the FP8Operand
        layout name of this weight."""
        return block.LAYOUT_BLOCK if self._scale_inv.dim() == 2 else block.LAYOUT_TENSOR

    def transpose_scale_inv(self) -> torch.Tensor:
        """Returns: the scale_inv of transpose_data(): the same tensor per-tensor; for 128x128 blocks the block
        scales transposed, [cdiv(K, 128), pad4(cdiv(N, 128))] (a new tensor)."""
        if self.layout == block.LAYOUT_TENSOR:
            return self._scale_inv
        return block.transpose_block_scales(self._scale_inv, tuple(self._data.shape))

    def fp8_operand(self, transpose: bool = False) -> "FP8Operand":  # noqa: F821  (quantization.operand)
        """This weight as a GEMM operand, without a cast: its own data and scale_inv in its layout.

        Args:
            transpose: also give the transposed copy data_t [K, N] (transpose_data(): kept with keep_transpose_) and
                its scale_inv_t (a dgrad's operand).
        Returns:
            FP8Operand(data, data_t or None, scale_inv, fp8_dtype, layout, scale_inv_t).
        """
        from .quantization.operand import FP8Operand  # (quantization builds on this module's neighbours)
        data_t = self.transpose_data() if transpose else None
        scale_inv_t = self.transpose_scale_inv() if transpose else None
        return FP8Operand(self._data, data_t, self._scale_inv, self._data.dtype, self.layout, scale_inv_t)

    def get_high_precision_init_val(self):
        """The high-precision values this weight was created from (a CPU tensor), kept by
        fp8_model_init(preserve_high_precision_init_val=True) until clear_high_precision_init_val(); else None."""
        return getattr(self, "_high_precision_init_val", None)

    def clear_high_precision_init_val(self):
        self._high_precision_init_val = None

    def dequantize(self, dtype=None):
        if self._scale_inv.dim() == 2:
            return block.dequantize_blocks(self._data, self._scale_inv, dtype or self.dtype)
        return tfp8.dequantize(self._data, self._scale_inv, dtype or self.dtype)

    @torch.no_grad()
    def quantize_(self, src):
        """Re-quantize `src` (high precision, same shape) into this tensor with scale = fp8_max / amax(src)."""
        src = src.to(device=self.device)
        self._kept_transpose = None  # (stale from here: see transpose_data)
        if self._scale_inv.dim() == 2:  # (power-of-2 scales stay so: a weight keeps its recipe's scale style)
            power_2_scale = block.is_power_of_2(self._scale_inv)
            data, scale_inv = block.quantize_blocks(src.reshape(self._data.shape), self._data.dtype, power_2_scale)
            self._data.copy_(data)
            self._scale_inv.copy_(scale_inv)
            return self
        amax = src.detach().abs().amax().float().reshape(1) if src.numel() else torch.zeros(1, device=self.device)
        fp8_max = FP8_MAX[self._data.dtype]
        usable = torch.isfinite(amax) & (amax > 0)
        scale = torch.where(usable, fp8_max / amax, torch.reciprocal(self._scale_inv))
        self._data.copy_(tfp8.quantize(src.contiguous(), scale, self._data.dtype, None, self._scale_inv))
        return self

    def transpose_data(self):
        """FP8 bytes of this 2-D tensor's transpose [K, N] (a dgrad GEMM's operand: Hopper's FP8 GEMMs take K-major
        operands only). With keep_transpose_(True) the first call's transpose is kept on the tensor and returned
        while its data is unchanged (in-place ops, copy_ and quantize_ drop it, and so does a write to _data itself:
        its version changes); else every call transposes."""
        if not self._keep_transpose:
            return tfp8.fp8_transpose(self._data)
        kept = self._kept_transpose
        if kept is None or kept[0] is not self._data or kept[1] != self._data._version:
            kept = self._kept_transpose = (self._data, self._data._version, tfp8.fp8_transpose(self._data))
        return kept[2]

    def keep_transpose_(self, keep=True):
        """Keep (True) the transpose that transpose_data makes, one more byte an element for no transpose per call
        (frozen weights trained around, e.g. LoRA's base); False drops a kept one. Returns self."""
        self._keep_transpose = bool(keep)
        if not keep:
            self._kept_transpose = None
        return self

    def narrow(self, dim, start, length):
        """A Float8Tensor view (FSDP2 narrows its padded shards; indexing, aten.slice, still dequantizes). Block
        weights: along dim 0 on 128-row boundaries only."""
        if self._scale_inv.dim() == 2:
            return _block_rows_view(self, dim, start, length, "narrow")
        return Float8Tensor(self._data.narrow(dim, start, length), self._scale_inv, self.dtype)

    def __repr__(self, *, tensor_contents=None):
        scale = f"{self._scale_inv.item():.6g}" if self._scale_inv.dim() < 2 else \
            f"<{tuple(self._scale_inv.shape)} per 128x128 block>"
        return f"Float8Tensor(fp8_dtype={self._data.dtype}, scale_inv={scale}, as {self.dequantize()!r})"

    def __reduce_ex__(self, protocol):
        return _rebuild_float8_tensor, (self._data, self._scale_inv, self.dtype, self.requires_grad)

    def __tensor_flatten__(self):
        return ["_data", "_scale_inv"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner_tensors, dtype, outer_size, outer_stride):
        return Float8Tensor(inner_tensors["_data"], inner_tensors["_scale_inv"], dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.detach.default:
            t = args[0]
            return Float8Tensor(t._data, t._scale_inv, t.dtype)
        if func is aten.clone.default:  # (deepcopy relies on it)
            t = args[0]
            return Float8Tensor(t._data.clone(), t._scale_inv.clone(), t.dtype)
        if func is aten._to_copy.default and _keeps_fake_dtype(args[0], kwargs):
            t, device = args[0], kwargs.get("device") or args[0].device
            return Float8Tensor(t._data.to(device), t._scale_inv.to(device), t.dtype)
        if func in _VIEW_OPS and isinstance(args[0], Float8Tensor) and args[0]._scale_inv.dim() == 2:
            return _block_view(func, args, kwargs)
        if func in _VIEW_OPS and isinstance(args[0], Float8Tensor):
            t = args[0]
            out = func(t._data, *args[1:], **kwargs)
            return [Float8Tensor(o, t._scale_inv, t.dtype) for o in out] if isinstance(out, (list, tuple)) \
                else Float8Tensor(out, t._scale_inv, t.dtype)
        if func is aten.new_zeros.default and isinstance(args[0], Float8Tensor):
            t = args[0]
            if t._scale_inv.dim() == 2 and len(args[1]) == 2:
                scale_inv = t._scale_inv.new_ones(block.block_scale_shape(args[1]))
                return Float8Tensor(t._data.new_zeros(args[1]), scale_inv, t.dtype)
            scale_inv = t._scale_inv.new_ones(1) if t._scale_inv.dim() == 2 else torch.ones_like(t._scale_inv)
            return Float8Tensor(t._data.new_zeros(args[1]), scale_inv, t.dtype)
        if func is aten.cat.default and _block_cat_applies(*args, **kwargs):
            tensors = args[0]
            return Float8Tensor(torch.cat([t._data for t in tensors]), torch.cat([t._scale_inv for t in tensors]),
                                tensors[0].dtype)
        if func is aten.copy_.default and isinstance(args[0], Float8Tensor):
            dst, src = args[0], args[1]
            if isinstance(src, Float8Tensor) and src._data.dtype == dst._data.dtype and \
                    src._scale_inv.shape == dst._scale_inv.shape:  # (same layout: bytes and scales copied)
                dst._data.copy_(src._data)
                dst._scale_inv.copy_(src._scale_inv)
                dst._kept_transpose = None
                return dst
            return dst.quantize_(_plain(src))
        plain_args, plain_kwargs = tree_map(_plain, args), tree_map(_plain, kwargs)
        out = func(*plain_args, **plain_kwargs)
        if _mutates_first_argument(func) and isinstance(args[0], Float8Tensor):
            return args[0].quantize_(plain_args[0])
        if _mutates_first_argument(func) and isinstance(args[0], (list, tuple)):  # _foreach_*_ (optimizers)
            for dst, src in zip(args[0], plain_args[0]):
                if isinstance(dst, Float8Tensor):
                    dst.quantize_(src)
        return out

    # --- FSDP2 all-gather extension (torch.distributed.fsdp.fully_shard) ---
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """All-gather inputs of this rank's shard: its FP8 data and its scale_inv (metadata: none). Block weights
        are refused (see the module docstring)."""
        if self._scale_inv.dim() == 2:
            raise NotImplementedError(_FSDP_BLOCK_REFUSAL)
        return (self._data, self._scale_inv), None

    @torch.no_grad()
    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """(data [world * shard rows, ...] FP8, scale_invs [world]) -> the unsharded Float8Tensor, its data in the
        largest scale_inv. With `out` (the Float8Tensor of an earlier call, whose storage FSDP re-allocated) the
        result is written into it."""
        data, scale_invs = all_gather_outputs
        common = scale_invs.amax().reshape(1)
        per_rank = data.view(scale_invs.numel(), -1).float()
        rescaled = (per_rank * (scale_invs / common).unsqueeze(1)).to(data.dtype).view(data.shape)
        # (factors <= 1: no overflow; a factor of 1 keeps the bytes)
        if out is not None:
            out._data.copy_(rescaled.view(out._data.shape))
            out._scale_inv.copy_(common)
            return None
        return Float8Tensor(rescaled, common, param_dtype), (rescaled,)


_FSDP_BLOCK_REFUSAL = ("FSDP2 (fully_shard) cannot shard block-scaled FP8 weights (128x128 blocks): it keeps a "
                       "flattened view of each shard, and block scales follow the weight's 2-D shape. Use per-tensor "
                       "FP8 weights (fp8_model_init without Float8BlockScaling) or high-precision weights with FSDP2")

_VIEW_OPS = (aten.split.Tensor, aten.split_with_sizes.default, aten.view.default, aten.as_strided.default,
             aten._unsafe_view.default)


def _plain(x):
    return x.dequantize() if isinstance(x, Float8Tensor) else x


def _block_rows_view(t, dim, start, length, what):
    """Rows [start, start + length) of a block weight t as a Float8Tensor sharing its data and block scales."""
    if dim not in (0, -2):
        raise NotImplementedError(f"{what}: block-scaled FP8 weights have views along dim 0 only (whole 128-row "
                                  f"blocks), got dim={dim}; dequantize() first")
    first, count = block.row_block_range(t._data.shape[0], start, length, what)
    return Float8Tensor(t._data.narrow(0, start, length), t._scale_inv.narrow(0, first, count), t.dtype)


def _block_view(func, args, kwargs):
    """The view ops of _VIEW_OPS on a block weight: splits along dim 0 on 128-row boundaries, and views that keep
    its shape (view, as_strided at its own shape and strides). Anything else is refused: its elements would need
    scales of their own."""
    t, name = args[0], func.__name__
    if func in (aten.split.Tensor, aten.split_with_sizes.default):
        sizes, dim = args[1], (args[2] if len(args) > 2 else kwargs.get("dim", 0))
        rows = t._data.shape[0]
        if isinstance(sizes, int):
            sizes = [min(sizes, rows - start) for start in range(0, rows, sizes)] or [0]
        out, start = [], 0
        for size in sizes:
            out.append(_block_rows_view(t, dim, start, size, name))
            start += size
        return out
    out = func(t._data, *args[1:], **kwargs)
    if (out.shape, out.stride(), out.storage_offset()) != (t._data.shape, t._data.stride(), t._data.storage_offset()):
        raise NotImplementedError(f"{name}: block-scaled FP8 weights (128x128 blocks) keep their shape in views "
                                  f"(got {tuple(out.shape)} for shape {tuple(t.shape)}); dequantize() first. "
                                  f"{_FSDP_BLOCK_REFUSAL if out.dim() == 1 else ''}")
    return Float8Tensor(out, t._scale_inv, t.dtype)


def _block_cat_applies(tensors, dim=0):
    """torch.cat keeps FP8 bytes and block scales: block weights of one FP8 dtype, fake dtype and width, stacked
    along dim 0, all but the last of a multiple of 128 rows (their blocks stay whole). Other cats dequantize."""
    if not tensors or not all(isinstance(t, Float8Tensor) and t._scale_inv.dim() == 2 for t in tensors):
        return False
    first = tensors[0]
    return dim in (0, -2) and all(t._data.dtype == first._data.dtype and t.dtype == first.dtype and
                                  t.shape[1] == first.shape[1] for t in tensors) and \
        all(t.shape[0] % block.BLOCK == 0 for t in tensors[:-1])


def _keeps_fake_dtype(t, kwargs):
    dtype = kwargs.get("dtype")
    return (dtype is None or dtype == t.dtype) and kwargs.get("layout") in (None, torch.strided)


def _mutates_first_argument(func):
    arguments = func._schema.arguments
    return bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write


def _rebuild_float8_tensor(data, scale_inv, dtype, requires_grad):
    return Float8Tensor(data, scale_inv, dtype, requires_grad)


torch.serialization.add_safe_globals([Float8Tensor, _rebuild_float8_tensor])
