"""Queueing the gradient-state update from a backward that torch.compile traced.

Eager: a module's backward registers its gradient state (update.register_backward), which queues an autograd-engine
callback that updates the gradient scaling states after the backward. A compiled backward runs none of our Python, so
the traced backward calls the op `transformer_fp8::queue_backward_update` instead: its kernel (Python) does that
registration each time the compiled backward runs. The op takes a key (id of the ScalingState, a constant of the
graph); the module's forward, traced as well, files (state, recipe, group) under the key (Dynamo replays the store on
every call).
"""
from typing import Any

import torch

from . import update


class _Filed:
    """Attribute `k<key>`: the (ScalingState, recipe, group) filed under key. (Attributes, not a dict: Dynamo guards
    on the keys of a dict it stores into, so every newly filed state would recompile the graphs traced before.)"""


_FILED = _Filed()


def file_backward_state(scaling_state: Any, recipe: Any, group: Any) -> None:
    """Call from a forward that torch.compile traces: the entry that its compiled backward registers.

    Args:
        scaling_state: the gradient ScalingState; recipe, group: those of the forward.
    """
    setattr(_FILED, f"k{id(scaling_state)}", (scaling_state, recipe, group))


@torch.library.custom_op("transformer_fp8::queue_backward_update", mutates_args=("amax",))
def queue_backward_update(amax: torch.Tensor, key: int) -> None:
    """Register the gradient state filed under `key` for the update after the running backward. amax: an amax slot
    of that state which this backward's cast wrote; declared mutated (the update will change it) so that the op stays
    in the graph, after the cast."""
    update.register_backward(*getattr(_FILED, f"k{key}"))


@queue_backward_update.register_fake
def _(amax, key):
    return None
