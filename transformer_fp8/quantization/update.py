"""The fused delayed-scaling update and its queues (moved here from autocast.py, which re-exports the names).

Delayed scaling: each module registers its forward scaling state once per (outermost) fp8_autocast into the calling
thread's forward queue; at the outermost exit the newest amaxes are all-reduced (MAX) over `fp8_group` (one
collective) and ONE `delayed_scaling_update` launch per recipe and device updates every registered state. Gradient
states are registered by the modules' backward, into the queue of the running backward (autograd graph task); the
first registration queues an autograd-engine callback that does the same after the backward. Nothing here
synchronises with the device. (The queue rules across threads: see autocast.py.)

In a single process (no amax reduction to run) both updates go through C++ (csrc/delayed_update_queue.cpp,
NATIVE_UPDATES): the forward one in one call, the gradient queue kept there so that a backward of C++ Linear nodes ends
without Python. The same launches with the same tensors: the results are bit for bit those of the Python path below.
"""
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from .. import _C
from ..ops import tfp8
from ..recipe import FP8_MAX, DelayedScaling

if TYPE_CHECKING:
    from .state import ScalingState

# Whether single-process updates go through csrc/delayed_update_queue.cpp (False: always the Python path; for tests
# and A/Bs).
NATIVE_UPDATES = True


def native_update_args(recipe: DelayedScaling, forward: bool) -> tuple[float, float, bool]:
    """The C++ update's arguments under `recipe`.

    Args:
        recipe: the DelayedScaling recipe.
        forward: the forward states' FP8 format (else the gradients').
    Returns:
        (fp8_max, margin, use_max), use_max: amax_compute_algo == "max".
    """
    dtype = recipe.fp8_format.fwd_dtype if forward else recipe.fp8_format.bwd_dtype
    return FP8_MAX[dtype], float(recipe.margin), recipe.amax_compute_algo == "max"


def native_updates_apply() -> bool:
    """Returns:
        Whether the updates go through C++ now: NATIVE_UPDATES, no process group to reduce amaxes over
        (torch.distributed not initialized), not inside torch.compile's tracing."""
    return NATIVE_UPDATES and not distributed_initialized() and not torch.compiler.is_compiling()


def register_forward(queue: list, scaling_state: "ScalingState", recipe: DelayedScaling, group: Any) -> None:
    """Queue a module's forward state for the update at the calling thread's outermost autocast exit (once per
    autocast).

    Args:
        queue: the calling thread's forward queue (autocast.STATE.forward_states).
        scaling_state: the module's forward ScalingState (marked pending until the update).
        recipe: the DelayedScaling recipe it was cast with.
        group: the process group its amaxes are reduced over (None: the default group).
    """
    if scaling_state.updated_inline:  # (an inference call in this autocast updated it already: see ScalingState)
        scaling_state.undo_inline_update()
    scaling_state.pending = True
    queue.append((scaling_state, recipe, group))


class _BackwardQueue(list):
    """The (state, recipe, group) entries that one backward (autograd graph task) registered, and their ids. Only
    its end-of-backward callback holds it: when the graph task ends, normally or by an error (the callback then
    never runs), the queue goes with it, and so does its entry in _backward_queues."""

    __slots__ = ("ids", "__weakref__")

    def __init__(self):
        super().__init__()
        self.ids = set()


# graph task id -> weak reference to its _BackwardQueue. Keyed by graph task, not by thread: a backward's nodes run
# on the thread that called it (CPU) or on autograd's device threads, which serve every thread's backwards; task ids
# are unique in the process. Weak: a failed backward's queue disappears with its graph task (the reference's callback
# removes the key). (A dict of weak references, not a WeakValueDictionary: its get() is Python code, ~4x slower.)
_backward_queues = {}
_backward_queues_lock = threading.Lock()  # (the first registration of a task: at most one queue and one callback)


def register_backward(scaling_state: "ScalingState", recipe: DelayedScaling, group: Any) -> None:
    """Queue a module's gradient state for the update at the end of the running backward (call from a backward).
    Once per state and backward; nested backwards (torch.autograd.grad inside a backward) keep their own queues.

    Args:
        scaling_state: the module's gradient ScalingState, after the backward's casts into it.
        recipe, group: those its forward saved (ctx or the C++ node), never the calling thread's settings: the
            backward may run on autograd's device thread or be called from another thread.
    """
    if native_updates_apply():
        _C.queue_backward_update(scaling_state.amax_history, scaling_state.scale, scaling_state.scale_inv,
                                 *native_update_args(recipe, forward=False),
                                 None if scaling_state.calibrated else scaling_state)
        return
    task = torch._C._current_graph_task_id()
    ref = _backward_queues.get(task)
    queue = ref() if ref is not None else None
    if queue is None:
        queue = _new_backward_queue(task)
    if id(scaling_state) not in queue.ids:
        queue.ids.add(id(scaling_state))
        queue.append((scaling_state, recipe, group))


def _new_backward_queue(task):
    """The queue of graph task `task`, made (with its end-of-backward callback) unless another thread just did."""
    with _backward_queues_lock:
        ref = _backward_queues.get(task)
        queue = ref() if ref is not None else None
        if queue is None:
            queue = _BackwardQueue()
            _backward_queues[task] = weakref.ref(queue, lambda _, task=task: _backward_queues.pop(task, None))
            torch.autograd.Variable._execution_engine.queue_callback(lambda: _finish_backward(queue))
    return queue


def _finish_backward(queue):
    entries = list(queue)
    queue.clear()
    queue.ids.clear()
    if entries:
        update_scaling_states(entries, forward=False)


class _UpdatePlan:
    """How one list of registered (state, recipe, group) entries is updated: the states grouped for the amax
    reduction (per group) and for the fused update (per recipe and device). Built once and reused while a step
    registers the same entries (the usual training loop), so an exit does no grouping work."""

    def __init__(self, entries, forward):
        self.key = entries
        per_group, per_recipe = {}, {}
        for scaling_state, recipe, group in entries:
            if recipe.reduce_amax:
                per_group.setdefault(id(group), (group, []))[1].append(scaling_state)
            per_recipe.setdefault((id(recipe), scaling_state.device), (recipe, []))[1].append(scaling_state)
        self.reductions = list(per_group.values())
        self.updates = []
        for recipe, states in per_recipe.values():
            fp8_dtype = recipe.fp8_format.fwd_dtype if forward else recipe.fp8_format.bwd_dtype
            tensors = ([s.amax_history for s in states], [s.scale for s in states], [s.scale_inv for s in states])
            self.updates.append((states, (FP8_MAX[fp8_dtype], float(recipe.margin), recipe.amax_compute_algo),
                                 tensors, native_update_args(recipe, forward),
                                 [len(s.scale_inv_slots) for s in states]))
        self.states = [entry[0] for entry in entries]


# The last plan of forward and of backward updates. Shared by all threads: threads updating different entries in turn
# rebuild it (correct, a little host time); each update uses the plan it read or built.
_plans = {True: None, False: None}


_DISTRIBUTED_BUILT = torch.distributed.is_available()  # (a property of the torch build: asked once)


def distributed_initialized() -> bool:
    """Returns:
        Whether torch.distributed is built and its default process group initialized."""
    return _DISTRIBUTED_BUILT and torch.distributed.is_initialized()


def forget_update_plans() -> None:
    """Drop the cached forward and backward update plans (the next update builds new ones)."""
    _plans[True] = _plans[False] = None


def update_scaling_states(entries: list[tuple["ScalingState", DelayedScaling, Any]], forward: bool) -> None:
    """Reduce the newest amaxes over each group (if the recipe asks) and run one fused update per recipe and device.
    A forward update also gives the states new scale_inv snapshots (see renew_scale_inv_snapshots).

    Args:
        entries: the registered (scaling_state, recipe, group) triples to update.
        forward: True for forward states (renews their scale_inv snapshots), False for gradient states.
    """
    plan = _plans[forward]
    if plan is None or plan.key != entries:
        plan = _plans[forward] = _UpdatePlan(entries, forward)
    for state in plan.states:
        state.pending, state.calibrated = False, True
    if plan.reductions and distributed_initialized():
        for group, states in plan.reductions:
            _all_reduce_amax(states, group)
    native = forward and native_updates_apply()
    for states, args, tensors, native_args, counts in plan.updates:
        if native:  # (the launch and the new snapshots in one call)
            views = _C.forward_scaling_update(*tensors, *native_args, sum(counts))
            start = 0
            for state, n in zip(states, counts):
                state.scale_invs, start = tuple(views[start:start + n]), start + n
            continue
        tfp8.delayed_scaling_update(*tensors, *args)
        if forward:
            renew_scale_inv_snapshots(states)


def renew_scale_inv_snapshots(states: Sequence["ScalingState"]) -> None:
    """Give every slot of `states` (ScalingStates on one device) a new scale_inv snapshot: a one-element view, 16 bytes
    from the next (cuBLASLt's scale pointers need that alignment), of one new buffer. The casts write 1/scale into
    it; FP8 tensors saved or cached with an older snapshot keep the scale they were cast with. Two host calls for all
    states, no launch.

    Args:
        states: the ScalingStates (all on one device) whose slots get new snapshots.
    """
    counts = [len(s.scale_inv_slots) for s in states]
    total = sum(counts)
    views = torch.empty_strided((total,), (4,), dtype=torch.float32, device=states[0].device).split_with_sizes(
        [1] * total)  # (Tensor.split is a Python wrapper: twice the host time)
    start = 0
    for state, n in zip(states, counts):
        state.scale_invs, start = views[start:start + n], start + n


def _all_reduce_amax(states, group):
    """MAX all-reduce of the row-0 amaxes of `states` over `group` (None: the default group), in one collective."""
    dist = torch.distributed
    if dist.get_world_size(group) <= 1:
        return
    rows = [s.amax_history[0] for s in states]
    flat = torch.cat(rows)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    torch._foreach_copy_(rows, list(flat.split([r.numel() for r in rows])))
