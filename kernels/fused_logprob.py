"""Fused linear -> selected-token log-prob and entropy, forward and backward: cuBLAS matmuls, Triton row maths.

Public functions: `fused_linear_logprob` (what `algos/grpo.py --kernels` and `common.token_logprobs` call) and
`fused_linear_logprob_loss` (gradients in the forward for a loss written per row; below the two modes):

    fused_linear_logprob(hidden, weight, targets, temperature=1.0, mode="auto", budget_bytes=None)
        -> (logprob, entropy)
        hidden  [..., H]  final hidden states (fp32 / bf16 / fp16), requires_grad as you like
        weight  [V, H]    lm_head weight, same dtype
        targets [...]     int token ids in [0, V)
        mode    "auto" | "store" | "recompute"   (see below; "auto" picks per call)
        returns logprob [...] and entropy [...], both fp32, both differentiable w.r.t. hidden and weight

It runs the Triton kernels when the tensors are on CUDA, or on CPU when TRITON_INTERPRET=1 (the tests), and
the pure-torch `fused_linear_logprob_ref` otherwise. Anchors: Liger-Kernel's fused linear cross-entropy
(chunked rows, matmuls left to cuBLAS) and Apple's Cut Cross-Entropy (never hold all N x V logits).

Maths (one row n; z = W h_n / T are the logits at temperature T; p = softmax(z)):
    lse      = log sum_v exp(z_v)                          (online: running max m, running sum s)
    logprob  = z_target - lse
    entropy  = lse - sum_v p_v z_v                         (running t = sum exp(z_v - m) z_v; sum p z = t / s)
    d logprob / d z_v = [v == target] - p_v
    d entropy / d z_v = -p_v (z_v - lse + entropy)         (= -p_v (log p_v + entropy))
    dz_v = g_logprob [v == target] - g_logprob p_v - g_entropy p_v (log p_v + entropy)
    d hidden = (dz / T) W,   d weight = (dz / T)^T hidden

Division of labour: every matmul is cuBLAS's (torch.mm in the input dtype, fp32 accumulation inside, exactly as
eager torch computes the logits); Triton only does the row-wise work on logits already in memory, in fp32
maths with the storage in the input dtype: `_row_stats_kernel` (one program per row: online max / sum exp /
sum exp*z / target logit -> logprob, entropy, lse) and `_dz_kernel` (logits -> dz / T in place).
Rows are processed in chunks: as many rows as fit `budget_bytes` of logits (LOGITS_BUDGET_BYTES, 2 GiB), at
least MIN_CHUNK_ROWS (1024) so the GEMMs stay large, split into equal chunks (the last one ragged).

Two modes (flops for N rows, V vocab, H hidden; b bytes per element; the [V, H] and [N, H] gradients come on top):
    STORE     forward: logits = h W^T (2 NVH) kept whole in the input dtype; stats kernel.
              backward: dz kernel in place on the kept logits; d_hidden = dz W (2 NVH);
              d_weight = dz^T h (2 NVH) as ONE matmul over all N rows (no accumulator, one rounding).
              6 NVH flops; extra memory N V b (the logits, then dz in the same buffer).
    RECOMPUTE forward: per chunk logits -> stats; kept: lse and entropy (8 bytes a row) and the chunk buffer.
              backward per chunk: recompute the logits (2 NVH), dz kernel in place, d_hidden[chunk] = dz W,
              d_weight += dz^T h[chunk].  8 NVH flops; extra memory one chunk (<= budget) + the accumulator.
              The forward's chunk buffer is kept with the last chunk's logits, and the backward runs the chunks
              last-first without recomputing that one: 8 NVH - 2 (rows of the last chunk) V H.
    "auto" picks STORE when N V b fits the budget, else RECOMPUTE. A forward without autograd (no_grad, or
    no input needs a gradient) keeps nothing and runs in budget-sized chunks.
    d_weight accumulator (RECOMPUTE with several chunks, half-precision weights): fp32. Each chunk's product is
    rounded once to the input dtype by cuBLAS, as eager's single product is, and then summed in fp32, so the error
    does not grow with the number of chunks (a bf16 accumulator, Liger's default, would round once per chunk:
    long batches run tens of chunks). Its price is 12 V H bytes of traffic per chunk (bf16 product written,
    read with the fp32 sum, sum written), under 20% of that chunk's d_weight matmul at >= 1024-row chunks, and
    4 V H bytes of memory. A single chunk (or fp32 weights, addmm in place) needs no separate accumulator.
    A STORE backward consumes the kept logits (they become dz), so a second backward through the same graph
    (retain_graph=True) raises; use mode="recompute" for that (its second backward recomputes every chunk).

Gradients in the forward (Liger-Kernel's design), when the loss is known at forward time:

    fused_linear_logprob_loss(hidden, weight, targets, token_loss, temperature=1.0, budget_bytes=None,
                              dw_accum="fp32") -> (loss, logprob, entropy)
        token_loss(logprob_rows, entropy_rows, rows) -> scalar: the loss of the rows `rows` (a slice of the
            flattened rows) given their fp32 log-probs and entropies. It must be a sum of per-row terms, each
            depending on its own row only (token-mean and sequence-mean GRPO losses are: their normalisers
            come from the mask, not from the log-probs), so that the loss and its gradient add up over chunks.
        loss is differentiable w.r.t. hidden and weight; logprob and entropy [...] come back detached.
    Per chunk: logits (2 NVH), stats kernel, the chunk's (g_logprob, g_entropy) by autograd on token_loss (a few
    elementwise ops on the chunk's rows), dz kernel in place, d_hidden[chunk] = dz W (2 NVH), d_weight += dz^T h
    (2 NVH). 6 NVH flops, and nothing of the logits outlives its chunk: extra memory one chunk of logits
    (LOSS_BUDGET_BYTES, 256 MiB, at least MIN_CHUNK_ROWS rows) plus d_hidden, d_weight and, for half-precision
    weights over several chunks, the fp32 d_weight accumulator (4 V H bytes; dw_accum="input" accumulates in the
    weight's dtype instead, as Liger does: 2 V H bytes less, one rounding per chunk). The backward only scales
    the saved gradients by the incoming one, in place (no new [V, H] buffer); a second backward raises.
    Why fused_linear_logprob itself cannot do this: its per-row upstream gradients (g_logprob, g_entropy) come
    from a loss computed after it, and d_weight = dz^T h is not separable in them without materialising both
    per-row terms. So that function chooses between 6 NVH with the logits kept and 8 NVH with one chunk; a
    caller that can write its loss per row (grpo_loss, cross-entropy) gets 6 NVH with one chunk here.

Roofline floor: matmul-bound for any realistic H. The floor is the lower of the two designs, 6 N V H /
matmul_rate (torch.compile of the reference also does 6 N V H and runs under an 8 N V H floor), plus the
logits' bytes (STORE: written, read by the stats, read + written by dz, read by the two matmuls: ~5 N V b).
    H200 at ~715 bf16 TFLOP/s: N=4096 H=4096 V=151936: 6NVH 21.4 ms (8NVH 28.5 ms), logits 1.24 GB -> STORE;
    N=16384 H=896 V=151936: 6NVH 18.7 ms, 8NVH 24.9 ms, logits 5.0 GB -> RECOMPUTE (3 chunks of 5462 rows);
    N=8192 H=576 V=49152: 6NVH 1.95 ms, logits 0.8 GB -> STORE.
Measured: see benchmarks/results/kernels.md.
Design that won (by the flop count; the H200 figures are in the results file): the previous version (always
RECOMPUTE, 256 MB chunks of ~880 rows, d_weight summed through an fp32 copy of every chunk's product) measured
48 ms / 5 GB at N=4096 H=4096 against torch.compile's 24 ms: 8 NVH, plus (estimated) ~12 GB of accumulator
traffic per chunk, ~13 ms in all. STORE, 6 NVH in three whole-batch GEMMs, is the only design here that can meet
compile's time (compile also does 6 NVH); it is chosen wherever the logits fit the budget, and RECOMPUTE (with
large chunks, the last one not recomputed, a cheap fp32 accumulator) bounds the memory beyond it. Where the
caller can write its loss per row, fused_linear_logprob_loss gets both: 6 NVH and one chunk of logits (the
benchmark's ours_loss rows, against Liger's fused linear cross-entropy and GRPO loss). Neither of the two new
designs has been timed on a GPU yet (the results file names the commit of each row).

Deviations / notes:
    * The first version fused the matmuls into the Triton kernels too (as Cut Cross-Entropy); its backward added
      every tile's d_weight with fp32 atomics and measured 10x slower than eager torch on an H200
      (benchmarks/results/gpu_checks.md).
    * The interpreter on CPU runs the same Triton kernels; the matmuls are torch's on either device.
"""
from __future__ import annotations

import torch
from kernels._interpret import new_output, tl, triton, use_triton  # stand-ins where Triton has no wheels


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


# ---- planning: mode and chunks ----
LOGITS_BUDGET_BYTES = 2 * 2 ** 30  # logits alive at once (STORE: all of them, RECOMPUTE: one chunk)
MIN_CHUNK_ROWS = 1024              # chunks never smaller (when N allows), so the GEMMs stay large
MODES = ("auto", "store", "recompute")


def _plan(N: int, V: int, elem_bytes: int, mode: str = "auto", budget_bytes: int | None = None,
          keep: bool = True) -> tuple[str, list[tuple[int, int]]]:
    """(mode, [(row_start, row_end), ...]): STORE when all N x V logits fit the budget (and are needed)."""
    budget = LOGITS_BUDGET_BYTES if budget_bytes is None else int(budget_bytes)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not keep:
        mode = "none"  # forward only: nothing is kept
    elif mode == "auto":
        mode = "store" if N * V * elem_bytes <= budget else "recompute"
    rows_max = min(N, max(1, min(N, MIN_CHUNK_ROWS), budget // (V * elem_bytes)))
    n_chunks = -(-N // rows_max)
    rows = -(-N // n_chunks)  # equal chunks, the last one ragged
    return mode, [(a, min(N, a + rows)) for a in range(0, N, rows)]


def _block_v(V, interpreted):
    return min(1024 if interpreted else 4096, triton.next_power_of_2(V))


def _add_dw(dw, dw32, dz, h, fp32_accumulator: bool = True):
    """d_weight += dz^T h for one chunk -> (dw, dw32). The first chunk's product is dw; later ones add in place
    (fp32 weights, or half weights without the fp32 accumulator: one rounding per chunk, Liger's choice) or into
    dw32, an fp32 copy made at the second chunk (the caller casts it back at the end; see the header)."""
    if dw is None:
        return torch.mm(dz.T, h), None
    if dw.dtype == torch.float32 or not fp32_accumulator:
        dw.addmm_(dz.T, h)
        return dw, None
    if dw32 is None:
        dw32 = dw.float()
    dw32.add_(torch.mm(dz.T, h))
    return dw, dw32


class _FusedLinearLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, mode, chunks):
        N, V = hidden.shape[0], weight.shape[0]
        bv, inv_t = _block_v(V, not hidden.is_cuda), 1.0 / temperature
        lp, ent, lse = (new_output((N,), hidden.device) for _ in range(3))
        rows_max = max(b - a for a, b in chunks)
        logits = new_output((N if mode == "store" else rows_max, V), hidden.device, hidden.dtype)
        for a, b in chunks:
            z = logits[a:b] if mode == "store" else logits[:b - a]
            torch.mm(hidden[a:b], weight.T, out=z)              # cuBLAS, input dtype, like eager
            _row_stats_kernel[(b - a,)](z, targets[a:b], lp[a:], ent[a:], lse[a:], V, z.stride(0), inv_t,
                                        BLOCK_V=bv, num_warps=8)
        ctx.mode, ctx.chunks, ctx.temperature = mode, chunks, temperature
        if mode != "none":
            ctx.save_for_backward(hidden, weight, targets, lse, ent)
        # an intermediate, not saved for backward: STORE's backward turns it into dz; RECOMPUTE's holds the last
        # chunk's logits, which its backward uses first instead of recomputing them
        ctx.logits = logits if mode != "none" else None
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        if ctx.mode == "none":
            raise RuntimeError("fused_linear_logprob: forward ran without autograd, nothing kept for a backward")
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        N, V = hidden.shape[0], weight.shape[0]
        bv, inv_t = _block_v(V, not hidden.is_cuda), 1.0 / ctx.temperature
        g_lp = torch.zeros(N, device=hidden.device) if g_lp is None else g_lp.float().contiguous()
        g_ent = torch.zeros(N, device=hidden.device) if g_ent is None else g_ent.float().contiguous()
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = new_output(hidden.shape, hidden.device, hidden.dtype) if need_dh else None
        dw = None
        chunks = ctx.chunks
        if ctx.mode == "store":
            logits = ctx.logits
            if logits is None:
                raise RuntimeError("fused_linear_logprob (mode='store'): the backward consumed the kept logits; "
                                   "use mode='recompute' to backward twice through one graph")
            ctx.logits = None
            for a, b in chunks:
                z = logits[a:b]
                _dz_kernel[(b - a, triton.cdiv(V, bv))](z, targets[a:b], lse[a:], ent[a:], g_lp[a:], g_ent[a:],
                                                        V, z.stride(0), inv_t, BLOCK_V=bv, num_warps=8)
                if need_dh:
                    torch.mm(z, weight, out=dh[a:b])
            if need_dw:
                dw = torch.mm(logits.T, hidden)                 # one matmul over all N rows
            return dh, dw, None, None, None, None
        buf, ctx.logits = ctx.logits, None                     # the forward's buffer: the last chunk's logits
        have_last = buf is not None
        if buf is None:                                         # a second backward through the same graph
            buf = torch.empty((max(b - a for a, b in chunks), V), device=hidden.device, dtype=hidden.dtype)
        dw32 = None
        for i, (a, b) in enumerate(reversed(chunks)):          # last chunk first: its logits are in buf
            z = buf[:b - a]
            if not (i == 0 and have_last):
                torch.mm(hidden[a:b], weight.T, out=z)          # recompute the chunk's logits ...
            _dz_kernel[(b - a, triton.cdiv(V, bv))](z, targets[a:b], lse[a:], ent[a:], g_lp[a:], g_ent[a:],
                                                    V, z.stride(0), inv_t, BLOCK_V=bv, num_warps=8)
            if need_dh:                                         # ... turned into dz / T in place
                torch.mm(z, weight, out=dh[a:b])
            if need_dw:
                dw, dw32 = _add_dw(dw, dw32, z, hidden[a:b])
        if dw32 is not None:
            dw = dw32.to(weight.dtype)
        return dh, dw, None, None, None, None


# ---- gradients in the forward: the loss is known per row at forward time ----
LOSS_BUDGET_BYTES = 256 * 2 ** 20  # fused_linear_logprob_loss: logits alive at once (one chunk)
DW_ACCUM = ("fp32", "input")


class _FusedLinearLogprobLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, token_loss, chunks, need_dh, need_dw, dw_accum):
        N, V = hidden.shape[0], weight.shape[0]
        bv, inv_t = _block_v(V, not hidden.is_cuda), 1.0 / temperature
        lp, ent, lse = (new_output((N,), hidden.device) for _ in range(3))
        buf = torch.empty((max(b - a for a, b in chunks), V), device=hidden.device, dtype=hidden.dtype)
        dh = new_output(hidden.shape, hidden.device, hidden.dtype) if need_dh else None
        dw = dw32 = None
        loss = torch.zeros((), device=hidden.device)
        for a, b in chunks:
            z = buf[:b - a]
            torch.mm(hidden[a:b], weight.T, out=z)
            _row_stats_kernel[(b - a,)](z, targets[a:b], lp[a:], ent[a:], lse[a:], V, z.stride(0), inv_t,
                                        BLOCK_V=bv, num_warps=8)
            lp_c, ent_c = lp[a:b].detach().requires_grad_(), ent[a:b].detach().requires_grad_()
            with torch.enable_grad():  # the chunk's upstream gradients, by autograd on a few elementwise ops
                chunk_loss = token_loss(lp_c, ent_c, slice(a, b))
            loss += chunk_loss.detach().float()
            if not (need_dh or need_dw):
                continue
            g_lp, g_ent = torch.autograd.grad(chunk_loss, (lp_c, ent_c), allow_unused=True)
            g_lp = torch.zeros_like(lp_c) if g_lp is None else g_lp.float().contiguous()
            g_ent = torch.zeros_like(ent_c) if g_ent is None else g_ent.float().contiguous()
            _dz_kernel[(b - a, triton.cdiv(V, bv))](z, targets[a:b], lse[a:], ent[a:], g_lp, g_ent,
                                                    V, z.stride(0), inv_t, BLOCK_V=bv, num_warps=8)
            if need_dh:                                         # the logits are now dz / T
                torch.mm(z, weight, out=dh[a:b])
            if need_dw:
                dw, dw32 = _add_dw(dw, dw32, z, hidden[a:b], fp32_accumulator=dw_accum == "fp32")
        if dw32 is not None:
            dw = dw32.to(weight.dtype)
        ctx.grads = (dh, dw)                                    # scaled in place by the backward
        ctx.mark_non_differentiable(lp, ent)
        return loss, lp, ent

    @staticmethod
    def backward(ctx, g_loss, _g_lp, _g_ent):
        if ctx.grads is None:
            raise RuntimeError("fused_linear_logprob_loss: the gradients were computed in the forward and handed "
                               "to the first backward; a second backward needs a second forward")
        dh, dw = ctx.grads
        ctx.grads = None
        g = g_loss.float()
        for t in (dh, dw):
            if t is not None:
                t.mul_(g)                                       # in place: no second [V, H] buffer
        return dh, dw, None, None, None, None, None, None, None


def fused_linear_logprob_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, token_loss,
                              temperature: float = 1.0, budget_bytes: int | None = None,
                              dw_accum: str = "fp32") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, logprob, entropy): loss = token_loss(logprob, entropy, all rows), its gradients w.r.t. hidden and
    weight computed chunk by chunk in the forward (6 N V H flops, one chunk of logits; see the header).

    token_loss(logprob_rows, entropy_rows, rows) -> scalar, rows a slice of the flattened [...] rows; it must be a
    sum of per-row terms. logprob and entropy [...] are returned detached (fp32). dw_accum: "fp32" (default) or
    "input" (the weight's dtype, Liger's choice: less memory, one rounding per chunk)."""
    _check(hidden, weight, targets, temperature)
    if dw_accum not in DW_ACCUM:
        raise ValueError(f"dw_accum must be one of {DW_ACCUM}, got {dw_accum!r}")
    if not callable(token_loss):
        raise TypeError("token_loss must be a callable (logprob_rows, entropy_rows, rows) -> scalar loss")
    if not _use_triton(hidden, weight, targets) or hidden.numel() == 0:
        return fused_linear_logprob_loss_ref(hidden, weight, targets, token_loss, temperature)
    lead = hidden.shape[:-1]
    h2 = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    w2 = weight.contiguous()
    grad = torch.is_grad_enabled()
    budget = LOSS_BUDGET_BYTES if budget_bytes is None else budget_bytes
    _, chunks = _plan(h2.shape[0], w2.shape[0], h2.element_size(), "recompute", budget)
    loss, lp, ent = _FusedLinearLogprobLoss.apply(h2, w2, targets.reshape(-1).contiguous(), float(temperature),
                                                  token_loss, chunks, grad and hidden.requires_grad,
                                                  grad and weight.requires_grad, dw_accum)
    return loss, lp.reshape(lead), ent.reshape(lead)


def fused_linear_logprob_loss_ref(hidden, weight, targets, token_loss, temperature: float = 1.0):
    """Eager torch: logits materialised, token_loss called once on all (flattened) rows."""
    lp, ent = fused_linear_logprob_ref(hidden, weight, targets, temperature)
    loss = token_loss(lp.reshape(-1), ent.reshape(-1), slice(0, lp.numel()))
    return loss, lp.detach(), ent.detach()


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
                         temperature: float = 1.0, mode: str = "auto",
                         budget_bytes: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of `targets` and entropy under softmax(hidden @ weight.T / temperature), both fp32 [...].

    mode: "store" keeps the logits for the backward (6 N V H flops, N V bytes-per-element of memory),
    "recompute" keeps two floats a row and recomputes the logits chunk by chunk (8 N V H, one chunk of memory),
    "auto" stores when the logits fit `budget_bytes` (default LOGITS_BUDGET_BYTES)."""
    _check(hidden, weight, targets, temperature)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not _use_triton(hidden, weight, targets) or hidden.numel() == 0:
        return fused_linear_logprob_ref(hidden, weight, targets, temperature)
    lead = hidden.shape[:-1]
    h2 = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    w2 = weight.contiguous()
    keep = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    run_mode, chunks = _plan(h2.shape[0], w2.shape[0], h2.element_size(), mode, budget_bytes, keep)
    lp, ent = _FusedLinearLogprob.apply(h2, w2, targets.reshape(-1).contiguous(), float(temperature),
                                        run_mode, chunks)
    return lp.reshape(lead), ent.reshape(lead)


def fused_linear_logprob_ref(hidden, weight, targets, temperature: float = 1.0):
    """Eager torch: materialises the logits. Matmul in the input dtype, softmax in at least fp32."""
    acc = torch.promote_types(hidden.dtype, torch.float32)
    logits = (hidden @ weight.T).to(acc) / temperature
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent
