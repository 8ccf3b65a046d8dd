"""Shared-prompt attention (DualKV): N responses attend to one prompt stored once, forward and backward.

Paper: "DualKV: Shared-Prompt Flash Attention for Efficient RL Training with Large Rollouts and Long Contexts"
(arXiv:2605.15422).

Public functions:

    dualkv_attention(qp, kp, vp, qr, kr, vr, scale=None) -> (out_prompt, out_responses)
        qp, kp, vp  [B, H, P, D]     the prompt's queries/keys/values, stored ONCE per group
        qr, kr, vr  [B, N, H, R, D]  each of the N responses' own queries/keys/values
        returns out_prompt [B, H, P, D] and out_responses [B, N, H, R, D]; differentiable in all six inputs
    pack_shared_prompt(x, prompt_len)   [B, N, P + R, ...] -> ([B, P, ...], [B, N, R, ...])  (checks the
                                        prompts really are identical)
    unpack_shared_prompt(prompt, responses) -> [B, N, P + R, ...]  (the replicated layout, for references)
    token_reduction(N, P, R) -> rho = N (P + R) / (P + N R)

Triton kernels when the tensors are on CUDA (or on CPU with TRITON_INTERPRET=1, the tests); the pure-torch
`dualkv_attention_ref` (ordinary causal attention on the replicated N(P+R) layout) otherwise.

Why it is exact: with causal masking a prompt token only sees prompt tokens, so the prompt's hidden states
are the same in all N sequences at every layer; computing them once and letting each response attend to
[prompt keys | its own keys] is the same function as attention on the replicated layout. Gradients of the
shared prompt keys/values are the sum of the N replicas' gradients, which the backward forms directly.

Maths (scale s = 1/sqrt(D) by default; softmax over the concatenated key set; causal within a region):
    prompt query i   : keys = prompt[0..i]
    response query j : keys = prompt[0..P-1]  ++  own response[0..j]
    O = softmax(s Q K^T) V, computed FlashAttention-style: online softmax over key blocks, region by
    region, keeping lse = log sum exp(s q.k) per query for the backward.
    Backward (FlashAttention-2): delta = rowsum(dO * O);  P = exp(s Q K^T - lse);  dV = P^T dO;
    dP = dO V^T;  dS = P (dP - delta);  dQ = s dS K;  dK = s dS^T Q.
    dK, dV of a prompt key block sum over the prompt's queries (causal) AND all N responses' queries.

Memory layout and schedule: all tensors contiguous, head-major ([B, H, P, D] and [B, N, H, R, D]).
One kernel per pass, specialised by the constexpr IS_PROMPT and launched twice (prompt rows, response rows):
    forward   grid (query blocks, B*H, 1 or N): a response program walks the prompt's key blocks (no mask)
              then its own key blocks (causal).
    backward  dQ: same grid as the forward. dK/dV: grid (key blocks, B*H, 1 or N); a prompt-key program walks
              the prompt's queries and then the N responses' queries, so the N-fold sum happens in registers
              with no atomics.
The paper fuses both regions into one launch; two launches of one specialised kernel cost one extra launch
latency and keep the kernel readable.

Token reduction and roofline floor: every per-token op (norms, projections, MLP) sees P + N R tokens instead
of N (P + R): rho = N (P + R) / (P + N R). Attention flops (forward) ~ 4 D H B [P^2/2 + N (P R + R^2/2)]
against 4 D H B N (P + R)^2 / 2 replicated; backward 2.5x the forward. Bytes: Q, K, V, O of P + N R tokens.
The floor is max(flops / matmul rate, bytes / bandwidth) for the shape.

Precision: every tl.dot asks for input_precision="ieee": with fp32 operands (the fp32 path and the tests) a GPU
would otherwise round them to TF32; bf16/fp16 operands ignore the flag.

Deviations: one prompt length P and one response length R per call (pad ragged responses and mask them
out in the loss; a varlen version would take offsets); the preprocessing delta = rowsum(dO * O) is done in torch.
"""
from __future__ import annotations

import math

import torch
from kernels._interpret import new_output, tl, triton, use_triton  # stand-ins where Triton has no wheels


def _use_triton(*tensors) -> bool:
    return use_triton(globals(), *tensors)  # this module's kernels, made interpretable when asked


# ---- Triton kernels ----
@triton.jit
def _load_rows(X, pos, L, D, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    """Rows X[pos, :D] of a contiguous [L, D] matrix (zeros outside)."""
    d = tl.arange(0, BLOCK_D)
    x = tl.load(X + pos[:, None] * D + d[None, :], mask=(pos < L)[:, None] & (d < D)[None, :], other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _fwd_region(acc, m, l, q, q_pos, K, V, Lk, hi, D, scale, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    """Fold key blocks [0, hi) of one KV region into the online-softmax state (acc, m, l)."""
    for n0 in range(0, hi, BLOCK_N):
        k_pos = n0 + tl.arange(0, BLOCK_N)
        k = _load_rows(K, k_pos, Lk, D, BLOCK_D, UPCAST)
        v = _load_rows(V, k_pos, Lk, D, BLOCK_D, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        valid = (k_pos < Lk)[None, :]
        if CAUSAL:
            valid = valid & (k_pos[None, :] <= q_pos[:, None])
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))              # finite: key 0 of the prompt is visible to every query
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new
    return acc, m, l


@triton.jit
def _dualkv_fwd_kernel(QP, KP, VP, QR, KR, VR, O, LSE, H, N, P, R, D, scale, IS_PROMPT: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)                   # b * H + h
    resp = (bh // H * N + tl.program_id(2)) * H + bh % H  # (b, n, h) flattened, for response launches
    prompt_kv = bh * P * D
    if IS_PROMPT:
        Lq = P
        q_base = prompt_kv
        row_base = bh * P
        Q = QP
    else:
        Lq = R
        q_base = resp * R * D
        row_base = resp * R
        Q = QR
    q_pos = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = _load_rows(Q + q_base, q_pos, Lq, D, BLOCK_D, UPCAST)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    causal_hi = tl.minimum((pid_m + 1) * BLOCK_M, Lq)    # last key block a causal query block can see
    if IS_PROMPT:   # region 1 only: the prompt, causal
        acc, m, l = _fwd_region(acc, m, l, q, q_pos, KP + prompt_kv, VP + prompt_kv, P, causal_hi, D, scale,
                                True, BLOCK_N, BLOCK_D, UPCAST)
    else:           # region 1: the whole shared prompt; region 2: this response's own keys, causal
        acc, m, l = _fwd_region(acc, m, l, q, q_pos, KP + prompt_kv, VP + prompt_kv, P, P, D, scale,
                                False, BLOCK_N, BLOCK_D, UPCAST)
        acc, m, l = _fwd_region(acc, m, l, q, q_pos, KR + q_base, VR + q_base, R, causal_hi, D, scale,
                                True, BLOCK_N, BLOCK_D, UPCAST)
    d = tl.arange(0, BLOCK_D)
    qmask = q_pos < Lq
    tl.store(O + q_base + q_pos[:, None] * D + d[None, :], acc / l[:, None], mask=qmask[:, None] & (d < D)[None, :])
    tl.store(LSE + row_base + q_pos, m + tl.log(l), mask=qmask)


@triton.jit
def _dq_region(dq, q, do, lse, delta, q_pos, K, V, Lk, hi, D, scale, CAUSAL: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    for n0 in range(0, hi, BLOCK_N):
        k_pos = n0 + tl.arange(0, BLOCK_N)
        k = _load_rows(K, k_pos, Lk, D, BLOCK_D, UPCAST)
        v = _load_rows(V, k_pos, Lk, D, BLOCK_D, UPCAST)
        valid = (k_pos < Lk)[None, :]
        if CAUSAL:
            valid = valid & (k_pos[None, :] <= q_pos[:, None])
        s_qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        p = tl.where(valid, tl.exp(s_qk * scale - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee")
    return dq


@triton.jit
def _dualkv_bwd_dq_kernel(QP, KP, VP, QR, KR, VR, DO, LSE, DELTA, DQ, H, N, P, R, D, scale,
                          IS_PROMPT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    resp = (bh // H * N + tl.program_id(2)) * H + bh % H
    prompt_kv = bh * P * D
    if IS_PROMPT:
        Lq = P
        q_base = prompt_kv
        row_base = bh * P
        Q = QP
    else:
        Lq = R
        q_base = resp * R * D
        row_base = resp * R
        Q = QR
    q_pos = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    qmask = q_pos < Lq
    q = _load_rows(Q + q_base, q_pos, Lq, D, BLOCK_D, UPCAST)
    do = _load_rows(DO + q_base, q_pos, Lq, D, BLOCK_D, UPCAST)
    lse = tl.load(LSE + row_base + q_pos, mask=qmask, other=0.0)
    delta = tl.load(DELTA + row_base + q_pos, mask=qmask, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    causal_hi = tl.minimum((pid_m + 1) * BLOCK_M, Lq)
    if IS_PROMPT:
        dq = _dq_region(dq, q, do, lse, delta, q_pos, KP + prompt_kv, VP + prompt_kv, P, causal_hi, D, scale,
                        True, BLOCK_N, BLOCK_D, UPCAST)
    else:
        dq = _dq_region(dq, q, do, lse, delta, q_pos, KP + prompt_kv, VP + prompt_kv, P, P, D, scale,
                        False, BLOCK_N, BLOCK_D, UPCAST)
        dq = _dq_region(dq, q, do, lse, delta, q_pos, KR + q_base, VR + q_base, R, causal_hi, D, scale,
                        True, BLOCK_N, BLOCK_D, UPCAST)
    d = tl.arange(0, BLOCK_D)
    tl.store(DQ + q_base + q_pos[:, None] * D + d[None, :], dq * scale, mask=qmask[:, None] & (d < D)[None, :])


@triton.jit
def _dkdv_region(dk, dv, k, v, k_pos, Q, DO, LSE, DELTA, Lq, lo, D, scale, CAUSAL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    """Add the contributions of query rows [lo, Lq) of one query region to a key block's dK, dV."""
    for m0 in range(lo, Lq, BLOCK_M):
        q_pos = m0 + tl.arange(0, BLOCK_M)
        qmask = q_pos < Lq
        q = _load_rows(Q, q_pos, Lq, D, BLOCK_D, UPCAST)
        do = _load_rows(DO, q_pos, Lq, D, BLOCK_D, UPCAST)
        lse = tl.load(LSE + q_pos, mask=qmask, other=0.0)
        delta = tl.load(DELTA + q_pos, mask=qmask, other=0.0)
        valid = qmask[:, None]
        if CAUSAL:
            valid = valid & (k_pos[None, :] <= q_pos[:, None])
        s_qk = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_M, BLOCK_N]
        p = tl.where(valid, tl.exp(s_qk * scale - lse[:, None]), 0.0)
        dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision="ieee")
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision="ieee")
    return dk, dv


@triton.jit
def _dualkv_bwd_dkdv_kernel(QP, KP, VP, QR, KR, VR, DOP, DOR, LSEP, LSER, DELTAP, DELTAR, DK, DV,
                            H, N, P, R, D, scale, IS_PROMPT: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    prompt_kv = bh * P * D
    k_pos = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    lo = (pid_n * BLOCK_N) // BLOCK_M * BLOCK_M          # first query block that can see this key block
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    if IS_PROMPT:
        Lk = P
        kv_base = prompt_kv
        k = _load_rows(KP + kv_base, k_pos, P, D, BLOCK_D, UPCAST)
        v = _load_rows(VP + kv_base, k_pos, P, D, BLOCK_D, UPCAST)
        # the prompt's own queries (causal) ...
        dk, dv = _dkdv_region(dk, dv, k, v, k_pos, QP + prompt_kv, DOP + prompt_kv, LSEP + bh * P,
                              DELTAP + bh * P, P, lo, D, scale, True, BLOCK_M, BLOCK_D, UPCAST)
        # ... plus every response's queries (all of them see the whole prompt): the N-fold sum
        for n in range(0, N):
            resp = (b * N + n) * H + h
            dk, dv = _dkdv_region(dk, dv, k, v, k_pos, QR + resp * R * D, DOR + resp * R * D, LSER + resp * R,
                                  DELTAR + resp * R, R, 0, D, scale, False, BLOCK_M, BLOCK_D, UPCAST)
    else:
        resp = (b * N + tl.program_id(2)) * H + h
        Lk = R
        kv_base = resp * R * D
        k = _load_rows(KR + kv_base, k_pos, R, D, BLOCK_D, UPCAST)
        v = _load_rows(VR + kv_base, k_pos, R, D, BLOCK_D, UPCAST)
        dk, dv = _dkdv_region(dk, dv, k, v, k_pos, QR + kv_base, DOR + kv_base, LSER + resp * R,
                              DELTAR + resp * R, R, lo, D, scale, True, BLOCK_M, BLOCK_D, UPCAST)
    d = tl.arange(0, BLOCK_D)
    omask = (k_pos < Lk)[:, None] & (d < D)[None, :]
    tl.store(DK + kv_base + k_pos[:, None] * D + d[None, :], dk * scale, mask=omask)
    tl.store(DV + kv_base + k_pos[:, None] * D + d[None, :], dv, mask=omask)


# ---- autograd wrapper ----
def _config(D, interpreted):
    block_d = max(16, triton.next_power_of_2(D))
    if interpreted:  # few, large tiles
        return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_D=block_d)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=block_d)


class _DualKVAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qp, kp, vp, qr, kr, vr, scale):
        B, H, P, D = qp.shape
        N, R = qr.shape[1], qr.shape[3]
        interpreted = not qp.is_cuda
        cfg = _config(D, interpreted)
        upcast = interpreted or qp.dtype == torch.float32
        op, orr = new_output(qp.shape, qp.device, qp.dtype), new_output(qr.shape, qr.device, qr.dtype)
        lsep, lser = new_output((B, H, P), qp.device), new_output((B, N, H, R), qp.device)
        common = (qp, kp, vp, qr, kr, vr)
        _dualkv_fwd_kernel[(triton.cdiv(P, cfg["BLOCK_M"]), B * H, 1)](
            *common, op, lsep, H, N, P, R, D, scale, IS_PROMPT=True, UPCAST=upcast, **cfg)
        _dualkv_fwd_kernel[(triton.cdiv(R, cfg["BLOCK_M"]), B * H, N)](
            *common, orr, lser, H, N, P, R, D, scale, IS_PROMPT=False, UPCAST=upcast, **cfg)
        ctx.save_for_backward(qp, kp, vp, qr, kr, vr, op, orr, lsep, lser)
        ctx.scale, ctx.cfg, ctx.upcast = scale, cfg, upcast
        return op, orr

    @staticmethod
    def backward(ctx, dop, dor):
        qp, kp, vp, qr, kr, vr, op, orr, lsep, lser = ctx.saved_tensors
        B, H, P, D = qp.shape
        N, R = qr.shape[1], qr.shape[3]
        cfg, scale, upcast = ctx.cfg, ctx.scale, ctx.upcast
        dop = torch.zeros_like(op) if dop is None else dop.contiguous()
        dor = torch.zeros_like(orr) if dor is None else dor.contiguous()
        deltap = (dop.float() * op.float()).sum(-1)      # rowsum(dO * O), the FlashAttention-2 preprocessing
        deltar = (dor.float() * orr.float()).sum(-1)
        dqp, dkp, dvp = (new_output(qp.shape, qp.device, qp.dtype) for _ in range(3))
        dqr, dkr, dvr = (new_output(qr.shape, qr.device, qr.dtype) for _ in range(3))
        common = (qp, kp, vp, qr, kr, vr)
        _dualkv_bwd_dq_kernel[(triton.cdiv(P, cfg["BLOCK_M"]), B * H, 1)](
            *common, dop, lsep, deltap, dqp, H, N, P, R, D, scale, IS_PROMPT=True, UPCAST=upcast, **cfg)
        _dualkv_bwd_dq_kernel[(triton.cdiv(R, cfg["BLOCK_M"]), B * H, N)](
            *common, dor, lser, deltar, dqr, H, N, P, R, D, scale, IS_PROMPT=False, UPCAST=upcast, **cfg)
        both = (*common, dop, dor, lsep, lser, deltap, deltar)
        _dualkv_bwd_dkdv_kernel[(triton.cdiv(P, cfg["BLOCK_N"]), B * H, 1)](
            *both, dkp, dvp, H, N, P, R, D, scale, IS_PROMPT=True, UPCAST=upcast, **cfg)
        _dualkv_bwd_dkdv_kernel[(triton.cdiv(R, cfg["BLOCK_N"]), B * H, N)](
            *both, dkr, dvr, H, N, P, R, D, scale, IS_PROMPT=False, UPCAST=upcast, **cfg)
        return dqp, dkp, dvp, dqr, dkr, dvr, None


# ---- public functions and reference ----
def _check(qp, kp, vp, qr, kr, vr):
    if qp.dim() != 4 or qr.dim() != 5:
        raise ValueError(f"prompt tensors must be [B, H, P, D] and response tensors [B, N, H, R, D]; got "
                         f"{tuple(qp.shape)} and {tuple(qr.shape)}")
    if kp.shape != qp.shape or vp.shape != qp.shape or kr.shape != qr.shape or vr.shape != qr.shape:
        raise ValueError("q, k and v must have the same shape within the prompt and within the responses")
    B, H, P, D = qp.shape
    if (qr.shape[0], qr.shape[2], qr.shape[4]) != (B, H, D):
        raise ValueError(f"responses {tuple(qr.shape)} must share B, H, D with the prompt {tuple(qp.shape)}")
    if P < 1:
        raise ValueError("the shared prompt must have at least one token")


def dualkv_attention(qp, kp, vp, qr, kr, vr, scale: float | None = None):
    """Causal attention of a shared prompt (stored once) and N responses. Returns (out_prompt, out_responses)."""
    _check(qp, kp, vp, qr, kr, vr)
    scale = 1.0 / math.sqrt(qp.shape[-1]) if scale is None else float(scale)
    if not _use_triton(qp, kp, vp, qr, kr, vr):
        return dualkv_attention_ref(qp, kp, vp, qr, kr, vr, scale)
    return _DualKVAttention.apply(*(x.contiguous() for x in (qp, kp, vp, qr, kr, vr)), scale)


def dualkv_attention_ref(qp, kp, vp, qr, kr, vr, scale: float | None = None):
    """Ordinary causal attention on the replicated [B, N, H, P + R, D] layout (eager, at least fp32 softmax)."""
    scale = 1.0 / math.sqrt(qp.shape[-1]) if scale is None else float(scale)
    N, P = qr.shape[1], qp.shape[2]

    def rep(p, r):  # [B, H, P, D] + [B, N, H, R, D] -> [B, N, H, P + R, D]
        return torch.cat([p[:, None].expand(-1, N, -1, -1, -1), r], dim=3)

    q, k, v = rep(qp, qr), rep(kp, kr), rep(vp, vr)
    L = q.shape[3]
    s = (q @ k.transpose(-1, -2)).to(torch.promote_types(q.dtype, torch.float32)) * scale
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    a = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
    o = (a.to(v.dtype) @ v)
    # every replica of the prompt computes the same rows; the packed layout keeps replica 0's
    return o[:, 0, :, :P], o[:, :, :, P:]


def pack_shared_prompt(x: torch.Tensor, prompt_len: int, check: bool = True):
    """[B, N, P + R, ...] (N responses to one prompt, prompt replicated) -> ([B, P, ...], [B, N, R, ...])."""
    prompt = x[:, 0, :prompt_len]
    if check and not torch.equal(x[:, :, :prompt_len], prompt[:, None].expand_as(x[:, :, :prompt_len])):
        raise ValueError("the N sequences of a group do not share their first prompt_len tokens")
    return prompt.contiguous(), x[:, :, prompt_len:].contiguous()


def unpack_shared_prompt(prompt: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """([B, P, ...], [B, N, R, ...]) -> the replicated [B, N, P + R, ...] layout."""
    N = responses.shape[1]
    return torch.cat([prompt[:, None].expand(-1, N, *prompt.shape[1:]), responses], dim=2)


def token_reduction(N: int, P: int, R: int) -> float:
    """rho = N (P + R) / (P + N R): how many fewer tokens every per-token op processes after packing."""
    return N * (P + R) / (P + N * R)
