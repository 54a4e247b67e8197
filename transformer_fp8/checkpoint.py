"""Activation checkpointing for FP8 modules: `checkpoint(function, *args, **kwargs)` (TE's `te.checkpoint`).

torch.utils.checkpoint recomputes a region's forward inside the backward, outside the fp8_autocast that the forward
ran in, and after the autocast exit has updated the delayed scales: our modules would recompute in high precision,
or quantize with other scales than the forward's. (They refuse such a recompute with a clear error, see
FP8ModuleBase._check_recompute_precision.) `checkpoint` wraps torch.utils.checkpoint (non-reentrant) with two
contexts:
- the forward records the FP8 settings (enabled, recipe, group), the RNG tracker's named states (the dropout of
  tensor-parallel attention draws from them; torch.utils.checkpoint restores only the default random states) and,
  the first time each FP8 module of the region runs, a copy of its forward scales and scale_invs and whether they
  were calibrated (one small copy per module);
- the recompute restores those settings (on the thread that runs it: autograd's, or the one that called the
  backward, whatever that thread's own fp8_autocast settings are; see autocast.py) and tracker states and gives each
  recorded module a replay scaling state: the recorded scales, scratch amaxes and scale_inv snapshots, nothing
  queued for an update. So the recompute quantizes exactly as the forward did (the gradients equal those without
  checkpointing, bit for bit) and leaves the modules' scaling state (amax histories, scales, snapshots held by saved
  or cached tensors) untouched.
Inside both contexts the modules pass everything their backward needs through save_for_backward (LayerNormMLP's
stash included), so that the region keeps only its inputs between the forward and the backward.
"""
import contextlib

import torch
import torch.utils.checkpoint

from . import autocast, rng
from .quantization import ScalingState


class _Region:
    """One checkpointed call: the autocast settings at its forward and the recorded scaling states."""

    def __init__(self, tracker):
        self.recording = True
        self.settings = None
        self.tracker, self.tracker_states = tracker, None
        self.outer = None  # the region this one's forward runs in (nested checkpoints), if any
        self.records = {}  # id(holder) -> (holder, attribute, copy of [scale, scale_inv], calibrated)

    def record(self, holder, attribute):
        """Called by an FP8 module (or FP8 attention scaling) at the start of its forward in this region: the
        ScalingState at holder.<attribute> is copied once per region, for this region and the recording regions
        around it (an outer region's recompute replays the inner regions' modules too)."""
        region = self
        while region is not None and region.recording:
            if id(holder) not in region.records:
                state = getattr(holder, attribute)
                region.records[id(holder)] = (holder, attribute, torch.stack((state.scale, state.scale_inv)),
                                              state.calibrated)
            region = region.outer

    @contextlib.contextmanager
    def forward(self):
        state = autocast.STATE  # (the forward thread's settings: what the recompute will restore)
        self.settings = (state.enabled, state.recipe, state.group)
        self.tracker_states = self.tracker.get_states()
        self.outer, state.checkpoint = state.checkpoint, self
        try:
            yield
        finally:
            state.checkpoint = self.outer
            self.recording = False

    @contextlib.contextmanager
    def recompute(self):
        state = autocast.STATE  # (the settings of the thread running the backward: replaced here, then restored)
        saved = (state.enabled, state.calibrating, state.recipe, state.group, state.checkpoint)
        state.enabled, state.recipe, state.group = self.settings
        state.calibrating, state.checkpoint = False, self  # (a recompute records no amaxes)
        state.depth += 1  # (an autocast inside the function does not update anything at its exit)
        tracker_states = self.tracker.get_states()
        self.tracker.set_states(self.tracker_states)
        swapped = [(holder, attribute, getattr(holder, attribute)) for holder, attribute, _, _ in
                   self.records.values()]
        for holder, attribute, scales, calibrated in self.records.values():
            setattr(holder, attribute, _replay_state(getattr(holder, attribute), scales, calibrated))
        try:
            yield
        finally:
            for holder, attribute, original in swapped:
                setattr(holder, attribute, original)
            self.tracker.set_states(tracker_states)
            state.depth -= 1
            state.enabled, state.calibrating, state.recipe, state.group, state.checkpoint = saved


def _replay_state(original, scales, calibrated):
    """A ScalingState like `original` (slots, history length) over the recorded scale and scale_inv (`scales`
    [2, n], the region's own copy; FP8 attention reads its S slot's scale_inv), with scratch amaxes and snapshots,
    never queued for an update."""
    amax_history = torch.zeros(original.history_len, scales.shape[1], dtype=torch.float32, device=scales.device)
    replay = ScalingState.over(amax_history, scales[0], scales[1], calibrated)
    replay.pending = True
    replay.calibration_group = original.calibration_group
    return replay


@torch.compiler.disable  # (dynamo cannot trace a checkpoint with a context_fn: a compiled caller runs it eagerly)
def checkpoint(function, *args, distribute_saved_activations=False, get_rng_state_tracker=None, tp_group=None,
               use_reentrant=True, **kwargs):
    """function(*args, **kwargs) with its activations recomputed in the backward instead of kept (TE's arguments).
    FP8 modules inside recompute in FP8 with the forward's scales (see the module docstring); the random states are
    restored for the recompute (dropout masks repeat): torch's, and the named states of the RNG tracker that
    get_rng_state_tracker() returns (default: rng.get_rng_state_tracker(); any object with get_states() and
    set_states(), e.g. Megatron's). The recomputation is always torch.utils.checkpoint's non-reentrant one, the mode
    PyTorch recommends; use_reentrant is accepted for TE compatibility, as is tp_group (TE uses it only with
    distribute_saved_activations=True, which is not supported). Under torch.compile the region runs eagerly (a graph
    break)."""
    if not callable(function):
        raise TypeError(f"function: expected a callable, got {type(function).__name__}")
    if distribute_saved_activations:
        raise ValueError("distribute_saved_activations: only False is supported (the inputs are kept whole on "
                         "every rank)")
    if get_rng_state_tracker is not None and not callable(get_rng_state_tracker):
        raise TypeError(f"get_rng_state_tracker: expected None or a callable returning an RNG tracker, got "
                        f"{get_rng_state_tracker!r}")
    tracker = (get_rng_state_tracker or rng.get_rng_state_tracker)()
    if not (hasattr(tracker, "get_states") and hasattr(tracker, "set_states")):
        raise TypeError(f"get_rng_state_tracker: its tracker needs get_states() and set_states(), got "
                        f"{type(tracker).__name__}")
    if not isinstance(use_reentrant, bool):
        raise TypeError(f"use_reentrant: expected a bool, got {use_reentrant!r}")
    region = _Region(tracker)
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                             context_fn=lambda: (region.forward(), region.recompute()), **kwargs)
