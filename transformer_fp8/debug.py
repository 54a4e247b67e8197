"""Seeing what FP8 does: per module and tensor role, FP8 vs high-precision calls and the numbers of the last cast.

    stats = transformer_fp8.debug.enable(model)   # or: with transformer_fp8.debug.enable(model): ...
    ... training or inference steps inside fp8_autocast ...
    print(transformer_fp8.debug.report(model))    # reads the device once per module, here
    transformer_fp8.debug.disable(model)          # removes the hooks (the numbers stay readable)

Roles are the FP8 modules' scaling slots (module docstrings): Linear and LayerNormLinear `input` (LayerNormLinear: the
normalised input), `weight`, `grad_output`; LayerNormMLP `fc1_input`, `fc1_weight`, `fc2_input`, `fc2_weight`,
`fc1_grad_output`, `fc2_grad_output`. Per role: FP8 calls and high-precision calls (forwards inside an enabled
fp8_autocast; backward roles: the backwards of those forwards), and from the last FP8 cast its layout, its amax,
its scale (q = saturate(x * scale)), the fraction of its elements flushed to zero (x != 0 but |x * scale| at most
half the smallest subnormal: they round to 0) and the fraction saturated (|x * scale| beyond the format's max by
more than half its step: clamped by more than rounding would move them). Block layouts (Float8BlockScaling) have a
scale per 1x128 tile or 128x128 block, not one: their `scale` is NaN, `scale_min` / `scale_max` span the tiles'
scales (a per-tensor cast has scale_min = scale_max = scale), and each element is judged with its own tile's scale
(the block quantizer's rule: tile amax floored at amax_epsilon, power-of-2 rounding). They describe the rowwise cast
(the forward and dgrad GEMMs' operand); the wgrad's transposed copy of a 1x128 cast has tiles of its own along the
other dimension and is not described. These are computed
with a few torch ops on the device from the high-precision tensor the module casts, seen at the module's boundary:
the weights, the input (the norm recomputed for the fused-norm modules), the output gradient. `fc2_input` and
`fc1_grad_output` live inside LayerNormMLP's fused kernels and get call counts only. Not covered: FP8 attention
(fp8_dpa), Float8Tensor weights (no cast: counts only), and the amax reduction over tensor-parallel ranks (the stats
are this rank's).

Collection costs nothing until `enable`: no hooks, no ops. While enabled, each FP8 forward and backward of a module
runs the stats ops (no host synchronisation: everything stays on the device until `stats` / `report`). The call
counters themselves are always on (host integers, counted by the modules): `call_counts(module)`.

`disable_fp8(module)` forces a module (and the FP8 GEMM modules inside it) onto its high-precision path inside
fp8_autocast: the attribute `fp8_disabled` of Linear / LayerNormLinear / LayerNormMLP.
"""
import math
from typing import Any

import torch
import torch.nn.functional as F

from .cpu.block import BLOCK, tile_scales
from .module.base import FP8ModuleBase
from .module.layernorm_linear import LayerNormLinear
from .module.layernorm_mlp import LayerNormMLP
from .module.linear import Linear
from .module.norm import norm_fwd
from .quantization import Role
from .recipe import FP8_MAX

__all__ = ["DebugSession", "call_counts", "disable", "disable_fp8", "enable", "report", "stats"]

# the module classes whose casts are reported, under their roles' names (forward_roles / backward_roles)
ROLE_CLASSES = (Linear, LayerNormLinear, LayerNormMLP)

# Half the smallest subnormal: |x * scale| at or below it rounds to 0 (a tie rounds to the even 0).
FLUSH_BOUND = {torch.float8_e4m3fn: 2.0 ** -10, torch.float8_e5m2: 2.0 ** -17}
# The max plus half its step (E4M3 448 + 32 / 2, E5M2 57344 + 8192 / 2): |x * scale| above it is changed by the
# saturation more than rounding would change it. (Not the max itself: under delayed scaling with a steady amax, the
# largest element lands on max * (1 + 2**-24) as often as not, and loses nothing to the clamp.)
SATURATION_BOUND = {torch.float8_e4m3fn: 464.0, torch.float8_e5m2: 61440.0}

STAT_NAMES = ("amax", "scale", "scale_min", "scale_max", "flushed", "saturated")


def cast_stats(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, per_tile: bool = False) -> torch.Tensor:
    """What casting x with `scale` into fp8_dtype does, on x's device without a host sync.

    Args:
        x: the high-precision tensor the cast reads.
        scale: the cast's scale (q = saturate(x * scale)), float32: one element, or (per_tile) the scale of each
            element's tile, broadcastable to x.
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        per_tile: `scale` holds tile scales (a block layout): the "scale" entry is NaN, there being no single one.
    Returns:
        float32 [6], STAT_NAMES: amax(|x|), the scale, the smallest and largest scale, the fraction of elements
        flushed to zero, the fraction saturated (see FLUSH_BOUND, SATURATION_BOUND).
    """
    x = x.detach()
    scale = scale.float() if per_tile else scale.float().reshape(())
    scaled = (x.float() * scale).abs()  # (float32, as the cast kernels multiply)
    flushed = (scaled <= FLUSH_BOUND[fp8_dtype]) & (x != 0)
    saturated = scaled > SATURATION_BOUND[fp8_dtype]
    single = torch.full_like(scale.amin(), math.nan) if per_tile else scale
    return torch.stack([x.abs().amax().float(), single, scale.amin(), scale.amax(), flushed.float().mean(),
                        saturated.float().mean()])


def tile_scales_per_element(x: torch.Tensor, block_dim: int, fp8_dtype: torch.dtype, amax_epsilon: float,
                            power_2_scale: bool) -> torch.Tensor:
    """The scale block_cast gives each element of x [M, K] (torch ops on x's device: cpu.block.tile_scales, the
    reference kernel's rule, over each tile's amax).

    Args:
        x: the 2-D high-precision tensor the block cast reads (rowwise).
        block_dim: 1 (1x128 tiles along K) or 2 (128x128 blocks).
        fp8_dtype, amax_epsilon, power_2_scale: the cast's (the quantizer's qparams).
    Returns:
        float32 [M, K].
    """
    tile_rows = 1 if block_dim == 1 else BLOCK
    m, k = x.shape
    row_tiles, col_tiles = -(-m // tile_rows), -(-k // BLOCK)
    padded = F.pad(x.detach().float().abs(), (0, col_tiles * BLOCK - k, 0, row_tiles * tile_rows - m))
    amax = padded.view(row_tiles, tile_rows, col_tiles, BLOCK).amax(dim=(1, 3))
    scales = tile_scales(amax, FP8_MAX[fp8_dtype], amax_epsilon, power_2_scale)
    return scales.repeat_interleave(tile_rows, 0)[:m].repeat_interleave(BLOCK, 1)[:, :k]


def _quantizer_stats(x: torch.Tensor, quantizer, scale: torch.Tensor) -> torch.Tensor:
    """cast_stats of x under `quantizer`: with `scale` (per-tensor layouts), or with the tile scales the block
    quantizer computes from x itself (block layouts; x as the module casts it, 2-D)."""
    if quantizer.layout == "tensor":
        return cast_stats(x, scale, quantizer.fp8_dtype)
    x = x.reshape(-1, x.shape[-1])
    per_element = tile_scales_per_element(x, quantizer.block_dim, quantizer.fp8_dtype,
                                          float(quantizer.qparams.amax_epsilon), quantizer.qparams.power_2_scale)
    return cast_stats(x, per_element, quantizer.fp8_dtype, per_tile=True)


def _own_scale(x, state_scale, fp8_dtype):
    """The scale a cast that scales from x's own amax sets (current scaling; delayed scaling before the state's first
    update): fp8_max / amax(x), or the state's scale where that amax is zero or not finite."""
    amax = x.detach().abs().amax().float().reshape(1)
    own = torch.full_like(amax, FP8_MAX[fp8_dtype]) / amax  # (float / tensor would multiply by a reciprocal: 1 ulp off)
    return torch.where(torch.isfinite(amax) & (amax > 0) & torch.isfinite(own), own, state_scale)


def _roles_of(module):
    """(forward role names, backward role names) of a reported module, in slot order; None for another module."""
    if not isinstance(module, ROLE_CLASSES):
        return None
    return tuple(r.value for r in module.forward_roles), tuple(r.value for r in module.backward_roles)


def _first(output):
    return output[0] if isinstance(output, (tuple, list)) else output


class _Recorder:
    """One module's debug numbers: host call counts per role, and a device tensor [roles, 4] of the last cast's
    STAT_NAMES per role (NaN until recorded)."""

    def __init__(self, module):
        self.fwd_roles, self.bwd_roles = _roles_of(module)
        self.roles = self.fwd_roles + self.bwd_roles
        self.counts = {role: [0, 0] for role in self.roles}  # [FP8, high precision]
        self.layouts = {}  # role -> the layout of its last recorded cast ("tensor", "block_1x128", "block_128x128")
        self.values = None  # created on the device of the first recorded tensor
        self.handles = []
        self._before = (0, 0)

    def attach(self, module):
        if not self.handles:
            self.handles = [module.register_forward_pre_hook(self._pre, with_kwargs=True),
                            module.register_forward_hook(self._post, with_kwargs=True)]

    def detach(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _pre(self, module, args, kwargs):
        self._before = tuple(module._fp8_call_counts)

    def _post(self, module, args, kwargs, output):
        fp8 = module._fp8_call_counts[0] > self._before[0]
        if not fp8 and module._fp8_call_counts[1] == self._before[1]:
            return  # outside fp8_autocast: nothing to count
        for role in self.fwd_roles:
            self.counts[role][0 if fp8 else 1] += 1
        if fp8:
            inp = args[0] if args else kwargs["inp"]
            self._record_forward(module, inp)
        out = _first(output)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: self._on_grad_output(module, grad, fp8))

    def _store(self, role, quantizer, values):
        if self.values is None or self.values.device != values.device:
            self.values = torch.full((len(self.roles), len(STAT_NAMES)), math.nan, device=values.device)
        self.values[self.roles.index(role)].copy_(values)
        self.layouts[role] = quantizer.layout

    def _record_forward(self, module, inp):
        quantizers = module.quantizers
        if isinstance(module, Linear):
            tensors = {"input": inp, "weight": module.weight}
        else:
            x = inp.reshape(-1, inp.shape[-1]).contiguous()
            normed = norm_fwd(module.normalization, x, module.layer_norm_weight, module.layer_norm_bias, module.eps,
                              module.zero_centered_gamma)[0]
            if isinstance(module, LayerNormLinear):
                tensors = {"input": normed, "weight": module.weight}
            else:
                tensors = {"fc1_input": normed, "fc1_weight": module.fc1_weight, "fc2_weight": module.fc2_weight}
        for role in self.fwd_roles:
            x = tensors.get(role)
            if x is not None and not module._fp8_params:  # (Float8Tensor weights: no cast to look at)
                quantizer = quantizers[Role(role)]
                self._store(role, quantizer, _quantizer_stats(x, quantizer, quantizer.scale))

    def _on_grad_output(self, module, grad, fp8):
        """The module's output gradient, before its backward casts it (into the last backward slot)."""
        for role in self.bwd_roles:
            self.counts[role][0 if fp8 else 1] += 1
        if not fp8 or grad is None:
            return
        role = self.bwd_roles[-1]  # (the role that casts the output gradient: the last backward role)
        quantizer = module.quantizers[Role(role)]
        dy = grad.reshape(-1, grad.shape[-1])
        scale = quantizer.scale
        if quantizer.layout == "tensor" and not quantizer.known_scale:  # (the cast scales from dy's own amax)
            scale = _own_scale(dy, scale, quantizer.fp8_dtype)
        self._store(role, quantizer, _quantizer_stats(dy, quantizer, scale))

    def read(self):
        """{role: {"fp8_calls", "high_precision_calls", "layout", *STAT_NAMES}} (one device read)."""
        values = self.values.cpu().tolist() if self.values is not None else None
        table = {}
        for i, role in enumerate(self.roles):
            row = {"fp8_calls": self.counts[role][0], "high_precision_calls": self.counts[role][1],
                   "layout": self.layouts.get(role)}
            row.update(zip(STAT_NAMES, values[i] if values is not None else [math.nan] * len(STAT_NAMES)))
            table[role] = row
        return table


def _fp8_modules(model):
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    return [(name, m) for name, m in model.named_modules() if _roles_of(m) is not None]


class DebugSession:
    """What `enable` returns: a context manager whose exit (or `close()`) removes the hooks it added."""

    def __init__(self, modules):
        self.modules = modules

    def close(self) -> None:
        """Stop collecting (the numbers stay readable through stats / report)."""
        for module in self.modules:
            module._tfp8_debug.detach()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def enable(model: torch.nn.Module) -> DebugSession:
    """Collect per-role debug numbers for every Linear, LayerNormLinear and LayerNormMLP in `model` (itself
    included), and name them (their qualified names in model) for warnings and reports. Enabling again continues the
    counts.

    Args:
        model: a module containing FP8 modules.
    Returns:
        A DebugSession; use it as a context manager, or call `disable(model)`, to stop collecting.
    """
    modules = _fp8_modules(model)
    if not modules:
        raise ValueError(f"model: expected a module containing Linear, LayerNormLinear or LayerNormMLP, got "
                         f"{type(model).__name__} without any")
    for name, module in modules:
        module._tfp8_name = name or type(module).__name__
        if getattr(module, "_tfp8_debug", None) is None:
            module._tfp8_debug = _Recorder(module)
        module._tfp8_debug.attach(module)
    return DebugSession([m for _, m in modules])


def disable(model: torch.nn.Module) -> None:
    """Stop collecting in every FP8 module of `model` (removes the hooks; the numbers stay readable).

    Args:
        model: a module on which `enable` was called (other modules are left as they are).
    """
    for _, module in _fp8_modules(model):
        recorder = getattr(module, "_tfp8_debug", None)
        if recorder is not None:
            recorder.detach()


def disable_fp8(module: torch.nn.Module, disabled: bool = True) -> None:
    """Force `module` and every Linear / LayerNormLinear / LayerNormMLP inside it onto the high-precision path, also
    inside fp8_autocast (their attribute `fp8_disabled`); `disabled=False` gives them FP8 back.

    Args:
        module: an FP8 module or a module containing some.
        disabled: True to force high precision, False to undo.
    Raises:
        ValueError: no FP8 GEMM module inside, or one with Float8Tensor weights (fp8_model_init: no high-precision
            weight to run).
    """
    if not isinstance(disabled, bool):
        raise TypeError(f"disabled: expected a bool, got {disabled!r}")
    modules = [m for m in (module.modules() if isinstance(module, torch.nn.Module) else ())
               if isinstance(m, FP8ModuleBase)]
    if not modules:
        raise ValueError(f"module: expected an FP8 module or one containing some, got {type(module).__name__}")
    if disabled:
        for m in modules:
            if m._fp8_params:
                raise ValueError(f"module: {type(m).__name__} has Float8Tensor weights (created under "
                                 "fp8_model_init) and no high-precision weight, so it cannot run without FP8")
    for m in modules:
        m.fp8_disabled = disabled


def call_counts(module: torch.nn.Module) -> dict[str, int]:
    """Forwards of an FP8 module inside an enabled fp8_autocast, counted on the host (eager calls only: calls traced
    by torch.compile are not counted).

    Args:
        module: a Linear, LayerNormLinear or LayerNormMLP.
    Returns:
        {"fp8": FP8 calls, "high_precision": small-shape or fp8_disabled calls}.
    """
    if not isinstance(module, FP8ModuleBase):
        raise TypeError(f"module: expected a Linear, LayerNormLinear or LayerNormMLP, got {type(module).__name__}")
    fp8, high = module._fp8_call_counts
    return {"fp8": fp8, "high_precision": high}


def _tables(model):
    """[(name, module, {role: numbers})] for every FP8 module of model (see stats)."""
    tables = []
    for name, module in _fp8_modules(model):
        recorder = getattr(module, "_tfp8_debug", None)
        if recorder is not None:
            roles = recorder.read()
        else:
            counts = call_counts(module)
            roles = {"forward": dict(fp8_calls=counts["fp8"], high_precision_calls=counts["high_precision"],
                                     layout=None, **{k: math.nan for k in STAT_NAMES})}
        tables.append((name or type(module).__name__, module, roles))
    return tables


def stats(model: torch.nn.Module) -> dict[str, dict[str, dict[str, Any]]]:
    """The debug numbers of every FP8 module in `model` (reads the device: call between steps, not inside one).

    Args:
        model: a module containing FP8 modules.
    Returns:
        {module name: {role: {"fp8_calls", "high_precision_calls", "layout", "amax", "scale", "scale_min",
        "scale_max", "flushed", "saturated"}}}; modules never enabled have one role "forward" with their call counts
        only; NaN (layout None) = not recorded. layout: "tensor", "block_1x128" or "block_128x128"; a block
        layout's "scale" is NaN and scale_min / scale_max span its tiles' scales (see the module docstring). flushed
        and saturated are fractions of the cast's elements, each judged with the scale of its own tile.
    """
    return {name: roles for name, _, roles in _tables(model)}


def _fmt(value, percent=False):
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return f"{100 * value:.3g}%" if percent else f"{value:.4g}"


def _fmt_scale(row):
    """The scale, or for tile scales (a block layout) their range "min..max"."""
    if math.isnan(row["scale"]) and not math.isnan(row["scale_min"]):
        return f"{_fmt(row['scale_min'])}..{_fmt(row['scale_max'])}"
    return _fmt(row["scale"])


def report(model: torch.nn.Module) -> str:
    """A table of `stats(model)`: one row per module and role (fp8_disabled modules marked; a block layout's
    scale column shows its tiles' range, min..max).

    Args:
        model: a module containing FP8 modules.
    Returns:
        The table as text.
    """
    header = ("module", "role", "layout", "fp8", "high prec.", "amax", "scale", "flushed", "saturated")
    rows = []
    for name, module, roles in _tables(model):
        label = name + (" (fp8 disabled)" if module.fp8_disabled else "")
        for role, row in roles.items():
            rows.append((label, role, row["layout"] or "-", str(row["fp8_calls"]), str(row["high_precision_calls"]),
                         _fmt(row["amax"]), _fmt_scale(row), _fmt(row["flushed"], True),
                         _fmt(row["saturated"], True)))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in [header, *rows]]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(lines)
