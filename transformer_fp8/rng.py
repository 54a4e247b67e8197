"""The dropout RNG tracker (Megatron / TE's CudaRNGStatesTracker): named RNG states that tensor-parallel dropout
forks from, and that checkpoint.py saves and restores around a recompute. (Its own module: checkpoint.py and
distributed.py both need it, and distributed.py re-exports checkpoint.)
"""
import contextlib

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"  # the RNG tracker's state for dropout on split tensors


class RNGStatesTracker:
    """Named RNG states (CPU, and the current CUDA device's when CUDA is initialised). `fork(name)` runs its block on
    that state and leaves the default one untouched: seed a name identically on every TP rank for the same dropout
    masks, or per rank (e.g. seed + rank) for independent ones."""

    def __init__(self):
        self.states = {}

    def reset(self):
        self.states = {}

    def get_states(self):
        return dict(self.states)

    def set_states(self, states):
        self.states = dict(states)

    def add(self, name, seed):
        if name in self.states:
            raise ValueError(f"name: RNG state {name!r} already exists")
        with _saved_default_rng():
            torch.manual_seed(seed)
            self.states[name] = _current_rng()

    @contextlib.contextmanager
    def fork(self, name=MODEL_PARALLEL_RNG):
        if name not in self.states:
            raise KeyError(f"name: no RNG state {name!r} (add it first)")
        with _saved_default_rng():
            _set_rng(self.states[name])
            try:
                yield
            finally:
                self.states[name] = _current_rng()


def _current_rng():
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng(state):
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


@contextlib.contextmanager
def _saved_default_rng():
    saved = _current_rng()
    try:
        yield
    finally:
        _set_rng(saved)


_RNG_TRACKER = RNGStatesTracker()


def get_rng_state_tracker():
    """The process-wide RNGStatesTracker."""
    return _RNG_TRACKER


def model_parallel_rng(active):
    """The tracker's MODEL_PARALLEL_RNG fork when `active` and that state was added, else a no-op context: dropout
    on tensors split across TP ranks (heads, sequence blocks) draws from it (seed it per rank)."""
    if active and MODEL_PARALLEL_RNG in _RNG_TRACKER.states:
        return _RNG_TRACKER.fork(MODEL_PARALLEL_RNG)
    return contextlib.nullcontext()
