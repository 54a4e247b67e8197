"""fp8_autocast, fp8_model_init and the FP8 state they set, per thread.

Inside `fp8_autocast` our modules run their GEMMs in FP8. Delayed scaling: each module registers its forward scaling
state once per (outermost) autocast; at the outermost exit the newest amaxes are all-reduced (MAX) over `fp8_group`
(one collective) and ONE `delayed_scaling_update` launch per recipe updates every registered state. Gradient states
are registered by the modules' backward; the first one queues an autograd-engine callback that does the same after the
backward. Nothing here synchronises with the device.

Threads (as torch.autocast): the settings (enabled, calibrating, recipe, group, nesting depth, fp8_model_init's) are
the calling thread's own; a new thread starts outside fp8_autocast. What a backward needs (recipe, group) is taken
from the graph: the forward saves it in its autograd ctx or C++ node, so a backward on autograd's device threads, or
called from another thread, updates with its forward's recipe and never reads these settings.
Update queues, the rule: a thread's outermost fp8_autocast exit updates exactly the forward states that its own
thread registered inside it; a backward's end updates exactly the gradient states that this backward (its autograd
graph task) registered. Neither ever updates or drops another thread's or another backward's queue, so concurrent
steps on different modules in different threads are independent. A module's scaling state itself is not
thread-safe: one module run by two threads' steps at the same time shares its amaxes and scales between them (its
state is queued, and updated, by whichever step registered it first).
"""
import contextlib
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .ops import tfp8
from .recipe import FP8_MAX, DelayedScaling, Float8CurrentScaling

if TYPE_CHECKING:
    from .module.base import ScalingState

DEFAULT_RECIPE = DelayedScaling()


class _FP8ThreadState(threading.local):
    """What the modules read on every call, the calling thread's own (as torch.autocast's state); __init__ runs once
    in each thread, at its first access.
    Why a threading.local and not a contextvars.ContextVar: per thread is torch.autocast's rule, which users expect;
    the state is mutable (depth, the forward queue), and a mutable object held by a ContextVar is shared by every
    context copied from it (asyncio tasks, threads started with an inherited context), which would share the queue;
    and the ~25 read sites keep reading plain attributes (`autocast.STATE.enabled`). Cost (CPython 3.11, timeit,
    busy 2-core host): an attribute read is ~40 ns against ~20 ns on the former plain object; ContextVar.get() plus
    the read measures ~25-30 ns, but only with every site rewritten to call it."""

    def __init__(self):
        self.enabled = False
        self.calibrating = False  # (see fp8_autocast)
        self.recipe = DEFAULT_RECIPE
        self.group = None
        self.depth = 0
        self.model_init = False
        self.preserve_init_val = False  # (see fp8_model_init)
        self.model_init_options = {}  # Float8Tensor.from_hp's layout arguments for fp8_model_init's weights
        self.forward_states = []  # (ScalingState, recipe, group) used in this thread's current outermost autocast
        self.checkpoint = None  # the checkpoint region (checkpoint.py) whose forward or recompute runs in this thread


STATE = _FP8ThreadState()


def is_fp8_enabled() -> bool:
    """Returns:
        Whether the calling thread is inside an fp8_autocast(enabled=True) (the innermost one decides)."""
    return STATE.enabled


def get_fp8_recipe() -> DelayedScaling | Float8CurrentScaling:
    """Returns:
        The recipe of the calling thread's innermost fp8_autocast (DEFAULT_RECIPE outside any)."""
    return STATE.recipe


class fp8_autocast(contextlib.ContextDecorator):
    """Run our modules in FP8 inside this context (TE's name and arguments). Nests: the innermost settings apply
    inside it and the outer ones are restored on exit. fp8_recipe=None means DelayedScaling().
    calibrating=True: a module that runs its high-precision path here (enabled=False, or the small-shape path)
    records the amaxes of the forward tensors its FP8 path would cast (GEMM inputs and weights) into its
    delayed-scaling state, which the exit updates as after an FP8 forward: scales for FP8 (e.g. inference) from a
    high-precision run. The outputs stay those of the high-precision path. (Not for current scaling, which keeps
    no scales, nor for FP8 attention's slots.)"""

    def __init__(self, enabled=True, calibrating=False, fp8_recipe=None, fp8_group=None):
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled: expected a bool, got {enabled!r}")
        if not isinstance(calibrating, bool):
            raise TypeError(f"calibrating: expected a bool, got {calibrating!r}")
        if fp8_recipe is None:
            fp8_recipe = DEFAULT_RECIPE
        if not isinstance(fp8_recipe, (DelayedScaling, Float8CurrentScaling)):
            raise TypeError(f"fp8_recipe: expected DelayedScaling or Float8CurrentScaling, got {fp8_recipe!r}")
        self.settings = (enabled, calibrating, fp8_recipe, fp8_group)
        # thread id -> the settings each enter replaced, innermost last: one instance (say a decorator) may be
        # entered by several threads at once, and each exit must restore its own thread's settings
        self.saved = {}

    def __enter__(self):
        state = STATE  # (the calling thread's)
        self.saved.setdefault(threading.get_ident(), []).append(
            (state.enabled, state.calibrating, state.recipe, state.group))
        state.enabled, state.calibrating, state.recipe, state.group = self.settings
        state.depth += 1
        return self

    def __exit__(self, *exc):
        state, thread = STATE, threading.get_ident()
        stack = self.saved[thread]
        state.enabled, state.calibrating, state.recipe, state.group = stack.pop()
        if not stack:
            del self.saved[thread]
        state.depth -= 1
        if state.depth == 0 and state.forward_states:
            entries, state.forward_states = state.forward_states, []
            update_scaling_states(entries, forward=True)
        return False


@contextlib.contextmanager
def fp8_model_init(enabled: bool = True, recipe: Any = None,
                   preserve_high_precision_init_val: bool = False) -> Iterator[None]:
    """Weights of our modules created inside are Float8Tensor parameters: E4M3 data + one scale_inv from the
    weight's own amax (recipe None, DelayedScaling or Float8CurrentScaling), or with recipe=Float8BlockScaling() one
    scale_inv per 128x128 block (layout "block_128x128", the block GEMM's weight operand); biases and norm weights
    stay in high precision. preserve_high_precision_init_val=True keeps each weight's high-precision initial values
    on the CPU, for `param.get_high_precision_init_val()` (e.g. to start FP32 master weights from them) until
    `param.clear_high_precision_init_val()`.

    Args:
        enabled: whether weights created inside are Float8Tensor parameters.
        recipe: TE's argument: the recipe the model will run with; it decides the weights' scaling layout (None:
            per tensor).
        preserve_high_precision_init_val: keep each weight's high-precision initial values on the CPU.

    Returns:
        A context manager (the settings are the calling thread's, restored on exit).
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected a bool, got {enabled!r}")
    options = _model_init_options(recipe)
    if not isinstance(preserve_high_precision_init_val, bool):
        raise TypeError(f"preserve_high_precision_init_val: expected a bool, got {preserve_high_precision_init_val!r}")
    state = STATE  # (the calling thread's: fp8_model_init is per thread too)
    saved = state.model_init, state.preserve_init_val, state.model_init_options
    state.model_init, state.preserve_init_val = enabled, enabled and preserve_high_precision_init_val
    state.model_init_options = options
    try:
        yield
    finally:
        state.model_init, state.preserve_init_val, state.model_init_options = saved


def _model_init_options(recipe: Any) -> dict[str, Any]:
    """Float8Tensor.from_hp's layout arguments for fp8_model_init's weights under `recipe`: {} (one scale per
    tensor) or 128x128 blocks with the recipe's weight QParams (the bytes its block quantizer casts the weight to)."""
    from .recipe import Float8BlockScaling  # (here: keeps this module's imports as the quantization refactor has them)
    if isinstance(recipe, Float8BlockScaling):
        if recipe.w_block_scaling_dim != 2:
            raise NotImplementedError(f"recipe: fp8_model_init makes 128x128-block weights (w_block_scaling_dim=2) "
                                      f"only, got w_block_scaling_dim={recipe.w_block_scaling_dim!r}")
        qparams = recipe.fp8_quant_fwd_weight
        return {"layout": "block_128x128", "power_2_scale": qparams.power_2_scale,
                "amax_epsilon": qparams.amax_epsilon}
    if recipe is not None and not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        raise TypeError(f"recipe: expected None, DelayedScaling, Float8CurrentScaling or Float8BlockScaling, got "
                        f"{recipe!r}")
    return {}


def register_forward(scaling_state: "ScalingState", recipe: DelayedScaling, group: Any) -> None:
    """Queue a module's forward state for the update at the calling thread's outermost autocast exit (once per
    autocast).

    Args:
        scaling_state: the module's forward ScalingState (marked pending until the update).
        recipe: the DelayedScaling recipe it was cast with.
        group: the process group its amaxes are reduced over (None: the default group).
    """
    scaling_state.pending = True
    STATE.forward_states.append((scaling_state, recipe, group))


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
            self.updates.append((states, (FP8_MAX[fp8_dtype], float(recipe.margin), recipe.amax_compute_algo)))
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
    for states, args in plan.updates:
        tfp8.delayed_scaling_update([s.amax_history for s in states], [s.scale for s in states],
                                    [s.scale_inv for s in states], *args)
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
