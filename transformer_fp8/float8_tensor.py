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
"""
import torch
from torch.utils._pytree import tree_map

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
        self = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=dtype, device=data.device,
                                                   requires_grad=requires_grad)
        self._data = data
        self._scale_inv = scale_inv
        return self

    @classmethod
    def from_hp(cls, tensor, fp8_dtype=torch.float8_e4m3fn):
        """Quantize a high-precision tensor with a scale from its own amax."""
        data = torch.empty_like(tensor, dtype=fp8_dtype)
        out = cls(data, torch.ones(1, dtype=torch.float32, device=tensor.device), tensor.dtype)
        out.quantize_(tensor)
        return out

    def get_high_precision_init_val(self):
        """The high-precision values this weight was created from (a CPU tensor), kept by
        fp8_model_init(preserve_high_precision_init_val=True) until clear_high_precision_init_val(); else None."""
        return getattr(self, "_high_precision_init_val", None)

    def clear_high_precision_init_val(self):
        self._high_precision_init_val = None

    def dequantize(self, dtype=None):
        return tfp8.dequantize(self._data, self._scale_inv, dtype or self.dtype)

    @torch.no_grad()
    def quantize_(self, src):
        """Re-quantize `src` (high precision, same shape) into this tensor with scale = fp8_max / amax(src)."""
        src = src.to(device=self.device)
        self._kept_transpose = None  # (stale from here: see transpose_data)
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
        """A Float8Tensor view (FSDP2 narrows its padded shards; indexing, aten.slice, still dequantizes)."""
        return Float8Tensor(self._data.narrow(dim, start, length), self._scale_inv, self.dtype)

    def __repr__(self, *, tensor_contents=None):
        return (f"Float8Tensor(fp8_dtype={self._data.dtype}, scale_inv={self._scale_inv.item():.6g}, "
                f"as {self.dequantize()!r})")

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
        if func in _VIEW_OPS and isinstance(args[0], Float8Tensor):
            t = args[0]
            out = func(t._data, *args[1:], **kwargs)
            return [Float8Tensor(o, t._scale_inv, t.dtype) for o in out] if isinstance(out, (list, tuple)) \
                else Float8Tensor(out, t._scale_inv, t.dtype)
        if func is aten.new_zeros.default and isinstance(args[0], Float8Tensor):
            t = args[0]
            return Float8Tensor(t._data.new_zeros(args[1]), torch.ones_like(t._scale_inv), t.dtype)
        if func is aten.copy_.default and isinstance(args[0], Float8Tensor):
            dst, src = args[0], args[1]
            if isinstance(src, Float8Tensor) and src._data.dtype == dst._data.dtype:
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
        """All-gather inputs of this rank's shard: its FP8 data and its scale_inv (metadata: none)."""
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


_VIEW_OPS = (aten.split.Tensor, aten.split_with_sizes.default, aten.view.default, aten.as_strided.default,
             aten._unsafe_view.default)


def _plain(x):
    return x.dequantize() if isinstance(x, Float8Tensor) else x


def _keeps_fake_dtype(t, kwargs):
    dtype = kwargs.get("dtype")
    return (dtype is None or dtype == t.dtype) and kwargs.get("layout") in (None, torch.strided)


def _mutates_first_argument(func):
    arguments = func._schema.arguments
    return bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write


def _rebuild_float8_tensor(data, scale_inv, dtype, requires_grad):
    return Float8Tensor(data, scale_inv, dtype, requires_grad)


torch.serialization.add_safe_globals([Float8Tensor, _rebuild_float8_tensor])
