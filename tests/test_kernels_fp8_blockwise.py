"""kernels/fp8_blockwise.py: quantisation bit-exact against torch's e4m3 cast, block-scaled matmul against the
exact K-block reference, the fused (activation quantised inside the GEMM) and prepared-weight paths of fp8_linear
against the same reference, split-K against the reference and the unsplit kernel, and the end-to-end fp8 error
against a full-precision matmul."""
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


def _product_mass(xq, xs, wq, ws):
    """[M, N] fp64: sum over k of |scaled product| sa sb |qx qw| (what each output's rounding errors scale with)."""
    absq = (xq.float().abs().to(torch.float8_e4m3fn), wq.float().abs().to(torch.float8_e4m3fn))
    return K.fp8_blockwise_matmul_ref(absq[0], xs, absq[1], ws, torch.float64, acc_dtype=torch.float64)


def _check_blockwise_matmul(name, xq, xs, wq, ws, y=None, rel=FP8_ACC_REL):
    """y (default: fp8_blockwise_matmul's fp32 output) against the exact reference for these codes and scales;
    on a GPU within rel of the product mass (add 2^-8 for a bf16 output: its rounding is at most 2^-8 of
    |y| <= mass)."""
    y = K.fp8_blockwise_matmul(xq, xs, wq, ws) if y is None else y
    eager = K.fp8_blockwise_matmul_ref(xq, xs, wq, ws)
    gold = K.fp8_blockwise_matmul_ref(xq, xs, wq, ws, torch.float64, acc_dtype=torch.float64)
    if not y.is_cuda:
        assert_close_to_gold(name, y, eager, gold)
        return
    mass = _product_mass(xq, xs, wq, ws)
    err = (y.double() - gold).abs()
    worst = (err / (mass + 1e-30)).max().item()
    print(f"{name}: max error / product mass = {worst:.2e} (bound {rel:.1e})")
    assert torch.isfinite(y).all(), f"{name}: NaN/inf in the output"
    assert worst <= rel, f"{name}: error {worst:.2e} of the product mass > {rel:.1e}"


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
    """Rounding to e4m3 (3 mantissa bits) moves a value by at most 2^-4 of its size; uniform over that interval and
    over a log-uniform mantissa its RMS relative error is 2^-4 / sqrt(3) * sqrt(E[1 / m^2]) = 2.65%, and with both
    operands rounded the product's is sqrt(2) times that, 3.75% (measured over 300 draws: means 3.7-3.8% on these
    shapes, at most 5.3% on the smallest, whose 80 outputs average least). The bound is 1.5 times that RMS on one
    fixed draw of typical activations; a wrong block scale or a lost block moves whole outputs (errors of order 1)."""
    x, w = _inputs(*shape, torch.float32, DEV)
    x = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(DEV)  # typical activations, one fixed draw
    y = K.fp8_linear(x, w)
    exact = x.double() @ w.double().T
    rel = ((y.double() - exact).norm() / exact.norm()).item()
    assert rel < 1.5 * 0.0375, f"relative error {rel:.3f}: e4m3 rounding of both operands gives about 3.8% RMS"


def test_bad_shapes_raise_clear_errors():
    xq, xs = K.quantize_act_ref(torch.randn(4, 130))
    wq, ws = K.quantize_weight_ref(torch.randn(8, 128))
    with pytest.raises(ValueError, match="recipe"):
        K.fp8_blockwise_matmul(xq, xs, wq, ws)
    with pytest.raises(ValueError, match="2-D"):
        K.quantize_act(torch.randn(2, 3, 4))


# fused path: M not a multiple of BLOCK_M (70, 96 with BLOCK_M = 64), N not a multiple of 128 (130), K = 2-3 blocks
FUSED_SHAPES = [(32, 128, 256), (70, 256, 384), (96, 130, 256)]


@pytest.mark.parametrize("shape", FUSED_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_and_prepared_paths_match_the_reference(shape, dtype, interpret, monkeypatch):
    poison(monkeypatch)
    x, w = _inputs(*shape, dtype, DEV)
    assert K._use_triton(x), "the kernel path must run in this test"
    prep = K.prepare_weight(w)
    wq_ref, ws_ref = K.quantize_weight_ref(w)
    assert prep.wq.dtype == torch.float8_e4m3fn and prep.shape == tuple(w.shape)
    assert torch.equal(_bits(prep.wq), _bits(wq_ref)) and torch.equal(prep.ws.cpu(), ws_ref.cpu())
    xq, xs = K.quantize_act_ref(x)
    fused = K.fp8_linear(x, prep, torch.float32, fused=True)      # one launch: x quantised inside the GEMM
    two = K.fp8_linear(x, prep, torch.float32, fused=False)       # quantize_act, then the GEMM on its codes
    per_call = K.fp8_linear(x, w, torch.float32)                  # the weight quantised in the call
    for name, y in (("fused", fused), ("two-launch", two), ("per-call weight", per_call)):
        _check_blockwise_matmul(f"fp8_linear {name} {shape} {dtype}", xq, xs, wq_ref, ws_ref, y)
    if not fused.is_cuda:
        # same tiles and summation order: any activation code that differs from quantize_act's shows up here
        assert torch.equal(fused, two), f"fused differs from two-launch: {(fused - two).abs().max().item():.3e}"
        assert torch.equal(per_call, fused)


def test_fused_quantisation_equals_division_at_rounding_edges(interpret, monkeypatch):
    """The fused path divides by a multiply and two fmas (Markstein); values at e4m3 midpoints times the scale,
    where a quotient 1 ulp off rounds to the other code, must land exactly where quantize_act's division does."""
    poison(monkeypatch)
    g = torch.Generator().manual_seed(1)
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    pos = grid[torch.isfinite(grid) & (grid >= 0)].unique()
    mids = (pos[1:] + pos[:-1]) / 2                                   # 125 tie points in e4m3 units
    amax = torch.rand(64, 1, generator=g) * 10 + 0.1                  # non-power-of-two scales
    scale = amax * torch.tensor(1 / 448.0)
    vals = mids[torch.randint(0, len(mids), (64, 255), generator=g)] * scale
    vals = vals * (1 + (torch.randint(-2, 3, vals.shape, generator=g) * 2.0 ** -23))  # +-2 ulps around each tie
    x = torch.cat([amax, vals, -amax, -vals], 1)[:, :384].contiguous().to(DEV)       # [64, 384]: 3 K blocks
    w = torch.eye(128, 384).repeat(1, 1).to(DEV)                      # w[n, n] = 1: y[:, n] = dequantised x[:, n]
    w = torch.cat([w, torch.roll(w, 128, 1), torch.roll(w, 256, 1)], 0)  # [384, 384]: every column of x
    xq, xs = K.quantize_act_ref(x)
    wq, ws = K.quantize_weight_ref(w)
    y = K.fp8_linear(x, K.prepare_weight(w), torch.float32, fused=True)
    want = K.fp8_blockwise_matmul_ref(xq, xs, wq, ws)
    if not y.is_cuda:
        assert torch.equal(y.cpu(), want.cpu()), f"{(y.cpu() != want.cpu()).sum().item()} outputs differ"
    else:  # one product per output: the tensor cores' accumulator is exact here too
        assert torch.equal(y, want), f"{(y != want).sum().item()} outputs differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_out_dtype(dtype, interpret, monkeypatch):
    poison(monkeypatch)
    x, w = _inputs(40, 128, 256, dtype, DEV)
    prep = K.prepare_weight(w)
    y32 = K.fp8_linear(x, prep, torch.float32, fused=True)
    for fused in (True, False):
        y = K.fp8_linear(x, prep, fused=fused)
        assert y.dtype == dtype and y.shape == (40, 128)
        yb = K.fp8_linear(x, prep, torch.bfloat16, fused=fused)
        assert yb.dtype == torch.bfloat16
        if not y.is_cuda:  # the kernel rounds its fp32 accumulator once, to nearest even
            assert torch.equal(yb, y32.to(torch.bfloat16)) and torch.equal(y, y32.to(dtype))


def test_prepared_weight_needs_k_multiple_of_128():
    with pytest.raises(ValueError, match="multiple of 128"):
        K.prepare_weight(torch.randn(8, 200))
    prep = K.prepare_weight(torch.randn(8, 128))
    with pytest.raises(ValueError, match="K = 256"):
        K.fp8_linear(torch.randn(4, 256), prep)
    with pytest.raises(ValueError, match="2-D"):
        K.prepare_weight(torch.randn(2, 3, 128))


# ---- split-K ----
# Interpreted, every 128-wide K block's term t_kb = dot_kb * sa * sb comes out bit-identical with or without a
# split (same tiles, same dot); split-K changes only the order in which the KB terms are added (within each
# program's share, then the SPLIT_K partials in the reduce). Any order of adding n terms in fp32 is within
# (n - 1) u sum|t| of their exact sum (u = 2^-24; each term passes through at most KB - 1 + SPLIT_K - 1 adds),
# so a split and an unsplit output differ by at most 2 (KB + SPLIT_K) u sum|t_kb| <= 2 (KB + SPLIT_K) u mass
# (1 + a few u), with mass = sum_k sa sb |qx qw| (_product_mass). A dropped, doubled or misplaced K block is off by
# about mass / KB: 10^5 times more at these sizes.
def _split_bound(Kd, split, mass):
    return 2.0 * (-(-Kd // 128) + split) * 2.0 ** -24 * 1.001 * mass


def _check_split(name, y, y1, Kd, split, mass):
    assert torch.isfinite(y).all(), f"{name}: NaN/inf in the output (an unwritten element or workspace slice?)"
    err = (y.double() - y1.double()).abs().cpu()
    bound = _split_bound(Kd, split, mass.cpu())
    worst = (err - bound).max().item()
    assert worst <= 0, f"{name}: split-K differs from split_k=1 by {err.max().item():.3e}, beyond the fp32 " \
                       f"summation-order bound ({(err / (bound + 1e-30)).max().item():.2f}x)"


# (M, N, K): K = 600 is 5 K blocks, the last one partial (K % 128 != 0); split 2 gives shares of 2/3 blocks,
# 3 gives 1/2/2, 4 gives 1/1/1/2, 8 leaves three programs with no block (they must store zeros). K = 200 is 2
# blocks, so splits 3 and 4 exceed it too.
@pytest.mark.parametrize("shape", [(33, 130, 600), (5, 16, 200)])
@pytest.mark.parametrize("split", [2, 3, 4, 8])
def test_split_k_matmul_matches_reference_and_unsplit(shape, split, interpret, monkeypatch):
    poison(monkeypatch)   # the workspace too: a program that skips its store leaves NaN in the sum
    x, w = _inputs(*shape, torch.float32, DEV)
    assert K._use_triton(x), "the kernel path must run in this test"
    xq, xs = K.quantize_act_ref(x)
    wq, ws = K.quantize_weight_ref(w)
    y = K.fp8_blockwise_matmul(xq, xs, wq, ws, split_k=split)
    _check_blockwise_matmul(f"fp8 matmul split_k={split} {shape}", xq, xs, wq, ws, y)
    yb = K.fp8_blockwise_matmul(xq, xs, wq, ws, torch.bfloat16, split_k=split)
    assert yb.dtype == torch.bfloat16
    # the reduce sums the same partials in the same order whatever the output dtype, then rounds once (RN even)
    assert torch.equal(yb, y.to(torch.bfloat16)), f"bf16 output differs from the fp32 one rounded: {shape} {split}"
    if not y.is_cuda:
        y1 = K.fp8_blockwise_matmul(xq, xs, wq, ws, split_k=1)
        _check_split(f"fp8 matmul {shape} split_k={split}", y, y1, shape[2], split, _product_mass(xq, xs, wq, ws))


# through fp8_linear with a prepared weight: K = 512 is 4 blocks (split 3: 1/1/2; split 8: four empty programs)
@pytest.mark.parametrize("split", [3, 8])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_through_fp8_linear(split, fused, dtype, interpret, monkeypatch):
    poison(monkeypatch)
    shape = (40, 130, 512)
    x, w = _inputs(*shape, dtype, DEV)
    prep = K.prepare_weight(w)
    xq, xs = K.quantize_act_ref(x)
    y = K.fp8_linear(x, prep, torch.float32, fused=fused, split_k=split)
    _check_blockwise_matmul(f"fp8_linear fused={fused} split_k={split} {dtype}", xq, xs, prep.wq, prep.ws, y)
    yd = K.fp8_linear(x, prep, fused=fused, split_k=split)                 # out_dtype defaults to x's
    assert yd.dtype == dtype and torch.equal(yd, y.to(dtype))
    if not y.is_cuda:
        y1 = K.fp8_linear(x, prep, torch.float32, fused=fused, split_k=1)
        _check_split(f"fp8_linear fused={fused} split_k={split}", y, y1, shape[2], split,
                     _product_mass(xq, xs, prep.wq, prep.ws))
        other = K.fp8_linear(x, prep, torch.float32, fused=not fused, split_k=split)
        assert torch.equal(y, other), "fused and two-launch differ under the same split (same tiles and order)"


def test_bad_split_k_raises():
    x, w = torch.randn(4, 128), torch.randn(8, 128)
    xq, xs = K.quantize_act_ref(x)
    wq, ws = K.quantize_weight_ref(w)
    for bad in (0, -2, 2.5, True, "2"):
        with pytest.raises(ValueError, match="split_k must be None .* or a positive int"):
            K.fp8_linear(x, w, split_k=bad)
        with pytest.raises(ValueError, match="split_k must be None .* or a positive int"):
            K.fp8_blockwise_matmul(xq, xs, wq, ws, split_k=bad)


def test_split_candidates_keep_work_per_program_and_workspace_bounded():
    """The automatic choice times only splits with >= 4 K blocks per program and a workspace (4 SPLIT_K M N
    bytes) no larger than the fp8 weight (N K bytes)."""
    assert K._split_candidates(64, 4096, 4096) == [1, 2, 4, 8]
    assert K._split_candidates(256, 4096, 4096) == [1, 2, 4]
    assert K._split_candidates(1024, 4096, 4096) == [1]
    assert K._split_candidates(64, 4096, 1024) == [1, 2]   # 8 K blocks: at most 2 programs of 4
    for M, N, Kd in ((64, 4096, 4096), (256, 11008, 4096), (16, 4096, 14336), (3000, 512, 8192)):
        for s in K._split_candidates(M, N, Kd):
            assert s == 1 or (-(-Kd // 128) >= 4 * s and 4 * s * M * N <= N * Kd)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(64, 4096, 4096), (256, 4096, 4096)])
@pytest.mark.parametrize("split", [None, 1, 2, 4, 8])
def test_split_k_on_gpu(shape, split, monkeypatch):
    poison(monkeypatch)
    x, w = _inputs(*shape, torch.bfloat16, "cuda")
    prep = K.prepare_weight(w)
    xq, xs = K.quantize_act_ref(x)
    y = K.fp8_linear(x, prep, split_k=split)
    assert torch.equal(y, K.fp8_linear(x, prep, split_k=split)), "split-K must be deterministic"
    chosen = [v[1] for k, v in K._TUNED.items() if k[:3] == (K._m_key(shape[0]),) + shape[1:] and k[-1] == split]
    print(f"{shape} split_k={split}: launched SPLIT_K {chosen}")
    _check_blockwise_matmul(f"fp8_linear split_k={split} {shape}", xq, xs, prep.wq, prep.ws, y,
                            rel=FP8_ACC_REL + 2.0 ** -8)


@pytest.mark.gpu
# all but the last shape take the autotuned kernel (M N K >= AUTOTUNE_MIN_MNK)
@pytest.mark.parametrize("shape", [(64, 4096, 4096), (256, 4096, 4096), (1000, 1024, 2048), (2048, 384, 512)])
@pytest.mark.parametrize("fused", [True, False])
def test_fused_and_prepared_paths_on_gpu(shape, fused, monkeypatch):
    poison(monkeypatch)
    x, w = _inputs(*shape, torch.bfloat16, "cuda")
    prep = K.prepare_weight(w)
    xq, xs = K.quantize_act_ref(x)
    wq, ws = K.quantize_weight_ref(w)
    y = K.fp8_linear(x, prep, fused=fused)  # bf16 out, as in the timing runs (the same compiled kernels)
    assert y.dtype == torch.bfloat16
    _check_blockwise_matmul(f"fp8_linear fused={fused} {shape}", xq, xs, wq, ws, y, rel=FP8_ACC_REL + 2.0 ** -8)


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


def test_a_gpu_without_fp8_tensor_cores_is_refused_by_name(monkeypatch):
    """On CUDA the Triton paths first check the compute capability (8.9+: fp8 tensor cores); an A100 (8.0) gets a
    message naming the requirement instead of a failure inside Triton's compiler. CPU tensors are not checked."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(RuntimeError, match=r"compute capability 8\.9 or newer.*A100 has 8\.0"):
        K._check_fp8_device("cuda:0")
    for cap in ((8, 9), (9, 0), (10, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cap=cap: cap)
        K._check_fp8_device("cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    K._check_fp8_device("cpu")  # the interpreter and the references need no GPU
