"""moe_permute_rows / moe_unpermute_rows / moe_merging_probs_grad: CPU reference vs float64 formulas written from the
contract, CUDA vs the CPU reference (bit for bit: both round each product and sum in slot order), opcheck, bad
inputs; and moe_permute / moe_unpermute (transformer_fp8.permutation) vs a per-token float64 loop, values and
gradients, mask and index routing, dropped rows, FP8 operands."""
import pytest
import torch

import transformer_fp8  # noqa: F401  (registers the ops)
from transformer_fp8.grouped_gemm import padded_rows_bound
from transformer_fp8.permutation import moe_permute, moe_unpermute
from transformer_fp8.quantization import FP8Operand

ops = torch.ops.transformer_fp8
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def random_routing(tokens, experts, topk, device="cpu"):
    """(mask [T, E] bool, indices [T, topk] int64, probs [T, E] float32 (softmax over the chosen experts))."""
    scores = torch.randn(tokens, experts, device=device)
    top = scores.topk(topk, dim=1)
    mask = torch.zeros(tokens, experts, dtype=torch.bool, device=device).scatter_(1, top.indices, True)
    probs = torch.zeros(tokens, experts, device=device).scatter_(1, top.indices, top.values.softmax(1))
    return mask, top.indices, probs


def permute_ref(inp, mask):
    """float64 permuted rows, expert by expert, token order within an expert; and (token, expert) of each row."""
    order = [(t, e) for e in range(mask.shape[1]) for t in range(mask.shape[0]) if mask[t, e]]
    rows = torch.stack([inp[t].double() for t, _ in order]) if order else inp.new_zeros(0, inp.shape[1]).double()
    return rows, order


# ---------------------------------------------------------------------------------------------- ops, CPU reference
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_probs", (False, True))
def test_permute_rows_matches_formula(dtype, with_probs):
    tokens, slots, hidden = 9, 3, 20
    inp = torch.randn(tokens, hidden, dtype=dtype)
    slot_of_row = torch.tensor([5, -1, 0, 26, 13, 27, -3, 2], dtype=torch.int32)  # 27, -3: out of range -> zeros
    probs = torch.rand(tokens, slots) if with_probs else None
    out = ops.moe_permute_rows(inp, slot_of_row, slots, probs)
    assert out.shape == (8, hidden) and out.dtype == dtype
    for n, slot in enumerate(slot_of_row.tolist()):
        if not 0 <= slot < tokens * slots:
            assert torch.equal(out[n], torch.zeros(hidden, dtype=dtype))
            continue
        ref = inp[slot // slots].double() * (probs.view(-1)[slot].double() if with_probs else 1)
        torch.testing.assert_close(out[n].double(), ref, rtol=2 ** -8 if dtype != torch.float32 else 1e-6, atol=0)


@pytest.mark.parametrize("fp8_dtype", (torch.float8_e4m3fn, torch.float8_e5m2))
def test_permute_rows_moves_fp8_bytes(fp8_dtype):
    inp = torch.randn(6, 32).to(fp8_dtype)
    slot_of_row = torch.tensor([3, 0, -1, 11], dtype=torch.int32)
    out = ops.moe_permute_rows(inp, slot_of_row, 2)
    assert out.dtype == fp8_dtype
    bytes_in, bytes_out = inp.view(torch.uint8), out.view(torch.uint8)
    assert torch.equal(bytes_out[0], bytes_in[1]) and torch.equal(bytes_out[1], bytes_in[0])
    assert torch.equal(bytes_out[2], torch.zeros(32, dtype=torch.uint8))
    assert torch.equal(bytes_out[3], bytes_in[5])


def routed_slots(row_id_map, rows):
    """(token, slot, row) of every slot of row_id_map [tokens, slots] whose row is in [0, rows)."""
    tokens, slots = row_id_map.shape
    routes = [(t, s, int(row_id_map[t, s])) for t in range(tokens) for s in range(slots)]
    return [(t, s, r) for t, s, r in routes if 0 <= r < rows]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_probs", (False, True))
def test_unpermute_rows_and_probs_grad_match_formula(dtype, with_probs):
    tokens, slots, rows, hidden = 7, 4, 10, 24
    inp = torch.randn(rows, hidden, dtype=dtype)
    row_id_map = torch.randint(-1, rows, (tokens, slots), dtype=torch.int32)
    row_id_map[0, 0] = rows + 3  # out of range: skipped
    probs = torch.rand(tokens, slots) if with_probs else None
    out = ops.moe_unpermute_rows(inp, row_id_map, probs)
    ref = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t, s, r in routed_slots(row_id_map, rows):
        ref[t] += inp[r].double() * (float(probs[t, s]) if with_probs else 1.0)
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    grad = torch.randn(tokens, hidden, dtype=dtype)
    d_probs = ops.moe_merging_probs_grad(grad, inp, row_id_map)
    ref_d = torch.zeros(tokens, slots, dtype=torch.float64)
    for t, s, r in routed_slots(row_id_map, rows):
        ref_d[t, s] = (grad[t].double() * inp[r].double()).sum()
    assert d_probs.dtype == torch.float32
    torch.testing.assert_close(d_probs.double(), ref_d, rtol=1e-5, atol=1e-5)


def opcheck_args(device):
    inp = torch.randn(6, 16, device=device, dtype=torch.bfloat16)
    slot_of_row = torch.tensor([1, 4, -1, 10, 7], dtype=torch.int32, device=device)
    row_id_map = torch.tensor([[0, -1], [3, 1], [-1, -1], [2, 4]], dtype=torch.int32, device=device)
    probs = torch.rand(6, 2, device=device)
    rows = torch.randn(5, 16, device=device, dtype=torch.bfloat16)
    grad = torch.randn(4, 16, device=device, dtype=torch.bfloat16)
    return [
        ("moe_permute_rows", (inp, slot_of_row, 2)),
        ("moe_permute_rows", (inp, slot_of_row, 2, probs)),
        ("moe_permute_rows", (inp.to(torch.float8_e4m3fn), slot_of_row, 2)),
        ("moe_unpermute_rows", (rows, row_id_map)),
        ("moe_unpermute_rows", (rows, row_id_map, probs[:4])),
        ("moe_merging_probs_grad", (grad, rows, row_id_map)),
    ]


# opcheck's test_schema compares inputs before/after with torch.allclose, which has no float8 kernel: skipped for FP8.
FP8_OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def run_opcheck(device):
    for name, args in opcheck_args(device):
        utils = FP8_OPCHECK_UTILS if args[0].dtype.itemsize == 1 else None
        torch.library.opcheck(getattr(ops, name).default, args, **({"test_utils": utils} if utils else {}))


def test_opcheck_cpu():
    run_opcheck("cpu")


def _bad(device):
    inp = torch.randn(4, 8, device=device)
    slots = torch.zeros(3, dtype=torch.int32, device=device)
    rmap = torch.zeros(4, 2, dtype=torch.int32, device=device)
    return [
        (lambda: ops.moe_permute_rows(inp[0], slots, 2), r"inp: expected a 2-D tensor \[rows, hidden\]"),
        (lambda: ops.moe_permute_rows(inp.t(), slots, 2), "inp: expected a contiguous tensor"),
        (lambda: ops.moe_permute_rows(inp, slots.long(), 2), "slot_of_row: expected an int32 tensor"),
        (lambda: ops.moe_permute_rows(inp, slots, 0), "slots_per_token: expected >= 1"),
        (lambda: ops.moe_permute_rows(inp, slots, 2, torch.ones(5, device=device)), "probs: expected 8 elements"),
        (lambda: ops.moe_permute_rows(inp.to(torch.float8_e4m3fn), slots, 2, torch.ones(8, device=device)),
         "probs: not supported with an FP8 inp"),
        (lambda: ops.moe_unpermute_rows(inp.to(torch.float8_e4m3fn), rmap), "inp: expected a float32, float16"),
        (lambda: ops.moe_unpermute_rows(inp, rmap[0]), "row_id_map: expected a 2-D tensor"),
        (lambda: ops.moe_unpermute_rows(inp, rmap, torch.ones(4, 2, dtype=torch.float16, device=device)),
         "probs: expected a float32 tensor"),
        (lambda: ops.moe_merging_probs_grad(inp, inp.half(), rmap), "inp: expected (torch.float32|Float) rows of 8"),
        (lambda: ops.moe_merging_probs_grad(inp[:3], inp, rmap), "row_id_map: expected 3 rows"),
    ]


@pytest.mark.parametrize("case", range(len(_bad("cpu"))))
def test_cpu_bad_inputs_raise(case):
    call, match = _bad("cpu")[case]
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        call()


# --------------------------------------------------------------------------------- moe_permute / moe_unpermute API
@pytest.mark.parametrize("map_type", ("mask", "index"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_permute_unpermute_match_loop(map_type, dtype, device="cpu"):
    tokens, experts, topk, hidden = 13, 5, 2, 16
    mask, indices, probs_e = random_routing(tokens, experts, topk, device)
    inp = torch.randn(tokens, hidden, dtype=dtype, device=device, requires_grad=True)
    routing = mask if map_type == "mask" else indices
    probs = probs_e if map_type == "mask" else probs_e.gather(1, indices)
    probs = probs.clone().requires_grad_(True)
    permuted, row_id_map, counts = moe_permute(inp, routing, num_out_tokens=tokens * topk, map_type=map_type,
                                               return_tokens_per_expert=True, num_experts=experts)
    ref_rows, order = permute_ref(inp.detach().cpu(), mask.cpu())
    assert torch.equal(permuted.detach().cpu().double(), ref_rows)
    assert counts.dtype == torch.int32 and counts.tolist() == mask.sum(0).tolist()
    expert_out = torch.randn(tokens * topk, hidden, dtype=dtype, device=device, requires_grad=True)
    out = moe_unpermute(expert_out, row_id_map, probs, restore_shape=(tokens, hidden), map_type=map_type)
    ref = torch.zeros(tokens, hidden, dtype=torch.float64)
    for n, (t, e) in enumerate(order):
        ref[t] += probs_e[t, e].cpu().double() * expert_out[n].detach().cpu().double()
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(out.detach().cpu().double(), ref, rtol=tol, atol=tol)
    # gradients: autograd through float64 loops of the same formulas
    grad_out, grad_perm = torch.randn_like(out), torch.randn_like(permuted)
    (out * grad_out).sum().backward()
    (permuted * grad_perm).sum().backward()
    x64 = inp.detach().cpu().double().requires_grad_(True)
    y64 = expert_out.detach().cpu().double().requires_grad_(True)
    p64 = probs_e.cpu().double().requires_grad_(True)
    slot = {(t, e): k for t in range(tokens) for k, e in enumerate(indices[t].tolist())}
    ref_out = torch.stack([sum(p64[t, e] * y64[n] for n, (tt, e) in enumerate(order) if tt == t)
                           for t in range(tokens)])
    ref_perm = torch.stack([x64[t] for t, _ in order])
    (ref_out * grad_out.cpu().double()).sum().backward()
    (ref_perm * grad_perm.cpu().double()).sum().backward()
    torch.testing.assert_close(inp.grad.cpu().double(), x64.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(expert_out.grad.cpu().double(), y64.grad, rtol=tol, atol=tol)
    ref_dp = p64.grad if map_type == "mask" else p64.grad.gather(1, indices.cpu())
    if map_type == "mask":
        ref_dp = ref_dp * mask.cpu()  # unrouted slots get no gradient
    torch.testing.assert_close(probs.grad.cpu().double(), ref_dp, rtol=1e-4,
                               atol=1e-4 if dtype == torch.float32 else 0.05)
    assert all(slot)  # (every chosen expert has a slot)


def test_dropped_rows_and_padding():
    tokens, experts, hidden = 6, 3, 8
    mask, _, _ = random_routing(tokens, experts, 2)
    inp = torch.randn(tokens, hidden)
    full, _ = moe_permute(inp, mask)  # counts on the host (no num_out_tokens)
    assert full.shape == (12, hidden)
    dropped, row_id_map = moe_permute(inp, mask, num_out_tokens=7)
    assert torch.equal(dropped, full[:7])
    assert int((row_id_map >= 0).sum()) == 7
    padded, _ = moe_permute(inp, mask, num_out_tokens=15)
    assert torch.equal(padded[:12], full) and torch.equal(padded[12:], torch.zeros(3, hidden))


def segments(counts):
    """[(start, end)] of each expert's rows from the per-expert counts."""
    ends = torch.cumsum(counts.cpu(), 0).tolist()
    return list(zip([0] + ends[:-1], ends))


@pytest.mark.parametrize("map_type", ("mask", "index"))
@pytest.mark.parametrize("align_size", (4, 16))
def test_aligned_permute_pads_each_expert(map_type, align_size, device="cpu"):
    tokens, experts, topk, hidden = 37, 6, 2, 8
    mask, indices, probs_e = random_routing(tokens, experts, topk, device)
    others = torch.tensor([0, 1, 3, 4, 5], device=device)  # (expert 2 gets no token: its padded count is 0)
    indices = torch.stack([others[torch.randperm(5, device=device)[:topk]] for _ in range(tokens)])
    mask = torch.zeros_like(mask).scatter_(1, indices, True)
    routing = mask if map_type == "mask" else indices
    probs = probs_e.masked_fill(~mask, 0.0) if map_type == "mask" else torch.rand(tokens, topk, device=device)
    inp = torch.randn(tokens, hidden, device=device, requires_grad=True)
    args = dict(num_out_tokens=int(mask.sum()), map_type=map_type, return_tokens_per_expert=True,
                num_experts=experts)
    plain, plain_map, plain_counts = moe_permute(inp, routing, **args)
    padded, padded_map, counts = moe_permute(inp, routing, align_size=align_size, **args)
    assert padded.shape == (padded_rows_bound(int(mask.sum()), experts, align_size), hidden)
    assert counts.dtype == torch.int32 and int(counts.sum()) == padded.shape[0]
    assert all(c % align_size == 0 for c in counts.tolist()) and counts[2] == 0
    for e, ((p0, p1), (q0, q1)) in enumerate(zip(segments(plain_counts), segments(counts))):
        assert q0 % align_size == 0 and q1 - q0 >= p1 - p0 and (e == experts - 1 or q1 - q0 < p1 - p0 + align_size)
        assert torch.equal(padded[q0:q0 + p1 - p0], plain[p0:p1])
        assert torch.equal(padded[q0 + p1 - p0:q1], torch.zeros_like(padded[q0 + p1 - p0:q1]))
    # the same expert outputs at the padded rows (garbage in the padding) unpermute to the same tokens and gradients
    plain_out = torch.randn(plain.shape, device=device)
    padded_out = torch.randn(padded.shape, device=device)
    for (p0, p1), (q0, _) in zip(segments(plain_counts), segments(counts)):
        padded_out[q0:q0 + p1 - p0] = plain_out[p0:p1]
    results = []
    for rows, row_map, out in ((plain, plain_map, plain_out), (padded, padded_map, padded_out)):
        inp.grad = None
        out, prob = out.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        merged = moe_unpermute(out, row_map, prob, map_type=map_type)
        (merged.sum() + (rows * rows.detach()).sum()).backward()
        results.append((merged, inp.grad, prob.grad, out.grad))
    (merged, d_inp, d_prob, d_out), (merged_a, d_inp_a, d_prob_a, d_out_a) = results
    torch.testing.assert_close(merged_a, merged, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(d_inp_a, d_inp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(d_prob_a, d_prob, rtol=1e-5, atol=1e-5)
    for (p0, p1), (q0, q1) in zip(segments(plain_counts), segments(counts)):
        assert torch.equal(d_out_a[q0:q0 + p1 - p0], d_out[p0:p1])
        assert torch.equal(d_out_a[q0 + p1 - p0:q1], torch.zeros_like(d_out_a[q0 + p1 - p0:q1]))


def test_aligned_permute_with_dropped_rows():
    tokens, experts, hidden = 20, 4, 8
    mask, _, _ = random_routing(tokens, experts, 2)
    plain, _, plain_counts = moe_permute(torch.arange(tokens * hidden, dtype=torch.float32).view(tokens, hidden),
                                         mask, num_out_tokens=23, return_tokens_per_expert=True)
    padded, row_id_map, counts = moe_permute(torch.arange(tokens * hidden, dtype=torch.float32).view(tokens, hidden),
                                             mask, num_out_tokens=23, return_tokens_per_expert=True, align_size=8)
    assert int((row_id_map >= 0).sum()) == 23 and padded.shape[0] == padded_rows_bound(23, experts, 8)
    for (p0, p1), (q0, q1) in zip(segments(plain_counts), segments(counts)):
        assert torch.equal(padded[q0:q0 + p1 - p0], plain[p0:p1]) and not padded[q0 + p1 - p0:q1].any()


def test_fp8_operand_keeps_scale():
    tokens, hidden = 8, 32
    mask, _, _ = random_routing(tokens, 4, 2)
    x = torch.randn(tokens, hidden)
    scale_inv = torch.tensor([0.01])
    operand = FP8Operand((x / scale_inv).to(torch.float8_e4m3fn), None, scale_inv, torch.float8_e4m3fn)
    permuted, _ = moe_permute(operand, mask, num_out_tokens=16)
    assert isinstance(permuted, FP8Operand) and permuted.scale_inv is scale_inv and permuted.data_t is None
    assert permuted.fp8_dtype == torch.float8_e4m3fn
    ref, _ = moe_permute(operand.data.float(), mask, num_out_tokens=16)
    assert torch.equal(permuted.data.float(), ref)


def test_api_bad_inputs():
    inp, mask = torch.randn(4, 8), torch.ones(4, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="map_type: expected 'mask' or 'index'"):
        moe_permute(inp, mask, map_type="dense")
    with pytest.raises(ValueError, match="routing_map: expected 4 rows"):
        moe_permute(inp, mask[:3])
    with pytest.raises(TypeError, match="routing_map: expected an integer tensor"):
        moe_permute(inp, mask, map_type="index")
    _, row_id_map = moe_permute(inp, mask, num_out_tokens=8)
    with pytest.raises(ValueError, match=r"merging_probs: expected shape \(4, 2\)"):
        moe_unpermute(torch.randn(8, 8), row_id_map, torch.ones(4, 3))
    with pytest.raises(ValueError, match="restore_shape"):
        moe_unpermute(torch.randn(8, 8), row_id_map, restore_shape=(5, 8))
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="align_size: expected an int >= 1"):
            moe_permute(inp, mask, num_out_tokens=8, align_size=bad)
    with pytest.raises(ValueError, match="num_experts: expected a positive int"):
        moe_permute(inp, torch.zeros(4, 1, dtype=torch.long), map_type="index", align_size=16)


# ------------------------------------------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES + (torch.float8_e4m3fn,))
@pytest.mark.parametrize("hidden", (4096, 20, 7))
def test_cuda_matches_cpu_bitwise(dtype, hidden):
    tokens, slots, rows = 300, 8, 520
    inp = torch.randn(tokens, hidden).to(dtype)
    slot_of_row = torch.randint(-1, tokens * slots, (rows,), dtype=torch.int32)
    probs = torch.rand(tokens, slots) if dtype.itemsize > 1 else None
    out = ops.moe_permute_rows(inp.cuda(), slot_of_row.cuda(), slots, None if probs is None else probs.cuda())
    ref = ops.moe_permute_rows(inp, slot_of_row, slots, probs)
    assert torch.equal(out.cpu().view(torch.uint8), ref.view(torch.uint8))
    if dtype.itemsize == 1:
        return
    rows_in = torch.randn(rows, hidden).to(dtype)
    row_id_map = torch.randint(-1, rows, (tokens, slots), dtype=torch.int32)
    out = ops.moe_unpermute_rows(rows_in.cuda(), row_id_map.cuda(), probs.cuda())
    assert torch.equal(out.cpu(), ops.moe_unpermute_rows(rows_in, row_id_map, probs))
    out = ops.moe_unpermute_rows(rows_in.cuda(), row_id_map.cuda())
    assert torch.equal(out.cpu(), ops.moe_unpermute_rows(rows_in, row_id_map))
    grad = torch.randn(tokens, hidden).to(dtype)
    d_probs = ops.moe_merging_probs_grad(grad.cuda(), rows_in.cuda(), row_id_map.cuda())
    torch.testing.assert_close(d_probs.cpu(), ops.moe_merging_probs_grad(grad, rows_in, row_id_map), rtol=1e-4,
                               atol=1e-4 * hidden ** 0.5)


@pytest.mark.gpu
def test_opcheck_cuda():
    run_opcheck("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(_bad("cpu"))))
def test_cuda_bad_inputs_raise(case):
    call, match = _bad("cuda")[case]
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("map_type", ("mask", "index"))
def test_cuda_api_matches_loop(map_type):
    test_permute_unpermute_match_loop(map_type, torch.bfloat16, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("map_type", ("mask", "index"))
def test_cuda_aligned_permute_pads_each_expert(map_type):
    test_aligned_permute_pads_each_expert(map_type, 16, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("align_size", (1, 16))
def test_cuda_permute_never_syncs(align_size):
    mask, indices, probs = random_routing(4096, 8, 2, "cuda")
    inp = torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for routing, map_type in ((mask, "mask"), (indices, "index")):
            permuted, row_id_map, counts = moe_permute(inp, routing, num_out_tokens=8192, map_type=map_type,
                                                       return_tokens_per_expert=True, num_experts=8,
                                                       align_size=align_size)
            p = probs if map_type == "mask" else probs.gather(1, indices)
            moe_unpermute(permuted, row_id_map, p, map_type=map_type).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
