"""delayed_scaling_update: CPU reference vs a plain-Python model of the recipe, CUDA vs CPU reference (bit-exact)."""
import math
import random

import pytest
import torch

import transformer_fp8  # noqa: F401  (registers the ops)

ops = torch.ops.transformer_fp8
ALGOS = ("max", "most_recent")
# (H, n) of the histories of one update: lengths 1 and longer, slot counts from 0 to a few hundred.
SIZES = ((5, 3), (1, 7), (16, 1), (4, 0), (1024, 2), (3, 300))


class RecipeModel:
    """The delayed-scaling recipe on Python lists of floats: history rows [H][n], scale and scale_inv [n]."""

    def __init__(self, hist, scale, scale_inv):
        self.hist = [list(row) for row in hist]
        self.scale, self.scale_inv = list(scale), list(scale_inv)

    def step(self, fp8_max, margin, algo):
        for j in range(len(self.scale)):
            newest = self.hist[0][j] if math.isfinite(self.hist[0][j]) else 0.0
            column = [newest] + [row[j] for row in self.hist[1:]]
            amax = max(column) if algo == "max" else newest
            for k in range(len(self.hist) - 1, 0, -1):
                self.hist[k][j] = column[k - 1]
            self.hist[0][j] = 0.0
            if amax > 0 and math.isfinite(amax):
                scale = fp8_max / amax / 2.0 ** margin
                if math.isfinite(scale) and scale < 3.4e38:
                    self.scale[j], self.scale_inv[j] = scale, 1.0 / scale


def random_amax(n, special=True):
    """Fresh amaxes for row 0: mostly positive, and (when special) a few 0, NaN, Inf and subnormal ones."""
    values = [random.uniform(0.01, 100.0) for _ in range(n)]
    if special:
        for j in range(n):
            r = random.random()
            values[j] = (0.0 if r < 0.05 else math.nan if r < 0.1 else math.inf if r < 0.13
                         else 1e-44 if r < 0.15 else values[j])
    return values


def make_state(sizes, device="cpu"):
    hists = [torch.zeros(h, n, device=device) for h, n in sizes]
    scales = [torch.rand(n, device=device) + 0.5 for _, n in sizes]
    return hists, scales, [1.0 / s for s in scales]


def assert_matches_model(tensors, model_values, exact):
    values = torch.tensor(model_values, dtype=torch.float64).reshape(tensors.shape)
    if exact:
        assert torch.equal(tensors.double(), values)
    else:
        torch.testing.assert_close(tensors.double(), values, rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------------------------------- CPU reference
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("margin", (0.0, 1.0, 2.5))
@pytest.mark.parametrize("fp8_max", (448.0, 57344.0))
def test_several_steps_match_the_recipe(algo, margin, fp8_max):
    random.seed(7)
    sizes = SIZES[:4] + ((6, 40),)
    hists, scales, scale_invs = make_state(sizes)
    models = [RecipeModel(h.tolist(), s.tolist(), si.tolist()) for h, s, si in zip(hists, scales, scale_invs)]
    for _ in range(9):
        for hist, model in zip(hists, models):
            hist[0] = torch.tensor(random_amax(hist.shape[1]))
            model.hist[0] = hist[0].tolist()  # the float32 values
        ops.delayed_scaling_update(hists, scales, scale_invs, fp8_max, margin, algo)
        for hist, scale, scale_inv, model in zip(hists, scales, scale_invs, models):
            model.step(fp8_max, margin, algo)
            assert_matches_model(hist, model.hist, exact=True)
            assert_matches_model(scale, model.scale, exact=False)
            assert_matches_model(scale_inv, model.scale_inv, exact=False)


def test_max_algo_remembers_the_largest_amax_until_it_rolls_out():
    hist, scale, scale_inv = torch.zeros(3, 1), torch.ones(1), torch.ones(1)
    seen = []
    for amax in (4.0, 1.0, 2.0, 0.5, 0.5):
        hist[0, 0] = amax
        ops.delayed_scaling_update([hist], [scale], [scale_inv], 448.0, 0.0, "max")
        seen.append(448.0 / scale.item())
    assert seen == [4.0, 4.0, 4.0, 2.0, 2.0]


@pytest.mark.parametrize("bad", (0.0, math.nan, math.inf, -math.inf, 1e-44))
@pytest.mark.parametrize("algo", ALGOS)
def test_bad_amax_keeps_the_scale_and_does_not_poison_later_steps(bad, algo):
    """0, NaN, Inf: no usable amax; 1e-44 (subnormal): fp8_max / amax overflows to Inf. All keep the old scale."""
    hist = torch.zeros(4, 2)
    scale, scale_inv = torch.tensor([3.0, 5.0]), torch.tensor([1 / 3.0, 1 / 5.0])
    hist[0] = torch.tensor([bad, 8.0])
    entering = hist[0, 0].nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).item()  # what row 1 must hold after the step
    ops.delayed_scaling_update([hist], [scale], [scale_inv], 448.0, 1.0, algo)
    assert scale.tolist() == [3.0, 448.0 / 8.0 / 2.0]
    assert scale_inv[0].item() == pytest.approx(1 / 3.0, rel=1e-7)
    assert hist[:, 0].tolist() == [0.0, entering, 0.0, 0.0] and hist[:, 1].tolist() == [0.0, 8.0, 0.0, 0.0]
    hist[0] = torch.tensor([2.0, 4.0])
    ops.delayed_scaling_update([hist], [scale], [scale_inv], 448.0, 1.0, algo)
    assert scale.tolist() == [112.0, 28.0 if algo == "max" else 56.0]
    assert scale_inv[0].item() == pytest.approx(1 / 112.0, rel=1e-7)


def test_opcheck_cpu():
    hists, scales, scale_invs = make_state(((4, 3), (2, 5)))
    for hist in hists:
        hist[0] = torch.rand(hist.shape[1]) + 0.1
    torch.library.opcheck(ops.delayed_scaling_update.default, (hists, scales, scale_invs, 448.0, 0.0, "max"))


@pytest.mark.parametrize("change,match", [
    (lambda h, s, si: (h, s[:1], si), "scales: expected 2 tensors"),
    (lambda h, s, si: (h, s, si + [si[0]]), "scale_invs: expected 2 tensors"),
    (lambda h, s, si: ([h[0].double(), h[1]], s, si), r"amax_histories\[0\]: expected a float32"),
    (lambda h, s, si: ([h[0], h[1][0]], s, si), r"amax_histories\[1\]: expected shape \[H, n\]"),
    (lambda h, s, si: (h, [s[0], torch.ones(4)], si), r"scales\[1\]: expected shape \(5,\)"),
    (lambda h, s, si: (h, s, [si[0].half(), si[1]]), r"scale_invs\[0\]: expected a float32"),
    (lambda h, s, si: ([h[0], h[1].t()], s, si), r"amax_histories\[1\]: expected a contiguous"),
])
def test_bad_inputs_raise(change, match):
    hists, scales, scale_invs = make_state(((4, 3), (2, 5)))
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        ops.delayed_scaling_update(*change(hists, scales, scale_invs), 448.0, 0.0, "max")


def test_bad_algo_and_fp8_max_raise():
    hists, scales, scale_invs = make_state(((4, 3),))
    with pytest.raises((ValueError, RuntimeError), match="amax_compute_algo: expected one of"):
        ops.delayed_scaling_update(hists, scales, scale_invs, 448.0, 0.0, "mean")
    with pytest.raises((ValueError, RuntimeError), match="fp8_max: expected a positive"):
        ops.delayed_scaling_update(hists, scales, scale_invs, 0.0, 0.0, "max")


# ----------------------------------------------------------------------------------------------------- CUDA kernel
@pytest.mark.gpu
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("margin", (0.0, 1.5))
@pytest.mark.parametrize("count", (len(SIZES), 700))
def test_cuda_matches_cpu_bit_exact(algo, margin, count):
    random.seed(11)
    sizes = [SIZES[i % len(SIZES)] for i in range(count)]  # 700 tensors: more than one table of pointers
    hists, scales, scale_invs = make_state(sizes, "cuda")
    cpu = [[t.cpu() for t in ts] for ts in (hists, scales, scale_invs)]
    for _ in range(4):
        for hist, hist_cpu in zip(hists, cpu[0]):
            hist_cpu[0] = torch.tensor(random_amax(hist.shape[1]))
            hist.copy_(hist_cpu)
        ops.delayed_scaling_update(hists, scales, scale_invs, 448.0, margin, algo)
        ops.delayed_scaling_update(*cpu, 448.0, margin, algo)
        for gpu_list, cpu_list in zip((hists, scales, scale_invs), cpu):
            for t, t_cpu in zip(gpu_list, cpu_list):
                assert torch.equal(t.cpu().view(torch.int32), t_cpu.view(torch.int32))


@pytest.mark.gpu
def test_cuda_opcheck():
    hists, scales, scale_invs = make_state(((4, 3), (2, 5), (1, 0)), "cuda")
    for hist in hists:
        hist[0] = torch.rand(hist.shape[1], device="cuda") + 0.1
    torch.library.opcheck(ops.delayed_scaling_update.default, (hists, scales, scale_invs, 448.0, 0.0, "most_recent"))


@pytest.mark.gpu
def test_cuda_rejects_a_tensor_on_another_device():
    hists, scales, scale_invs = make_state(((4, 3), (2, 5)), "cuda")
    with pytest.raises(RuntimeError, match=r"scales\[1\]: expected a tensor on cuda"):
        ops.delayed_scaling_update(hists, [scales[0], scales[1].cpu()], scale_invs, 448.0, 0.0, "max")
