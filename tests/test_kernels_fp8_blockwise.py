"""kernels/fp8_blockwise.py: quantisation bit-exact against torch's e4m3 cast, block-scaled matmul against the
exact K-block reference, and the end-to-end fp8 error against a full-precision matmul."""
import pytest
import torch

import kernels.fp8_blockwise as K
from _kernel_check import DEV, assert_close_to_gold, interpret, poison  # noqa: F401

# (M, N, K): K=200 leaves a partial 128-block, N=130 a partial weight block, M=5 a partial row tile
SHAPES = [(5, 16, 100), (33, 130, 200), (70, 64, 384)]


def _inputs(M, N, Kd, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, Kd, generator=g) * torch.logspace(-3, 2, Kd)[torch.randperm(Kd, generator=g)]  # wide range
    x[0, :7] = 0.0                                       # zeros and an all-zero tile edge case
    w = torch.randn(N, Kd, generator=g) / Kd ** 0.5
    return x.to(dtype).to(device), w.to(dtype).to(device)


def _bits(q):
    return q.view(torch.uint8).cpu()


# Hopper's fp8 tensor cores add products in a reduced-precision accumulator (about 14 mantissa bits, DeepSeek-V3
# section 3.3.2), so on a GPU the matmul is not exact up to fp32 summation order. There we bound each output's
# error by 2^-8 of the sum of |scaled products| that feed it (a 14-bit adder loses ~2^-14 of the running sum per
# add, and a 128-wide block has up to 128 adds before the fp32 promotion); a wrong scale, block or index gives
# errors of the order of that sum itself (0.6 for a shifted scale). Interpreted (CPU) the products are exact.
FP8_ACC_REL = 2.0 ** -8


def _check_blockwise_matmul(name, xq, xs, wq, ws):
    y = K.fp8_blockwise_matmul(xq, xs, wq, ws)
    eager = K.fp8_blockwise_matmul_ref(xq, xs, wq, ws)
    gold = K.fp8_blockwise_matmul_ref(xq, xs, wq, ws, torch.float64, acc_dtype=torch.float64)
    if not y.is_cuda:
        assert_close_to_gold(name, y, eager, gold)
        return
    absq = (xq.float().abs().to(torch.float8_e4m3fn), wq.float().abs().to(torch.float8_e4m3fn))
    mass = K.fp8_blockwise_matmul_ref(*absq[:1], xs, absq[1], ws, torch.float64, acc_dtype=torch.float64)
    err = (y.double() - gold).abs()
    worst = (err / (mass + 1e-30)).max().item()
    print(f"{name}: max error / product mass = {worst:.2e} (bound {FP8_ACC_REL:.1e})")
    assert torch.isfinite(y).all(), f"{name}: NaN/inf in the output"
    assert worst <= FP8_ACC_REL, f"{name}: error {worst:.2e} of the product mass > {FP8_ACC_REL:.1e}"


@pytest.mark.parametrize("shape", SHAPES)
def test_quantisation_is_bit_exact(shape, interpret, monkeypatch):
    poison(monkeypatch)
    x, w = _inputs(*shape, torch.float32, DEV)
    assert K._use_triton(x), "the kernel path must run in this test"
    for kern, ref, t in ((K.quantize_act, K.quantize_act_ref, x), (K.quantize_weight, K.quantize_weight_ref, w)):
        q, s = kern(t)
        q_ref, s_ref = ref(t)
        assert torch.equal(s.cpu(), s_ref.cpu()), f"{kern.__name__}: scales differ"
        assert torch.equal(_bits(q), _bits(q_ref)), (
            f"{kern.__name__}: {(_bits(q) != _bits(q_ref)).sum().item()} fp8 codes differ")


def test_rounding_covers_every_e4m3_code_and_ties(interpret):
    """Every finite e4m3 value, the midpoints between neighbours (ties to even) and tiny negatives (-0.0)."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()
    pos = grid[grid >= 0]
    mids = (pos[1:] + pos[:-1]) / 2
    vals = torch.cat([grid, -0.0 * grid[:1], mids, -mids, torch.tensor([-1e-6, 1e-9])])
    vals = torch.nn.functional.pad(vals, (0, -len(vals) % 127))
    # one 128-wide tile per row, each led by 448: the tile's scale is exactly 1, so q = round_e4m3(value)
    x = torch.cat([torch.full((len(vals) // 127, 1), 448.0), vals.view(-1, 127)], 1).to(DEV)
    q, s = K.quantize_act(x)
    q_ref, s_ref = K.quantize_act_ref(x)
    assert torch.equal(s_ref, torch.ones_like(s_ref)) and torch.equal(s.cpu(), s_ref.cpu())
    assert torch.equal(_bits(q), _bits(q_ref)), f"{(_bits(q) != _bits(q_ref)).sum().item()} codes differ"


@pytest.mark.parametrize("shape", SHAPES)
def test_blockwise_matmul_matches_exact_reference(shape, interpret, monkeypatch):
    poison(monkeypatch)
    x, w = _inputs(*shape, torch.float32, DEV)
    xq, xs = K.quantize_act_ref(x)
    wq, ws = K.quantize_weight_ref(w)
    _check_blockwise_matmul(f"fp8 matmul {shape}", xq, xs, wq, ws)


@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_linear_error_is_quantisation_sized(shape, interpret):
    x, w = _inputs(*shape, torch.float32, DEV)
    x = torch.randn_like(x)                               # typical activations
    y = K.fp8_linear(x, w)
    exact = x.double() @ w.double().T
    rel = ((y.double() - exact).norm() / exact.norm()).item()
    assert rel < 0.05, f"relative error {rel:.3f}: e4m3 has a 3-bit mantissa, expect ~2-3%"


def test_bad_shapes_raise_clear_errors():
    xq, xs = K.quantize_act_ref(torch.randn(4, 130))
    wq, ws = K.quantize_weight_ref(torch.randn(8, 128))
    with pytest.raises(ValueError, match="recipe"):
        K.fp8_blockwise_matmul(xq, xs, wq, ws)
    with pytest.raises(ValueError, match="2-D"):
        K.quantize_act(torch.randn(2, 3, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES + [(1024, 4096, 4096), (77, 3000, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_fp8_path_on_gpu(shape, dtype, monkeypatch):
    poison(monkeypatch)
    x, w = _inputs(*shape, dtype, "cuda")
    q, s = K.quantize_act(x)
    q_ref, s_ref = K.quantize_act_ref(x)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    q, s = K.quantize_weight(w)
    q_ref, s_ref = K.quantize_weight_ref(w)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    xq, xs = K.quantize_act_ref(x)
    wq, ws = K.quantize_weight_ref(w)
    _check_blockwise_matmul(f"fp8 matmul {shape}", xq, xs, wq, ws)
