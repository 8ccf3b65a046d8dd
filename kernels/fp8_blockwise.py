"""FP8 (e4m3) blockwise quantisation and the block-scaled matmul (DeepSeek-V3 / verl FP8-rollout recipe).

Public functions:

    quantize_act(x)    x [M, K]   -> (xq [M, K] float8_e4m3fn, xs [M, ceil(K/128)] fp32)    1 x 128 tiles
    quantize_weight(w) w [N, K]   -> (wq [N, K] float8_e4m3fn, ws [ceil(N/128), ceil(K/128)] fp32) 128 x 128 blocks
    prepare_weight(w)  w [N, K]   -> Fp8Weight(wq, ws): quantize_weight once per weight sync (K % 128 == 0)
    fp8_blockwise_matmul(xq, xs, wq, ws, out_dtype=torch.float32, split_k=None) -> y [M, N] ~= x @ w.T
    fp8_linear(x, w_or_prepared, out_dtype=None, fused=None, split_k=None) -> y [M, N] = x @ w.T through fp8
        (out_dtype defaults to x's dtype); w a bf16/fp32 weight (quantised per call) or an Fp8Weight (no weight
        pass)
    split_k (both GEMM entry points): None = automatic (timed once per autotuned shape on a GPU, else 1), or a
        positive int forced on every device (1 = no split); see "Split-K" below

Each has an `_ref` twin in pure torch. Triton kernels run when the tensors are on CUDA (there the matmul
feeds real fp8 operands to the tensor cores: compute capability 8.9 or newer, Ada / Hopper; an older GPU is refused
with a message naming the requirement, _check_fp8_device) or on CPU with TRITON_INTERPRET=1 (the tests).

Maths:
    scale = max(amax(tile), 1e-12) * fp32(1/448)    (448 = largest e4m3 value; one scale per tile/block)
    q     = round_to_e4m3(x / scale)                 (round to nearest, ties to even, saturate at +-448)
    y[m, n] = sum_kb  scale_x[m, kb] * scale_w[n // 128, kb] * sum_{k in kb} q_x[m, k] q_w[n, k]
The matmul accumulates each 128-wide K block in fp32 and applies the two scales per block, so the
reference is exact up to fp32 summation order (products of two e4m3 numbers are exact in fp32).

The GEMM (_fp8_linear_kernel, one launch; split-K adds a reduce launch, below): a program owns a [BLOCK_M,
BLOCK_N] output tile and walks K in 128-wide steps (BLOCK_K = TILE). Each step loads the e4m3 weight tile
[BLOCK_N, 128] (K contiguous: the K-major B operand Hopper's fp8 wgmma wants, so prepare_weight keeps
nn.Linear's [N, K] layout and needs no transpose) and
  fused (fp8_linear(..., fused=True); default only for M <= FUSE_MAX_M): the bf16/fp32 activation tile
      [BLOCK_M, 128], its row amax, the scale, x / scale and the cast to e4m3 in registers (bit-equal to
      quantize_act, see below);
  two-launch (fp8_linear's default above FUSE_MAX_M, and fp8_blockwise_matmul): quantize_act's codes and scales;
then part = tl.dot(a_e4m3, b_e4m3) (fp8 tensor cores, fp32 out) and acc += part * sa[:, None] * sb[None, :]:
the fp32 promotion every 128 K that DeepGEMM and DeepSeek-V3 use (Hopper adds fp8 products inside one wgmma in
a ~14-bit accumulator). Autotuned over a few Hopper configs keyed on (M's power-of-two class, N, K, SPLIT_K),
with BLOCK_M = 64 and BLOCK_N 32..256 for decode (M = 64..256: 1-4 M tiles, each program streams its weight
columns once); the interpreter launches one config.

Split-K (SPLIT_K > 1, a third grid axis): at decode the [M, N] grid alone is too small and too serial. At M = 64,
N = K = 4096 it has N / BLOCK_N programs (128 at BLOCK_N = 32, for 132 SMs: one wave, no SM with a second program to
hide latency) and each walks KB = 32 dependent 128-wide K steps, so the 16 MB weight is not streamed at full
bandwidth. With SPLIT_K, program k of a tile walks the contiguous K blocks [k KB // SPLIT_K, (k+1) KB // SPLIT_K)
(shares differ by at most one block; a program whose share is empty stores zeros), keeps the per-128-K promotion
with both scales exactly as above, and stores its fp32 partial tile into a workspace [SPLIT_K, M, N].
_splitk_reduce_kernel then adds the partials in the fixed order 0, 1, ..., SPLIT_K - 1 and casts to the output
dtype in one launch (deterministic: no atomics). It is a small Triton kernel rather than torch's sum + cast because
that is two launches plus an fp32 [M, N] temporary (decode is launch-bound), the order of torch's reduction is not
spelled out, and the interpreter's bf16 rounding is fixed the same way as the GEMM's. Split-K changes only the fp32
summation order of the per-block terms (the tests bound the difference at that level). SPLIT_K = 1 is the plain
launch above (2-D grid, no workspace, no reduce).
Workspace traffic: SPLIT_K x M x N x 4 bytes written and read back, i.e. 4 SPLIT_K M / K of the fp8 weight's N K
bytes each way: at N = K = 4096, 2 MB (1/8 of the weight) for M = 64, SPLIT_K = 2, 4 MB for SPLIT_K = 4; small
enough to be expected to stay in the H200's 50 MB L2 between the two launches (not measured), and it grows with M:
the reason splits are not tried at large M.
Choosing SPLIT_K (split_k=None): 1 on CPU / the interpreter and for the small untuned GEMMs; for the autotuned
shapes on a GPU, _split_candidates keeps the values of (1, 2, 4, 8) that leave each program >= 4 K blocks and a
workspace no larger than the weight (4 SPLIT_K M <= K: at N = K = 4096, M = 64 tries 1/2/4/8, M = 256 1/2/4,
M >= 1024 only 1); the autotuner picks the tile config per candidate (kernel time), then the whole call (workspace,
GEMM, reduce) is timed once per candidate and the fastest is cached in _TUNED with its config (a larger split must
win by 2%). The extra config BLOCK_N = 128 / 6 stages is for split decode (the split supplies the programs, so
wider N tiles); pruning drops pipelines deeper than a program's K steps + 1.

Why the fused path is not the default (FUSE_MAX_M = 0; estimates, the GPU timings decide): every program
re-quantises its A tiles, ~6 CUDA-core instructions per element (convert, |max|, multiply, two fmas, cvt), so a
program spends BLOCK_M x K x 6 / 128 lanes cycles on it whatever N is: ~7 us per program at BLOCK_M = 64,
K = 4096, comparable to a whole decode GEMM (the fp8 weight read is ~3.5 us), and at 4096^3 the total,
M K (N / BLOCK_N) x 6 instructions, is ~100 us next to the ~110 us of fp8 MMA. A separate quantize_act pass
reads x once (~10-15 us at 4096^2 bf16, ~2 us at decode). The fused launch saves one kernel launch, which
matters only when the CPU, not the GPU, is the bottleneck (decode without CUDA graphs).

Exact division at multiply cost (fused path): x / scale must be the IEEE quotient (the reference divides), but
a per-element div.rn is ~10 instructions. The kernel takes inv = RN(1 / scale) once per row, q0 = x * inv
(within 1 ulp), r = fma(-q0, scale, x) (exact) and q = fma(r, inv, q0) = RN(x / scale) (Markstein's theorem);
the tests check it at every e4m3 rounding midpoint +-2 ulps. On a GPU the cast to e4m3 is cvt.rn.satfinite
(nearest even, saturating), the reference's rounding.

Interpreter traps (seen with triton 3.9): Triton's CPU interpreter rounds fp32 -> fp8 casts wrongly for a few
percent of values, so under the interpreter the kernels first round onto the e4m3 grid in fp32 (`_round_e4m3`:
exponent from the bits, spacing 2^(e-3), round half to even) and only then cast (exact everywhere); the
quantisation kernel keeps that rounding on a GPU too (a no-op there). Its fp32 -> bf16 cast truncates, so the
GEMM rounds a bf16 output by the bits first (ROUND_BF16, interpreter only). fp8 arithmetic does not run there
either: the operands are upcast to fp32 (exact). The scale multiplies by the fp32 reciprocal of 448 (torch on a
GPU turns a division by a Python number into exactly that multiplication, torch on a CPU does not, so the
reference spells it out), and x / scale uses div_rn in the quantisation kernel: Triton's plain fp32 `/` is an
approximate division on NVIDIA GPUs, torch's tensor / tensor is IEEE, and the tests demand equal bits.

Memory layout: row-major [M, K] and [N, K] (K contiguous, as nn.Linear's weight); scales row-major.
Quantisation programs own [BLOCK_R, 128] tiles (activations: one scale per row; weights: BLOCK_R = 128,
one scale per tile).

Roofline floor (fp8_linear with a prepared weight): bytes = x read once (2 M K for bf16) + wq read (N K) + the
[M/128 or M, K/128] scales + out written (2 M N for bf16); flops = 2 M N K at the fp8 tensor-core rate
(torch._scaled_mm measured ~1270 TFLOP/s on one H200). At 4096^3: 32 + 16 + 32 MB over ~4.8 TB/s = 17 us vs
137 GFLOP / 1270 TFLOP/s = 108 us: compute-bound, floor 0.108 ms (the bf16 matmul: 0.192 ms). At decode (M = 64..256,
N = K = 4096) the 16 MB fp8 weight read dominates: ~3.5 us vs ~7 us for the bf16 weight; the split-K workspace adds
2 x 4 SPLIT_K M N bytes (4 MB at M = 64, SPLIT_K = 2; 32 MB at M = 256, SPLIT_K = 4), expected to be mostly L2
traffic, so the decode floor stays ~3.5 us plus a second, tiny launch (its CPU launch cost matters when decode is
launch-bound; a CUDA graph hides it). Reaching it needs >= 1 program per SM with several K steps in flight: the
point of split-K.
Quantisation alone is memory-bound: reads 4 (fp32) or 2 (bf16) bytes and writes 1 byte per element (+ 4 bytes
per 128-element scale).
Measured (one H200, commit 95b1adc, benchmarks/results/kernels.md): with a prepared weight 0.241 ms at 4096^3,
2.20x its 0.109 ms floor, and slower than the bf16 matmul's 0.190 ms. At decode shapes (N = K = 4096) it is
slower too: 0.032 / 0.031 / 0.037 ms at M = 64 / 128 / 256 vs bf16's 0.018 / 0.019 / 0.025 ms. Those figures
predate split-K: the split-K path has not been timed on a GPU yet (its correctness is tested in the
interpreter; tests/test_kernels_fp8_blockwise.py::test_split_k_on_gpu checks it on a GPU).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
from kernels._interpret import new_output, tl, triton, use_triton  # stand-ins where Triton has no wheels


E4M3_MAX = 448.0
TILE = 128


def _use_triton(*tensors) -> bool:
    return use_triton(globals(), *tensors)  # this module's kernels, made interpretable when asked


# ---- Triton kernels ----
@triton.jit
def _pow2(e):
    """2^e for integer e in the normal fp32 range, built from the bits (exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_e4m3(y):
    """Round fp32 y onto the e4m3 grid (nearest, ties to even, saturating at +-448), staying in fp32."""
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    a = tl.abs(y)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127   # floor(log2 a) for normal a
    e = tl.maximum(e, -6)                                     # subnormals: same spacing as the 2^-6 binade
    n = a * _pow2(3 - e)                                      # a in units of the grid spacing 2^(e-3)
    f = tl.floor(n)
    d = n - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    r = f + tl.where((d > 0.5) | ((d == 0.5) & odd), 1.0, 0.0)
    q = r * _pow2(e - 3)
    # sign from the bit, applied by a multiply: Triton lowers -q to 0 - q, which turns -0.0 into +0.0 on a GPU
    return q * tl.where(y.to(tl.int32, bitcast=True) < 0, -1.0, 1.0)


@triton.jit
def _round_bf16(acc):
    """fp32 -> the nearest-even bf16 value, still in fp32 (the interpreter's own cast truncates)."""
    u = acc.to(tl.int32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & -65536
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _quant_kernel(X, XQ, S, R, C, n_col_blocks, stride_x, BLOCK_R: tl.constexpr, PER_ROW: tl.constexpr):
    """One [BLOCK_R, 128] tile: per-row scales (activations) or one scale for the tile (weights)."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * 128 + tl.arange(0, 128)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    x = tl.load(X + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if PER_ROW:
        scale = tl.maximum(tl.max(tl.abs(x), 1), 1e-12) * 0.002232142857142857  # [BLOCK_R]; * fp32(1/448)
        tl.store(S + rows * n_col_blocks + pid_c, scale, mask=rows < R)
        y = tl.div_rn(x, scale[:, None])
    else:
        scale = tl.maximum(tl.max(tl.max(tl.abs(x), 1), 0), 1e-12) * 0.002232142857142857  # scalar
        tl.store(S + pid_r * n_col_blocks + pid_c, scale)
        y = tl.div_rn(x, tl.zeros_like(x) + scale)
    q = _round_e4m3(y)
    tl.store(XQ + rows[:, None].to(tl.int64) * C + cols[None, :], q.to(XQ.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_linear_kernel(X, XS, W, WS, Y, M, N, K, M_KEY, stride_x, stride_y,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, A_FP8: tl.constexpr,
                       EVEN_K: tl.constexpr, INTERP: tl.constexpr, ROUND_BF16: tl.constexpr,
                       SPLIT_K: tl.constexpr = 1):
    """y[BLOCK_M, BLOCK_N] = sum over 128-wide K steps of sa * sb * (qa @ qw^T), promoted in fp32 each step.

    SPLIT_K = 1: Y is the output and the program walks all KB = cdiv(K, 128) K blocks (grid (M tiles, N tiles)).
    SPLIT_K > 1: grid (M tiles, N tiles, SPLIT_K); program k walks K blocks [k KB // SPLIT_K, (k+1) KB // SPLIT_K)
    (shares differ by at most one block; an empty share stores zeros) and stores its fp32 partial tile into
    Y = the fp32 workspace [SPLIT_K, M, N] (stride_y = N, ROUND_BF16 unused); _splitk_reduce_kernel sums them.

    A_FP8 = False (the fused path): X is the bf16/fp32 activation; each K step loads its [BLOCK_M, 128] tile,
    takes the row amax, and quantises it in registers to e4m3 (the 1 x 128 recipe, bit-equal to quantize_act).
    A_FP8 = True: X, XS are quantize_act's codes and scales. M_KEY only keys the autotuner (M's size class).
    EVEN_K: K % 128 == 0 (no K masks; otherwise the last block is zero-padded, as the reference pads).
    INTERP: Triton's CPU interpreter (fp32 everywhere, software e4m3 rounding, no fp8 arithmetic).
    ROUND_BF16 (interpreter, bf16 output): its fp32 -> bf16 cast truncates; round to nearest even by the bits."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = rm < M
    nmask = rn < N
    rk = tl.arange(0, 128)
    KB = tl.cdiv(K, 128)
    x_ptrs = X + rm[:, None].to(tl.int64) * stride_x + rk[None, :]
    w_ptrs = W + rn[:, None].to(tl.int64) * K + rk[None, :]
    ws_ptrs = WS + (rn // 128) * KB
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    kb_lo = 0
    kb_hi = KB
    if SPLIT_K > 1:  # this program's contiguous share of the K blocks
        pid_k = tl.program_id(2)
        kb_lo = pid_k * KB // SPLIT_K
        kb_hi = (pid_k + 1) * KB // SPLIT_K
        x_ptrs += kb_lo * 128
        w_ptrs += kb_lo * 128
        Y += pid_k.to(tl.int64) * M * N  # this split's [M, N] slice of the workspace
    for kb in range(kb_lo, kb_hi):
        if EVEN_K:
            amask = mmask[:, None]
            bmask = nmask[:, None]
        else:
            kin = (kb * 128 + rk < K)[None, :]
            amask = mmask[:, None] & kin
            bmask = nmask[:, None] & kin
        b = tl.load(w_ptrs, mask=bmask, other=0.0)                                # [BLOCK_N, 128] e4m3
        sb = tl.load(ws_ptrs + kb, mask=nmask, other=0.0)
        if A_FP8:
            a = tl.load(x_ptrs, mask=amask, other=0.0)
            sa = tl.load(XS + rm * KB + kb, mask=mmask, other=0.0)
            if INTERP:
                a = a.to(tl.float32)
        else:
            x = tl.load(x_ptrs, mask=amask, other=0.0).to(tl.float32)          # [BLOCK_M, 128]
            sa = tl.maximum(tl.max(tl.abs(x), 1), 1e-12) * 0.002232142857142857  # * fp32(1/448), as quantize_act
            # x / sa correctly rounded (the reference's IEEE division) at the cost of a multiply and two fmas:
            # q0 = x * RN(1/sa) is within 1 ulp, the residual x - q0 sa is exact in an fma, and one fma with
            # RN(1/sa) then rounds to RN(x / sa) (Markstein's theorem). One division per row, not per element.
            inv = tl.broadcast_to(tl.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), sa)[:, None], (BLOCK_M, 128))
            q0 = x * inv
            r = tl.fma(-q0, tl.broadcast_to(sa[:, None], (BLOCK_M, 128)), x)
            y = tl.fma(r, inv, q0)
            if INTERP:
                a = _round_e4m3(y)        # the interpreter's fp8 casts round wrongly: stay on the grid in fp32
            else:
                a = y.to(tl.float8e4nv)  # cvt.rn.satfinite on sm_89+: round to nearest even, saturating
        if INTERP:
            b = b.to(tl.float32)         # fp8 -> fp32 is exact; products of e4m3 values are exact in fp32
        # One dot per 128-wide K block, promoted with both scales into the fp32 accumulator (DeepSeek-V3's
        # promotion interval: Hopper adds fp8 products in a ~14-bit accumulator inside a wgmma).
        part = tl.dot(a, tl.trans(b))
        acc += part * sa[:, None] * sb[None, :]
        x_ptrs += 128
        w_ptrs += 128
    if ROUND_BF16 and SPLIT_K == 1:
        acc = _round_bf16(acc)
    tl.store(Y + rm[:, None].to(tl.int64) * stride_y + rn[None, :], acc.to(Y.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _splitk_reduce_kernel(P, Y, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, ROUND_BF16: tl.constexpr):
    """y.flat[i] = ((P[0, i] + P[1, i]) + P[2, i]) + ... in this fixed order (deterministic), cast to y's dtype.
    P: the fp32 workspace [SPLIT_K, M, N], contiguous; Y: the contiguous [M, N] output; MN = M * N."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    p = P + offs
    acc = tl.load(p, mask=mask, other=0.0)
    for _ in tl.static_range(1, SPLIT_K):
        p += MN
        acc += tl.load(p, mask=mask, other=0.0)
    if ROUND_BF16:
        acc = _round_bf16(acc)
    tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=mask)


# ---- public functions ----
FP8_MIN_CAPABILITY = (8, 9)  # fp8 (e4m3) tensor cores and conversions: Ada (8.9), Hopper (9.0) and newer


def _check_fp8_device(device) -> None:
    """Refuse, naming the requirement, a CUDA device without FP8 tensor cores (Triton would fail deep inside its
    compiler on the e4m3 conversions and the fp8 dot)."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    cap = tuple(torch.cuda.get_device_capability(device))
    if cap < FP8_MIN_CAPABILITY:
        raise RuntimeError(f"kernels/fp8_blockwise.py needs FP8 tensor cores: CUDA compute capability "
                           f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} or newer (Ada, Hopper, Blackwell); "
                           f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}. Use the _ref functions "
                           f"(pure torch) on this GPU.")


def _check2d(name, x):
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, K], got shape {tuple(x.shape)}")


def _quantize(x, per_row: bool):
    _check_fp8_device(x.device)
    R, C = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    n_cb = triton.cdiv(C, TILE)
    block_r = (16 if x.is_cuda else min(64, max(16, triton.next_power_of_2(R)))) if per_row else TILE
    xq = new_output((R, C), x.device, torch.float8_e4m3fn)
    s = new_output((R if per_row else triton.cdiv(R, TILE), n_cb), x.device)
    _quant_kernel[(triton.cdiv(R, block_r), n_cb)](x, xq, s, R, C, n_cb, x.stride(0), BLOCK_R=block_r,
                                                  PER_ROW=per_row)
    return xq, s


def quantize_act(x: torch.Tensor):
    """1 x 128 tiles: (x_fp8 [M, K], scales [M, ceil(K/128)])."""
    _check2d("x", x)
    if not _use_triton(x):
        return quantize_act_ref(x)
    return _quantize(x, per_row=True)


def quantize_weight(w: torch.Tensor):
    """128 x 128 blocks: (w_fp8 [N, K], scales [ceil(N/128), ceil(K/128)])."""
    _check2d("w", w)
    if not _use_triton(w):
        return quantize_weight_ref(w)
    return _quantize(w, per_row=False)


def _check_split_k(split_k):
    if split_k is not None and (isinstance(split_k, bool) or not isinstance(split_k, numbers.Integral) or split_k < 1):
        raise ValueError(f"split_k must be None (automatic) or a positive int, got {split_k!r}")
    return None if split_k is None else int(split_k)


def fp8_blockwise_matmul(xq, xs, wq, ws, out_dtype: torch.dtype = torch.float32, split_k: int | None = None):
    """y [M, N] = block-scaled xq @ wq.T (see the header). split_k: None (automatic) or the number of K splits
    to force (1 = no split; see the header's split-K paragraph)."""
    split_k = _check_split_k(split_k)
    M, K = xq.shape
    N = wq.shape[0]
    KB = triton.cdiv(K, TILE)
    if wq.shape[1] != K or tuple(xs.shape) != (M, KB) or tuple(ws.shape) != (triton.cdiv(N, TILE), KB):
        raise ValueError(f"shapes do not match the 1x128 / 128x128 recipe: xq {tuple(xq.shape)}, xs "
                         f"{tuple(xs.shape)}, wq {tuple(wq.shape)}, ws {tuple(ws.shape)}")
    if not _use_triton(xq, xs, wq, ws):
        return fp8_blockwise_matmul_ref(xq, xs, wq, ws, out_dtype)
    return _gemm(xq.contiguous(), xs.contiguous(), wq.contiguous(), ws.contiguous(), out_dtype, a_fp8=True,
                 split_k=split_k)


@dataclass(frozen=True)
class Fp8Weight:
    """A weight quantised once per weight sync: wq [N, K] e4m3 (K contiguous: the K-major B operand that
    Hopper's fp8 wgmma wants, so no transpose is needed) and ws [ceil(N/128), K/128] fp32 block scales."""
    wq: torch.Tensor
    ws: torch.Tensor

    @property
    def shape(self):
        return tuple(self.wq.shape)


def prepare_weight(w: torch.Tensor) -> Fp8Weight:
    """Quantise a [N, K] weight for fp8_linear (once per weight sync). K must be a multiple of 128."""
    _check2d("w", w)
    if w.shape[1] % TILE:
        raise ValueError(f"prepare_weight: K = {w.shape[1]} must be a multiple of {TILE} (the GEMM's K step)")
    wq, ws = quantize_weight(w)
    return Fp8Weight(wq.contiguous(), ws.contiguous())


def fp8_linear(x: torch.Tensor, w, out_dtype: torch.dtype | None = None, fused: bool | None = None,
               split_k: int | None = None) -> torch.Tensor:
    """x @ w.T through blockwise fp8 (forward only: the FP8 rollout path).

    w: a bf16/fp32 [N, K] weight (quantised here, per call) or prepare_weight's Fp8Weight (quantised once).
    fused: quantise the activation inside the GEMM (one launch; the default for M <= FUSE_MAX_M) or in a
    separate quantize_act launch first (the default above it: the fused path re-quantises x in every N tile,
    see the header).
    split_k: None (automatic: timed once per autotuned shape on a GPU, else 1) or the number of K splits to
    force (1 = no split)."""
    _check2d("x", x)
    split_k = _check_split_k(split_k)
    if isinstance(w, Fp8Weight):
        wq, ws = w.wq, w.ws
        if wq.shape[1] != x.shape[1]:
            raise ValueError(f"fp8_linear: x has K = {x.shape[1]}, the prepared weight K = {wq.shape[1]}")
    else:
        _check2d("w", w)
        if w.shape[1] != x.shape[1]:
            raise ValueError(f"fp8_linear: x has K = {x.shape[1]}, w has K = {w.shape[1]}")
        wq, ws = quantize_weight(w)
    out_dtype = out_dtype or x.dtype
    if not _use_triton(x, wq, ws):
        xq, xs = quantize_act_ref(x)
        return fp8_blockwise_matmul_ref(xq, xs, wq, ws, out_dtype)
    if fused is None:
        fused = x.shape[0] <= FUSE_MAX_M
    if not fused:
        xq, xs = quantize_act(x)
        return _gemm(xq, xs, wq, ws, out_dtype, a_fp8=True, split_k=split_k)
    x = x if x.stride(1) == 1 else x.contiguous()
    return _gemm(x, ws, wq, ws, out_dtype, a_fp8=False, split_k=split_k)  # XS unused on the fused path


FUSE_MAX_M = 0  # fp8_linear's default: fused activation quantisation up to this many rows (none: see header)


def _m_key(M: int) -> int:
    return min(triton.next_power_of_2(M), 8192)


def _prune(configs, named_args, **kwargs):
    """Small-M configs for decode (M_KEY <= 64: BLOCK_M = 64 only), large tiles and short pipelines only for
    big M; no pipeline deeper than a program's K steps + 1 (KB / SPLIT_K with split-K: extra stages only fill)."""
    try:
        m = int(named_args["M_KEY"])
        steps = triton.cdiv(triton.cdiv(int(named_args["K"]), TILE), int(kwargs.get("SPLIT_K", 1)))
        keep = [c for c in configs if (m > 64 or c.kwargs["BLOCK_M"] == 64)
                and (m < 1024 or (c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] >= 8192 and c.num_stages <= 5))
                and c.num_stages <= max(steps + 1, 3)]
        return keep or configs
    except Exception:  # noqa: BLE001 - pruning is an optimisation only
        return configs


# Hopper configs. The fp8 dot of each K step is a fresh [BLOCK_M, BLOCK_N] fp32 tile next to the accumulator
# (the promotion), so a thread holds two of them: 8 warps for 128 x 128, 4 warps up to 64 x 128 / 128 x 64.
_GPU_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 256}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=5),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=5),
    # decode: deep pipelines keep enough weight bytes in flight per SM to stream at full bandwidth
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=8),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=8),
    # decode with split-K: the K split supplies the programs, so wider N tiles (x re-read by fewer programs) with
    # a pipeline as deep as the shared memory allows (6 stages x 32 KB on the fused path, bf16 A + fp8 B tiles)
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=4, num_stages=6),
]
# Autotuning needs a GPU; the interpreter launches the plain kernel with one config (see _gemm). The autotuner
# wraps the compiled kernel object; the module name _fp8_linear_kernel stays free for the interpreter swap.
# Each candidate is timed briefly (10 ms warm-up, 40 ms of repeats: a decode GEMM is ~10 us).
_fp8_linear_tuned = triton.autotune(
    configs=_GPU_CONFIGS, key=["M_KEY", "N", "K", "A_FP8", "EVEN_K", "SPLIT_K"],
    prune_configs_by={"early_config_prune": _prune},
    do_bench=lambda kernel_call, quantiles: triton.testing.do_bench(kernel_call, warmup=10, rep=40,
                                                                    quantiles=quantiles))(_fp8_linear_kernel)
AUTOTUNE_MIN_MNK = 2 ** 30  # smaller GEMMs (the tiny rollout models, the tests) take one fixed config, untuned
_SMALL_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
_TUNED: dict = {}  # (M size class, N, K, a_fp8, dtypes, split_k asked) -> (the autotuner's config, SPLIT_K)
SPLIT_K_CANDIDATES = (1, 2, 4, 8)  # what the automatic choice times on a GPU (see _split_candidates)
MIN_K_BLOCKS_PER_SPLIT = 4         # each split program still walks >= 4 K blocks (something to pipeline)
_REDUCE_BLOCK = 1024               # elements per program of _splitk_reduce_kernel on a GPU


def _split_candidates(M: int, N: int, K: int) -> list[int]:
    """The SPLIT_K values worth timing: each program keeps >= MIN_K_BLOCKS_PER_SPLIT K blocks, and the fp32
    workspace (SPLIT_K M N 4 bytes, written then read) stays no larger than the fp8 weight (N K bytes), i.e.
    4 SPLIT_K M <= K. At N = K = 4096: M = 64 times 1, 2, 4, 8; M = 256 times 1, 2, 4; M >= 1024 only 1."""
    kb = triton.cdiv(K, TILE)
    return [s for s in SPLIT_K_CANDIDATES if s == 1 or (kb >= MIN_K_BLOCKS_PER_SPLIT * s and 4 * s * M <= K)]


def _launch(kernel, x, xs, wq, ws, y, a_fp8: bool, split: int, interp: bool, meta: dict | None):
    """One fp8 GEMM call: the kernel (meta = its config; None when `kernel` is the autotuner) and, for
    split > 1, the fp32 workspace and the reduce. Returns y."""
    M, K = x.shape
    N = wq.shape[0]
    flags = dict(A_FP8=a_fp8, EVEN_K=K % TILE == 0, INTERP=interp, ROUND_BF16=interp and y.dtype == torch.bfloat16)
    meta = meta or {}
    out, stride = (y, y.stride(0)) if split == 1 else (new_output((split, M, N), x.device), N)
    if split == 1:  # today's launch: a 2-D grid, the kernel writes y
        grid = lambda m: (triton.cdiv(M, m["BLOCK_M"]), triton.cdiv(N, m["BLOCK_N"]))  # noqa: E731
    else:
        grid = lambda m: (triton.cdiv(M, m["BLOCK_M"]), triton.cdiv(N, m["BLOCK_N"]), split)  # noqa: E731
    kernel[grid if not meta else grid(meta)](x, xs, wq, ws, out, M, N, K, _m_key(M), x.stride(0), stride,
                                             SPLIT_K=split, **flags, **meta)
    if split > 1:
        block = _REDUCE_BLOCK if not interp else min(16384, triton.next_power_of_2(M * N))
        _splitk_reduce_kernel[(triton.cdiv(M * N, block),)](out, y, M * N, SPLIT_K=split, BLOCK=block,
                                                            ROUND_BF16=flags["ROUND_BF16"])
    return y


def _tune(x, xs, wq, ws, y, a_fp8: bool, splits: list[int]):
    """For each candidate SPLIT_K the autotuner picks the tile config (by kernel time: the reduce does not
    depend on it); then, with several candidates, the whole call (workspace, kernel, reduce) is timed once per
    candidate and the fastest kept (ties within 2% go to the smaller split: less workspace traffic)."""
    best = None
    for s in splits:
        _launch(_fp8_linear_tuned, x, xs, wq, ws, y, a_fp8, s, False, None)
        cfg = getattr(_fp8_linear_tuned, "best_config", None)
        meta = cfg.all_kwargs() if cfg is not None else dict(_SMALL_CONFIG)
        if len(splits) == 1:
            return meta, s
        t = triton.testing.do_bench(lambda: _launch(_fp8_linear_kernel, x, xs, wq, ws, y, a_fp8, s, False, meta),
                                    warmup=10, rep=40)
        if best is None or t < 0.98 * best[0]:
            best = (t, meta, s)
    return best[1], best[2]


def _gemm(x, xs, wq, ws, out_dtype, a_fp8: bool, split_k: int | None = None):
    _check_fp8_device(x.device)
    M, K = x.shape
    N = wq.shape[0]
    y = new_output((M, N), x.device, out_dtype)
    if x.is_cuda and M * N * K >= AUTOTUNE_MIN_MNK:
        key = (_m_key(M), N, K, a_fp8, x.dtype, wq.dtype, out_dtype, split_k)
        choice = _TUNED.get(key)
        if choice is None:  # first call for this size class: time the configs (and the splits, when automatic)
            choice = _TUNED[key] = _tune(x, xs, wq, ws, y, a_fp8, [split_k] if split_k else
                                         _split_candidates(M, N, K))
        meta, split = choice  # later calls launch the choice directly (less Python per call: decode is launch-bound)
        return _launch(_fp8_linear_kernel, x, xs, wq, ws, y, a_fp8, split, False, meta)
    if x.is_cuda:
        return _launch(_fp8_linear_kernel, x, xs, wq, ws, y, a_fp8, split_k or 1, False, dict(_SMALL_CONFIG))
    bm, bn = min(64, max(16, triton.next_power_of_2(M))), min(128, max(16, triton.next_power_of_2(N)))
    return _launch(_fp8_linear_kernel, x, xs, wq, ws, y, a_fp8, split_k or 1, True, dict(BLOCK_M=bm, BLOCK_N=bn))


# ---- references ----
def _tiles(x: torch.Tensor, rows: int):
    """Zero-pad [R, C] to multiples of (rows, 128) and view as [R/rows, rows, C/128, 128]."""
    R, C = x.shape
    xp = torch.nn.functional.pad(x.float(), (0, -C % TILE, 0, -R % rows))
    return xp.view(xp.shape[0] // rows, rows, xp.shape[1] // TILE, TILE)


def _quantize_ref(x, rows_per_scale: int):
    R, C = x.shape
    t = _tiles(x, rows_per_scale)                               # [Rb, r, Cb, 128]
    amax = t.abs().amax(dim=(1, 3), keepdim=True)               # one value per (row block, column block)
    scale = amax.clamp(min=1e-12) * torch.tensor(1 / E4M3_MAX, dtype=torch.float32, device=x.device)
    q = (t / scale).to(torch.float8_e4m3fn)                     # from fp32: ties to even, saturating
    q = q.view(t.shape[0] * rows_per_scale, t.shape[2] * TILE)[:R, :C].contiguous()
    return q, scale[:, 0, :, 0]


def quantize_act_ref(x):
    q, s = _quantize_ref(x, 1)
    return q, s


def quantize_weight_ref(w):
    return _quantize_ref(w, TILE)


def fp8_blockwise_matmul_ref(xq, xs, wq, ws, out_dtype: torch.dtype = torch.float32, acc_dtype=torch.float32):
    """Exact reference: loop over K blocks, fp32 (or acc_dtype) block products, per-row x per-block scales."""
    M, K = xq.shape
    N = wq.shape[0]
    ws_cols = ws.repeat_interleave(TILE, dim=0)[:N]              # [N, KB]: each output column's weight scale
    y = torch.zeros(M, N, dtype=acc_dtype, device=xq.device)
    for kb in range(triton.cdiv(K, TILE)):
        k = slice(kb * TILE, (kb + 1) * TILE)
        part = xq[:, k].to(acc_dtype) @ wq[:, k].to(acc_dtype).T
        y += part * xs[:, kb:kb + 1].to(acc_dtype) * ws_cols[:, kb][None, :].to(acc_dtype)
    return y.to(out_dtype)
