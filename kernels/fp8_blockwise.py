"""FP8 (e4m3) blockwise quantisation and the block-scaled matmul (DeepSeek-V3 / verl FP8-rollout recipe).

Public functions:

    quantize_act(x)    x [M, K]   -> (xq [M, K] float8_e4m3fn, xs [M, ceil(K/128)] fp32)    1 x 128 tiles
    quantize_weight(w) w [N, K]   -> (wq [N, K] float8_e4m3fn, ws [ceil(N/128), ceil(K/128)] fp32) 128 x 128 blocks
    fp8_blockwise_matmul(xq, xs, wq, ws, out_dtype=torch.float32) -> y [M, N] ~= x @ w.T
    fp8_linear(x, w, out_dtype=None)  quantise both, then the matmul (out_dtype defaults to x's dtype)

Each has an `_ref` twin in pure torch. Triton kernels run when the tensors are on CUDA (there the matmul
feeds real fp8 operands to the tensor cores: Hopper or newer) or on CPU with TRITON_INTERPRET=1 (the tests).

Maths:
    scale = max(amax(tile), 1e-12) * fp32(1/448)    (448 = largest e4m3 value; one scale per tile/block)
    q     = round_to_e4m3(x / scale)                 (round to nearest, ties to even, saturate at +-448)
    y[m, n] = sum_kb  scale_x[m, kb] * scale_w[n // 128, kb] * sum_{k in kb} q_x[m, k] q_w[n, k]
The matmul accumulates each 128-wide K block in fp32 and applies the two scales per block, so the
reference is exact up to fp32 summation order (products of two e4m3 numbers are exact in fp32).

Interpreter trap (seen with triton 3.9): Triton's CPU interpreter rounds fp32 -> fp8 casts wrongly for a few
percent of values, so the kernel first rounds onto the e4m3 grid in fp32 (`_round_e4m3`: exponent from the
bits, spacing 2^(e-3), round half to even) and only then casts, which is exact everywhere. On a GPU the same
code runs; the cast is then a no-op rounding. The scale multiplies by the fp32 reciprocal of 448 (torch on a GPU
turns a division by a Python number into exactly that multiplication, torch on a CPU does not, so the reference
spells it out), and x / scale uses div_rn: Triton's plain fp32 `/` is an approximate division on NVIDIA GPUs,
torch's tensor / tensor is IEEE, and the tests demand equal bits.

Memory layout: row-major [M, K] and [N, K] (K contiguous, as nn.Linear's weight); scales row-major.
Quantisation programs own [BLOCK_R, 128] tiles (activations: one scale per row; weights: BLOCK_R = 128,
one scale per tile). Matmul programs own [BLOCK_M, BLOCK_N] outputs and walk K in 128-wide blocks.

Roofline floor: quantisation is memory-bound: reads 4 (fp32) or 2 (bf16) bytes and writes 1 byte per element
(+ 4 bytes per 128-element scale). The matmul: 2 M N K flops at the fp8 tensor-core rate (about 2x bf16 on
H100/H200), bytes (M K + N K) + M N * out_bytes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

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
def _fp8_mm_kernel(A, AS, B, BS, Cout, M, N, K, KB, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   UPCAST: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = rm < M
    nmask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for kb in range(0, KB):
        rk = kb * 128 + tl.arange(0, 128)
        kmask = rk < K
        a = tl.load(A + rm[:, None].to(tl.int64) * K + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(B + rn[:, None].to(tl.int64) * K + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        if UPCAST:  # interpreter: no fp8 arithmetic; the fp8 -> fp32 conversion itself is exact
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        # fp8 x fp8 on the tensor cores. Hopper accumulates fp8 products in a reduced-precision adder (about
        # 14 bits, DeepSeek-V3 section 3.3.2), so one dot covers one 128-wide K block and the block's partial
        # sum is promoted to the fp32 accumulator below, which is DeepSeek-V3's promotion interval.
        part = tl.dot(a, tl.trans(b))
        sa = tl.load(AS + rm * KB + kb, mask=mmask, other=0.0)
        sb = tl.load(BS + (rn // 128) * KB + kb, mask=nmask, other=0.0)
        acc += part * sa[:, None] * sb[None, :]
    tl.store(Cout + rm[:, None].to(tl.int64) * N + rn[None, :], acc.to(Cout.dtype.element_ty),
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
    y = new_output((M, N), xq.device, out_dtype)
    if xq.is_cuda:
        bm, bn = 64, 128
    else:
        bm, bn = min(64, max(16, triton.next_power_of_2(M))), min(128, max(16, triton.next_power_of_2(N)))
    _fp8_mm_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
        xq.contiguous(), xs.contiguous(), wq.contiguous(), ws.contiguous(), y, M, N, K, KB,
        BLOCK_M=bm, BLOCK_N=bn, UPCAST=not xq.is_cuda)
    return y


def fp8_linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x @ w.T through blockwise fp8 (forward only: the FP8 rollout path)."""
    xq, xs = quantize_act(x)
    wq, ws = quantize_weight(w)
    return fp8_blockwise_matmul(xq, xs, wq, ws, out_dtype or x.dtype)


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
