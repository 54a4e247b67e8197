"""fp8_autocast, fp8_model_init and the global FP8 state.

Inside `fp8_autocast` our modules run their GEMMs in FP8. Delayed scaling: each module registers its forward scaling
state once per (outermost) autocast; at the outermost exit the newest amaxes are all-reduced (MAX) over `fp8_group`
(one collective) and ONE `delayed_scaling_update` launch per recipe updates every registered state. Gradient states
are registered by the modules' backward; the first one queues an autograd-engine callback that does the same after the
backward. Nothing here synchronises with the device.
"""
import contextlib

import torch

from .ops import tfp8
from .recipe import FP8_MAX, DelayedScaling, Float8CurrentScaling

DEFAULT_RECIPE = DelayedScaling()


class _FP8GlobalState:
    """What the modules read on every call (plain attributes: cheap)."""

    def __init__(self):
        self.enabled = False
        self.recipe = DEFAULT_RECIPE
        self.group = None
        self.depth = 0
        self.model_init = False
        self.forward_states = []  # (ScalingState, recipe, group) used in the current outermost autocast
        self.backward_states = []  # the same for gradients, in the running backward
        self.backward_task = None  # id of the backward whose callback is queued


STATE = _FP8GlobalState()


def is_fp8_enabled():
    return STATE.enabled


def get_fp8_recipe():
    return STATE.recipe


class fp8_autocast(contextlib.ContextDecorator):
    """Run our modules in FP8 inside this context (TE's name and arguments). Nests: the innermost settings apply
    inside it and the outer ones are restored on exit. fp8_recipe=None means DelayedScaling()."""

    def __init__(self, enabled=True, fp8_recipe=None, fp8_group=None):
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled: expected a bool, got {enabled!r}")
        if fp8_recipe is None:
            fp8_recipe = DEFAULT_RECIPE
        if not isinstance(fp8_recipe, (DelayedScaling, Float8CurrentScaling)):
            raise TypeError(f"fp8_recipe: expected DelayedScaling or Float8CurrentScaling, got {fp8_recipe!r}")
        self.settings = (enabled, fp8_recipe, fp8_group)
        self.saved = []

    def __enter__(self):
        self.saved.append((STATE.enabled, STATE.recipe, STATE.group))
        STATE.enabled, STATE.recipe, STATE.group = self.settings
        STATE.depth += 1
        return self

    def __exit__(self, *exc):
        STATE.enabled, STATE.recipe, STATE.group = self.saved.pop()
        STATE.depth -= 1
        if STATE.depth == 0 and STATE.forward_states:
            entries, STATE.forward_states = STATE.forward_states, []
            update_scaling_states(entries, forward=True)
        return False


@contextlib.contextmanager
def fp8_model_init(enabled=True):
    """Weights of our modules created inside are Float8Tensor parameters (E4M3 data + scale_inv); biases and norm
    weights stay in high precision."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected a bool, got {enabled!r}")
    saved, STATE.model_init = STATE.model_init, enabled
    try:
        yield
    finally:
        STATE.model_init = saved


def register_forward(scaling_state, recipe, group):
    """Queue a module's forward state for the update at the outermost autocast exit (once per autocast)."""
    scaling_state.pending = True
    STATE.forward_states.append((scaling_state, recipe, group))


def register_backward(scaling_state, recipe, group):
    """Queue a module's gradient state for the update at the end of the running backward (call from backward)."""
    task = torch._C._current_graph_task_id()
    if task != STATE.backward_task:  # the first of our modules in this backward (a failed one left no callback)
        for stale, _, _ in STATE.backward_states:
            stale.pending = False
        STATE.backward_states, STATE.backward_task = [], task
        torch.autograd.Variable._execution_engine.queue_callback(_finish_backward)
    if not scaling_state.pending:
        scaling_state.pending = True
        STATE.backward_states.append((scaling_state, recipe, group))


def _finish_backward():
    entries, STATE.backward_states, STATE.backward_task = STATE.backward_states, [], None
    update_scaling_states(entries, forward=False)


def update_scaling_states(entries, forward):
    """Reduce the newest amaxes over each group (if the recipe asks) and run one fused update per recipe and device.
    Entries are grouped by recipe and group identity (one object per fp8_autocast in the usual loop)."""
    per_group, per_recipe = {}, {}
    for scaling_state, recipe, group in entries:
        scaling_state.pending = False
        if recipe.reduce_amax:
            per_group.setdefault(id(group), (group, []))[1].append(scaling_state)
        per_recipe.setdefault((id(recipe), scaling_state.device), (recipe, []))[1].append(scaling_state)
    for group, states in per_group.values():
        _all_reduce_amax(states, group)
    for recipe, states in per_recipe.values():
        fp8_dtype = recipe.fp8_format.fwd_dtype if forward else recipe.fp8_format.bwd_dtype
        tfp8.delayed_scaling_update([s.amax_history for s in states], [s.scale for s in states],
                                    [s.scale_inv for s in states], FP8_MAX[fp8_dtype], float(recipe.margin),
                                    recipe.amax_compute_algo)


def _all_reduce_amax(states, group):
    """MAX all-reduce of the row-0 amaxes of `states` over `group` (None: the default group), in one collective."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) <= 1:
        return
    rows = [s.amax_history[0] for s in states]
    flat = torch.cat(rows)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    torch._foreach_copy_(rows, list(flat.split([r.numel() for r in rows])))
