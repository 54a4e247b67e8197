"""ScalingState: the float32 tensors behind one direction's quantizers of a module (forward or backward).

One slot per role: amax_history [H, n] (row 0: this step's amax, max-accumulated by the casts), scale [n] (starts at
1), scale_inv [n]. H is the recipe's amax_history_len (1 for current scaling).
Delayed scaling: each cast also writes 1/scale into its slot's `scale_invs[i]`, a one-element, 16-byte aligned
(cuBLASLt's scale pointers need it) snapshot that the GEMMs read and that FP8 tensors are saved or cached with. The
forward update gives the forward slots new snapshots (renew_scale_inv_snapshots), so a saved or cached tensor keeps the
scale it was cast with; gradient snapshots are reused (nothing outlives the backward that casts them).
Snapshots share one buffer (and so one autograd version counter): autograd Functions keep them as ctx attributes, not
through save_for_backward, whose version check would trip on writes to the other slots.
"""
from typing import Any, Callable

import torch

from ..ops import tfp8
from . import update


class ScalingState:
    """One set of FP8 slots, with one-element views of every slot made once (rebuilt when the tensors move).

    calibrated: False until the state's first update (delayed scaling). Until then a cast takes its slot's scale from
    the tensor's own amax (calibrate_scale) instead of the initial scale 1, under which gradients (~1e-4 and below)
    would flush to zero in E4M3. calibration_group: (group,) to MAX-reduce those amaxes over, as the update does
    (the autocast's fp8_group when the recipe reduces amaxes; (None,) = the default group), or None.
    pending: queued for the next fused update.
    updated_inline: an FP8-weight Linear's inference call (module/linear.py) ran this state's update inside its own
    launch (the op inference_cast) instead of queueing it for the autocast's exit; update_backup [4, n] holds what the
    update replaced (history rows 0 and H - 1, scale, scale_inv) until the thread's outermost autocast exits. A
    registration for the exit's update in the same autocast (a second call of the module, or a training forward)
    first undoes it (undo_inline_update), so the state ends as one update at the exit would leave it.
    """

    calibration_group = None
    updated_inline = False
    update_backup = None
    _inline_args = None  # (recipe, inline_update_args(recipe))

    def __init__(self, n: int, history_len: int, device: torch.device | str):
        """Args:
            n: the number of slots (roles).
            history_len: the amax history length H.
            device: where the tensors live.
        """
        self.amax_history = torch.zeros(history_len, n, dtype=torch.float32, device=device)
        self.scale = torch.ones(n, dtype=torch.float32, device=device)
        self.scale_inv = torch.ones(n, dtype=torch.float32, device=device)
        self.pending = False  # queued for the next update (see update.py)
        self.calibrated = False
        self._make_views()

    def _make_views(self):
        self.device = self.scale.device
        self.update_backup = self._inline_args = None
        self.scales = self.scale.split(1)
        self.scale_inv_slots = self.scale_inv.split(1)
        self.amaxes = self.amax_history[0].split(1)
        self.histories = self.amax_history.split(1, dim=1)
        update.renew_scale_inv_snapshots([self])

    def inline_update_args(self, recipe: Any) -> tuple:
        """The state arguments of inference_cast's fused update under `recipe` (a DelayedScaling), made once per
        recipe (update_backup made with them).

        Returns:
            (amax_history, scale, scale_inv, update_backup, margin, use_max), use_max: amax_compute_algo == "max".
        """
        cached = self._inline_args
        if cached is not None and cached[0] is recipe:
            return cached[1]
        if self.update_backup is None:
            self.update_backup = torch.empty(4, self.scale.shape[0], dtype=torch.float32, device=self.device)
        args = (self.amax_history, self.scale, self.scale_inv, self.update_backup, float(recipe.margin),
                recipe.amax_compute_algo == "max")
        self._inline_args = (recipe, args)
        return args

    def undo_inline_update(self) -> None:
        """Put back what the last inline update replaced (update_backup): the history rolled back up (its row 0 and
        last row from the backup), scale and scale_inv. Enqueued device copies, no synchronisation."""
        history, backup = self.amax_history, self.update_backup
        if history.shape[0] > 1:
            history[1:-1].copy_(history[2:].clone())
            history[-1].copy_(backup[1])
        history[0].copy_(backup[0])
        self.scale.copy_(backup[2])
        self.scale_inv.copy_(backup[3])
        self.updated_inline = False

    @property
    def history_len(self) -> int:
        """The amax history length H."""
        return self.amax_history.shape[0]

    def to(self, device: torch.device) -> None:
        """Move the tensors to `device` (in place on this object; the update plans are rebuilt)."""
        if self.scale.device != device:
            self.amax_history, self.scale, self.scale_inv = (
                t.to(device) for t in (self.amax_history, self.scale, self.scale_inv))
            self._make_views()
            update.forget_update_plans()  # they group states by device

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Returns:
            {"amax_history", "scale", "scale_inv"}: the tensors themselves (the checkpoint format)."""
        return {"amax_history": self.amax_history, "scale": self.scale, "scale_inv": self.scale_inv}

    @classmethod
    def over(cls, amax_history: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor,
             calibrated: bool) -> "ScalingState":
        """A state over these float32 tensors ([H, n], [n], [n]; used as they are, not copied)."""
        self = cls.__new__(cls)
        self.amax_history, self.scale, self.scale_inv = amax_history, scale, scale_inv
        self.pending, self.calibrated = False, calibrated
        self._make_views()
        return self

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor], device: torch.device) -> "ScalingState":
        """A calibrated state over float32 copies on `device` of a state_dict()'s tensors."""
        return cls.over(*(state[k].detach().to(device=device, dtype=torch.float32, copy=True)
                          for k in ("amax_history", "scale", "scale_inv")), calibrated=True)

    def set_current_scale(self, x: torch.Tensor, i: int, fp8_max: float, group: Any = None) -> None:
        """Current scaling: slot i's scale from amax(x), MAX-reduced over `group` if not None (the update re-zeroes
        the amax slot). The amax goes through histories[i] ([1, 1]), the view the update reads: torch.compile makes
        overlapping views (amaxes[i]) separate graph inputs and loses writes through one of them in a backward."""
        amax = self.histories[i]
        tfp8.compute_amax(x, amax)
        if group is not None:
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=group)
        tfp8.delayed_scaling_update([amax], [self.scales[i]], [self.scale_inv_slots[i]], fp8_max, 0.0, "most_recent")

    def calibrate_scale(self, x: torch.Tensor, i: int, fp8_max: float) -> torch.Tensor:
        """Delayed scaling before the first update: slot i's scale = fp8_max / amax(x) (amax MAX-reduced over
        calibration_group; a zero or non-finite amax keeps the scale). The amax stays in history row 0, where the
        cast accumulates it again and the update reads it.

        Returns:
            A fresh scale_inv [1] for the cast to write (not the slot's snapshot: a later cast of the slot in the
            same step may calibrate another scale).
        """
        return self.calibrate_scale_by(i, fp8_max, lambda amax: tfp8.compute_amax(x, amax), x.device)

    def calibrate_scale_by(self, i: int, fp8_max: float, accumulate_amax: Callable[[torch.Tensor], None],
                           device: torch.device) -> torch.Tensor:
        """calibrate_scale for a tensor that is not at hand whole (an op's output before the op runs).

        Args:
            i: the slot.
            fp8_max: the slot's FP8 maximum.
            accumulate_amax: max-accumulates the tensor's amax into the float32 [1] tensor it is given (say chunk by
                chunk, so that the tensor never exists whole in high precision).
            device: where the fresh scale_inv goes.

        Returns:
            As calibrate_scale: a fresh scale_inv [1] for the op to write.
        """
        amax = self.amaxes[i]
        accumulate_amax(amax)
        if self.calibration_group is not None:
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=self.calibration_group[0])
        usable = torch.isfinite(amax) & (amax > 0)
        self.scales[i].copy_(torch.where(usable, fp8_max / amax, self.scales[i]))
        return torch.empty(1, dtype=torch.float32, device=device)
