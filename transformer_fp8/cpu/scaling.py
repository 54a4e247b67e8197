"""CPU reference kernel of delayed_scaling_update.

amax_histories[i] [H_i, n_i], scales[i] / scale_invs[i] [n_i], float32. Per slot: new = history[0] (NaN/Inf -> 0);
amax = max over the history with new in row 0 ("max") or new ("most_recent"); the history rolls down one row
(row k -> row k+1, last row dropped, row 0 zeroed); if amax > 0 and finite and s = fp8_max / amax / 2**margin
(float32, in that order) is finite: scale = s, scale_inv = 1 / s; otherwise both are kept.
"""
import torch

from ._common import register

AMAX_COMPUTE_ALGOS = ("max", "most_recent")


def check_scaling_args(amax_histories, scales, scale_invs, fp8_max, amax_compute_algo):
    if amax_compute_algo not in AMAX_COMPUTE_ALGOS:
        raise ValueError(f"amax_compute_algo: expected one of {AMAX_COMPUTE_ALGOS}, got {amax_compute_algo!r}")
    if not fp8_max > 0:
        raise ValueError(f"fp8_max: expected a positive number, got {fp8_max}")
    n = len(amax_histories)
    for lst, arg in ((scales, "scales"), (scale_invs, "scale_invs")):
        if len(lst) != n:
            raise ValueError(f"{arg}: expected {n} tensors (one per amax history), got {len(lst)}")
    device = amax_histories[0].device if n else None
    for i, (hist, scale, scale_inv) in enumerate(zip(amax_histories, scales, scale_invs)):
        if hist.dim() != 2 or hist.shape[0] < 1:
            raise ValueError(f"amax_histories[{i}]: expected shape [H, n] with H >= 1, got {tuple(hist.shape)}")
        for t, arg, shape in ((hist, "amax_histories", tuple(hist.shape)), (scale, "scales", (hist.shape[1],)),
                              (scale_inv, "scale_invs", (hist.shape[1],))):
            if t.dtype != torch.float32:
                raise TypeError(f"{arg}[{i}]: expected a float32 tensor, got {t.dtype}")
            if tuple(t.shape) != shape:
                raise ValueError(f"{arg}[{i}]: expected shape {shape}, got {tuple(t.shape)}")
            if not t.is_contiguous():
                raise ValueError(f"{arg}[{i}]: expected a contiguous tensor (got strides {t.stride()})")
            if t.device != device:
                raise ValueError(f"{arg}[{i}]: expected a tensor on {device}, got one on {t.device}")


def update_one(hist, scale, scale_inv, fp8_max, pow2_margin, amax_compute_algo):
    """Roll one [H, n] history and refresh its scales in place (the recipe above)."""
    newest = hist[0].clone()
    newest = torch.where(torch.isfinite(newest), newest, torch.zeros_like(newest))
    if amax_compute_algo == "max":
        amax = torch.cat([newest[None], hist[1:]]).amax(dim=0)
    else:
        amax = newest
    if hist.shape[0] > 1:
        hist[2:] = hist[1:-1].clone()
        hist[1] = newest
    hist[0] = 0.0
    new_scale = (fp8_max / amax) / pow2_margin
    ok = (amax > 0) & torch.isfinite(amax) & torch.isfinite(new_scale)
    scale.copy_(torch.where(ok, new_scale, scale))
    scale_inv.copy_(torch.where(ok, 1.0 / new_scale, scale_inv))


@register("delayed_scaling_update")
def delayed_scaling_update(amax_histories, scales, scale_invs, fp8_max, margin, amax_compute_algo):
    check_scaling_args(amax_histories, scales, scale_invs, fp8_max, amax_compute_algo)
    fp8_max_f32 = torch.tensor(fp8_max, dtype=torch.float32)
    pow2_margin = torch.tensor(2.0 ** margin, dtype=torch.float32)
    for hist, scale, scale_inv in zip(amax_histories, scales, scale_invs):
        update_one(hist, scale, scale_inv, fp8_max_f32, pow2_margin, amax_compute_algo)
