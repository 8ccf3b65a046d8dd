"""GRPO / PPO clipped policy-gradient loss fused over tokens, forward and backward.

Public function (what `algos/grpo.py --kernels` calls):

    clipped_pg_loss(logp, old_logp, advantages, mask, eps_low=0.2, eps_high=0.2,
                    ref_logp=None, beta=0.0, reduction="token_mean") -> (loss, stats)
        logp       [B, T]  log-probs of the sampled tokens under the current policy (requires grad)
        old_logp   [B, T]  behaviour log-probs (no grad)
        advantages [B] or [B, T]   per-sequence (GRPO) or per-token (PPO) advantages
        mask       [B, T]  1 for response tokens, 0 for padding (bool or float)
        ref_logp   [B, T]  reference-policy log-probs for the k3 KL penalty (optional; beta = its weight)
        reduction  "token_mean": sum over all tokens / number of tokens (DAPO, Dr.GRPO-style token level)
                   "seq_mean":   mean over each sequence's tokens, then over sequences (original GRPO)
        returns loss (0-d fp32, differentiable w.r.t. logp) and stats {"pg", "kl", "clip_frac"} (detached)

Triton kernels when the tensors are on CUDA (or on CPU with TRITON_INTERPRET=1, the tests); the pure-torch
`clipped_pg_loss_ref` otherwise.

Maths (per token, r = exp(logp - old_logp), A the advantage, w the reduction weight):
    pg    = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)                  (PPO, asymmetric clip: DAPO)
    kl    = exp(ref - logp) - (ref - logp) - 1                              (k3 estimator of KL(pi || ref))
    loss  = sum_t w_t (pg_t + beta kl_t);   w = mask / count (token_mean) or mask / (len_b B) (seq_mean)
    d pg / d logp = 0 where the clip is active ((A > 0 and r > 1 + eps_high) or (A < 0 and r < 1 - eps_low)),
                    -r A otherwise
    d kl / d logp = 1 - exp(ref - logp)
Padding positions (w = 0) are ignored even when they hold inf or NaN.

Memory layout: the [B, T] inputs are read through their strides (no copies; a [B] advantage is read with a
T-stride of 0); each forward program reduces BLOCK tokens to three partial sums (pg, kl, clip) written to a
[programs, 3] buffer that torch sums (deterministic, no atomics). The backward re-reads the inputs and
writes d logp: it is cheaper to recompute r than to store it.

Roofline floor: purely memory-bound. Forward reads 4-5 values per token (logp, old, adv, mask, ref);
backward reads the same and writes one. At fp32 that is about 20 B/token forward and 24 B/token backward:
floor = bytes / HBM bandwidth. Eager torch materialises ~10 temporaries of [B, T], hence the speedup.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._interpret import new_output, use_triton


def _use_triton(*tensors) -> bool:
    return use_triton(globals(), *tensors)  # this module's kernels, made interpretable when asked


# ---- Triton kernels ----
@triton.jit
def _token_terms(LP, OLD, ADV, REF, W, offs, T, numel, s_lp, s_old, s_adv_b, s_adv_t, s_ref, s_w,
                 eps_low, eps_high, HAS_REF: tl.constexpr):
    """Per-token (weight, ratio, advantage, clip-active flag, pg, kl, d kl / d logp) for a block of tokens."""
    b = offs // T
    t = offs % T
    inb = offs < numel
    w = tl.load(W + b * s_w + t, mask=inb, other=0.0)
    active = w != 0.0
    # padding may hold inf/NaN: replace it before any arithmetic so it cannot leak through 0 * inf
    lp = tl.where(active, tl.load(LP + b * s_lp + t, mask=inb, other=0.0).to(tl.float32), 0.0)
    old = tl.where(active, tl.load(OLD + b * s_old + t, mask=inb, other=0.0).to(tl.float32), 0.0)
    adv = tl.where(active, tl.load(ADV + b * s_adv_b + t * s_adv_t, mask=inb, other=0.0).to(tl.float32), 0.0)
    ratio = tl.exp(lp - old)
    clipped = tl.minimum(tl.maximum(ratio, 1.0 - eps_low), 1.0 + eps_high)
    pg = -tl.minimum(ratio * adv, clipped * adv)
    clip_on = ((adv > 0) & (ratio > 1.0 + eps_high)) | ((adv < 0) & (ratio < 1.0 - eps_low))
    if HAS_REF:
        ref = tl.where(active, tl.load(REF + b * s_ref + t, mask=inb, other=0.0).to(tl.float32), 0.0)
        d = ref - lp
        kl = tl.exp(d) - d - 1.0
        dkl = 1.0 - tl.exp(d)
    else:
        kl = tl.zeros_like(ratio)
        dkl = tl.zeros_like(ratio)
    return w, ratio, adv, clip_on, pg, kl, dkl


@triton.jit
def _pg_fwd_kernel(LP, OLD, ADV, REF, W, PART, T, numel, s_lp, s_old, s_adv_b, s_adv_t, s_ref, s_w,
                   eps_low, eps_high, HAS_REF: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    w, ratio, adv, clip_on, pg, kl, dkl = _token_terms(LP, OLD, ADV, REF, W, offs, T, numel, s_lp, s_old,
                                                       s_adv_b, s_adv_t, s_ref, s_w, eps_low, eps_high, HAS_REF)
    tl.store(PART + pid * 3 + 0, tl.sum(w * pg, 0))
    tl.store(PART + pid * 3 + 1, tl.sum(w * kl, 0))
    tl.store(PART + pid * 3 + 2, tl.sum(tl.where(clip_on, w, 0.0), 0))


@triton.jit
def _pg_bwd_kernel(LP, OLD, ADV, REF, W, GRAD, DLP, T, numel, s_lp, s_old, s_adv_b, s_adv_t, s_ref, s_w,
                   eps_low, eps_high, beta, HAS_REF: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    w, ratio, adv, clip_on, pg, kl, dkl = _token_terms(LP, OLD, ADV, REF, W, offs, T, numel, s_lp, s_old,
                                                       s_adv_b, s_adv_t, s_ref, s_w, eps_low, eps_high, HAS_REF)
    g = tl.load(GRAD)
    dpg = tl.where(clip_on, 0.0, -ratio * adv)
    tl.store(DLP + offs, g * w * (dpg + beta * dkl), mask=offs < numel)  # DLP is a contiguous [B, T]


# ---- autograd wrapper ----
def _strides(logp, old, adv, ref, w):
    s_adv_t = adv.stride(1) if adv.dim() == 2 else 0
    for name, x in (("logp", logp), ("old_logp", old), ("ref_logp", ref), ("weights", w)):
        if x.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous along the token dimension")
    if adv.dim() == 2 and adv.stride(1) != 1:
        raise ValueError("advantages must be contiguous along the token dimension")
    return logp.stride(0), old.stride(0), adv.stride(0), s_adv_t, ref.stride(0), w.stride(0)


BLOCK = 1024


class _ClippedPG(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, old, adv, ref, w, eps_low, eps_high, beta, has_ref):
        B, T = logp.shape
        numel = B * T
        block = BLOCK if logp.is_cuda else max(16, min(BLOCK, triton.next_power_of_2(numel)))
        n_prog = triton.cdiv(numel, block)
        part = new_output((n_prog, 3), logp.device)
        _pg_fwd_kernel[(n_prog,)](logp, old, adv, ref, w, part, T, numel, *_strides(logp, old, adv, ref, w),
                                  eps_low, eps_high, HAS_REF=has_ref, BLOCK=block)
        sums = part.sum(0)
        ctx.save_for_backward(logp, old, adv, ref, w)
        ctx.args = (eps_low, eps_high, beta, has_ref, block)
        loss, kl, clip, pg = sums[0] + beta * sums[1], sums[1], sums[2], sums[0]
        ctx.mark_non_differentiable(kl, clip, pg)  # statistics only
        return loss, kl, clip, pg

    @staticmethod
    def backward(ctx, g_loss, *_stats_grads):
        logp, old, adv, ref, w = ctx.saved_tensors
        eps_low, eps_high, beta, has_ref, block = ctx.args
        B, T = logp.shape
        dlp = new_output((B, T), logp.device)
        _pg_bwd_kernel[(triton.cdiv(B * T, block),)](logp, old, adv, ref, w, g_loss.float().reshape(1), dlp, T,
                                                     B * T, *_strides(logp, old, adv, ref, w), eps_low,
                                                     eps_high, beta, HAS_REF=has_ref, BLOCK=block)
        return dlp.to(logp.dtype), None, None, None, None, None, None, None, None


# ---- public function and reference ----
def _weights(mask: torch.Tensor, reduction: str) -> torch.Tensor:
    """Per-token reduction weights: the loss is sum_t w_t loss_t."""
    m = mask.float()
    if reduction == "token_mean":
        return m / m.sum().clamp(min=1.0)
    if reduction == "seq_mean":
        return m / (m.sum(1, keepdim=True).clamp(min=1.0) * m.shape[0])
    raise ValueError(f"reduction must be 'token_mean' or 'seq_mean', got {reduction!r}")


def _check(logp, old_logp, advantages, mask, ref_logp, eps_low, eps_high):
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    for name, x in (("old_logp", old_logp), ("mask", mask), ("ref_logp", ref_logp)):
        if x is not None and x.shape != logp.shape:
            raise ValueError(f"{name} must have the shape of logp {tuple(logp.shape)}, got {tuple(x.shape)}")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"advantages must be [B] or [B, T] = {tuple(logp.shape)}, got {tuple(advantages.shape)}")
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"clip ranges must be >= 0, got eps_low={eps_low}, eps_high={eps_high}")


def clipped_pg_loss(logp, old_logp, advantages, mask, eps_low: float = 0.2, eps_high: float = 0.2,
                    ref_logp=None, beta: float = 0.0, reduction: str = "token_mean"):
    """Clipped surrogate + optional k3 KL, reduced over masked tokens. Returns (loss, stats)."""
    _check(logp, old_logp, advantages, mask, ref_logp, eps_low, eps_high)
    w = _weights(mask, reduction)
    if not _use_triton(logp, old_logp, advantages, w):
        return clipped_pg_loss_ref(logp, old_logp, advantages, mask, eps_low, eps_high, ref_logp, beta, reduction)
    has_ref = ref_logp is not None
    ref = ref_logp.detach() if has_ref else logp.detach()  # dummy pointer when there is no reference
    loss, kl, clip, pg = _ClippedPG.apply(logp, old_logp.detach(), advantages.detach(), ref, w,
                                          float(eps_low), float(eps_high), float(beta), has_ref)
    return loss, {"pg": pg.detach(), "kl": kl.detach(), "clip_frac": clip.detach()}


def clipped_pg_loss_ref(logp, old_logp, advantages, mask, eps_low: float = 0.2, eps_high: float = 0.2,
                        ref_logp=None, beta: float = 0.0, reduction: str = "token_mean"):
    """Eager torch, term by term as in the equations."""
    w = _weights(mask, reduction).to(torch.promote_types(logp.dtype, torch.float32))
    active = w != 0
    zero = torch.zeros((), dtype=w.dtype, device=w.device)
    lp = torch.where(active, logp.to(w.dtype), zero)
    old = torch.where(active, old_logp.to(w.dtype), zero)
    adv = advantages.to(w.dtype)
    adv = torch.where(active, adv[:, None] if adv.dim() == 1 else adv, zero)
    ratio = torch.exp(lp - old)
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    clip_on = ((adv > 0) & (ratio > 1 + eps_high)) | ((adv < 0) & (ratio < 1 - eps_low))
    if ref_logp is not None:
        d = torch.where(active, ref_logp.to(w.dtype), zero) - lp
        kl = torch.exp(d) - d - 1
    else:
        kl = torch.zeros_like(lp)
    pg_sum, kl_sum = (w * pg).sum(), (w * kl).sum()
    stats = {"pg": pg_sum.detach().float(), "kl": kl_sum.detach().float(),
             "clip_frac": (w * clip_on).sum().detach().float()}
    return (pg_sum + beta * kl_sum).float(), stats
