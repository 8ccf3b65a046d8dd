"""Tree-masked attention: T tree nodes attend a committed prefix and their own ancestors, forward and backward.

Two uses: (a) verify a draft token TREE in one target forward (the drafter proposes several continuations that
share prefixes; every node is scored at once and the longest accepted root-to-leaf path is kept), as in SpecInfer
("SpecInfer: Accelerating Large Language Model Serving with Tree-based Speculative Inference and Verification",
arXiv:2305.09781) and DART, a parallel drafter that builds draft-token trees for the target to verify; (b) score a
prefix-shared rollout tree (a prompt and a tree of continuations) without replicating the shared prefix, forward
and backward, for training on tree rollouts.

Public functions:

    tree_verify_attention(q, k, v, parents, scale=None, bits=None) -> out [B, H, T, D]
        q        [B, H, T, D]       the tree nodes' queries
        k, v     [B, H, P + T, D]   keys/values of the committed prefix (P positions, all visible) then the T nodes
        parents  [B, T] int         parents[b, i] < i is node i's parent, -1 for a root (a child of the prefix's
                                    last token); nodes are in topological order
        bits     optional: ancestor_bits(ancestor_mask(parents)), built once and shared by every layer
        differentiable in q, k and v
    tree_verify_attention_ref(q, k, v, parents, scale=None)   dense mask + softmax (eager, fp32 softmax)
    ancestor_mask(parents) -> bool [B, T, T]    anc[b, i, j] = node j is node i or one of its ancestors
    tree_attention_mask(parents, prefix_len) -> bool [B, T, P + T]   the visibility of every node (prefix + ancestors)
    ancestor_bits(anc) -> int32 [B, T, ceil(T / 32)]   the mask packed 32 keys to a word (what the kernels read)
    tree_depths(parents) -> long [B, T]         depth of every node (a root has depth 1): its position offset

Triton kernels when the tensors are on CUDA (or on CPU with TRITON_INTERPRET=1, the tests); the pure-torch
reference otherwise.

Maths (scale s = 1/sqrt(D) by default). Node i sees the key set
    K_i = {prefix 0..P-1} U {P + j : j in anc(i)},   anc(i) = {i, parent(i), parent(parent(i)), ...}
    O_i = softmax_{K_i}(s q_i . k) V, computed FlashAttention-style: online softmax over key blocks, keeping
    lse_i = log sum_{K_i} exp(s q_i . k) for the backward.
    Backward (FlashAttention-2): delta = rowsum(dO * O);  P = exp(s Q K^T - lse) on the visible pairs, 0 elsewhere;
    dV = P^T dO;  dP = dO V^T;  dS = P (dP - delta);  dQ = s dS K;  dK = s dS^T Q.
A chain (parents[i] = i - 1) is ordinary causal attention of T new tokens over a P-token cache; a star (every node a
root) lets each node see the prefix and itself only. Since parents[i] < i, a node never sees a later node: key
blocks above the diagonal are skipped exactly as in causal attention.

Memory layout and schedule: all tensors contiguous, head-major. The ancestor mask is packed into int32 words
bits[b, i, j // 32] >> (j % 32) & 1 (T^2 / 8 bytes per tree, shared by all heads), built once per call in torch.
    forward   grid (query blocks, B*H): the full prefix blocks without a mask, then the straddling prefix block
              and the tree's key blocks up to the diagonal with the mask (prefix | ancestor bit).
    backward  dQ: the forward's grid. dK/dV: grid (key blocks of P + T, B*H); a prefix key block sums over all T
              queries with no mask; a block holding tree keys walks the queries from the diagonal on, with the mask.
              No atomics.

Roofline floor: forward flops ~ 4 D H B T (P + T_vis) where T_vis is the mean number of tree keys below the
diagonal (T / 2, as causal; the ancestor mask only zeroes some of them: a kernel that skipped blocks with no
visible bit would do less on bushy trees); backward 2.5x the forward. Bytes: Q, O of T rows and K, V of P + T rows
plus the bitmask. For verification (T of 8-64 nodes over a long prefix) the pass reads the prefix's K, V once per
query block: bandwidth-bound like decoding, and one call for all T nodes instead of one per tree path.

Precision: every tl.dot asks for input_precision="ieee": with fp32 operands (the fp32 path and the tests) a GPU
would otherwise round them to TF32; bf16/fp16 operands ignore the flag. In the interpreter the tiles are upcast to
fp32 (its bf16 arithmetic is wrong), as the other kernels here do.

Deviations: one prefix length P and one tree size T per call (pad smaller trees with extra roots and ignore their
outputs); heads of q and k/v are equal (no grouped-query broadcasting: expand k, v first); the preprocessing
delta = rowsum(dO * O) and the bitmask are computed in torch; no block skipping on empty ancestor tiles.
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
def _visible(BITS, q_pos, k_pos, P, T, W):
    """[BLOCK_M, BLOCK_N] visibility: key k_pos (prefix 0..P-1, then tree nodes) seen by tree node q_pos."""
    in_tree = (k_pos >= P) & (k_pos < P + T)
    j = tl.where(in_tree, k_pos - P, 0)                  # tree index of the key (0 where it is no tree key)
    inside = (q_pos < T)[:, None] & in_tree[None, :]
    word = tl.load(BITS + q_pos[:, None] * W + j[None, :] // 32, mask=inside, other=0)
    bit = (word >> (j[None, :] % 32)) & 1
    return ((k_pos < P)[None, :] & (q_pos < T)[:, None]) | (inside & (bit != 0))


@triton.jit
def _fwd_blocks(acc, m, l, q, q_pos, K, V, BITS, lo, hi, P, T, W, D, scale, MASKED: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    """Fold key blocks [lo, hi) into the online-softmax state (acc, m, l); MASKED: apply the tree mask."""
    for n0 in range(lo, hi, BLOCK_N):
        k_pos = n0 + tl.arange(0, BLOCK_N)
        k = _load_rows(K, k_pos, P + T, D, BLOCK_D, UPCAST)
        v = _load_rows(V, k_pos, P + T, D, BLOCK_D, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        if MASKED:
            s = tl.where(_visible(BITS, q_pos, k_pos, P, T, W), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block may hide every key of a row
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new
    return acc, m, l


@triton.jit
def _tree_fwd_kernel(Q, K, V, BITS, O, LSE, H, P, T, W, D, scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)                   # b * H + h
    q_base, kv_base, bits = bh * T * D, bh * (P + T) * D, BITS + (bh // H) * T * W
    q_pos = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = _load_rows(Q + q_base, q_pos, T, D, BLOCK_D, UPCAST)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    p_full = P // BLOCK_N * BLOCK_N                      # prefix blocks every node sees whole
    hi = P + tl.minimum((pid_m + 1) * BLOCK_M, T)        # no node sees a later node
    acc, m, l = _fwd_blocks(acc, m, l, q, q_pos, K + kv_base, V + kv_base, bits, 0, p_full, P, T, W, D, scale,
                            False, BLOCK_N, BLOCK_D, UPCAST)
    acc, m, l = _fwd_blocks(acc, m, l, q, q_pos, K + kv_base, V + kv_base, bits, p_full, hi, P, T, W, D, scale,
                            True, BLOCK_N, BLOCK_D, UPCAST)
    d = tl.arange(0, BLOCK_D)
    qmask = q_pos < T
    l = tl.where(qmask, l, 1.0)                          # rows past T saw nothing (P = 0); never stored
    tl.store(O + q_base + q_pos[:, None] * D + d[None, :], acc / l[:, None], mask=qmask[:, None] & (d < D)[None, :])
    tl.store(LSE + bh * T + q_pos, m + tl.log(l), mask=qmask)


@triton.jit
def _dq_blocks(dq, q, do, lse, delta, q_pos, K, V, BITS, lo, hi, P, T, W, D, scale, MASKED: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    for n0 in range(lo, hi, BLOCK_N):
        k_pos = n0 + tl.arange(0, BLOCK_N)
        k = _load_rows(K, k_pos, P + T, D, BLOCK_D, UPCAST)
        v = _load_rows(V, k_pos, P + T, D, BLOCK_D, UPCAST)
        s_qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        p = tl.exp(s_qk * scale - lse[:, None])
        if MASKED:
            p = tl.where(_visible(BITS, q_pos, k_pos, P, T, W), p, 0.0)
        else:
            p = tl.where((q_pos < T)[:, None], p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee")
    return dq


@triton.jit
def _tree_bwd_dq_kernel(Q, K, V, BITS, DO, LSE, DELTA, DQ, H, P, T, W, D, scale, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    q_base, kv_base, bits = bh * T * D, bh * (P + T) * D, BITS + (bh // H) * T * W
    q_pos = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    qmask = q_pos < T
    q = _load_rows(Q + q_base, q_pos, T, D, BLOCK_D, UPCAST)
    do = _load_rows(DO + q_base, q_pos, T, D, BLOCK_D, UPCAST)
    lse = tl.load(LSE + bh * T + q_pos, mask=qmask, other=0.0)
    delta = tl.load(DELTA + bh * T + q_pos, mask=qmask, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    p_full = P // BLOCK_N * BLOCK_N
    hi = P + tl.minimum((pid_m + 1) * BLOCK_M, T)
    dq = _dq_blocks(dq, q, do, lse, delta, q_pos, K + kv_base, V + kv_base, bits, 0, p_full, P, T, W, D, scale,
                    False, BLOCK_N, BLOCK_D, UPCAST)
    dq = _dq_blocks(dq, q, do, lse, delta, q_pos, K + kv_base, V + kv_base, bits, p_full, hi, P, T, W, D, scale,
                    True, BLOCK_N, BLOCK_D, UPCAST)
    d = tl.arange(0, BLOCK_D)
    tl.store(DQ + q_base + q_pos[:, None] * D + d[None, :], dq * scale, mask=qmask[:, None] & (d < D)[None, :])


@triton.jit
def _tree_bwd_dkdv_kernel(Q, K, V, BITS, DO, LSE, DELTA, DK, DV, H, P, T, W, D, scale, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    q_base, kv_base, bits = bh * T * D, bh * (P + T) * D, BITS + (bh // H) * T * W
    k0 = pid_n * BLOCK_N
    k_pos = k0 + tl.arange(0, BLOCK_N)
    k = _load_rows(K + kv_base, k_pos, P + T, D, BLOCK_D, UPCAST)
    v = _load_rows(V + kv_base, k_pos, P + T, D, BLOCK_D, UPCAST)
    masked = k0 + BLOCK_N > P                            # the block holds tree keys (or straddles the prefix end)
    lo = tl.maximum(k0 - P, 0) // BLOCK_M * BLOCK_M      # tree key j is seen by nodes i >= j only
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    for m0 in range(lo, T, BLOCK_M):
        q_pos = m0 + tl.arange(0, BLOCK_M)
        qmask = q_pos < T
        q = _load_rows(Q + q_base, q_pos, T, D, BLOCK_D, UPCAST)
        do = _load_rows(DO + q_base, q_pos, T, D, BLOCK_D, UPCAST)
        lse = tl.load(LSE + bh * T + q_pos, mask=qmask, other=0.0)
        delta = tl.load(DELTA + bh * T + q_pos, mask=qmask, other=0.0)
        s_qk = tl.dot(q, tl.trans(k), input_precision="ieee")   # [BLOCK_M, BLOCK_N]
        p = tl.exp(s_qk * scale - lse[:, None])
        if masked:
            p = tl.where(_visible(bits, q_pos, k_pos, P, T, W), p, 0.0)
        else:
            p = tl.where(qmask[:, None], p, 0.0)
        dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision="ieee")
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision="ieee")
    d = tl.arange(0, BLOCK_D)
    omask = (k_pos < P + T)[:, None] & (d < D)[None, :]
    tl.store(DK + kv_base + k_pos[:, None] * D + d[None, :], dk * scale, mask=omask)
    tl.store(DV + kv_base + k_pos[:, None] * D + d[None, :], dv, mask=omask)


# ---- autograd wrapper ----
def _config(D, interpreted):
    block_d = max(16, triton.next_power_of_2(D))
    if interpreted:  # few, large tiles
        return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_D=block_d)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=block_d)


class _TreeVerifyAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bits, scale):
        B, H, T, D = q.shape
        P, W = k.shape[2] - T, bits.shape[-1]
        interpreted = not q.is_cuda
        cfg = _config(D, interpreted)
        upcast = interpreted or q.dtype == torch.float32
        o, lse = new_output(q.shape, q.device, q.dtype), new_output((B, H, T), q.device)
        _tree_fwd_kernel[(triton.cdiv(T, cfg["BLOCK_M"]), B * H)](
            q, k, v, bits, o, lse, H, P, T, W, D, scale, UPCAST=upcast, **cfg)
        ctx.save_for_backward(q, k, v, bits, o, lse)
        ctx.scale, ctx.cfg, ctx.upcast = scale, cfg, upcast
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, bits, o, lse = ctx.saved_tensors
        B, H, T, D = q.shape
        P, W = k.shape[2] - T, bits.shape[-1]
        cfg, scale, upcast = ctx.cfg, ctx.scale, ctx.upcast
        do = do.contiguous()
        delta = (do.float() * o.float()).sum(-1)         # rowsum(dO * O), the FlashAttention-2 preprocessing
        dq = new_output(q.shape, q.device, q.dtype)
        dk, dv = new_output(k.shape, k.device, k.dtype), new_output(v.shape, v.device, v.dtype)
        _tree_bwd_dq_kernel[(triton.cdiv(T, cfg["BLOCK_M"]), B * H)](
            q, k, v, bits, do, lse, delta, dq, H, P, T, W, D, scale, UPCAST=upcast, **cfg)
        _tree_bwd_dkdv_kernel[(triton.cdiv(P + T, cfg["BLOCK_N"]), B * H)](
            q, k, v, bits, do, lse, delta, dk, dv, H, P, T, W, D, scale, UPCAST=upcast, **cfg)
        return dq, dk, dv, None, None


# ---- the tree's masks ----
def check_parents(parents: torch.Tensor) -> None:
    """parents [B, T] of integers with -1 <= parents[b, i] < i (topological order); ValueError otherwise."""
    if parents.dim() != 2 or parents.dtype.is_floating_point or parents.dtype == torch.bool:
        raise ValueError(f"parents must be an integer tensor [B, T]; got {parents.dtype} {tuple(parents.shape)}")
    idx = torch.arange(parents.shape[1], device=parents.device)
    bad = (parents < -1) | (parents >= idx)
    if bool(bad.any()):
        b, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"parents[{b}, {i}] = {int(parents[b, i])}: every node's parent must come before it "
                         "(-1 <= parents[b, i] < i, nodes in topological order; -1 marks a root)")


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """anc [B, T, T] bool: anc[b, i, j] = node j is node i or an ancestor of it. One pass per tree level: every
    node marks its ancestor at the current height, then steps one level up (max depth passes, not T)."""
    check_parents(parents)
    B, T = parents.shape
    anc = torch.eye(T, dtype=torch.bool, device=parents.device).repeat(B, 1, 1)
    parents = parents.long()
    up = parents.clone()
    while bool((up >= 0).any()):
        b, i = (up >= 0).nonzero(as_tuple=True)
        anc[b, i, up[b, i]] = True
        up = torch.where(up >= 0, parents.gather(1, up.clamp(min=0)), up)
    return anc


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """depth [B, T]: 1 for a root, its parent's depth + 1 otherwise (node i's position is the prefix's last
    position + depth)."""
    return ancestor_mask(parents).sum(-1)


def tree_attention_mask(parents: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """[B, T, P + T] bool: node i sees the whole prefix and its own ancestors (itself included)."""
    anc = ancestor_mask(parents)
    B, T = parents.shape
    return torch.cat([torch.ones(B, T, prefix_len, dtype=torch.bool, device=parents.device), anc], dim=-1)


def ancestor_bits(anc: torch.Tensor) -> torch.Tensor:
    """Pack anc [B, T, T] bool into int32 words [B, T, ceil(T / 32)]: bit j % 32 of word j // 32."""
    B, T, _ = anc.shape
    W = max(1, -(-T // 32))
    padded = torch.zeros(B, T, W * 32, dtype=torch.int64, device=anc.device)
    padded[..., :T] = anc.long()
    words = (padded.view(B, T, W, 32) << torch.arange(32, device=anc.device)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


# ---- public functions and reference ----
def _check(q, k, v, parents):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q must be [B, H, T, D] and k, v [B, H, P + T, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, H, T, D = q.shape
    if k.shape != v.shape or k.shape[:2] != (B, H) or k.shape[3] != D or k.shape[2] < T:
        raise ValueError(f"k and v must be [B, H, P + T, D] with q's B, H, D and P >= 0: q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if tuple(parents.shape) != (B, T):
        raise ValueError(f"parents must be [B, T] = {(B, T)}; got {tuple(parents.shape)}")
    if T < 1:
        raise ValueError("the tree must have at least one node")
    check_parents(parents)


def tree_verify_attention(q, k, v, parents, scale: float | None = None, bits: torch.Tensor | None = None):
    """Tree-masked attention of T nodes over a P-token prefix and their ancestors. Returns out [B, H, T, D].

    bits: ancestor_bits(ancestor_mask(parents)) computed once and passed to every layer of a model (the tree is the
    same in all of them); built here when None."""
    _check(q, k, v, parents)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if not _use_triton(q, k, v):
        return tree_verify_attention_ref(q, k, v, parents, scale)
    if bits is None:
        bits = ancestor_bits(ancestor_mask(parents.to(q.device)))
    if tuple(bits.shape) != (q.shape[0], q.shape[2], max(1, -(-q.shape[2] // 32))) or bits.dtype != torch.int32:
        raise ValueError(f"bits must be int32 [B, T, ceil(T / 32)] from ancestor_bits; got {bits.dtype} "
                         f"{tuple(bits.shape)}")
    return _TreeVerifyAttention.apply(*(x.contiguous() for x in (q, k, v)), bits, scale)


def tree_verify_attention_ref(q, k, v, parents, scale: float | None = None):
    """Dense reference: scores over all P + T keys, the tree mask, softmax (at least fp32), times V."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    T, L = q.shape[2], k.shape[2]
    mask = tree_attention_mask(parents.to(q.device), L - T)[:, None]    # [B, 1, T, P + T]
    s = (q @ k.transpose(-1, -2)).to(torch.promote_types(q.dtype, torch.float32)) * scale
    a = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    return a.to(v.dtype) @ v
