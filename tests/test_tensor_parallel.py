"""Tensor and sequence parallelism: 2 processes (gloo on CPU; NCCL on 2 GPUs with TFP8_DIST_BACKEND=nccl, see
tests/dist_utils.py), one spawned job for the whole file.

Each case builds the single-process module and its TP=2 counterpart, loads the full state dict into the TP one
(sliced by rank), feeds both the same full input (the TP one its shard: dim 0 with sequence_parallel, last dim for
row-parallel) and checks the output and every gradient against the matching part of the single-process ones, for each
of RECIPES: outside fp8_autocast, delayed scaling (second step: the scales then come from amaxes reduced over the TP
group and must equal the single-process module's), current scaling (amaxes reduced over the TP group before each
cast: the same scales again) and delayed scaling without amax reduction (per-rank scales: the sequence-parallel input
is gathered in high precision). Also recorded: the collectives transformer_fp8.distributed issues (the
sequence-parallel all-gathers move FP8 bytes inside fp8_autocast) and the rows every norm runs on (this rank's
sequence block with sequence_parallel). Every rank's results are checked (tests.dist_utils.RankResults): a failure
names the rank.
"""
import traceback
import types

import pytest
import torch
import torch.distributed as dist

import transformer_fp8 as te
from transformer_fp8 import distributed as tpd
from transformer_fp8 import recipe
from transformer_fp8.module import norm as norm_ops
from transformer_fp8.quantization.block import BlockScalingQuantizer
from tests.dist_utils import DEVICE, WORLD, run_workers_per_rank
from tests.utils import FP8_RTOL, rel_error

S, B, H, N, FFN = 8, 4, 32, 48, 64  # sequence, batch, hidden, Linear/LayerNormLinear width, MLP ffn width
RECIPES = {  # label: recipe (None: outside fp8_autocast)
    "hp": None,
    "fp8": recipe.DelayedScaling(amax_history_len=2),
    "fp8_current": recipe.Float8CurrentScaling(),
    "fp8_per_rank": recipe.DelayedScaling(amax_history_len=2, reduce_amax=False),
    "fp8_block": recipe.Float8BlockScaling(),  # (per-tile scales: gathers in high precision, casts per rank)
}
FP8_LABELS = ("fp8", "fp8_current")  # the scales equal the single-process module's


def _linear(**tp):
    return te.Linear(H, N, params_dtype=torch.float32, device=DEVICE, **tp)


def _row_linear(**tp):
    return te.Linear(N, H, params_dtype=torch.float32, device=DEVICE, **tp)


def _ln_linear(**tp):
    return te.LayerNormLinear(H, N, params_dtype=torch.float32, device=DEVICE, **tp)


def _mlp(activation="gelu", normalization="LayerNorm"):
    def make(parallel_mode=None, **tp):
        return te.LayerNormMLP(H, FFN, activation=activation, normalization=normalization,
                               params_dtype=torch.float32, device=DEVICE, set_parallel_mode=parallel_mode is not None,
                               **tp)
    return make


def _attention(parallel_mode=None, **tp):
    return te.MultiheadAttention(H, 4, num_gqa_groups=2, attention_dropout=0.0, input_layernorm=True,
                                 params_dtype=torch.float32, device=DEVICE, set_parallel_mode=parallel_mode is not None,
                                 **tp)


def _transformer_layer(parallel_mode=None, **tp):
    return te.TransformerLayer(H, FFN, 4, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
                               device=DEVICE, set_parallel_mode=parallel_mode is not None, **tp)


class _ResidualParam(torch.nn.Module):
    """module(x, residual=r), r a parameter of the output's shape (its gradient is checked like a weight's)."""

    def __init__(self, module, shape):
        super().__init__()
        self.module, self.residual = module, torch.nn.Parameter(torch.randn(shape).to(DEVICE))

    def forward(self, x):
        return self.module(x, residual=self.residual)


class _AddsInput(torch.nn.Module):
    """module(x, residual=x)."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x, residual=x)


def _row_linear_residual(**tp):
    return _ResidualParam(_row_linear(**tp), (S, B, H))


def _mlp_adds_input(parallel_mode=None, **tp):
    return _AddsInput(_mlp()(parallel_mode, **tp))


# name: (constructor, parallel_mode, sequence_parallel, input split, output split, input width)
# splits: None (full), "seq" (this rank's dim-0 block), "last" (this rank's last-dim block)
CASES = {
    "column": (_linear, "column", False, None, "last", H),
    "column_sp": (_linear, "column", True, "seq", "last", H),
    "row": (_row_linear, "row", False, "last", None, N),
    "row_sp": (_row_linear, "row", True, "last", "seq", N),
    "row_residual": (_row_linear_residual, "row", False, "last", None, N),
    "layernorm_linear": (_ln_linear, "column", False, None, "last", H),
    "layernorm_linear_sp": (_ln_linear, "column", True, "seq", "last", H),
    "layernorm_mlp": (_mlp(), "column", False, None, None, H),
    "layernorm_mlp_sp": (_mlp(), "column", True, "seq", "seq", H),
    "layernorm_mlp_adds_input": (_mlp_adds_input, "column", False, None, None, H),
    "layernorm_mlp_swiglu_rmsnorm_sp": (_mlp("swiglu", "RMSNorm"), "column", True, "seq", "seq", H),
    "multihead_attention": (_attention, "column", False, None, None, H),
    "multihead_attention_sp": (_attention, "column", True, "seq", "seq", H),
    "transformer_layer": (_transformer_layer, "column", False, None, None, H),
    "transformer_layer_sp": (_transformer_layer, "column", True, "seq", "seq", H),
}
# per case: (column-parallel GEMMs fed by an all-gather with sequence_parallel, whether the module has norms)
GATHERS = {"column_sp": 1, "layernorm_linear_sp": 1, "layernorm_mlp_sp": 1, "layernorm_mlp_swiglu_rmsnorm_sp": 1,
           "multihead_attention_sp": 1, "transformer_layer_sp": 2}
HAS_NORM = ("layernorm", "attention", "transformer")
# attention runs in BF16 on CUDA (float32 inputs are cast around SDPA): looser there
HP_TOL = {"cpu": 1e-5, "cuda": 1e-5}
HP_TOL_ATTENTION = {"cpu": 1e-5, "cuda": 1e-2}


class _Recorder:
    """Records (collective, dtype, numel of the full buffer) of the collectives transformer_fp8.distributed issues,
    the names of those started asynchronously, and the rows of every norm forward, while active."""

    def __init__(self):
        self.collectives, self.started_async, self.norm_rows = [], [], []

    def _collective(self, name):
        real = getattr(dist, name)

        def recorded(*args, **kwargs):
            full = args[1] if name == "reduce_scatter_tensor" else args[0]
            self.collectives.append((name, str(full.dtype).removeprefix("torch."), full.numel()))
            if kwargs.get("async_op"):
                self.started_async.append(name)
            return real(*args, **kwargs)
        return recorded

    def _norm_fwd(self, real):
        def recorded(normalization, x, *args, **kwargs):
            self.norm_rows.append(x.shape[0])
            return real(normalization, x, *args, **kwargs)
        return recorded

    def _cast_normalized(self, real):  # (block scaling's fused norm -> FP8 path: norm_fwd is not called)
        def recorded(quantizer, spec, x, *args, **kwargs):
            self.norm_rows.append(x.shape[0])
            return real(quantizer, spec, x, *args, **kwargs)
        return recorded

    def __enter__(self):
        self.saved = tpd.dist, norm_ops.norm_fwd, BlockScalingQuantizer.cast_normalized
        BlockScalingQuantizer.cast_normalized = self._cast_normalized(BlockScalingQuantizer.cast_normalized)
        proxy = types.SimpleNamespace(**{n: getattr(dist, n) for n in dir(dist) if not n.startswith("__")})
        for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
            setattr(proxy, name, self._collective(name))
        tpd.dist, norm_ops.norm_fwd = proxy, self._norm_fwd(norm_ops.norm_fwd)
        return self

    def __exit__(self, *exc):
        tpd.dist, norm_ops.norm_fwd, BlockScalingQuantizer.cast_normalized = self.saved


def _part(full, split, rank):
    if split is None:
        return full
    dim = 0 if split == "seq" else -1
    return full.chunk(WORLD, dim)[rank]


def _param_part(full, local, rank, blocks):
    """This rank's part of a full parameter (or gradient) with the local parameter's shape."""
    if full.shape == local.shape:
        return full
    dim = next(d for d in range(full.dim()) if full.shape[d] != local.shape[d])
    pieces = [b.chunk(WORLD, dim)[rank] for b in full.chunk(blocks, dim)]
    return torch.cat(pieces, dim)


def _scales(module):
    """The forward and backward scales of every FP8 module in `module`, concatenated."""
    fp8 = [m for m in module.modules() if hasattr(m, "fp8_fwd")]
    return torch.cat([s for m in fp8 for s in (m.fp8_fwd.scale, m.fp8_bwd.scale)])


def _amax_histories(module):
    """{FP8 sub-module name: (forward amax history, backward amax history)} (copies)."""
    return {name: (m.fp8_fwd.amax_history.clone(), m.fp8_bwd.amax_history.clone())
            for name, m in module.named_modules() if hasattr(m, "fp8_fwd")}


def _step(module, x_full, dy_full, in_split, out_split, sp, rank):
    """One forward and backward: (output, input gradient (full), {name: grad}, forward Recorder, backward Recorder)."""
    module.zero_grad(set_to_none=True)
    x = x_full.clone().requires_grad_()
    if in_split == "seq":
        inp = tpd.scatter_to_sequence_parallel_region(x, dist.group.WORLD) if sp else x
    else:
        inp = _part(x, in_split, rank)
    with _Recorder() as forward:
        out = module(inp)
    with _Recorder() as backward:
        (out * _part(dy_full, out_split, rank)).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}, forward, backward


def _across_ranks(t):
    """Largest relative difference between the ranks' copies of t."""
    copies = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(copies, t.contiguous())
    return max(rel_error(c, copies[0]) for c in copies[1:])


def _compare_case(name, rank, results):
    make, mode, sp, in_split, out_split, width = CASES[name]

    def blocks(param):  # SwiGLU's fc1 rows are [gate | up], each split across ranks
        return 2 if "swiglu" in name and "fc1" in param else 1
    torch.manual_seed(0)
    ref = make()
    torch.manual_seed(0)  # same seed: the TP weights are created as the rank's part of the same full init
    tp = make(parallel_mode=mode, tp_group=dist.group.WORLD, sequence_parallel=sp)
    full = ref.state_dict()
    results[f"{name}/init"] = max(rel_error(p, _param_part(full[n], p, rank, blocks(n)))
                                  for n, p in tp.named_parameters())
    with torch.no_grad():  # non-trivial norm and bias parameters
        for p in ref.parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p))
    tp.load_state_dict(ref.state_dict())
    torch.manual_seed(1)
    x_full = torch.randn(S, B, width).to(DEVICE)
    dy_full = torch.randn(S, B, H if out_split != "last" else N).to(DEVICE)
    ref_outs = {}
    for label, fp8_recipe in RECIPES.items():
        outs = []
        for module, splits in ((ref, (None, None, False)), (tp, (in_split, out_split, sp))):
            for _ in range(1 if fp8_recipe is None else 2):  # FP8: the second step runs on updated scales
                with te.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
                    step = _step(module, x_full, dy_full, *splits, rank)
            outs.append(step)
        (ref_out, ref_dx, ref_grads, *_), (out, dx, grads, forward, backward) = outs
        ref_outs[label] = ref_out
        dx_part = _part(ref_dx, in_split if in_split == "last" else None, rank)
        dx_local = _part(dx, in_split if in_split == "last" else None, rank)
        results[f"{name}/shapes/{label}"] = {  # (rel_error broadcasts: shapes are checked apart)
            "out": (tuple(out.shape), tuple(_part(ref_out, out_split, rank).shape)),
            "dx": (tuple(dx_local.shape), tuple(dx_part.shape)),
            **{f"d{n}": (tuple(g.shape), tuple(p.shape)) for (n, g), p in zip(grads.items(), tp.parameters())}}
        results[f"{name}/{label}/out"] = rel_error(out, _part(ref_out, out_split, rank))
        results[f"{name}/{label}/dx"] = rel_error(dx_local, dx_part)
        for n, g in grads.items():
            results[f"{name}/{label}/d{n}"] = rel_error(g, _param_part(ref_grads[n], g, rank, blocks(n)))
        results[f"{name}/collectives/{label}"] = (forward.collectives, backward.collectives)
        results[f"{name}/norm_rows/{label}"] = forward.norm_rows
        results[f"{name}/started_async/{label}"] = backward.started_async
        if fp8_recipe is not None:
            results[f"{name}/fp8_vs_hp/{label}"] = rel_error(ref_outs[label], ref_outs["hp"])  # FP8 did run
            results[f"{name}/scales_vs_single/{label}"] = rel_error(_scales(tp), _scales(ref))
            results[f"{name}/scales_across_ranks/{label}"] = _across_ranks(_scales(tp))
            results[f"{name}/scales_moved/{label}"] = float((_scales(ref) != 1).float().mean())
            results[f"{name}/amax_histories/{label}"] = _amax_histories(tp)
            results[f"{name}/single_amax_histories/{label}"] = _amax_histories(ref)


def _errors_in_group(rank):
    """Bad arguments that need a group of 2: {check: exception text or 'no error'}."""
    group = dist.group.WORLD
    checks = {
        "out_features": lambda: te.Linear(H, 47, device="cpu", tp_group=group, parallel_mode="column"),
        "in_features": lambda: te.Linear(33, H, device="cpu", tp_group=group, parallel_mode="row"),
        "ffn_hidden_size": lambda: te.LayerNormMLP(H, 63, device="cpu", tp_group=group, set_parallel_mode=True),
        "tp_size": lambda: te.Linear(H, N, device="cpu", tp_group=group, tp_size=3, parallel_mode="column"),
        "sequence_parallel": lambda: te.Linear(H, N, device="cpu", tp_group=group, sequence_parallel=True),
        "parallel_mode": lambda: te.LayerNormLinear(H, N, device="cpu", tp_group=group, parallel_mode="row"),
        "inp": lambda: te.Linear(H, N, device=DEVICE, tp_group=group, parallel_mode="column",
                                 sequence_parallel=True)(torch.randn(H, device=DEVICE)),
        "residual": lambda: te.Linear(N, H, device=DEVICE, tp_group=group, parallel_mode="row",
                                      sequence_parallel=True)(torch.randn(2, N // 2, device=DEVICE),
                                                              residual=torch.randn(4, H, device=DEVICE)),
    }
    out = {}
    for name, build in checks.items():
        try:
            build()
            out[name] = "no error"
        except (ValueError, NotImplementedError) as err:
            out[name] = str(err)
    rank0_only = dist.new_group([0])  # every rank creates it; only rank 0 is a member
    if rank == 0:
        layer = te.Linear(H, N, params_dtype=torch.float32, device="cpu", tp_group=group, parallel_mode="column")
        try:
            with te.fp8_autocast(fp8_group=rank0_only):
                layer(torch.randn(4, H))
            out["fp8_group"] = "no error"
        except ValueError as err:
            out["fp8_group"] = str(err)
    return out


def _reduce_from_tp_checks(rank):
    """reduce_from_tensor_parallel_region: in place on a fresh partial output (no copy), on a copy for a view, and
    an error in backward when the partial was saved by another op: {check: bool}."""
    group, out = dist.group.WORLD, {}
    torch.manual_seed(0)  # (the same x on every rank)
    x = torch.randn(4, 3, device=DEVICE, requires_grad=True)
    partial = x * (rank + 1)
    ptr = partial.data_ptr()
    summed = tpd.reduce_from_tensor_parallel_region(partial, group)
    summed.backward(torch.ones_like(summed))
    out["in_place"] = summed.data_ptr() == ptr
    out["sum"] = torch.allclose(summed, x.detach() * sum(r + 1 for r in range(WORLD)))
    out["grad"] = torch.allclose(x.grad, torch.full_like(x, rank + 1.0))
    base = torch.randn(4, 6, device=DEVICE) * (rank + 1)
    view = base[:, :3]
    kept = view.clone()
    summed = tpd.reduce_from_tensor_parallel_region(view, group)
    out["view_untouched"] = torch.equal(view, kept) and summed.data_ptr() != view.data_ptr()
    saved = x.exp()  # (exp saves its output for the backward)
    try:
        tpd.reduce_from_tensor_parallel_region(saved, group).sum().backward()
        out["saved_raises"] = False
    except RuntimeError as err:
        out["saved_raises"] = "inplace" in str(err)
    return out


def _checkpoint_checks(rank):
    """A sequence-parallel TransformerLayer with hidden and attention dropout (the latter from the RNG tracker's
    per-rank state) under te.checkpoint (FP8, delayed scaling, 2 steps) against the same steps without it:
    {"grads_equal": bool, "recomputed": bool} on this rank."""
    torch.manual_seed(1)  # (the same full input on every rank)
    x_full = torch.randn(S, B, H, device=DEVICE)
    grads, calls = [], [0]
    tracker = tpd.get_rng_state_tracker()
    saved = tracker.get_states()

    def forward(x):
        calls[0] += 1
        return module(x)

    for checkpointed in (False, True):
        tracker.reset()
        tracker.add(tpd.MODEL_PARALLEL_RNG, 100 + rank)
        torch.manual_seed(0)  # (the same weights, and the same default random state, in both runs)
        module = te.TransformerLayer(H, FFN, 4, hidden_dropout=0.1, attention_dropout=0.1, params_dtype=torch.float32,
                                     device=DEVICE, set_parallel_mode=True, tp_group=dist.group.WORLD,
                                     sequence_parallel=True)
        for _ in range(2):
            module.zero_grad(set_to_none=True)
            x = tpd.scatter_to_sequence_parallel_region(x_full.clone().requires_grad_(), dist.group.WORLD)
            with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=4)):
                out = te.checkpoint(forward, x) if checkpointed else forward(x)
            out.pow(2).sum().backward()
        grads.append([p.grad for p in module.parameters()])
    tracker.set_states(saved)
    return {"grads_equal": all(torch.equal(a, b) for a, b in zip(*grads)), "recomputed": calls[0] == 6}


def _worker(rank):
    local = {"reduce_from_tp": _reduce_from_tp_checks(rank), "checkpoint": _checkpoint_checks(rank)}
    for name in CASES:
        try:
            _compare_case(name, rank, local)
        except Exception:  # reported per case by the tests
            local[f"{name}/exception"] = traceback.format_exc()
    local["errors"] = _errors_in_group(rank)
    return local


@pytest.fixture(scope="module")
def tp_results():
    """Every rank's {check: value} (tests.dist_utils.RankResults): the tests check each rank's."""
    return run_workers_per_rank(_worker)


def _case_checks(results, name, label):
    """The relative-error checks of a case and label ("name/label/what"), after asserting no rank raised in it."""
    results.assert_absent(f"{name}/exception")
    checks = [k for k in results.keys() if k.startswith(f"{name}/{label}/")]
    assert len(checks) >= 3  # out, dx and at least one parameter gradient
    return checks


def _check_errors_below(results, name, label, tol):
    for check in _case_checks(results, name, label):
        results.check_each(check, lambda err: err < tol, f"a relative error below {tol:.1e}")
    results.check_each(f"{name}/shapes/{label}", lambda shapes: all(got == want for got, want in shapes.values()),
                       "every (got, expected) shape pair equal")


@pytest.mark.parametrize("name", CASES)
def test_weights_are_created_as_the_rank_part_of_the_full_init(tp_results, name):
    tp_results.assert_absent(f"{name}/exception")
    tp_results.check_each(f"{name}/init", lambda err: err == 0.0, "0.0")


@pytest.mark.parametrize("name", CASES)
def test_matches_single_process_outside_autocast(tp_results, name):
    tol = (HP_TOL_ATTENTION if "attention" in name or "transformer" in name else HP_TOL)[DEVICE]
    _check_errors_below(tp_results, name, "hp", tol)


@pytest.mark.parametrize("label", FP8_LABELS)
@pytest.mark.parametrize("name", CASES)
def test_matches_single_process_inside_fp8_autocast(tp_results, name, label):
    """Delayed and current scaling: every rank casts with the single-process module's scales."""
    _check_errors_below(tp_results, name, label, 5e-3)
    # the scales were set from amaxes, TP-reduced: the single-process ones, on every rank
    tp_results.check_each(f"{name}/scales_moved/{label}", lambda frac: frac > 0.5, "most scales moved from 1")
    tp_results.check_each(f"{name}/scales_vs_single/{label}", lambda err: err < 1e-6, "the single-process scales")
    tp_results.check_each(f"{name}/scales_across_ranks/{label}", lambda err: err == 0.0, "one scale on all ranks")
    # (the FP8 path ran: its output differs from float32's)
    tp_results.check_each(f"{name}/fp8_vs_hp/{label}", lambda err: err > 1e-3, "FP8 differing from float32")


@pytest.mark.parametrize("label", FP8_LABELS)
@pytest.mark.parametrize("name", CASES)
def test_amax_histories_agree_across_ranks_and_with_single_process(tp_results, name, label):
    """With amaxes reduced over the TP group, every rank holds the same amax histories (exactly), and they are the
    single-process module's (which every rank built alike)."""
    tp_results.assert_absent(f"{name}/exception")
    histories = tp_results.same_on_every_rank(f"{name}/amax_histories/{label}")
    single = tp_results.same_on_every_rank(f"{name}/single_amax_histories/{label}")
    assert histories.keys() == single.keys()
    for module_name, pair in histories.items():
        for kind, got, want in zip(("forward", "backward"), pair, single[module_name]):
            assert got.shape == want.shape, (module_name, kind)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0, msg=lambda m: f"{module_name} {kind}: {m}")


@pytest.mark.parametrize("name", CASES)
def test_per_rank_delayed_scales_stay_within_fp8_tolerance(tp_results, name):
    """reduce_amax=False: sharded tensors get per-rank scales (the gathered input is cast after a high-precision
    gather), so results differ from the single-process module's by FP8 roundings only."""
    _check_errors_below(tp_results, name, "fp8_per_rank", FP8_RTOL[torch.float8_e5m2])
    tp_results.check_each(f"{name}/fp8_vs_hp/fp8_per_rank", lambda err: err > 1e-3, "FP8 differing from float32")


@pytest.mark.parametrize("name", CASES)
def test_block_scaling_stays_within_fp8_tolerance(tp_results, name):
    """Float8BlockScaling: each rank casts its own tiles (the gathered input after a high-precision gather), so
    results differ from the single-process module's by FP8 roundings only."""
    _check_errors_below(tp_results, name, "fp8_block", FP8_RTOL[torch.float8_e4m3fn])
    tp_results.check_each(f"{name}/fp8_vs_hp/fp8_block", lambda err: err > 1e-3, "FP8 differing from float32")


@pytest.mark.parametrize("name", GATHERS)
def test_sequence_parallel_gathers_fp8_inside_autocast(tp_results, name):
    """Forward: one all-gather per column-parallel GEMM, of the whole [S, B, H] input, as FP8 bytes (uint8: half of
    BF16's) inside fp8_autocast with shared scales, in float32 outside it and with per-rank scales. Backward: the
    dgrad of each gathered input is reduce-scattered in high precision."""
    gathered = S * B * H
    expected_forward = {"hp": "float32", "fp8": "uint8", "fp8_current": "uint8", "fp8_per_rank": "float32",
                        "fp8_block": "float32"}
    for label, dtype in expected_forward.items():
        for rank, (forward, backward) in tp_results.each(f"{name}/collectives/{label}"):
            gathers = [c for c in forward if c[0] == "all_gather_into_tensor"]
            assert gathers == [("all_gather_into_tensor", dtype, gathered)] * GATHERS[name], (rank, label, forward)
            scatters = [c for c in backward if c[0] == "reduce_scatter_tensor"]
            assert scatters.count(("reduce_scatter_tensor", "float32", gathered)) >= GATHERS[name], (
                rank, label, backward)
            assert not any(c[1] == "uint8" for c in backward), (rank, label, backward)


@pytest.mark.parametrize("name", CASES)
def test_every_rank_issues_the_same_collectives(tp_results, name):
    """The ranks of a group must issue the same collectives in the same order (else they would hang or mix up
    buffers): the recorded lists agree across ranks, for every label."""
    for label in RECIPES:
        tp_results.same_on_every_rank(f"{name}/collectives/{label}")


# FP8 backward: the collectives that sum a column-parallel input's dgrad, started before the wgrad GEMM (overlapping it)
DGRAD_SUMS = {"column": [], "row": [], "row_sp": [], "column_sp": ["reduce_scatter_tensor"],
              "layernorm_linear": ["all_reduce"], "layernorm_linear_sp": ["reduce_scatter_tensor"],
              "layernorm_mlp": ["all_reduce"], "layernorm_mlp_sp": ["reduce_scatter_tensor"],
              "multihead_attention": ["all_reduce"], "transformer_layer": ["all_reduce"] * 2,
              "transformer_layer_sp": ["reduce_scatter_tensor"] * 2}


@pytest.mark.parametrize("name", DGRAD_SUMS)
def test_dgrad_sums_overlap_the_wgrad_gemm_inside_fp8_autocast(tp_results, name):
    """(Linear without SP sums its input gradient outside its Function, after the wgrad: not overlapped.)"""
    for label in FP8_LABELS:
        tp_results.check_each(f"{name}/started_async/{label}", lambda got: got == DGRAD_SUMS[name],
                              repr(DGRAD_SUMS[name]))
    tp_results.check_each(f"{name}/started_async/hp", lambda got: got == [], "[]")


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith(HAS_NORM)])
def test_norms_run_on_this_ranks_sequence_block(tp_results, name):
    rows = S * B // WORLD if CASES[name][2] else S * B
    for label in RECIPES:
        tp_results.check_each(f"{name}/norm_rows/{label}", lambda norm_rows: bool(norm_rows) and
                              set(norm_rows) == {rows}, f"every norm on {rows} rows")


@pytest.mark.parametrize("check", ["out_features", "in_features", "ffn_hidden_size", "tp_size", "sequence_parallel",
                                   "parallel_mode", "fp8_group", "inp", "residual"])
def test_bad_arguments_in_a_group_raise_naming_the_argument(tp_results, check):
    """Every rank raises (fp8_group: checked on rank 0 only, the one rank in the group given)."""
    ranks = [0] if check == "fp8_group" else range(WORLD)
    for rank, errors in tp_results.each("errors"):
        if rank in ranks:
            assert errors[check].startswith(f"{check}:"), f"rank {rank}: {errors[check]}"


@pytest.mark.parametrize("build, match", [
    (lambda: te.Linear(H, N, device="cpu", parallel_mode="diagonal"), "parallel_mode"),
    (lambda: te.Linear(H, N, device="cpu", tp_size=2, parallel_mode="column"), "tp_group"),
    (lambda: te.Linear(H, N, device="cpu", sequence_parallel=True, parallel_mode="column"), "tp_group"),
    (lambda: te.LayerNormMLP(H, FFN, device="cpu", sequence_parallel=True, set_parallel_mode=True), "tp_group"),
    (lambda: te.Linear(H, N, device="cpu", tp_size=0), "tp_size"),
])
def test_bad_arguments_without_a_group(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_rng_tracker_forks_named_states_and_keeps_the_default_one():
    tracker = tpd.RNGStatesTracker()
    tracker.add("model-parallel-rng", 123)
    torch.manual_seed(7)
    with tracker.fork():
        first = torch.rand(5)
    default_draw = torch.rand(5)
    with tracker.fork():
        second = torch.rand(5)
    torch.manual_seed(123)
    expected = torch.rand(10)
    torch.manual_seed(7)
    assert torch.equal(default_draw, torch.rand(5))  # the forks did not advance the default state
    assert torch.equal(torch.cat([first, second]), expected)  # the named state continues where it stopped
    with pytest.raises(ValueError, match="name"):
        tracker.add("model-parallel-rng", 1)
    with pytest.raises(KeyError, match="name"):
        with tracker.fork("missing"):
            pass


def test_model_parallel_rng_forks_only_when_active_and_added():
    tracker = tpd.get_rng_state_tracker()
    saved = tracker.get_states()
    try:
        tracker.reset()
        torch.manual_seed(3)
        with tpd.model_parallel_rng(True):  # no state added: the default stream
            first = torch.rand(3)
        torch.manual_seed(3)
        assert torch.equal(first, torch.rand(3))
        tracker.add(tpd.MODEL_PARALLEL_RNG, 11)
        torch.manual_seed(3)
        with tpd.model_parallel_rng(False):
            assert torch.equal(torch.rand(3), first)
        with tpd.model_parallel_rng(True):
            forked = torch.rand(3)
        torch.manual_seed(11)
        assert torch.equal(forked, torch.rand(3))
    finally:
        tracker.set_states(saved)


@pytest.mark.parametrize("check", ["grads_equal", "recomputed"])
def test_checkpointed_sequence_parallel_layer_matches_uncheckpointed(tp_results, check):
    tp_results.check_each("checkpoint", lambda flags: flags[check] is True, f"{check} True")


@pytest.mark.parametrize("check", ["in_place", "sum", "grad", "view_untouched", "saved_raises"])
def test_reduce_from_tensor_parallel_region_sums_in_place(tp_results, check):
    tp_results.check_each("reduce_from_tp", lambda flags: flags[check] is True, f"{check} True")


def test_rank_results_check_every_rank_and_name_the_one_that_fails():
    """The harness itself (no processes): a value wrong on rank 1 only fails, naming rank 1, for floats, flags,
    lists and tensors alike."""
    from tests.dist_utils import RankResults
    results = RankResults([{"err": 0.0, "flags": {"ok": True}, "rows": [16], "hist": torch.ones(2, 3)},
                           {"err": 0.5, "flags": {"ok": False}, "rows": [32], "hist": torch.ones(2, 3) * 2}])
    with pytest.raises(AssertionError, match=r"^rank 1: err = 0\.5"):
        results.check_each("err", lambda err: err == 0.0)
    with pytest.raises(AssertionError, match=r"^rank 1: flags"):
        results.check_each("flags", lambda flags: flags["ok"] is True)
    for key in ("rows", "hist"):
        with pytest.raises(AssertionError, match=rf"(?s){key}: differs across ranks: rank 0: .*rank 1: "):
            results.same_on_every_rank(key)
    with pytest.raises(AssertionError, match=r"missing on rank\(s\) \[0\]"):
        RankResults([{}, {"err": 0.0}]).each("err")
    with pytest.raises(AssertionError, match="rank 1:\nboom"):
        RankResults([{}, {"case/exception": "boom"}]).assert_absent("case/exception")
    assert RankResults([{"t": torch.tensor([float("nan")])}] * 2).same_on_every_rank("t").isnan().all()
