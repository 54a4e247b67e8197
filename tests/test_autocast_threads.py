"""fp8_autocast's settings are per thread (as torch.autocast's): a thread outside fp8_autocast runs high precision
while another thread is inside one; nesting, recipes and the forward scaling update are each thread's own; a backward
(on autograd's thread, or called from another thread than the forward) takes the forward's recipe from the graph and
updates only the gradient states it registered; a checkpointed region recomputes with its forward's settings on
whichever thread runs the backward."""
import threading

import pytest
import torch

import transformer_fp8 as te
from transformer_fp8 import _C, autocast, recipe

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
TIMEOUT = 60  # seconds a barrier waits before the test fails (a thread died or deadlocked)


def run_threads(*targets):
    """Run each target in its own thread; re-raise the first exception a thread raised (the barriers' timeout makes
    a thread that waits for a dead one fail instead of hanging)."""
    errors = []

    def guarded(target):
        try:
            target()
        except BaseException as err:  # (reported below, in the test's thread)
            errors.append(err)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT * 4)
        assert not t.is_alive(), "a test thread hung"
    if errors:
        raise errors[0]


def high_precision_reference(module, x):
    """The module's output outside fp8_autocast (its high-precision path), computed before any thread starts."""
    with torch.no_grad():
        return module(x)


def make(name, device, dtype):
    if name == "Linear":
        return te.Linear(32, 48, params_dtype=dtype, device=device)
    if name == "LayerNormLinear":
        return te.LayerNormLinear(32, 48, params_dtype=dtype, device=device)
    return te.LayerNormMLP(32, 64, params_dtype=dtype, device=device)


def interleaved_leak_check(device, name, steps):
    """Thread A runs `steps` forwards inside fp8_autocast; between its enter and its exit (held there by a barrier)
    thread B calls another module outside any fp8_autocast. B's outputs must equal the high-precision reference
    bit for bit, every call, and B must see FP8 disabled."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    inside, outside = make(name, device, dtype), make(name, device, dtype)
    x_a = torch.randn(16, 32, device=device, dtype=dtype)
    x_b = torch.randn(16, 32, device=device, dtype=dtype)
    reference = high_precision_reference(outside, x_b)
    with te.fp8_autocast():  # (A's output must differ from it, or the check could not see a leak)
        fp8_out = outside(x_b)
    assert not torch.equal(fp8_out, reference)
    barrier = threading.Barrier(2, timeout=TIMEOUT)
    seen = []  # B's (is_fp8_enabled, output equals the reference), per call

    def thread_a():
        for _ in range(steps):
            with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=4)):
                barrier.wait()  # 1: A is inside its fp8_autocast
                inside(x_a)
                barrier.wait()  # 2: B's call is done; A exits (and updates its states)

    def thread_b():
        for _ in range(steps):
            barrier.wait()
            with torch.no_grad():
                out = outside(x_b)
            seen.append((te.is_fp8_enabled(), torch.equal(out, reference)))
            barrier.wait()

    run_threads(thread_a, thread_b)
    leaks = sum(1 for enabled, equal in seen if enabled or not equal)
    assert len(seen) == steps and leaks == 0, f"{leaks} of {steps} calls outside fp8_autocast leaked into FP8"


@pytest.mark.parametrize("name", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_a_thread_outside_fp8_autocast_runs_high_precision_while_another_is_inside(name):
    interleaved_leak_check("cpu", name, steps=20)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_a_thread_outside_fp8_autocast_runs_high_precision_while_another_is_inside_gpu(name):
    interleaved_leak_check("cuda", name, steps=200)


@pytest.mark.parametrize("device", DEVICES)
def test_free_running_threads_never_leak(device):
    """The issue's experiment: A loops inside fp8_autocast as fast as it can while B calls another Linear outside
    it; every one of B's outputs equals the high-precision reference."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    calls = 3000 if device == "cuda" else 600
    inside, outside = (te.Linear(32, 48, params_dtype=dtype, device=device) for _ in range(2))
    x_a, x_b = (torch.randn(8, 32, device=device, dtype=dtype) for _ in range(2))
    reference = high_precision_reference(outside, x_b)
    started, done, leaks = threading.Event(), threading.Event(), [0]

    def thread_a():
        while not done.is_set():
            with te.fp8_autocast():
                started.set()
                inside(x_a)

    def thread_b():
        assert started.wait(TIMEOUT)
        try:
            for _ in range(calls):
                with torch.no_grad():
                    leaks[0] += not torch.equal(outside(x_b), reference)
        finally:
            done.set()

    run_threads(thread_a, thread_b)
    assert leaks[0] == 0, f"{leaks[0]} of {calls} outputs outside fp8_autocast came out in FP8"


def test_nesting_recipes_and_the_forward_update_are_each_threads_own():
    """Two threads nest fp8_autocast with different recipes, interleaved step by step: each sees only its own
    settings at every level, and each outermost exit updates only the forward states its own thread registered
    (the other thread's stay queued, not updated, until that thread's own exit)."""
    r_a = recipe.DelayedScaling(amax_history_len=3, margin=1)
    r_b = recipe.DelayedScaling(fp8_format=recipe.Format.E4M3, amax_history_len=5)
    m_a, m_b = te.Linear(32, 16, device="cpu"), te.Linear(32, 16, device="cpu")
    x = torch.randn(8, 32)
    barrier = threading.Barrier(2, timeout=TIMEOUT)
    observed = {"a": [], "b": []}

    def look(key):
        observed[key].append((te.is_fp8_enabled(), te.get_fp8_recipe(), autocast.STATE.depth))

    def thread_a():
        look("a")
        barrier.wait()  # 1
        with te.fp8_autocast(fp8_recipe=r_a):
            look("a")
            m_a(x)
            barrier.wait()  # 2: both are inside their outer autocast
            with te.fp8_autocast(enabled=False):
                look("a")
                barrier.wait()  # 3: A in its inner (disabled), B in its inner (other recipe)
                barrier.wait()  # 4
            look("a")
        look("a")  # A has exited; B is still inside (until 6)
        assert m_a.fp8_fwd.calibrated and not m_a.fp8_fwd.pending  # A's exit updated A's state...
        assert m_b.fp8_fwd.pending and not m_b.fp8_fwd.calibrated  # ...and left B's queued
        barrier.wait()  # 5
        barrier.wait()  # 6: B has exited

    def thread_b():
        barrier.wait()  # 1
        with te.fp8_autocast(fp8_recipe=r_b):
            m_b(x)
            barrier.wait()  # 2
            with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
                barrier.wait()  # 3
                look("b")
                barrier.wait()  # 4
            look("b")
            barrier.wait()  # 5: A has exited and checked
        barrier.wait()  # 6
        look("b")

    run_threads(thread_a, thread_b)
    default = autocast.DEFAULT_RECIPE
    assert observed["a"] == [(False, default, 0), (True, r_a, 1), (False, default, 2), (True, r_a, 1),
                             (False, default, 0)]
    assert observed["b"] == [(True, recipe.Float8CurrentScaling(), 2), (True, r_b, 1), (False, default, 0)]
    assert m_b.fp8_fwd.calibrated and not m_b.fp8_fwd.pending  # B's own exit updated it
    # each state's history length and scales come from its own thread's recipe
    assert m_a.fp8_fwd.history_len == 3 and m_b.fp8_fwd.history_len == 5
    w_amax_a, w_amax_b = (m.weight.detach().abs().max() for m in (m_a, m_b))
    torch.testing.assert_close(m_a.fp8_fwd.scale[1], E4M3_MAX / w_amax_a / 2)
    torch.testing.assert_close(m_b.fp8_fwd.scale[1], E4M3_MAX / w_amax_b)


def test_one_decorated_function_run_by_two_threads_restores_each_threads_settings():
    """One fp8_autocast instance (a decorator) entered by two threads at once: each exit restores that thread's
    own settings."""
    barrier = threading.Barrier(2, timeout=TIMEOUT)
    current = recipe.Float8CurrentScaling()
    after = {}

    @te.fp8_autocast(fp8_recipe=current)
    def decorated():
        barrier.wait()  # both inside the same instance
        assert te.is_fp8_enabled() and te.get_fp8_recipe() is current

    def plain_thread():
        decorated()
        after["plain"] = (te.is_fp8_enabled(), te.get_fp8_recipe(), autocast.STATE.depth)

    outer = recipe.DelayedScaling(margin=2)

    def nested_thread():
        with te.fp8_autocast(fp8_recipe=outer):
            decorated()
            after["nested"] = (te.is_fp8_enabled(), te.get_fp8_recipe(), autocast.STATE.depth)

    run_threads(plain_thread, nested_thread)
    assert after == {"plain": (False, autocast.DEFAULT_RECIPE, 0), "nested": (True, outer, 1)}


def test_fp8_model_init_is_per_thread():
    barrier = threading.Barrier(2, timeout=TIMEOUT)
    made = {}

    def inside():
        with te.fp8_model_init():
            barrier.wait()
            made["inside"] = te.Linear(16, 16, device="cpu")
            barrier.wait()

    def outside():
        barrier.wait()
        made["outside"] = te.Linear(16, 16, device="cpu")
        barrier.wait()

    run_threads(inside, outside)
    assert isinstance(made["inside"].weight.data, te.Float8Tensor)
    assert not isinstance(made["outside"].weight.data, te.Float8Tensor)


def grad_scale_check(module, dy_amax, fp8_max, margin):
    """The gradient state was updated once, from this backward's grad-output amax, with the forward's recipe."""
    assert module.fp8_bwd.calibrated and not module.fp8_bwd.pending
    torch.testing.assert_close(module.fp8_bwd.amax_history[1, 0], dy_amax)
    torch.testing.assert_close(module.fp8_bwd.scale[0], fp8_max / dy_amax / 2 ** margin)


def with_amax(shape, amax, device):
    x = torch.randn(*shape, device=device)
    return x / x.abs().max() * amax


@pytest.mark.parametrize("device", DEVICES)
def test_a_backward_called_from_another_thread_updates_with_the_forwards_recipe(device):
    """Forward inside fp8_autocast(E4M3 recipe, margin 1) on this thread; torch.autograd.backward from another
    thread, itself inside an fp8_autocast with another recipe (HYBRID, margin 0): the gradient state is updated after
    that backward with the forward's recipe (E4M3 max, margin 1). On CUDA the backward runs on autograd's device
    thread."""
    forward_recipe = recipe.DelayedScaling(fp8_format=recipe.Format.E4M3, margin=1, amax_history_len=2)
    m = te.Linear(32, 16, params_dtype=torch.float32, device=device)
    x = torch.randn(8, 32, device=device, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=forward_recipe):
        out = m(x)
    dy = with_amax(out.shape, 3.0, device)

    def backward_thread():
        with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(margin=0)):
            torch.autograd.backward(out, dy)

    run_threads(backward_thread)
    grad_scale_check(m, dy.abs().max(), E4M3_MAX, 1)
    assert x.grad is not None and m.weight.grad is not None


class _MeetInBackward(torch.autograd.Function):
    """Identity whose backward waits at a barrier: holds two threads' backwards open at the same point. (Give it a
    CPU tensor: its backward then runs on the thread that called backward, not on a CUDA device thread that both
    backwards share, where the wait would block the other backward.)"""

    @staticmethod
    def forward(ctx, x, barrier):
        ctx.barrier = barrier
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.barrier.wait()
        return grad, None


@pytest.mark.parametrize("device", DEVICES)
def test_two_threads_backwards_at_once_each_update_their_own_gradient_states(device):
    """Two threads each run forward and backward of their own Linear with their own recipe; their backwards are
    held open together after both Linears registered their gradient states: each backward's end updates exactly
    its own states, with its own forward's recipe (one thread's backward never drops or flushes the other's)."""
    recipes = (recipe.DelayedScaling(margin=1), recipe.DelayedScaling(fp8_format=recipe.Format.E4M3))
    modules = [te.Linear(32, 16, params_dtype=torch.float32, device=device) for _ in range(2)]
    barrier = threading.Barrier(2, timeout=TIMEOUT)
    dys = [None, None]

    def step(i):
        x = torch.randn(8, 32, requires_grad=True)
        with te.fp8_autocast(fp8_recipe=recipes[i]):
            out = modules[i](_MeetInBackward.apply(x, barrier).to(device))
        dys[i] = with_amax(out.shape, 2.0 + i, device)
        out.backward(dys[i])

    run_threads(lambda: step(0), lambda: step(1))
    grad_scale_check(modules[0], dys[0].abs().max(), E5M2_MAX, 1)
    grad_scale_check(modules[1], dys[1].abs().max(), E4M3_MAX, 0)


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_recompute_on_another_thread_uses_the_forwards_settings(device):
    """A te.checkpoint region's forward inside fp8_autocast on one thread, its backward (the recompute) on another
    thread outside any fp8_autocast: the gradients and FP8 states equal those of the same steps without
    checkpointing, bit for bit."""
    dtype = torch.bfloat16
    r = recipe.DelayedScaling(amax_history_len=3, margin=1)
    torch.manual_seed(0)
    template = te.LayerNormMLP(32, 64, params_dtype=dtype, device=device)
    x0 = torch.randn(2, 8, 32, device=device, dtype=dtype)

    def train(checkpointed):
        torch.manual_seed(0)
        module = te.LayerNormMLP(32, 64, params_dtype=dtype, device=device)
        module.load_state_dict(template.state_dict())
        grads = []
        for _ in range(3):
            x = x0.clone().requires_grad_()
            with te.fp8_autocast(fp8_recipe=r):
                y = te.checkpoint(module, x) if checkpointed else module(x)
            loss = y.float().pow(2).sum()
            run_threads(loss.backward)  # (another thread, outside any fp8_autocast)
            grads = [x.grad] + [p.grad for p in module.parameters()]
            module.zero_grad(set_to_none=True)
        states = [t for s in (module.fp8_fwd, module.fp8_bwd) for t in (s.amax_history, s.scale, s.scale_inv)]
        return grads, states

    plain, checkpointed = train(False), train(True)
    for a, b in zip(plain[0] + plain[1], checkpointed[0] + checkpointed[1]):
        assert torch.equal(a, b)


def test_a_new_thread_starts_outside_fp8_autocast():
    seen = []
    with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
        run_threads(lambda: seen.append((te.is_fp8_enabled(), te.get_fp8_recipe(), autocast.STATE.depth)))
        assert te.is_fp8_enabled()
    assert seen == [(False, autocast.DEFAULT_RECIPE, 0)]


class _BackwardRunsAnotherBackward(torch.autograd.Function):
    """Identity whose backward runs a whole FP8 forward and backward of `inner` (a nested graph task, as
    torch.autograd.grad inside a backward)."""

    @staticmethod
    def forward(ctx, x, inner, fp8_recipe):
        ctx.inner, ctx.fp8_recipe = inner, fp8_recipe
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        with torch.enable_grad(), te.fp8_autocast(fp8_recipe=ctx.fp8_recipe):
            y = torch.randn(4, 32, requires_grad=True)
            out = ctx.inner(y)
        torch.autograd.grad(out, y, with_amax(out.shape, 5.0, "cpu"))
        return grad, None, None


def test_a_nested_backward_keeps_its_own_queue():
    """A backward that runs another backward inside it (after the outer one registered a state): each backward's
    end updates its own states; the nested one neither drops nor flushes the outer one's queue."""
    outer, inner = te.Linear(32, 16, device="cpu"), te.Linear(32, 16, device="cpu")
    r_outer, r_inner = recipe.DelayedScaling(margin=1), recipe.DelayedScaling(fp8_format=recipe.Format.E4M3)
    x = torch.randn(8, 32, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=r_outer):
        out = outer(_BackwardRunsAnotherBackward.apply(x, inner, r_inner))
    dy = with_amax(out.shape, 2.0, "cpu")
    out.backward(dy)  # outer's backward registers first, then the nested backward runs and ends
    grad_scale_check(outer, dy.abs().max(), E5M2_MAX, 1)
    assert inner.fp8_bwd.calibrated and not inner.fp8_bwd.pending
    torch.testing.assert_close(inner.fp8_bwd.scale[0], torch.tensor(E4M3_MAX / 5.0))


def test_a_failed_backward_leaves_no_queue_behind():
    """A backward that dies after registering its state (its end-of-backward callback never runs) leaves no queue
    behind, and the next backward of the module updates its state."""
    m = te.Linear(32, 16, fuse_wgrad_accumulation=True, device="cpu")
    x = torch.randn(8, 32)
    with te.fp8_autocast():
        out = m(x)
    with pytest.raises(RuntimeError, match="main_grad"):
        run_threads(lambda: out.sum().backward())
    assert autocast._backward_queues == {} and _C.backward_queues_alive() == 0
    m.weight.main_grad = torch.zeros(16, 32)
    with te.fp8_autocast():
        out = m(x)
    dy = with_amax(out.shape, 3.0, "cpu")
    run_threads(lambda: out.backward(dy))
    grad_scale_check(m, dy.abs().max(), E5M2_MAX, 0)
    assert autocast._backward_queues == {} and _C.backward_queues_alive() == 0
