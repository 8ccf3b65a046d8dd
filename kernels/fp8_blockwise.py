"""FP8 (e4m3) blockwise quantisation and the block-scaled matmul (DeepSeek-V3 / verl FP8-rollout recipe).

Public functions:

    quantize_act(x)    x [M, K]   -> (xq [M, K] float8_e4m3fn, xs [M, ceil(K/128)] fp32)    1 x 128 tiles
    quantize_weight(w) w [N, K]   -> (wq [N, K] float8_e4m3fn, ws [ceil(N/128), ceil(K/128)] fp32) 128 x 128 blocks
    prepare_weight(w)  w [N, K]   -> Fp8Weight(wq, ws): quantize_weight once per weight sync (K % 128 == 0)
    fp8_blockwise_matmul(xq, xs, wq, ws, out_dtype=torch.float32) -> y [M, N] ~= x @ w.T
    fp8_linear(x, w_or_prepared, out_dtype=None, fused=None) -> y [M, N] = x @ w.T through fp8 (out_dtype
        defaults to x's dtype); w a bf16/fp32 weight (quantised per call) or an Fp8Weight (no weight pass)

Each has an `_ref` twin in pure torch. Triton kernels run when the tensors are on CUDA (there the matmul
feeds real fp8 operands to the tensor cores: Hopper or newer) or on CPU with TRITON_INTERPRET=1 (the tests).

Maths:
    scale = max(amax(tile), 1e-12) * fp32(1/448)    (448 = largest e4m3 value; one scale per tile/block)
    q     = round_to_e4m3(x / scale)                 (round to nearest, ties to even, saturate at +-448)
    y[m, n] = sum_kb  scale_x[m, kb] * scale_w[n // 128, kb] * sum_{k in kb} q_x[m, k] q_w[n, k]
The matmul accumulates each 128-wide K block in fp32 and applies the two scales per block, so the
reference is exact up to fp32 summation order (products of two e4m3 numbers are exact in fp32).

The GEMM (_fp8_linear_kernel, one launch): a program owns a [BLOCK_M, BLOCK_N] output tile and walks K in
128-wide steps (BLOCK_K = TILE). Each step loads the e4m3 weight tile [BLOCK_N, 128] (K contiguous: the K-major
B operand Hopper's fp8 wgmma wants, so prepare_weight keeps nn.Linear's [N, K] layout and needs no transpose) and
  fused (fp8_linear(..., fused=True); default only for M <= FUSE_MAX_M): the bf16/fp32 activation tile
      [BLOCK_M, 128], its row amax, the scale, x / scale and the cast to e4m3 in registers (bit-equal to
      quantize_act, see below);
  two-launch (fp8_linear's default above FUSE_MAX_M, and fp8_blockwise_matmul): quantize_act's codes and scales;
then part = tl.dot(a_e4m3, b_e4m3) (fp8 tensor cores, fp32 out) and acc += part * sa[:, None] * sb[None, :]:
the fp32 promotion every 128 K that DeepGEMM and DeepSeek-V3 use (Hopper adds fp8 products inside one wgmma in
a ~14-bit accumulator). Autotuned over a few Hopper configs keyed on (M's power-of-two class, N, K), with
BLOCK_M = 64 and BLOCK_N 32..256 for decode (M = 64..256: the grid splits N only, each program streams its
weight columns once); the interpreter launches one config.
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
137 GFLOP / 1270 TFLOP/s = 108 us: compute-bound, floor 0.108 ms (the bf16 matmul: 0.192 ms). At decode
(M = 64..256, N = K = 4096) the 16 MB fp8 weight read dominates: ~3.5 us vs ~7 us for the bf16 weight.
Quantisation alone is memory-bound: reads 4 (fp32) or 2 (bf16) bytes and writes 1 byte per element (+ 4 bytes
per 128-element scale).
Measured (one H200, commit 95b1adc, benchmarks/results/kernels.md): with a prepared weight 0.241 ms at 4096^3,
2.20x its 0.109 ms floor, and slower than the bf16 matmul's 0.190 ms. At decode shapes (N = K = 4096) it is
slower too: 0.032 / 0.031 / 0.037 ms at M = 64 / 128 / 256 vs bf16's 0.018 / 0.019 / 0.025 ms.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
import triton.testing

from kernels._interpret import new_output, use_triton


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
                       EVEN_K: tl.constexpr, INTERP: tl.constexpr, ROUND_BF16: tl.constexpr):
    """y[BLOCK_M, BLOCK_N] = sum over 128-wide K steps of sa * sb * (qa @ qw^T), promoted in fp32 each step.

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
    for kb in range(0, KB):
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
    if ROUND_BF16:
        u = acc.to(tl.int32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & -65536
        acc = u.to(tl.float32, bitcast=True)
    tl.store(Y + rm[:, None].to(tl.int64) * stride_y + rn[None, :], acc.to(Y.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


# ---- public functions ----
def _check2d(name, x):
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, K], got shape {tuple(x.shape)}")


def _quantize(x, per_row: bool):
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


def fp8_blockwise_matmul(xq, xs, wq, ws, out_dtype: torch.dtype = torch.float32):
    """y [M, N] = block-scaled xq @ wq.T (see the header)."""
    M, K = xq.shape
    N = wq.shape[0]
    KB = triton.cdiv(K, TILE)
    if wq.shape[1] != K or tuple(xs.shape) != (M, KB) or tuple(ws.shape) != (triton.cdiv(N, TILE), KB):
        raise ValueError(f"shapes do not match the 1x128 / 128x128 recipe: xq {tuple(xq.shape)}, xs "
                         f"{tuple(xs.shape)}, wq {tuple(wq.shape)}, ws {tuple(ws.shape)}")
    if not _use_triton(xq, xs, wq, ws):
        return fp8_blockwise_matmul_ref(xq, xs, wq, ws, out_dtype)
    return _gemm(xq.contiguous(), xs.contiguous(), wq.contiguous(), ws.contiguous(), out_dtype, a_fp8=True)


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


def fp8_linear(x: torch.Tensor, w, out_dtype: torch.dtype | None = None, fused: bool | None = None) -> torch.Tensor:
    """x @ w.T through blockwise fp8 (forward only: the FP8 rollout path).

    w: a bf16/fp32 [N, K] weight (quantised here, per call) or prepare_weight's Fp8Weight (quantised once).
    fused: quantise the activation inside the GEMM (one launch; the default for M <= FUSE_MAX_M) or in a
    separate quantize_act launch first (the default above it: the fused path re-quantises x in every N tile,
    see the header)."""
    _check2d("x", x)
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
        return _gemm(xq, xs, wq, ws, out_dtype, a_fp8=True)
    x = x if x.stride(1) == 1 else x.contiguous()
    return _gemm(x, ws, wq, ws, out_dtype, a_fp8=False)  # XS unused on the fused path


FUSE_MAX_M = 0  # fp8_linear's default: fused activation quantisation up to this many rows (none: see header)


def _m_key(M: int) -> int:
    return min(triton.next_power_of_2(M), 8192)


def _prune(configs, named_args, **kwargs):
    """Small-M configs for decode (M_KEY <= 64: BLOCK_M = 64 only), large tiles and short pipelines only for
    big M."""
    try:
        m = int(named_args["M_KEY"])
        keep = [c for c in configs if (m > 64 or c.kwargs["BLOCK_M"] == 64)
                and (m < 1024 or (c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] >= 8192 and c.num_stages <= 5))]
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
]
# Autotuning needs a GPU; the interpreter launches the plain kernel with one config (see _gemm). The autotuner
# wraps the compiled kernel object; the module name _fp8_linear_kernel stays free for the interpreter swap.
# Each candidate is timed briefly (10 ms warm-up, 40 ms of repeats: a decode GEMM is ~10 us).
_fp8_linear_tuned = triton.autotune(
    configs=_GPU_CONFIGS, key=["M_KEY", "N", "K", "A_FP8", "EVEN_K"], prune_configs_by={"early_config_prune": _prune},
    do_bench=lambda kernel_call, quantiles: triton.testing.do_bench(kernel_call, warmup=10, rep=40,
                                                                    quantiles=quantiles))(_fp8_linear_kernel)
AUTOTUNE_MIN_MNK = 2 ** 30  # smaller GEMMs (the tiny rollout models, the tests) take one fixed config, untuned
_SMALL_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
_TUNED: dict = {}  # (M size class, N, K, a_fp8, dtypes) -> the autotuner's choice


def _gemm(x, xs, wq, ws, out_dtype, a_fp8: bool):
    M, K = x.shape
    N = wq.shape[0]
    y = new_output((M, N), x.device, out_dtype)
    args = (x, xs, wq, ws, y, M, N, K, _m_key(M), x.stride(0), y.stride(0))
    if x.is_cuda and M * N * K >= AUTOTUNE_MIN_MNK:
        key = (args[8], N, K, a_fp8, x.dtype, wq.dtype, out_dtype)
        cfg = _TUNED.get(key)
        if cfg is None:  # first call for this size class: the autotuner times the configs
            grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]))  # noqa: E731
            _fp8_linear_tuned[grid](*args, A_FP8=a_fp8, EVEN_K=K % TILE == 0, INTERP=False, ROUND_BF16=False)
            _TUNED[key] = getattr(_fp8_linear_tuned, "best_config", None)
        else:  # later calls launch the chosen config directly (less Python per call: decode is launch-bound)
            _fp8_linear_kernel[(triton.cdiv(M, cfg.kwargs["BLOCK_M"]), triton.cdiv(N, cfg.kwargs["BLOCK_N"]))](
                *args, A_FP8=a_fp8, EVEN_K=K % TILE == 0, INTERP=False, ROUND_BF16=False, **cfg.all_kwargs())
    elif x.is_cuda:
        c = _SMALL_CONFIG
        _fp8_linear_kernel[(triton.cdiv(M, c["BLOCK_M"]), triton.cdiv(N, c["BLOCK_N"]))](
            *args, A_FP8=a_fp8, EVEN_K=K % TILE == 0, INTERP=False, ROUND_BF16=False, **c)
    else:
        bm, bn = min(64, max(16, triton.next_power_of_2(M))), min(128, max(16, triton.next_power_of_2(N)))
        _fp8_linear_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
            *args, BLOCK_M=bm, BLOCK_N=bn, A_FP8=a_fp8, EVEN_K=K % TILE == 0, INTERP=True,
            ROUND_BF16=out_dtype == torch.bfloat16)
    return y


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
