"""Fused linear -> selected-token log-prob and entropy, forward and backward, without the [N x V] logits.

Public function (what `algos/grpo.py --kernels` calls):

    fused_linear_logprob(hidden, weight, targets, temperature=1.0) -> (logprob, entropy)
        hidden  [..., H]  final hidden states (fp32 / bf16 / fp16), requires_grad as you like
        weight  [V, H]    lm_head weight, same dtype
        targets [...]     int token ids in [0, V)
        returns logprob [...] and entropy [...], both fp32, both differentiable w.r.t. hidden and weight

It runs the Triton kernels when the tensors are on CUDA, or on CPU when TRITON_INTERPRET=1 (the tests), and
the pure-torch `fused_linear_logprob_ref` otherwise. Anchor: Liger-Kernel's fused linear cross-entropy and
Apple's Cut Cross-Entropy (same idea: never write the logits to memory).

Maths (one row n; z = W h_n / T are the logits at temperature T; p = softmax(z)):
    lse      = log sum_v exp(z_v)                          (online: running max m, running sum s)
    logprob  = z_target - lse
    entropy  = lse - sum_v p_v z_v                         (running t = sum exp(z_v - m) z_v; sum p z = t / s)
    d logprob / d z_v = [v == target] - p_v
    d entropy / d z_v = -p_v (z_v - lse + entropy)         (= -p_v (log p_v + entropy))
    dz_v = g_logprob [v == target] - g_logprob p_v - g_entropy p_v (z_v - lse + entropy)
    d hidden = (dz / T) W,   d weight = (dz / T)^T hidden

Memory layout and schedule:
    forward : one program per BLOCK_N rows; it walks the vocabulary in BLOCK_V chunks, computes the
              [BLOCK_N, BLOCK_V] logit tile with a K-loop over H (tl.dot), and folds it into the online
              (m, s, t, z_target) statistics. Writes logprob, entropy and lse (4 bytes each per row).
    backward: one program per (row block, vocab block) tile: it recomputes the logit tile (one extra matmul,
              as FlashAttention does), forms dz in registers, then loops over H again and atomically adds
              dz @ W_tile into d_hidden and dz^T @ h_tile into d_weight (fp32 buffers). Nothing of size
              N x V ever reaches memory; peak extra memory is the fp32 gradient buffers.

Roofline floor (N rows, V vocab, H hidden, b bytes per element):
    flops: forward 2 N V H; backward 6 N V H (recompute + two gradient matmuls) -> matmul-bound for any
    realistic H, so the floor is 2NVH / matmul_rate forward and 6NVH / matmul_rate backward.
    bytes: forward (N H + V H) b + 16 N; eager torch additionally writes and reads the N x V logits (and
    log-softmax) several times, which is the memory the fused kernel saves.

Deviations / notes:
    * Atomic fp32 accumulation makes the backward order-nondeterministic in the last bits (as CCE).
    * CCE also skips gradient tiles whose softmax mass is negligible; we do not (exactness first).
    * Tensor-core dots use the input dtype (bf16) with fp32 accumulation; the interpreter on CPU upcasts to
      fp32 first (bf16 arithmetic is wrong in Triton's interpreter), controlled by the UPCAST constexpr.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._interpret import interpreter_requested, use_interpreter

POISON_OUTPUTS = False  # tests set True: outputs start as NaN, so an element the kernel forgets to write fails


def _new(shape, device, dtype=torch.float32):
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), device=device, dtype=dtype)
    return torch.empty(shape, device=device, dtype=dtype)


def _use_triton(*tensors) -> bool:
    if all(t.is_cuda for t in tensors):
        return True
    if interpreter_requested():
        use_interpreter(globals())
        return True
    return False


# ---- Triton kernels ----
@triton.jit
def _logit_tile(H, W, rows, cols, rmask, cmask, Hdim, stride_h, stride_w, inv_temp,
                BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                UPCAST: tl.constexpr, PREC: tl.constexpr):
    """z[BLOCK_N, BLOCK_V] = H[rows] @ W[cols]^T / T, K-loop over the hidden size."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for h0 in range(0, Hdim, BLOCK_H):
        hk = h0 + tl.arange(0, BLOCK_H)
        hmask = hk < Hdim
        a = tl.load(H + rows[:, None] * stride_h + hk[None, :], mask=rmask[:, None] & hmask[None, :], other=0.0)
        b = tl.load(W + cols[:, None] * stride_w + hk[None, :], mask=cmask[:, None] & hmask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PREC)
    return acc * inv_temp


@triton.jit
def _flp_fwd_kernel(H, W, TGT, LP, ENT, LSE, N, V, Hdim, stride_h, stride_w, inv_temp,
                    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                    UPCAST: tl.constexpr, PREC: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    tgt = tl.load(TGT + rows, mask=rmask, other=0)
    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)  # running max of z
    s = tl.zeros((BLOCK_N,), tl.float32)                 # running sum exp(z - m)
    t = tl.zeros((BLOCK_N,), tl.float32)                 # running sum exp(z - m) * z
    zt = tl.zeros((BLOCK_N,), tl.float32)                # logit of the target token
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        cmask = cols < V
        z = _logit_tile(H, W, rows, cols, rmask, cmask, Hdim, stride_h, stride_w, inv_temp,
                        BLOCK_N, BLOCK_V, BLOCK_H, UPCAST, PREC)
        z_or_ninf = tl.where(cmask[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z_or_ninf, 1))
        alpha = tl.exp(m - m_new)                        # rescales the old sums to the new max
        e = tl.exp(z_or_ninf - m_new[:, None])           # 0 on padded columns
        s = s * alpha + tl.sum(e, 1)
        t = t * alpha + tl.sum(e * tl.where(cmask[None, :], z, 0.0), 1)
        zt += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), 1)
        m = m_new
    lse = m + tl.log(s)
    tl.store(LSE + rows, lse, mask=rmask)
    tl.store(LP + rows, zt - lse, mask=rmask)
    tl.store(ENT + rows, lse - t / s, mask=rmask)


@triton.jit
def _flp_bwd_kernel(H, W, TGT, LSE, ENT, G_LP, G_ENT, DH, DW, N, V, Hdim, stride_h, stride_w, inv_temp,
                    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                    UPCAST: tl.constexpr, PREC: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    rmask = rows < N
    cmask = cols < V
    valid = rmask[:, None] & cmask[None, :]
    tgt = tl.load(TGT + rows, mask=rmask, other=0)
    lse = tl.load(LSE + rows, mask=rmask, other=0.0)
    ent = tl.load(ENT + rows, mask=rmask, other=0.0)
    g_lp = tl.load(G_LP + rows, mask=rmask, other=0.0)
    g_ent = tl.load(G_ENT + rows, mask=rmask, other=0.0)

    z = _logit_tile(H, W, rows, cols, rmask, cmask, Hdim, stride_h, stride_w, inv_temp,
                    BLOCK_N, BLOCK_V, BLOCK_H, UPCAST, PREC)
    p = tl.exp(z - lse[:, None])
    onehot = tl.where(cols[None, :] == tgt[:, None], 1.0, 0.0)
    dz = g_lp[:, None] * (onehot - p) - g_ent[:, None] * p * (z - lse[:, None] + ent[:, None])
    dz = tl.where(valid, dz, 0.0) * inv_temp             # chain rule through z = W h / T

    for h0 in range(0, Hdim, BLOCK_H):
        hk = h0 + tl.arange(0, BLOCK_H)
        hmask = hk < Hdim
        w = tl.load(W + cols[:, None] * stride_w + hk[None, :], mask=cmask[:, None] & hmask[None, :], other=0.0)
        h = tl.load(H + rows[:, None] * stride_h + hk[None, :], mask=rmask[:, None] & hmask[None, :], other=0.0)
        if UPCAST:
            w = w.to(tl.float32)
            h = h.to(tl.float32)
            dz_in = dz
        else:
            dz_in = dz.to(w.dtype)                       # tensor-core dot in the input dtype, fp32 accumulate
        dh = tl.dot(dz_in, w, input_precision=PREC)                 # [BLOCK_N, BLOCK_H]
        dw = tl.dot(tl.trans(dz_in), h, input_precision=PREC)       # [BLOCK_V, BLOCK_H]
        tl.atomic_add(DH + rows[:, None] * Hdim + hk[None, :], dh, mask=rmask[:, None] & hmask[None, :])
        tl.atomic_add(DW + cols[:, None] * Hdim + hk[None, :], dw, mask=cmask[:, None] & hmask[None, :])


# ---- launch configuration ----
def _config(N, V, Hdim, interpreted: bool):
    if interpreted:
        # The interpreter's cost grows with programs x loop steps: few, large tiles.
        return dict(BLOCK_N=max(16, min(64, triton.next_power_of_2(N))),
                    BLOCK_V=max(16, min(128, triton.next_power_of_2(V))),
                    BLOCK_H=max(16, min(64, triton.next_power_of_2(Hdim))), num_warps=4)
    return dict(BLOCK_N=64, BLOCK_V=128, BLOCK_H=64, num_warps=8)


def _meta(hidden, interpreted):
    upcast = interpreted or hidden.dtype == torch.float32
    prec = "ieee" if hidden.dtype == torch.float32 else "tf32"  # fp32 inputs: no TF32 rounding
    return upcast, prec


class _FusedLinearLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature):
        N, Hdim = hidden.shape
        V = weight.shape[0]
        interpreted = not hidden.is_cuda
        cfg = _config(N, V, Hdim, interpreted)
        upcast, prec = _meta(hidden, interpreted)
        lp, ent, lse = (_new((N,), hidden.device) for _ in range(3))
        grid = (triton.cdiv(N, cfg["BLOCK_N"]),)
        _flp_fwd_kernel[grid](hidden, weight, targets, lp, ent, lse, N, V, Hdim, hidden.stride(0),
                              weight.stride(0), 1.0 / temperature, UPCAST=upcast, PREC=prec, **cfg)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.temperature = temperature
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        N, Hdim = hidden.shape
        V = weight.shape[0]
        interpreted = not hidden.is_cuda
        cfg = _config(N, V, Hdim, interpreted)
        upcast, prec = _meta(hidden, interpreted)
        g_lp = torch.zeros(N, device=hidden.device) if g_lp is None else g_lp.float().contiguous()
        g_ent = torch.zeros(N, device=hidden.device) if g_ent is None else g_ent.float().contiguous()
        # fp32 accumulators that the tiles add into atomically: they must start at zero.
        dh = torch.zeros(N, Hdim, device=hidden.device, dtype=torch.float32)
        dw = torch.zeros(V, Hdim, device=hidden.device, dtype=torch.float32)
        grid = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(V, cfg["BLOCK_V"]))
        _flp_bwd_kernel[grid](hidden, weight, targets, lse, ent, g_lp, g_ent, dh, dw, N, V, Hdim,
                              hidden.stride(0), weight.stride(0), 1.0 / ctx.temperature,
                              UPCAST=upcast, PREC=prec, **cfg)
        return dh.to(hidden.dtype), dw.to(weight.dtype), None, None


# ---- public function and reference ----
def _check(hidden, weight, targets, temperature):
    if hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(f"hidden [..., H] and weight [V, H] must share H: got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets must have shape {tuple(hidden.shape[:-1])}, got {tuple(targets.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def fused_linear_logprob(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of `targets` and entropy under softmax(hidden @ weight.T / temperature), both fp32 [...]."""
    _check(hidden, weight, targets, temperature)
    if not _use_triton(hidden, weight, targets):
        return fused_linear_logprob_ref(hidden, weight, targets, temperature)
    lead = hidden.shape[:-1]
    h2 = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    lp, ent = _FusedLinearLogprob.apply(h2, weight.contiguous(), targets.reshape(-1).contiguous(),
                                        float(temperature))
    return lp.reshape(lead), ent.reshape(lead)


def fused_linear_logprob_ref(hidden, weight, targets, temperature: float = 1.0):
    """Eager torch: materialises the logits. Matmul in the input dtype, softmax in at least fp32."""
    acc = torch.promote_types(hidden.dtype, torch.float32)
    logits = (hidden @ weight.T).to(acc) / temperature
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent
