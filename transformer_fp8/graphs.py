"""make_graphed_callables: our modules' forward and backward captured in CUDA graphs, with the FP8 scaling updates
inside the graphs (Transformer Engine's name, arguments and semantics).

Per callable, and with fp8_weight_caching per weight-cache variant, two graphs are captured:
  forward:  the callable inside fp8_autocast(fp8_enabled, fp8_recipe, fp8_group); the autocast's exit, where the one
            fused forward delayed-scaling update runs, is inside the capture;
  backward: torch.autograd.grad of the outputs; our modules' end-of-backward callback (the gradient-state update)
            runs inside the capture.
A replay thus casts with the current scales and updates amax histories and scales as an eager step does. Replays
read and write fixed memory: the sample inputs (each call's inputs are copied in), the parameters (an optimizer
updates them in place), the FP8 states (amax_history, scale, scale_inv), the scale_inv snapshots and FP8 weight
caches the captures used (kept alive here), and the graphs' static outputs and gradients. All graphs share one memory
pool; forwards are captured first (in call order), then backwards (reverse call order).

fp8_weight_caching=True captures two forward/backward pairs: the "casting" one runs the callable with
is_first_microbatch=True (casts the weights and fills the FP8 weight cache), the "reusing" one with False (reads the
very cache buffers the casting graph writes, no weight cast). The host picks one per call.
"""
import torch
from torch import nn
from torch.utils import _pytree as pytree

from . import autocast
from .module.base import FP8ModuleBase
from .recipe import DelayedScaling, Float8CurrentScaling


def make_graphed_callables(modules, sample_args, num_warmup_iters=3, allow_unused_input=False, fp8_enabled=False,
                           fp8_recipe=None, fp8_group=None, fp8_weight_caching=False, sample_kwargs=None):
    """Graphed versions of `modules` (an nn.Module or callable, or a tuple of them in the order they run).

    sample_args: a tuple of CUDA tensors (the positional args), or with a tuple of modules a tuple of such tuples;
    their shapes, dtypes and requires_grad must be those of the real inputs. sample_kwargs: None, a dict of keyword
    args (or a tuple of dicts), tensors or constants. The sample tensors become the graphs' static inputs.
    num_warmup_iters (>= 1) eager forward+backward iterations on a side stream come first (they create the FP8 state
    and library handles); afterwards the FP8 states (and the CUDA RNG state) are put back as they were before, so
    graphing does not change the numerics: while a module's delayed-scaling state has never been updated, its calls
    run eagerly (inside the graphs' fp8_autocast), so that its first step calibrates its scales from the real inputs
    as an eager step does (the graphs hold the calibrated path). allow_unused_input: as torch.autograd.grad's
    allow_unused.
    fp8_enabled, fp8_recipe (None: DelayedScaling()), fp8_group: the fp8_autocast the graphs are captured in.
    fp8_weight_caching=True (needs fp8_enabled): the graphed forward takes is_first_microbatch= (True or None: cast
    the weights and cache them; False: reuse the cache, falling back to a cast until the first cast); every callable
    must accept that keyword.

    Returns the modules themselves (their forward replaced) or, for plain callables, graphed functions. A call
    replays the graphs when grad mode is on, a module is in the training mode it was captured in, and the inputs match
    the samples (same structure, tensor shapes, dtypes, devices and requires_grad, equal constants); otherwise it runs
    the original forward (under the caller's own fp8_autocast, if any). Replays need no fp8_autocast around them.
    With fp8_weight_caching, is_first_microbatch=False calls after an eager True call run eagerly too (they read the
    eager cache) until a True call replays.
    As with torch.cuda.make_graphed_callables: outputs are the graphs' static buffers (overwritten by the next replay
    of the same graph) and a forward's backward must run before that callable's next forward. Gradients returned to
    autograd are fresh tensors, so .grad accumulation over calls is correct. After graphing, do not move the modules,
    load state dicts into them or run them under another recipe object: that replaces tensors the graphs hold.
    """
    callables, args_per, kwargs_per = _checked_arguments(
        modules, sample_args, num_warmup_iters, allow_unused_input, fp8_enabled, fp8_recipe, fp8_weight_caching,
        sample_kwargs)
    settings = dict(enabled=fp8_enabled, fp8_recipe=fp8_recipe, fp8_group=fp8_group)  # (fp8_autocast's arguments)
    variants = (True, False) if fp8_weight_caching else (None,)
    captures = {first: [_Capture(func, args, kwargs, first) for func, args, kwargs in
                        zip(callables, args_per, kwargs_per)] for first in variants}
    fp8_modules = _fp8_modules(callables)
    saved_states = _copies_of_fp8_states(fp8_modules)
    rng_state = torch.cuda.get_rng_state()

    _warm_up(captures, settings, num_warmup_iters, allow_unused_input)
    keep_alive = []  # scale_inv snapshots and weight caches the graphs read and write
    pool = torch.cuda.graph_pool_handle()
    for first in variants:
        for capture in captures[first]:
            keep_alive.append(_scale_inv_snapshots(fp8_modules))
            capture.capture_forward(settings, pool)
    for first in variants:
        for capture in reversed(captures[first]):
            keep_alive.append(_scale_inv_snapshots(fp8_modules))
            capture.capture_backward(pool, allow_unused_input)
    for module in fp8_modules:  # the graphs keep their cache buffers; eager calls start from an empty cache
        keep_alive.append(dict(module._weight_cache))
        module._weight_cache.clear()
    torch.cuda.synchronize()
    _restore_fp8_states(fp8_modules, saved_states)
    torch.cuda.set_rng_state(rng_state)

    graphed = []
    for i, func in enumerate(callables):
        replacement = _GraphedForward(func, {first: captures[first][i] for first in variants}, settings, keep_alive)
        if isinstance(func, nn.Module):
            func.forward = replacement
            graphed.append(func)
        else:
            graphed.append(replacement)
    return graphed[0] if not isinstance(modules, tuple) else tuple(graphed)


class _Capture:
    """One callable's forward and backward graphs for one weight-cache variant (is_first_microbatch None, True or
    False) and the static tensors they read and write."""

    def __init__(self, func, args, kwargs, first):
        self.func, self.args, self.kwargs, self.first = func, args, kwargs, first
        leaves, self.in_spec = _flatten_inputs(args, kwargs)
        self.in_keys = [_leaf_key(leaf) for leaf in leaves]
        self.tensor_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self.static_inputs = [leaves[i] for i in self.tensor_positions]
        self.params = tuple(func.parameters()) if isinstance(func, nn.Module) else ()
        self.fwd_graph, self.bwd_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()

    def run(self, settings):
        """The callable on the sample inputs, inside the fp8_autocast of `settings`."""
        kwargs = self.kwargs if self.first is None else dict(self.kwargs, is_first_microbatch=self.first)
        with autocast.fp8_autocast(**settings):
            return self.func(*self.args, **kwargs)

    def grad_inputs(self):
        return [t for t in self.static_inputs + list(self.params) if t.requires_grad]

    def warm_up(self, settings, allow_unused):
        outputs = [o for o in pytree.tree_leaves(self.run(settings)) if isinstance(o, torch.Tensor) and o.requires_grad]
        if outputs:  # zero output gradients: no garbage amaxes, nothing added to main_grad
            torch.autograd.grad(outputs, self.grad_inputs(), [torch.zeros_like(o) for o in outputs],
                                allow_unused=allow_unused)

    def capture_forward(self, settings, pool):
        with torch.cuda.graph(self.fwd_graph, pool=pool):
            outputs = self.run(settings)
        self.static_outputs, self.out_spec = pytree.tree_flatten(outputs)
        self.single_output = self.out_spec.is_leaf()
        for o in self.static_outputs:
            if not isinstance(o, torch.Tensor):
                raise TypeError(f"modules: a graphed callable must return tensors (in tuples, lists or dicts), got "
                                f"a {type(o).__name__} from {self.func!r}")

    def capture_backward(self, pool, allow_unused):
        """The backward graph: gradients of the inputs and parameters that require grad, from the static output
        gradients (None where an output does not require grad)."""
        self.static_grad_outputs = [torch.empty_like(o) if o.requires_grad else None for o in self.static_outputs]
        outputs = [o for o in self.static_outputs if o.requires_grad]
        grads = [g for g in self.static_grad_outputs if g is not None]
        wanted = self.grad_inputs()
        results = iter(())
        if outputs and wanted:
            with torch.cuda.graph(self.bwd_graph, pool=pool):
                results = iter(torch.autograd.grad(outputs, wanted, grads, allow_unused=allow_unused))
        else:
            self.bwd_graph = None
        self.static_grad_inputs = [next(results, None) if t.requires_grad else None
                                   for t in self.static_inputs + list(self.params)]

    def matches(self, leaves, spec):
        return spec == self.in_spec and [_leaf_key(leaf) for leaf in leaves] == self.in_keys


def _flatten_inputs(args, kwargs):
    """(leaves, structure) of a call's inputs. Flat ones (no tuple, list or dict inside) skip pytree: host time."""
    leaves = (*args, *kwargs.values())
    if not any(isinstance(leaf, (tuple, list, dict)) for leaf in leaves):
        return leaves, (len(args), tuple(kwargs))
    return pytree.tree_flatten((args, kwargs))


def _leaf_key(leaf):
    """What a call's input leaf must agree on with the sample's: tensor metadata, or the constant itself."""
    if isinstance(leaf, torch.Tensor):
        return leaf.shape, leaf.dtype, leaf.device, leaf.requires_grad
    return leaf


class _Replay(torch.autograd.Function):
    """Replays a _Capture's forward graph (its backward replays the backward graph). Inputs: the capture, then the
    call's input tensors and the callable's parameters (so that autograd routes their gradients)."""

    @staticmethod
    def forward(ctx, capture, *inputs):
        for static, given in zip(capture.static_inputs, inputs):
            if static.data_ptr() != given.data_ptr():
                static.copy_(given)
        capture.fwd_graph.replay()
        ctx.capture = capture
        outputs = tuple(o.detach() for o in capture.static_outputs)
        ctx.mark_non_differentiable(*(o for o, g in zip(outputs, capture.static_grad_outputs) if g is None))
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        capture = ctx.capture
        for static, grad in zip(capture.static_grad_outputs, grads):
            if static is not None and static.data_ptr() != grad.data_ptr():
                static.copy_(grad)
        capture.bwd_graph.replay()
        return (None, *_fresh_copies(capture.static_grad_inputs))


def _fresh_copies(tensors):
    """New tensors equal to `tensors` (None stays None), in one multi-tensor copy. Returning the static buffers
    themselves would let autograd install one as a .grad that the next replay overwrites (breaking accumulation)."""
    present = [t for t in tensors if t is not None]
    copies = [torch.empty_like(t) for t in present]
    if copies:
        torch._foreach_copy_(copies, present)
    copies = iter(copies)
    return [None if t is None else next(copies) for t in tensors]


class _GraphedForward:
    """A graphed callable's forward: replays the graphs when it can (see make_graphed_callables), else runs the
    original forward."""

    def __init__(self, func, captures, settings, keep_alive):
        self.module = func if isinstance(func, nn.Module) else None
        self.training = self.module.training if self.module is not None else None
        self.original = func.forward if self.module is not None else func
        self.casting = captures.get(True, captures.get(None))
        self.reusing = captures.get(False)  # None without fp8_weight_caching
        self.cache_filled = False  # the casting graph has run: the reusing graph's cache holds FP8 weights
        self.eager_cache = False  # the last cast of the weights ran eagerly: False calls read the module's own cache
        self.settings, self.keep_alive = settings, keep_alive
        self.uncalibrated = _uncalibrated_states(self.module)

    def __call__(self, *args, **kwargs):
        capture, first = self.casting, None
        if self.reusing is not None:
            first = kwargs.pop("is_first_microbatch", None)
            if first is not None and not isinstance(first, bool):
                raise TypeError(f"is_first_microbatch: expected a bool or None, got {first!r}")
            if first is False and self.cache_filled:
                capture = self.reusing
        if torch.is_grad_enabled() and (self.module is None or self.module.training == self.training):
            leaves, spec = _flatten_inputs(args, kwargs)
            if capture.matches(leaves, spec):
                if self._calibrating() or (first is False and self.eager_cache):
                    return self._eager_step(args, kwargs, first)
                self.cache_filled = self.cache_filled or capture is self.casting
                self.eager_cache = self.eager_cache and capture is not self.casting
                outputs = _Replay.apply(capture, *(leaves[i] for i in capture.tensor_positions), *capture.params)
                return outputs[0] if capture.single_output else pytree.tree_unflatten(list(outputs), capture.out_spec)
        if self.reusing is not None:
            kwargs["is_first_microbatch"] = first
        return self.original(*args, **kwargs)

    def _calibrating(self):
        """Some delayed-scaling state of the module has not had its first update yet."""
        if self.uncalibrated:
            self.uncalibrated = [state for state in self.uncalibrated if not state.calibrated]
        return bool(self.uncalibrated)

    def _eager_step(self, args, kwargs, first):
        """The original forward inside the graphs' fp8_autocast (the step an eager model would run)."""
        if self.reusing is not None:
            kwargs["is_first_microbatch"] = first
            self.eager_cache = self.eager_cache or first is True
        with autocast.fp8_autocast(**self.settings):
            return self.original(*args, **kwargs)


def _warm_up(captures, settings, iters, allow_unused):
    """Eager forward+backward iterations on a side stream (lazy initialisation stays out of the captures)."""
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(iters):
            for variant in captures.values():
                for capture in variant:
                    capture.warm_up(settings, allow_unused)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def _fp8_modules(callables):
    found = {}
    for func in callables:
        if isinstance(func, nn.Module):
            found.update((id(m), m) for m in func.modules() if isinstance(m, FP8ModuleBase))
    return list(found.values())


def _states(module):
    return [(name, getattr(module, name)) for name in ("fp8_fwd", "fp8_bwd") if getattr(module, name) is not None]


def _scale_inv_snapshots(fp8_modules):
    return [state.scale_invs for m in fp8_modules for _, state in _states(m)]


def _copies_of_fp8_states(fp8_modules):
    """{(id(module), name): (state, [amax_history, scale, scale_inv] copies, calibrated)} of the states that exist
    now."""
    return {(id(m), name): (state, [t.clone() for t in (state.amax_history, state.scale, state.scale_inv)],
                            state.calibrated)
            for m in fp8_modules for name, state in _states(m)}


def _restore_fp8_states(fp8_modules, saved):
    """Put the FP8 states back as they were before the warm-up, in place (the graphs hold these tensors); states
    created since then start fresh (zero history, unit scales, not calibrated)."""
    for m in fp8_modules:
        for name, state in _states(m):
            before = saved.get((id(m), name))
            if before is not None and before[0] is state:
                for tensor, value in zip((state.amax_history, state.scale, state.scale_inv), before[1]):
                    tensor.copy_(value)
                state.calibrated = before[2]
            else:
                state.amax_history.zero_()
                state.scale.fill_(1.0)
                state.scale_inv.fill_(1.0)
                state.calibrated = False


def _uncalibrated_states(module):
    """The delayed-scaling states of `module`'s FP8 modules that have not had their first update."""
    if module is None:
        return []
    return [state for m in module.modules() if isinstance(m, FP8ModuleBase) and m.quantizers is not None
            for state in m.quantizers.uncalibrated_states()]


def _checked_arguments(modules, sample_args, num_warmup_iters, allow_unused_input, fp8_enabled, fp8_recipe,
                       fp8_weight_caching, sample_kwargs):
    """(callables, args per callable, kwargs per callable); a TypeError/ValueError naming the argument otherwise.
    Touches no CUDA state."""
    for name, value in (("allow_unused_input", allow_unused_input), ("fp8_enabled", fp8_enabled),
                        ("fp8_weight_caching", fp8_weight_caching)):
        if not isinstance(value, bool):
            raise TypeError(f"{name}: expected a bool, got {value!r}")
    if isinstance(num_warmup_iters, bool) or not isinstance(num_warmup_iters, int) or num_warmup_iters < 1:
        raise ValueError(f"num_warmup_iters: expected an int >= 1 (the warm-up creates the FP8 state the graphs "
                         f"use), got {num_warmup_iters!r}")
    if fp8_recipe is not None and not isinstance(fp8_recipe, (DelayedScaling, Float8CurrentScaling)):
        raise TypeError(f"fp8_recipe: expected None, DelayedScaling or Float8CurrentScaling, got {fp8_recipe!r}")
    if fp8_weight_caching and not fp8_enabled:
        raise ValueError("fp8_weight_caching: needs fp8_enabled=True")
    if autocast.STATE.depth:
        raise RuntimeError("make_graphed_callables: call it outside fp8_autocast (the graphs capture their own; "
                           "replays need none)")

    single = not isinstance(modules, tuple)
    callables = (modules,) if single else modules
    if not callables:
        raise ValueError("modules: expected a module or callable, or a non-empty tuple of them, got ()")
    for func in callables:
        _check_callable(func)

    if not isinstance(sample_args, tuple):
        raise TypeError(f"sample_args: expected a tuple, got {type(sample_args).__name__}")
    args_per = (sample_args,) if single else sample_args
    if not single and (len(sample_args) != len(callables) or not all(isinstance(a, tuple) for a in sample_args)):
        raise ValueError(f"sample_args: expected a tuple of {len(callables)} tuples (one per module), got "
                         f"{tuple(type(a).__name__ for a in sample_args)}")
    kwargs_per = _checked_sample_kwargs(sample_kwargs, single, len(callables), fp8_weight_caching)

    for args, kwargs in zip(args_per, kwargs_per):
        leaves = pytree.tree_leaves(args)
        if not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
            raise TypeError(f"sample_args: expected tensors only, got "
                            f"{[type(leaf).__name__ for leaf in leaves if not isinstance(leaf, torch.Tensor)]}")
        for name, tensors in (("sample_args", leaves), ("sample_kwargs", pytree.tree_leaves(kwargs))):
            for t in tensors:
                if isinstance(t, torch.Tensor) and not t.is_cuda:
                    raise ValueError(f"{name}: expected CUDA tensors, got one on {t.device}")
    if torch.is_autocast_enabled() and torch.is_autocast_cache_enabled():
        raise RuntimeError("make_graphed_callables: torch.autocast's weight cache breaks graphs; use "
                           "cache_enabled=False")
    return callables, args_per, kwargs_per


def _check_callable(func):
    if not callable(func):
        raise TypeError(f"modules: expected nn.Modules or callables, got a {type(func).__name__}")
    if not isinstance(func, nn.Module):
        return
    if func._forward_hooks or func._forward_pre_hooks or func._backward_hooks:
        raise ValueError(f"modules: {type(func).__name__} has hooks; register them after make_graphed_callables")
    if any(b.requires_grad for b in func.buffers()):
        raise ValueError(f"modules: {type(func).__name__} has a buffer that requires grad (only parameters may)")


def _checked_sample_kwargs(sample_kwargs, single, count, fp8_weight_caching):
    if sample_kwargs is None:
        kwargs_per = ({},) * count
    elif single:
        kwargs_per = (sample_kwargs,)
    elif not isinstance(sample_kwargs, tuple) or len(sample_kwargs) != count:
        raise TypeError(f"sample_kwargs: expected None or a tuple of {count} dicts (one per module), got "
                        f"{sample_kwargs!r}")
    else:
        kwargs_per = tuple({} if kw is None else kw for kw in sample_kwargs)
    for kwargs in kwargs_per:
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise TypeError(f"sample_kwargs: expected dicts with str keys, got {kwargs!r}")
        if fp8_weight_caching and "is_first_microbatch" in kwargs:
            raise ValueError("sample_kwargs: is_first_microbatch is chosen per call with fp8_weight_caching=True; "
                             "leave it out")
    return kwargs_per
