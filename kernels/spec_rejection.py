"""Speculative-decoding rejection sampler: accept or resample a batch of drafts in one kernel.

Public function:

    spec_rejection_sample(draft_tokens, draft_probs, target_probs, uniforms) -> (tokens, num_accepted)
        draft_tokens [B, K]        tokens proposed by the draft model
        draft_probs  [B, K, V]     q: the draft's distribution at each drafted position (the one x was drawn from)
        target_probs [B, K + 1, V] p: the target's distribution at each position, plus one for the bonus token
        uniforms     [B, K + 1]    U(0, 1) randoms: column j < K decides acceptance at j, column K drives the
                                   one final draw (the resample or the bonus). Passing them in makes the
                                   kernel and the reference comparable draw for draw.
        returns tokens [B, K + 1] int64 (emitted tokens, -1 after the last one) and num_accepted [B] int64;
        each row emits num_accepted + 1 tokens.

Triton kernel when the tensors are on CUDA (or on CPU with TRITON_INTERPRET=1, the tests); the pure-torch
`spec_rejection_sample_ref` otherwise. The inputs are read through their strides, so broadcast (expanded)
p and q cost nothing.

Maths (Leviathan et al. 2023; Chen et al. 2023), per row, for j = 0..K-1 while all previous were accepted:
    accept x_j  iff  u_j < min(1, p_j(x_j) / q_j(x_j))          (computed as u_j q_j(x_j) < p_j(x_j): no division)
    on the first rejection at j: emit y ~ norm(max(0, p_j - q_j)) and stop
    if all K are accepted:      emit a bonus y ~ p_K
This makes every emitted token distributed exactly as the target's p (the tests check it with a total-variation
test, and check that the wrong rule min(1, q/p) fails it). The draw y = smallest v with C_v > u_K * C_V,
C the running sum of the (unnormalised) weights: inverse-CDF sampling without normalising.
If rounding leaves max(0, p - q) with zero mass, the row falls back to p_j.

Memory layout and schedule: one program handles BLOCK_B rows as vectors (so the K acceptance steps are a
handful of gathers); the final draw walks the vocabulary in [BLOCK_B, BLOCK_V] tiles twice (total mass, then
the inverse-CDF count), reading only the one distribution row each sequence needs.

Roofline floor: memory-bound: the draw reads at most 2 rows of V probabilities per sequence (p and q at the
rejected position) twice, plus O(K) gathers: about 16 V bytes per sequence in fp32. Eager torch builds the
[B, V] residual, its cumsum and a multinomial, several passes more.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._interpret import new_output, use_triton


def _use_triton(*tensors) -> bool:
    return use_triton(globals(), *tensors)  # this module's kernels, made interpretable when asked


# ---- Triton kernel ----
@triton.jit
def _spec_kernel(D, Q, P, U, OUT, NACC, B, V,
                 sd_b, sq_b, sq_k, sp_b, sp_k, su_b, so_b,
                 K: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    rows64 = rows.to(tl.int64)
    n_acc = tl.zeros((BLOCK_B,), tl.int64)
    alive = rmask
    # 1. acceptance tests, left to right; a row stops at its first rejection
    for j in tl.static_range(K):
        x = tl.load(D + rows64 * sd_b + j, mask=rmask, other=0)
        px = tl.load(P + rows64 * sp_b + j * sp_k + x, mask=rmask, other=0.0).to(tl.float32)
        qx = tl.load(Q + rows64 * sq_b + j * sq_k + x, mask=rmask, other=0.0).to(tl.float32)
        u = tl.load(U + rows64 * su_b + j, mask=rmask, other=1.0)
        acc = alive & (u * qx < px)
        tl.store(OUT + rows64 * so_b + j, tl.where(acc, x, -1), mask=rmask)
        n_acc += acc.to(tl.int64)
        alive = acc
    tl.store(OUT + rows64 * so_b + K, tl.full((BLOCK_B,), -1, tl.int64), mask=rmask)

    # 2. the final draw at position r = n_acc: residual max(0, p_r - q_r) after a rejection, p_K as bonus
    r = n_acc
    rejected = r < K
    p_row = P + rows64 * sp_b + r * sp_k
    q_row = Q + rows64 * sq_b + tl.minimum(r, K - 1) * sq_k
    tot_res = tl.zeros((BLOCK_B,), tl.float32)
    tot_p = tl.zeros((BLOCK_B,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        m2 = rmask[:, None] & (cols < V)[None, :]
        p = tl.load(p_row[:, None] + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        q = tl.load(q_row[:, None] + cols[None, :], mask=m2 & rejected[:, None], other=0.0).to(tl.float32)
        tot_res += tl.sum(tl.maximum(p - q, 0.0), 1)
        tot_p += tl.sum(p, 1)
    use_res = rejected & (tot_res > 0)                   # otherwise draw from p itself (bonus, or fallback)
    total = tl.where(use_res, tot_res, tot_p)
    thr = tl.load(U + rows64 * su_b + K, mask=rmask, other=0.0) * total
    running = tl.zeros((BLOCK_B,), tl.float32)
    count = tl.zeros((BLOCK_B,), tl.int64)               # number of v with C_v <= thr = the sampled index
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        m2 = rmask[:, None] & (cols < V)[None, :]
        p = tl.load(p_row[:, None] + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        q = tl.load(q_row[:, None] + cols[None, :], mask=m2 & use_res[:, None], other=0.0).to(tl.float32)
        w = tl.maximum(p - q, 0.0)                        # = p where q was not loaded
        c = tl.cumsum(w, 1) + running[:, None]
        count += tl.sum(((c <= thr[:, None]) & m2).to(tl.int64), 1)
        running += tl.sum(w, 1)
    y = tl.minimum(count, V - 1)                         # u * total can round up to the last C_v
    tl.store(OUT + rows64 * so_b + r, y, mask=rmask)
    tl.store(NACC + rows64, n_acc, mask=rmask)


# ---- public function and reference ----
def _check(draft_tokens, draft_probs, target_probs, uniforms):
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [B, K], got shape {tuple(draft_tokens.shape)}")
    B, K = draft_tokens.shape
    if K < 1:
        raise ValueError("need at least one drafted token (K >= 1)")
    if draft_probs.dim() != 3 or draft_probs.shape[:2] != (B, K):
        raise ValueError(f"draft_probs must be [B, K, V] = [{B}, {K}, V], got {tuple(draft_probs.shape)}")
    V = draft_probs.shape[2]
    if tuple(target_probs.shape) != (B, K + 1, V):
        raise ValueError(f"target_probs must be [B, K + 1, V] = {(B, K + 1, V)}, got {tuple(target_probs.shape)}")
    if tuple(uniforms.shape) != (B, K + 1):
        raise ValueError(f"uniforms must be [B, K + 1] = {(B, K + 1)}, got {tuple(uniforms.shape)}")


def spec_rejection_sample(draft_tokens, draft_probs, target_probs, uniforms):
    """Accept/resample a batch of K-token drafts. Returns (tokens [B, K+1] with -1 padding, num_accepted [B])."""
    _check(draft_tokens, draft_probs, target_probs, uniforms)
    if not _use_triton(draft_tokens, draft_probs, target_probs, uniforms):
        return spec_rejection_sample_ref(draft_tokens, draft_probs, target_probs, uniforms)
    B, K = draft_tokens.shape
    V = draft_probs.shape[2]
    q, p = draft_probs, target_probs
    if q.stride(2) != 1 or p.stride(2) != 1:
        raise ValueError("draft_probs and target_probs must be contiguous along the vocabulary")
    d = draft_tokens.to(torch.int64).contiguous()
    u = uniforms.to(torch.float32).contiguous()
    out = new_output((B, K + 1), d.device, torch.int64, fill=0)  # poisoned with -7, a value it never writes
    n_acc = new_output((B,), d.device, torch.int64, fill=0)
    if d.is_cuda:
        block_b, block_v = 4, 1024
    else:  # interpreter: few programs, one large tile
        block_b, block_v = min(1024, triton.next_power_of_2(B)), min(256, triton.next_power_of_2(V))
    _spec_kernel[(triton.cdiv(B, block_b),)](d, q, p, u, out, n_acc, B, V, d.stride(0), q.stride(0), q.stride(1),
                                            p.stride(0), p.stride(1), u.stride(0), out.stride(0),
                                            K=K, BLOCK_B=block_b, BLOCK_V=block_v)
    return out, n_acc


def _accept_prob(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p/q): the rule that makes the output exact (a test swaps in a wrong one to show the check bites)."""
    return torch.clamp(p_x / q_x, max=1.0)


def spec_rejection_sample_ref(draft_tokens, draft_probs, target_probs, uniforms):
    """Eager torch, vectorised over the batch, step by step as in the maths."""
    B, K = draft_tokens.shape
    V = draft_probs.shape[2]
    q, p = draft_probs.float(), target_probs.float()
    u = uniforms.float()
    ar = torch.arange(B, device=q.device)
    x = draft_tokens.long()
    tokens = torch.full((B, K + 1), -1, dtype=torch.int64, device=q.device)
    alive = torch.ones(B, dtype=torch.bool, device=q.device)
    n_acc = torch.zeros(B, dtype=torch.int64, device=q.device)
    for j in range(K):
        acc = alive & (u[:, j] < _accept_prob(p[ar, j, x[:, j]], q[ar, j, x[:, j]]))
        tokens[:, j] = torch.where(acc, x[:, j], -1)
        n_acc += acc.long()
        alive = acc
    rejected = n_acc < K
    p_r = p[ar, n_acc]                                              # p_K for the bonus
    q_r = torch.where(rejected[:, None], q[ar, n_acc.clamp(max=K - 1)], torch.zeros_like(p_r))
    resid = torch.clamp(p_r - q_r, min=0)
    use_res = rejected & (resid.sum(-1) > 0)
    w = torch.where(use_res[:, None], resid, p_r)
    cdf = torch.cumsum(w, -1)
    y = (cdf <= (u[:, K] * w.sum(-1))[:, None]).sum(-1).clamp(max=V - 1)
    tokens[ar, n_acc] = y
    return tokens, n_acc
