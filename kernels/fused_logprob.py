"""Fused linear -> selected-token log-prob and entropy, forward and backward, one chunk of logits at a time.

Public function (what `algos/grpo.py --kernels` calls):

    fused_linear_logprob(hidden, weight, targets, temperature=1.0) -> (logprob, entropy)
        hidden  [..., H]  final hidden states (fp32 / bf16 / fp16), requires_grad as you like
        weight  [V, H]    lm_head weight, same dtype
        targets [...]     int token ids in [0, V)
        returns logprob [...] and entropy [...], both fp32, both differentiable w.r.t. hidden and weight

It runs the Triton kernels when the tensors are on CUDA, or on CPU when TRITON_INTERPRET=1 (the tests), and
the pure-torch `fused_linear_logprob_ref` otherwise. Anchor: Liger-Kernel's fused linear cross-entropy and
Apple's Cut Cross-Entropy (same goal: never hold all N x V logits; CCE does not even write a chunk).

Maths (one row n; z = W h_n / T are the logits at temperature T; p = softmax(z)):
    lse      = log sum_v exp(z_v)                          (online: running max m, running sum s)
    logprob  = z_target - lse
    entropy  = lse - sum_v p_v z_v                         (running t = sum exp(z_v - m) z_v; sum p z = t / s)
    d logprob / d z_v = [v == target] - p_v
    d entropy / d z_v = -p_v (z_v - lse + entropy)         (= -p_v (log p_v + entropy))
    dz_v = g_logprob [v == target] - g_logprob p_v - g_entropy p_v (z_v - lse + entropy)
    d hidden = (dz / T) W,   d weight = (dz / T)^T hidden

Memory layout and schedule (Liger-Kernel's chunking): rows are processed in chunks of CHUNK_ELEMENTS / V.
    forward : the chunk's logits z = h W^T come from the matmul library (cuBLAS on a GPU) in the input dtype,
              exactly as eager torch computes them; a Triton program per row folds them into the online
              (max, sum exp, sum exp * z, z_target) statistics and writes logprob, entropy and lse.
    backward: the chunk's logits are recomputed (one extra matmul, as FlashAttention does); a Triton kernel
              turns them into dz / T in place; d_hidden = dz W and d_weight += dz^T h are two more library
              matmuls (d_weight summed over chunks in fp32).
    Only one chunk of logits is ever alive: 2^27 elements (256 MB in bf16) instead of N x V (and eager's
    several N x V fp32 copies for log-softmax and its gradient).

Roofline floor (N rows, V vocab, H hidden, b bytes per element):
    flops: forward 2 N V H; backward 6 N V H (recompute + two gradient matmuls): matmul-bound for any
    realistic H, so the floor is 8 N V H / matmul_rate for forward + backward.
    bytes: (N H + V H) b per matmul, plus each chunk's logits written and read twice.

Deviations / notes:
    * The first version fused the matmuls into the Triton kernels too (no logits in memory at all, as Apple's
      Cut Cross-Entropy); its backward added every tile's d_weight with fp32 atomics and measured 10x slower
      than eager torch on an H200 (benchmarks/results/gpu_checks.md). Chunking keeps the memory saving and
      leaves the matmuls to the library that is best at them.
    * d_weight's per-chunk products are rounded to the input dtype before the fp32 sum (one rounding per chunk).
    * The interpreter on CPU runs the same Triton kernels; the matmuls are torch's on either device.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._interpret import new_output, use_triton


def _use_triton(*tensors) -> bool:
    return use_triton(globals(), *tensors)  # this module's kernels, made interpretable when asked


# ---- Triton kernels: the softmax statistics and the logit gradient of one chunk of rows ----
@triton.jit
def _row_stats_kernel(Z, TGT, LP, ENT, LSE, V, stride_z, inv_temp, BLOCK_V: tl.constexpr):
    """One program per row of the chunk's logits: online (max, sum exp, sum exp * z) over the vocabulary."""
    row = tl.program_id(0)
    z_row = Z + row.to(tl.int64) * stride_z
    tgt = tl.load(TGT + row)
    m = tl.full((BLOCK_V,), float("-inf"), tl.float32)   # per-lane running max, sums and target logit
    s = tl.zeros((BLOCK_V,), tl.float32)
    t = tl.zeros((BLOCK_V,), tl.float32)
    zt = tl.zeros((BLOCK_V,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        cmask = cols < V
        z = tl.load(z_row + cols, mask=cmask, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, z)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # lanes that have seen only padding
        alpha = tl.exp(m - m_safe)                               # rescales the old sums to the new max
        e = tl.exp(z - m_safe)                                   # 0 on padded columns
        s = s * alpha + e
        t = t * alpha + e * tl.where(cmask, z, 0.0)             # (0 * -inf would be NaN on padding)
        zt += tl.where(cols == tgt, z, 0.0)
        m = m_new
    m_row = tl.max(m, 0)                                         # combine the lanes
    scale = tl.exp(tl.where(m == float("-inf"), float("-inf"), m - m_row))
    s_row = tl.sum(s * scale, 0)
    lse = m_row + tl.log(s_row)
    tl.store(LSE + row, lse)
    tl.store(LP + row, tl.sum(zt, 0) - lse)
    tl.store(ENT + row, lse - tl.sum(t * scale, 0) / s_row)


@triton.jit
def _dz_kernel(Z, TGT, LSE, ENT, G_LP, G_ENT, V, stride_z, inv_temp, BLOCK_V: tl.constexpr):
    """In place: logits z -> dz / T = (g_lp ([v == target] - p) - g_ent p (z - lse + entropy)) / T."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    cmask = cols < V
    ptr = Z + row.to(tl.int64) * stride_z + cols
    z = tl.load(ptr, mask=cmask, other=0.0).to(tl.float32) * inv_temp
    lse, ent = tl.load(LSE + row), tl.load(ENT + row)
    g_lp, g_ent = tl.load(G_LP + row), tl.load(G_ENT + row)
    p = tl.exp(z - lse)
    onehot = tl.where(cols == tl.load(TGT + row), 1.0, 0.0)
    dz = (g_lp * (onehot - p) - g_ent * p * (z - lse + ent)) * inv_temp  # chain rule through z = W h / T
    tl.store(ptr, dz.to(Z.dtype.element_ty), mask=cmask)


# ---- the autograd function: chunks of rows, logits by the matmul library, statistics by Triton ----
CHUNK_ELEMENTS = 2 ** 27  # logits alive at once (rows x V): 256 MB in bf16; tests lower it to force chunks


def _chunks(N, V):
    rows = max(1, min(N, CHUNK_ELEMENTS // V))
    return [(i, min(N, i + rows)) for i in range(0, N, rows)]


def _block_v(V, interpreted):
    return min(1024 if interpreted else 4096, triton.next_power_of_2(V))


class _FusedLinearLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature):
        N, V = hidden.shape[0], weight.shape[0]
        bv, inv_t = _block_v(V, not hidden.is_cuda), 1.0 / temperature
        lp, ent, lse = (new_output((N,), hidden.device) for _ in range(3))
        for a, b in _chunks(N, V):
            z = hidden[a:b] @ weight.T                          # [rows, V] in the input dtype, like eager
            _row_stats_kernel[(b - a,)](z, targets[a:b], lp[a:], ent[a:], lse[a:], V, z.stride(0), inv_t,
                                        BLOCK_V=bv, num_warps=8)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.temperature = temperature
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        N, V = hidden.shape[0], weight.shape[0]
        bv, inv_t = _block_v(V, not hidden.is_cuda), 1.0 / ctx.temperature
        g_lp = torch.zeros(N, device=hidden.device) if g_lp is None else g_lp.float().contiguous()
        g_ent = torch.zeros(N, device=hidden.device) if g_ent is None else g_ent.float().contiguous()
        dh = torch.empty_like(hidden)
        dw = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)  # summed over chunks
        for a, b in _chunks(N, V):
            dz = hidden[a:b] @ weight.T                         # recompute the chunk's logits ...
            _dz_kernel[(b - a, triton.cdiv(V, bv))](dz, targets[a:b], lse[a:], ent[a:], g_lp[a:], g_ent[a:],
                                                    V, dz.stride(0), inv_t, BLOCK_V=bv, num_warps=8)
            dh[a:b] = dz @ weight                               # ... turned into dz / T in place
            dw += (dz.T @ hidden[a:b]).float()
        return dh, dw.to(weight.dtype), None, None


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
