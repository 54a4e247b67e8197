"""Float8Tensor: FP8 data + scale_inv that behaves as a tensor of a high-precision ("fake") dtype.

    value = _data.float() * _scale_inv        _data: FP8 [*shape], _scale_inv: float32 [1], dtype: the fake dtype

Our modules read `_data` / `_scale_inv` straight into the FP8 GEMM. detach, clone and device moves keep the
Float8Tensor; every other aten op runs on the dequantized value
and returns plain tensors, except in-place ops on a Float8Tensor (copy_, add_, ...: an optimizer step, load_state_dict),
which compute in high precision and re-quantize the result into it with a fresh per-tensor scale (current scaling).
"""
import torch
from torch.utils._pytree import tree_map

from .ops import tfp8
from .recipe import FP8_MAX

aten = torch.ops.aten


class Float8Tensor(torch.Tensor):
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

    def dequantize(self, dtype=None):
        return tfp8.dequantize(self._data, self._scale_inv, dtype or self.dtype)

    @torch.no_grad()
    def quantize_(self, src):
        """Re-quantize `src` (high precision, same shape) into this tensor with scale = fp8_max / amax(src)."""
        src = src.to(device=self.device)
        amax = src.detach().abs().amax().float().reshape(1) if src.numel() else torch.zeros(1, device=self.device)
        fp8_max = FP8_MAX[self._data.dtype]
        usable = torch.isfinite(amax) & (amax > 0)
        scale = torch.where(usable, fp8_max / amax, torch.reciprocal(self._scale_inv))
        self._data.copy_(tfp8.quantize(src.contiguous(), scale, self._data.dtype, None, self._scale_inv))
        return self

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
        if func is aten.copy_.default and isinstance(args[0], Float8Tensor):
            dst, src = args[0], args[1]
            if isinstance(src, Float8Tensor) and src._data.dtype == dst._data.dtype:
                dst._data.copy_(src._data)
                dst._scale_inv.copy_(src._scale_inv)
                return dst
            return dst.quantize_(_plain(src))
        plain_args, plain_kwargs = tree_map(_plain, args), tree_map(_plain, kwargs)
        out = func(*plain_args, **plain_kwargs)
        if _mutates_first_argument(func) and isinstance(args[0], Float8Tensor):
            return args[0].quantize_(plain_args[0])
        return out


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
