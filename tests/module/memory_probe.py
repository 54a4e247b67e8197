"""Bytes a training step holds, measured on any device from the ops it dispatches (the CPU reference kernels
included): LiveBytes, a TorchDispatchMode that records each op output's storage and, after every op, the bytes of
those still alive (its peak, and what is alive when asked: after a forward, what the backward will read).
SavedBytes counts what goes through save_for_backward (torch.autograd.graph.saved_tensors_hooks).

Both count tensors made inside them only (parameters and inputs made before do not count); each storage once.
Kernel-internal temporaries are invisible (an op's own workspace): what is counted is what the CUDA kernels
allocate as their outputs.
"""
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storage_key(t: torch.Tensor) -> tuple[torch.device, int]:
    return t.device, t.untyped_storage().data_ptr()


class LiveBytes(TorchDispatchMode):
    """Inside `with LiveBytes() as live:`, live.peak is the largest total size of the storages made by the ops run
    so far that were alive together after an op (mark() starts a new peak); live.now() the size of those alive now.
    """

    def __init__(self):
        super().__init__()
        self._live: dict[tuple, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def _sweep(self) -> int:
        for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            del self._live[key]
        return sum(n for _, n in self._live.values())

    def now(self) -> int:
        """Returns:
            The bytes of the storages made inside this mode that are alive now."""
        return self._sweep()

    def mark(self) -> None:
        """Start a new peak from what is alive now."""
        self.peak = self._sweep()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # (a view of an input, or an op writing into one, makes no new storage: one made before the mode is not
        # counted)
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
                key = _storage_key(t)
                if key in inputs and key not in self._live:
                    continue
                known = self._live.get(key)
                if known is None or known[0].expired():
                    self._live[key] = (StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes())
        self.peak = max(self.peak, self._sweep())
        return out


class SavedBytes:
    """Inside `with SavedBytes() as saved:`, saved.total is the bytes of the distinct storages that autograd nodes
    saved through save_for_backward (built-in and custom Functions alike)."""

    def __init__(self):
        self._seen: dict[tuple, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().nbytes() > 0:
            self._seen[_storage_key(t)] = t.untyped_storage().nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self._seen.values())

    def __enter__(self) -> "SavedBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
