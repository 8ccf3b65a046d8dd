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

Schedule: the op is launch-bound (a few MB of traffic, microseconds of HBM time), so it is built to issue as
few launches as possible, gradients computed in the forward as Liger-Kernel's losses do:
    forward   1. torch `mask.sum` (token_mean: the token count; seq_mean: the per-row lengths), one launch;
              2. one Triton kernel: per token the weight w = mask / denominator, the loss terms and the
                 gradient w (d pg / d logp + beta d kl / d logp), stored as a [B, T] tensor in logp's dtype;
                 each program writes its partial sums (pg, kl, clip, loss) to a [programs, 4] buffer;
              3. torch `.sum()` of the loss partials and 4. `.sum(0)` of the statistics partials, one launch
                 each (deterministic: a fixed summation order, no atomics). The statistics are views of that
                 [3] vector; the loss is a tensor of its own, so a caller may still modify it in place.
    backward  grad_out * saved_grad: one elementwise torch op (the 0-d fp32 grad_out does not promote a
              bf16 gradient). A second backward through retain_graph reuses the same saved gradient.
    In all 4 launches forward + 1 backward (fewer would need atomics into a buffer zeroed per call, itself a
    launch, or a loss that is a view), none of them a host sync; every buffer is torch.empty from the
    caching allocator (no launch). The previous design took ~9: the weights in torch (4), the forward
    kernel, its sum, the loss arithmetic (2), the backward kernel.
The [B, T] inputs are read through their strides (no copies; a [B] advantage is read with a T-stride of 0).

Roofline floor: purely memory-bound. The forward reads 4-5 values per token (logp, old, adv, mask, ref) and
writes the gradient; the backward reads and writes it once more: 25-36 B/token in fp32 (the benchmark counts 36),
so at B=64 T=4096 (9.4 MB) the floor is about 0.002 ms on an H200 (4.8 TB/s); the measured time is set by the
launches and Python, not by memory. Measured (one H200, commit 95b1adc, benchmarks/results/kernels.md): 0.384
ms forward + backward at B=64 T=4096 vs torch.compile of the reference 0.598 ms and eager 1.279 ms, 172x its
0.002 ms floor.
"""
from __future__ import annotations

import torch
from kernels._interpret import new_output, tl, triton, use_triton  # stand-ins where Triton has no wheels


def _use_triton(*tensors) -> bool:
    return use_triton(globals(), *tensors)  # this module's kernels, made interpretable when asked


# ---- Triton kernel ----
@triton.jit
def _pg_fwd_kernel(LP, OLD, ADV, REF, MASK, DEN, GRAD, PART, T, numel, s_lp, s_old, s_adv_b, s_adv_t, s_ref, s_m,
                   s_den, den_scale, eps_low, eps_high, beta, HAS_REF: tl.constexpr, BLOCK: tl.constexpr):
    """Per token: weight, loss terms and d loss / d logp (stored); per program: 4 partial sums."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < numel
    b = offs // T
    t = offs % T
    m = tl.load(MASK + b * s_m + t, mask=inb, other=0).to(tl.float32)
    den = tl.maximum(tl.load(DEN + b * s_den, mask=inb, other=1.0).to(tl.float32), 1.0) * den_scale
    w = m / den                                            # the reduction weight (0 on padding)
    active = w != 0.0
    # padding may hold inf/NaN: replace it before any arithmetic so it cannot leak through 0 * inf
    lp = tl.where(active, tl.load(LP + b * s_lp + t, mask=inb, other=0.0).to(tl.float32), 0.0)
    old = tl.where(active, tl.load(OLD + b * s_old + t, mask=inb, other=0.0).to(tl.float32), 0.0)
    adv = tl.where(active, tl.load(ADV + b * s_adv_b + t * s_adv_t, mask=inb, other=0.0).to(tl.float32), 0.0)
    ratio = tl.exp(lp - old)
    clipped = tl.minimum(tl.maximum(ratio, 1.0 - eps_low), 1.0 + eps_high)
    pg = -tl.minimum(ratio * adv, clipped * adv)
    clip_on = ((adv > 0) & (ratio > 1.0 + eps_high)) | ((adv < 0) & (ratio < 1.0 - eps_low))
    dpg = tl.where(clip_on, 0.0, -ratio * adv)
    if HAS_REF:
        ref = tl.where(active, tl.load(REF + b * s_ref + t, mask=inb, other=0.0).to(tl.float32), 0.0)
        d = ref - lp
        kl = tl.exp(d) - d - 1.0
        dkl = 1.0 - tl.exp(d)
        grad = w * (dpg + beta * dkl)
    else:
        kl = tl.zeros_like(ratio)
        grad = w * dpg
    tl.store(GRAD + offs, grad.to(GRAD.dtype.element_ty), mask=inb)  # GRAD is a contiguous [B, T]
    pg_sum = tl.sum(w * pg, 0)
    kl_sum = tl.sum(w * kl, 0)
    tl.store(PART + pid * 4 + 0, pg_sum)
    tl.store(PART + pid * 4 + 1, kl_sum)
    tl.store(PART + pid * 4 + 2, tl.sum(tl.where(clip_on, w, 0.0), 0))
    tl.store(PART + pid * 4 + 3, pg_sum + beta * kl_sum)


# ---- autograd wrapper ----
def _strides(logp, old, adv, ref, mask):
    s_adv_t = adv.stride(1) if adv.dim() == 2 else 0
    for name, x in (("logp", logp), ("old_logp", old), ("ref_logp", ref), ("mask", mask)):
        if x.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous along the token dimension")
    if adv.dim() == 2 and adv.stride(1) != 1:
        raise ValueError("advantages must be contiguous along the token dimension")
    return logp.stride(0), old.stride(0), adv.stride(0), s_adv_t, ref.stride(0), mask.stride(0)


BLOCK = 1024


class _ClippedPG(torch.autograd.Function):
    """Forward computes the loss, the statistics and the gradient; backward only scales the saved gradient."""

    @staticmethod
    def forward(ctx, logp, old, adv, ref, mask, reduction, eps_low, eps_high, beta, has_ref):
        B, T = logp.shape
        numel = B * T
        # launch 1: the denominators (the token count, or each row's length for seq_mean)
        if reduction == "token_mean":
            den, s_den, den_scale = mask.sum(dtype=torch.float32), 0, 1.0
        else:
            den, s_den, den_scale = mask.sum(1, dtype=torch.float32), 1, float(B)
        block = BLOCK if logp.is_cuda else max(16, min(BLOCK, triton.next_power_of_2(numel)))
        n_prog = triton.cdiv(numel, block)
        part = new_output((n_prog, 4), logp.device)
        grad = new_output((B, T), logp.device, logp.dtype)
        # launch 2: everything per token
        _pg_fwd_kernel[(n_prog,)](logp, old, adv, ref, mask, den, grad, part, T, numel,
                                  *_strides(logp, old, adv, ref, mask), s_den, den_scale, eps_low, eps_high, beta,
                                  HAS_REF=has_ref, BLOCK=block)
        # launches 3 and 4: the loss gets its own tensor (a view of a stats vector would forbid in-place use
        # of the returned loss); the statistics are views of one [3] sum
        loss = part[:, 3].sum()
        stats = part[:, :3].sum(0)
        ctx.save_for_backward(grad)
        pg, kl, clip = stats[0], stats[1], stats[2]
        ctx.mark_non_differentiable(pg, kl, clip)  # statistics only
        return loss, pg, kl, clip

    @staticmethod
    def backward(ctx, g_loss, *_stats_grads):
        (grad,) = ctx.saved_tensors
        # one launch; a 0-d grad_out keeps grad's dtype (fp32 maths, one rounding for bf16)
        return grad * g_loss, None, None, None, None, None, None, None, None, None


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
    if reduction not in ("token_mean", "seq_mean"):
        raise ValueError(f"reduction must be 'token_mean' or 'seq_mean', got {reduction!r}")
    if not _use_triton(logp, old_logp, advantages, mask):
        return clipped_pg_loss_ref(logp, old_logp, advantages, mask, eps_low, eps_high, ref_logp, beta, reduction)
    has_ref = ref_logp is not None
    if mask.stride(1) != 1:  # read through its row stride; a transposed or expanded mask is copied once
        mask = mask.contiguous()
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)  # same bytes, no copy; Triton reads it as 0/1 integers
    ref = ref_logp.detach() if has_ref else logp.detach()  # dummy pointer when there is no reference
    loss, pg, kl, clip = _ClippedPG.apply(logp, old_logp.detach(), advantages.detach(), ref, mask.detach(), reduction,
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
