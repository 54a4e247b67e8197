"""fp8_autocast, fp8_model_init and the FP8 state they set, per thread.

Inside `fp8_autocast` our modules run their GEMMs in FP8. Delayed scaling: each module registers its forward scaling
state once per (outermost) autocast into the thread's queue (STATE.forward_states); at the outermost exit the newest
amaxes are all-reduced (MAX) over `fp8_group` (one collective) and ONE `delayed_scaling_update` launch per recipe
updates every registered state. (An FP8-weight Linear's inference call updates its state inside its own launch
instead, undone if the state is registered later in the same autocast: see quantization/state.py; the exit then only
clears the states' flags.) Gradient states are registered by the modules' backward; the first one queues an
autograd-engine callback that does the same after the backward. The update and the backward queues live in
quantization/update.py (their names are re-exported here). Nothing here synchronises with the device.

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
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .quantization import update
from .quantization.update import (_backward_queues, _plans, distributed_initialized,  # noqa: F401  (re-exported)
                                  forget_update_plans, register_backward, renew_scale_inv_snapshots,
                                  update_scaling_states)
from .recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

if TYPE_CHECKING:
    from .quantization.state import ScalingState

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
        self.saved = []  # the settings the enclosing fp8_autocasts' enters replaced, innermost last
        self.model_init = False
        self.preserve_init_val = False  # (see fp8_model_init)
        self.model_init_options = {}  # Float8Tensor.from_hp's layout arguments for fp8_model_init's weights
        self.forward_states = []  # (ScalingState, recipe, group) used in this thread's current outermost autocast
        self.inline_updated = []  # ScalingStates that inference calls updated inline in it (see ScalingState)
        self.checkpoint = None  # the checkpoint region (checkpoint.py) whose forward or recompute runs in this thread


STATE = _FP8ThreadState()


def is_fp8_enabled() -> bool:
    """Returns:
        Whether the calling thread is inside an fp8_autocast(enabled=True) (the innermost one decides)."""
    return STATE.enabled


def get_fp8_recipe() -> DelayedScaling | Float8CurrentScaling | Float8BlockScaling:
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
        if not isinstance(fp8_recipe, (DelayedScaling, Float8CurrentScaling, Float8BlockScaling)):
            raise TypeError(f"fp8_recipe: expected DelayedScaling, Float8CurrentScaling or Float8BlockScaling, got "
                            f"{fp8_recipe!r}")
        self.settings = (enabled, calibrating, fp8_recipe, fp8_group)

    # The settings each enter replaces go on the calling thread's own stack (STATE.saved), innermost last: one
    # instance (say a decorator) may be entered by several threads at once, and each exit restores its own thread's
    # settings. (A per-thread stack rather than one per instance keyed by thread id: no thread-id lookup and no dict
    # per call: ~0.3 of ~1.6 µs per construct + enter + exit with nothing to update, measured on the CPU-only
    # development machine, where one autocast per call of a small inference layer counts.)
    def __enter__(self):
        state = STATE  # (the calling thread's)
        state.saved.append((state.enabled, state.calibrating, state.recipe, state.group))
        state.enabled, state.calibrating, state.recipe, state.group = self.settings
        state.depth += 1
        return self

    def __exit__(self, *exc):
        state = STATE
        state.enabled, state.calibrating, state.recipe, state.group = state.saved.pop()
        depth = state.depth - 1
        state.depth = depth
        if depth == 0:
            if state.forward_states:
                entries, state.forward_states = state.forward_states, []
                update_scaling_states(entries, forward=True)
            if state.inline_updated:  # (their updates ran in the inference calls' own launches)
                for scaling_state in state.inline_updated:
                    scaling_state.updated_inline = False
                state.inline_updated = []
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
    """Queue a forward state for the update at the calling thread's outermost autocast exit (see
    quantization.update.register_forward, which takes the queue).

    Args:
        scaling_state: the forward ScalingState (marked pending until the update).
        recipe: the DelayedScaling recipe it was cast with.
        group: the process group its amaxes are reduced over (None: the default group).
    """
    update.register_forward(STATE.forward_states, scaling_state, recipe, group)
