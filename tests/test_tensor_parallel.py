"""Tensor and sequence parallelism on CPU: 2 processes (gloo), one spawned job for the whole file.

Each case builds the single-process module and its TP=2 counterpart, loads the full state dict into the TP one
(sliced by rank), feeds both the same full input (the TP one its shard: dim 0 with sequence_parallel, last dim for
row-parallel) and checks the output and every gradient against the matching part of the single-process ones: outside
fp8_autocast (float32) and inside it (delayed scaling, second step: the scales then come from amaxes reduced over the
TP group and must equal the single-process module's).
"""
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import transformer_fp8 as te
from transformer_fp8 import distributed as tpd
from transformer_fp8 import recipe
from tests.utils import rel_error

WORLD = 2
S, B, H, N, FFN = 6, 3, 32, 48, 64  # sequence, batch, hidden, Linear/LayerNormLinear width, MLP ffn width


def _linear(**tp):
    return te.Linear(H, N, params_dtype=torch.float32, device="cpu", **tp)


def _row_linear(**tp):
    return te.Linear(N, H, params_dtype=torch.float32, device="cpu", **tp)


def _ln_linear(**tp):
    return te.LayerNormLinear(H, N, params_dtype=torch.float32, device="cpu", **tp)


def _mlp(activation="gelu", normalization="LayerNorm"):
    def make(parallel_mode=None, **tp):
        return te.LayerNormMLP(H, FFN, activation=activation, normalization=normalization,
                               params_dtype=torch.float32, device="cpu", set_parallel_mode=parallel_mode is not None,
                               **tp)
    return make


def _attention(parallel_mode=None, **tp):
    return te.MultiheadAttention(H, 4, num_gqa_groups=2, attention_dropout=0.0, input_layernorm=True,
                                 params_dtype=torch.float32, device="cpu", set_parallel_mode=parallel_mode is not None,
                                 **tp)


def _transformer_layer(parallel_mode=None, **tp):
    return te.TransformerLayer(H, FFN, 4, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
                               device="cpu", set_parallel_mode=parallel_mode is not None, **tp)


# name: (constructor, parallel_mode, sequence_parallel, input split, output split, input width)
# splits: None (full), "seq" (this rank's dim-0 block), "last" (this rank's last-dim block)
CASES = {
    "column": (_linear, "column", False, None, "last", H),
    "column_sp": (_linear, "column", True, "seq", "last", H),
    "row": (_row_linear, "row", False, "last", None, N),
    "row_sp": (_row_linear, "row", True, "last", "seq", N),
    "layernorm_linear": (_ln_linear, "column", False, None, "last", H),
    "layernorm_linear_sp": (_ln_linear, "column", True, "seq", "last", H),
    "layernorm_mlp": (_mlp(), "column", False, None, None, H),
    "layernorm_mlp_sp": (_mlp(), "column", True, "seq", "seq", H),
    "layernorm_mlp_swiglu_rmsnorm_sp": (_mlp("swiglu", "RMSNorm"), "column", True, "seq", "seq", H),
    "multihead_attention": (_attention, "column", False, None, None, H),
    "multihead_attention_sp": (_attention, "column", True, "seq", "seq", H),
    "transformer_layer": (_transformer_layer, "column", False, None, None, H),
    "transformer_layer_sp": (_transformer_layer, "column", True, "seq", "seq", H),
}


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


def _step(module, x_full, dy_full, in_split, out_split, sp, rank):
    """One forward and backward: (output, input gradient (full), {name: grad})."""
    module.zero_grad(set_to_none=True)
    x = x_full.clone().requires_grad_()
    if in_split == "seq":
        inp = tpd.scatter_to_sequence_parallel_region(x, dist.group.WORLD) if sp else x
    else:
        inp = _part(x, in_split, rank)
    out = module(inp)
    (out * _part(dy_full, out_split, rank)).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


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
    x_full, dy_full = torch.randn(S, B, width), torch.randn(S, B, H if out_split != "last" else N)
    ref_outs = {}
    for label, fp8 in (("hp", False), ("fp8", True)):
        fp8_recipe = recipe.DelayedScaling(amax_history_len=2)
        outs = []
        for module, splits in ((ref, (None, None, False)), (tp, (in_split, out_split, sp))):
            for _ in range(2 if fp8 else 1):  # FP8: the second step runs on the reduced amaxes' scales
                with te.fp8_autocast(enabled=fp8, fp8_recipe=fp8_recipe):
                    out, dx, grads = _step(module, x_full, dy_full, *splits, rank)
            outs.append((out, dx, grads))
        (ref_out, ref_dx, ref_grads), (out, dx, grads) = outs
        ref_outs[label] = ref_out
        dx_part = _part(ref_dx, in_split if in_split == "last" else None, rank)
        dx_local = _part(dx, in_split if in_split == "last" else None, rank)
        results[f"{name}/{label}/out"] = rel_error(out, _part(ref_out, out_split, rank))
        results[f"{name}/{label}/dx"] = rel_error(dx_local, dx_part)
        for n, g in grads.items():
            results[f"{name}/{label}/d{n}"] = rel_error(g, _param_part(ref_grads[n], g, rank, blocks(n)))
        if fp8:
            results[f"{name}/fp8_vs_hp"] = rel_error(ref_outs["fp8"], ref_outs["hp"])  # FP8 did run
            results[f"{name}/fp8/scales"] = rel_error(_scales(tp), _scales(ref))
            results[f"{name}/fp8_scales_moved"] = float((_scales(ref) != 1).float().mean())


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


def _worker(rank, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        local = {}
        for name in CASES:
            try:
                _compare_case(name, rank, local)
            except Exception:  # reported per case by the tests
                local[f"{name}/exception"] = traceback.format_exc()
        local["errors"] = _errors_in_group(rank)
        results[rank] = local
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_results():
    """{check: value} merged over the ranks (the worse of the two errors)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    shared = manager.dict()
    mp.spawn(_worker, args=(port, shared), nprocs=WORLD, join=True)
    per_rank = [dict(shared[r]) for r in range(WORLD)]
    merged = {}
    for local in per_rank:
        for key, value in local.items():
            if isinstance(value, float):
                merged[key] = max(merged.get(key, 0.0), value)
            elif key not in merged:
                merged[key] = value
    merged["errors"] = {**per_rank[1]["errors"], **per_rank[0]["errors"]}
    return merged


def _case_results(results, name, label):
    assert f"{name}/exception" not in results, results[f"{name}/exception"]
    checks = {k: v for k, v in results.items() if k.startswith(f"{name}/{label}/") and not k.endswith("scales")}
    assert len(checks) >= 3  # out, dx and at least one parameter gradient
    return checks


@pytest.mark.parametrize("name", CASES)
def test_weights_are_created_as_the_rank_part_of_the_full_init(tp_results, name):
    assert f"{name}/exception" not in tp_results, tp_results[f"{name}/exception"]
    assert tp_results[f"{name}/init"] == 0.0


@pytest.mark.parametrize("name", CASES)
def test_matches_single_process_outside_autocast(tp_results, name):
    for check, err in _case_results(tp_results, name, "hp").items():
        assert err < 1e-5, f"{check}: relative error {err:.2e}"


@pytest.mark.parametrize("name", CASES)
def test_matches_single_process_inside_fp8_autocast(tp_results, name):
    for check, err in _case_results(tp_results, name, "fp8").items():
        assert err < 5e-3, f"{check}: relative error {err:.2e}"
    assert tp_results[f"{name}/fp8_scales_moved"] > 0.5  # the second step ran on updated scales...
    assert tp_results[f"{name}/fp8/scales"] < 1e-6  # ...and the TP-reduced amaxes give the single-process ones
    assert tp_results[f"{name}/fp8_vs_hp"] > 1e-3  # (the FP8 path ran: its output differs from float32's)


@pytest.mark.parametrize("check", ["out_features", "in_features", "ffn_hidden_size", "tp_size", "sequence_parallel",
                                   "parallel_mode", "fp8_group"])
def test_bad_arguments_in_a_group_raise_naming_the_argument(tp_results, check):
    assert tp_results["errors"][check].startswith(f"{check}:"), tp_results["errors"][check]


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
