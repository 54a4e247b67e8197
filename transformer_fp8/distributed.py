"""Tensor and sequence parallelism over torch.distributed; the dropout RNG tracker (rng.py) and TE's
`te.distributed.checkpoint` (checkpoint.py) are re-exported here under their TE names.

Conventions (Megatron / Transformer Engine): a tensor-parallel (TP) group of `size` ranks. A column-parallel GEMM
splits the weight's output rows ([out/tp, in] per rank; its output is split along the last dim), a row-parallel one
its input columns ([out, in/tp]; its input is split along the last dim and the partial outputs are summed).
Sequence parallelism (SP) splits the activations between those GEMMs along dim 0 (the sequence of "sbhd", or the
tokens of a [tokens, hidden] input): norms, residual adds and dropout run on this rank's block; the column-parallel
module all-gathers its (normalised) input right before its GEMM, in FP8 inside fp8_autocast (all_gather_fp8; see
module/_column_parallel.py), and the row-parallel output is reduce-scattered.
`group=None` everywhere means the default group.
"""
import torch
import torch.distributed as dist

from .checkpoint import checkpoint  # noqa: F401  (TE's te.distributed.checkpoint)
from .rng import MODEL_PARALLEL_RNG, RNGStatesTracker, get_rng_state_tracker, model_parallel_rng  # noqa: F401

PARALLEL_MODES = (None, "column", "row")


def _initialized():
    return dist.is_available() and dist.is_initialized()


def group_size(group=None):
    """Ranks in `group` (1 when torch.distributed is not initialised)."""
    return dist.get_world_size(group) if _initialized() else 1


def group_rank(group=None):
    """This process's rank in `group` (0 when torch.distributed is not initialised)."""
    return dist.get_rank(group) if _initialized() else 0


# --- collectives (no-ops on a group of one) ---
def all_reduce(x, group=None):
    """Sum of x over the group (in place on a contiguous copy; returns it)."""
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def all_gather_first_dim(x, group=None):
    """[s, ...] per rank -> [size * s, ...], rank order."""
    size = group_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=group)
    return out


def all_gather_fp8(q, group=None):
    """FP8 [s, ...] per rank -> [size * s, ...] FP8, rank order, moved as raw bytes (a uint8 view: NCCL and gloo take
    it; one byte an element, half of BF16's). Every rank must have cast with the same scale."""
    if group_size(group) == 1:
        return q
    return all_gather_first_dim(q.view(torch.uint8), group).view(q.dtype)


class Pending:
    """A collective started with async_op=True: wait() returns its result once it is done (on CUDA: once the current
    stream has been made to wait for it; the work issued in between overlaps it)."""

    def __init__(self, out, work):
        self.out, self.work = out, work

    def wait(self):
        if self.work is not None:
            self.work.wait()
        return self.out


def start_all_reduce(x, group=None):
    """Start the sum of x over the group (in place on a contiguous copy): a Pending."""
    if group_size(group) == 1:
        return Pending(x, None)
    x = x.contiguous()
    return Pending(x, dist.all_reduce(x, group=group, async_op=True))


def start_reduce_scatter_first_dim(x, group=None):
    """Start reduce_scatter_first_dim(x): a Pending."""
    size = group_size(group)
    if size == 1:
        return Pending(x, None)
    _check_divisible(x, size)
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    return Pending(out, dist.reduce_scatter_tensor(out, x, group=group, async_op=True))


def _check_divisible(x, size):
    if x.shape[0] % size:
        raise ValueError(f"x: dim 0 ({x.shape[0]}) must be divisible by the group size {size}")


def reduce_scatter_first_dim(x, group=None):
    """[size * s, ...] per rank -> this rank's [s, ...] block of the sum over ranks."""
    size = group_size(group)
    if size == 1:
        return x
    _check_divisible(x, size)
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x, group=group)
    return out


def split_first_dim(x, group=None):
    """This rank's block of x along dim 0 (dim 0 divisible by the group size)."""
    size = group_size(group)
    if size == 1:
        return x
    _check_divisible(x, size)
    return x.chunk(size, dim=0)[group_rank(group)].contiguous()


# --- autograd Functions: the TP/SP region boundaries, each a collective and its conjugate for the gradient ---
def _identity(x, group):
    return x.view_as(x)


def _boundary(name, forward_op, backward_op, doc):
    """An autograd Function (x, group) -> forward_op(x, group) whose backward is backward_op(grad, group)."""

    def forward(ctx, x, group):
        ctx.group = group
        return forward_op(x, group)

    def backward(ctx, grad):
        return backward_op(grad, ctx.group), None

    return type(name, (torch.autograd.Function,),
                {"__doc__": doc, "forward": staticmethod(forward), "backward": staticmethod(backward)})


_CopyToTP = _boundary("_CopyToTP", _identity, all_reduce,
                      "Forward identity, backward all-reduce: a replicated tensor (or parameter) used by every TP "
                      "rank.")


class _ReduceFromTP(torch.autograd.Function):
    """Forward all-reduce (the sum of the row-parallel partial outputs), backward identity. The sum is taken in place
    on x (x is the caller's partial output, used for nothing else: no copy of a [tokens, hidden] tensor) when it is
    contiguous, not a view and not a leaf that requires grad (marked dirty: autograd raises if an op saved x for its
    backward), else on a copy."""

    @staticmethod
    def forward(ctx, x, group):
        if group_size(group) == 1:
            return x.view_as(x)
        if not x.is_contiguous() or x._is_view() or (x.is_leaf and x.requires_grad):
            return all_reduce(x.clone(memory_format=torch.contiguous_format), group)
        all_reduce(x, group)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


_GatherFromSP = _boundary("_GatherFromSP", all_gather_first_dim, reduce_scatter_first_dim,
                          "Forward all-gather along dim 0, backward reduce-scatter (the gradients are partial sums).")
_ReduceScatterToSP = _boundary("_ReduceScatterToSP", reduce_scatter_first_dim, all_gather_first_dim,
                               "Forward reduce-scatter along dim 0 (sum the partial outputs, keep this rank's block), "
                               "backward all-gather.")
_ScatterToSP = _boundary("_ScatterToSP", split_first_dim, all_gather_first_dim,
                         "Forward: this rank's block along dim 0 of a replicated tensor; backward all-gather.")


def copy_to_tensor_parallel_region(x, group=None):
    return _CopyToTP.apply(x, group)


def reduce_from_tensor_parallel_region(x, group=None):
    return _ReduceFromTP.apply(x, group)


def gather_from_sequence_parallel_region(x, group=None):
    return _GatherFromSP.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x, group=None):
    return _ReduceScatterToSP.apply(x, group)


def scatter_to_sequence_parallel_region(x, group=None):
    return _ScatterToSP.apply(x, group)


# --- a module's TP settings ---
class TensorParallel:
    """The TP settings of one module: group, size, rank, parallel_mode, sequence_parallel; gathers_input: the module
    all-gathers its sequence-parallel input itself (column-parallel with sequence_parallel).

    Shared scales: every rank casts each FP8 tensor with the scale the single-process module would use for the full
    tensor (sharded inputs, weights and gradients alike), so the sequence-parallel FP8 all-gather joins blocks of
    one scale. Delayed scaling: each amax is MAX-reduced over the autocast's fp8_group at each update (the recipe's
    reduce_amax=True, the default), so the fp8_group must hold the TP group (check_amax_group; fp8_group=None, the
    default group, always does); with reduce_amax=False the scales are per rank and the sequence-parallel input is
    all-gathered in high precision instead. Current scaling: each amax is MAX-reduced over the TP group right before
    its cast (quantization.CurrentScalingQuantizer.amax_group)."""

    def __init__(self, tp_group, tp_size, parallel_mode, sequence_parallel):
        if parallel_mode not in PARALLEL_MODES:
            raise ValueError(f"parallel_mode: expected one of {PARALLEL_MODES}, got {parallel_mode!r}")
        size = group_size(tp_group) if tp_group is not None else tp_size
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size: expected a positive int, got {tp_size!r}")
        if tp_group is not None and tp_size not in (1, size):
            raise ValueError(f"tp_size: expected the size of tp_group ({size}), got {tp_size}")
        if tp_group is None and (tp_size > 1 or sequence_parallel):
            raise ValueError(f"tp_group: needed for tp_size={tp_size}, sequence_parallel={sequence_parallel}")
        if sequence_parallel and parallel_mode is None:
            raise ValueError("sequence_parallel: needs parallel_mode='column' or 'row' (set_parallel_mode=True on "
                             "LayerNormMLP, MultiheadAttention, TransformerLayer)")
        self.group, self.size = tp_group, size
        self.rank = 0 if tp_group is None else group_rank(tp_group)
        self.mode, self.sequence_parallel = parallel_mode, bool(sequence_parallel)
        self.gathers_input = self.sequence_parallel and parallel_mode == "column"
        self._checked_amax_groups = set()

    @classmethod
    def create(cls, tp_group, tp_size, parallel_mode, sequence_parallel):
        """TensorParallel, or None when nothing is split or communicated (the module runs as on one GPU)."""
        tp = cls(tp_group, tp_size, parallel_mode, sequence_parallel)
        return tp if tp.size > 1 and tp.mode is not None else None

    def local(self, name, size):
        """size // tp, after checking that tp divides it (`name` names the argument)."""
        if size % self.size:
            raise ValueError(f"{name}: expected a multiple of tp_size={self.size}, got {size}")
        return size // self.size

    def shard(self, full, dim, blocks=1):
        """This rank's part of `full` along `dim`. blocks > 1: that dim is `blocks` equal blocks (e.g. SwiGLU's
        [gate | up] rows), each split across ranks, and the rank's pieces are concatenated in block order."""
        pieces = [b.chunk(self.size, dim)[self.rank] for b in full.chunk(blocks, dim)]
        return torch.cat(pieces, dim).contiguous() if blocks > 1 else pieces[0].contiguous()

    # activations at the region boundaries
    def column_input(self, x):
        """The high-precision input of a column-parallel GEMM: all-gathered along dim 0 (SP) or copied (its gradient
        all-reduced)."""
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(x, self.group)
        return copy_to_tensor_parallel_region(x, self.group)

    def row_output(self, partial):
        """The sum of the row-parallel partial outputs: reduce-scattered along dim 0 (SP) or all-reduced."""
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, self.group)
        return reduce_from_tensor_parallel_region(partial, self.group)

    def replicated(self, param):
        """A parameter replicated on every TP rank whose local gradient is a partial sum: all-reduced in backward."""
        return None if param is None else copy_to_tensor_parallel_region(param, self.group)

    def check_amax_group(self, fp8_group):
        """Inside fp8_autocast: the fp8_group (None: the default group) must hold every rank of the TP group."""
        key = id(fp8_group)
        if key in self._checked_amax_groups:
            return
        tp_ranks = set(dist.get_process_group_ranks(self.group))
        amax_ranks = set(range(dist.get_world_size())) if fp8_group is None else \
            set(dist.get_process_group_ranks(fp8_group))
        if not tp_ranks <= amax_ranks:
            raise ValueError(f"fp8_group: must hold the TP group's ranks {sorted(tp_ranks)} (their amaxes are "
                             f"reduced together), got ranks {sorted(amax_ranks)}")
        self._checked_amax_groups.add(key)

    def load_full_checkpoint_hook(self, sharded):
        """A load_state_dict pre-hook that slices full tensors of the parameters in `sharded` ({name: (dim, blocks)})
        to this rank's shard; tensors already of the shard's shape load as they are."""
        def hook(module, state_dict, prefix, *args):
            for name, (dim, blocks) in sharded.items():
                full = state_dict.get(prefix + name)
                local = getattr(module, name)
                if full is not None and local is not None and full.dim() == local.dim() and \
                        full.shape[dim] == local.shape[dim] * self.size:
                    state_dict[prefix + name] = self.shard(full, dim, blocks)
        return hook
