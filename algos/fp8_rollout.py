"""FP8 rollouts: GRPO whose rollout policy mu runs in simulated FP8 while the trainer stays at its own precision.

Papers: Qiu et al., "FP8-RL: A Practical and Stable Low-Precision Stack for LLM Reinforcement Learning",
arXiv:2601.18150 (blockwise W8A8 rollouts re-quantised at every weight sync, an FP8 KV cache with per-step scale
recalibration, TIS/MIS rollout corrections); Xi et al., "Jet-RL: Enabling On-Policy FP8 Reinforcement Learning with
Unified Training and Rollout Precision Flow", arXiv:2601.14243 (one FP8 precision graph for trainer and rollout);
the IcePop band of Ling Team, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking Model",
arXiv:2510.18855; truncated IS of Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training" (blog, 2025).

Parent: algos/grpo.py; changed: Args, Args.sampler_is_cap, Args.steps, Args.threads, Args.top_p, check_args,
  rollout, update, main.

Numerics of mu (--rollout-dtype fp8; FP8Engine, FP8Linear, KVScales of algos/_fp8_engine.py, the simulated engine
that algos/fp8_sol_rl.py shares, all through kernels/fp8_blockwise.py):
  weights     at each sync every decoder nn.Linear weight is rounded to bf16, then quantised once to e4m3 in
              128 x 128 blocks, s = amax / 448 (fp32), q = e4m3(w / s) (saturating cast)        quantize_weight
  activations every forward, per token per 128 channels (1 x 128 tiles, dynamic)                 quantize_act
  matmul      y = sum over 128-wide K blocks of s_x s_w (q_x q_w^T), output rounded to bf16  fp8_blockwise_matmul
  KV cache    (--kv-fp8 e4m3|e5m2) K and V after RoPE: s_k = |K|max / 200, s_v = |V|max / 100 per layer (or per
              head), calibrated at the first forward after a sync and frozen until the next; clamp, then cast
                                                                                      KVScales, qdq_static
  Embeddings, norms, attention arithmetic and lm_head stay at the trainer's precision: mu samples under the
  trainer's autocast (common.autocast; bf16 under --dtype bf16), and the fp8 matmuls run outside it (fp32 block
  sums, as the kernel). --rollout-dtype bf16 runs the whole copy in bf16 and fp32 runs it unchanged (the plumbing
  floor: mu is then the trainer's own computation, 0 mismatch in fp32 and bf16 alike). Shapes that are not
  multiples of 128 are zero-padded to the block (the kernel's reference does it), so every block size stays 128.
Corrections (--correction; rho_t = pi_old(y_t) / mu(y_t), log-ratio clamped to +-20; weights detached, applied to
each token's clipped surrogate; a masked token keeps its place in the normaliser)      correction_weights
  token-tis   w_t = min(rho_t, C)                                               C = --tis-cap
  seq-tis     w_t = min(prod_t rho_t, C)
  token-mis   w_t = rho_t if lo <= rho_t <= hi else 0  (IcePop band)            lo, hi = --mis-low, --mis-high
  seq-mis     w_t = prod_t rho_t if lo <= prod_t rho_t <= hi else 0
  geo-rs      w_t = 1 if geo_lo <= exp(mean_t log rho_t) <= geo_hi else 0 (geometric-mean rejection)
  loss        J = aggregate_t w_t * l_t  (l_t = GRPO's clipped surrogate)                  corrected_grpo_loss
Unified FP8 (--unified, Jet-RL): the trainer's Linear layers run the same fp8 matmul in the forward, with
straight-through gradients (the fp32 gradient at the quantised operands), and its attention uses the rollout's
frozen KV scales, so mu and pi_train share one precision graph                           FP8Linear (mode ste)
Sol-RL (FP8 rollouts as a candidate pool, the contrastive subset regenerated in fp32) is the variant
algos/fp8_sol_rl.py.
Metrics (mismatch_metrics, before the update, on the rollout's own tokens): mean and max |log pi_train - log mu|,
k1 = mean(log mu - log pi), k3 = mean(r - 1 - log r) with r = pi / mu, the exact KL(mu || pi_train) summed
over the vocabulary, per position bucket, for the fp32 trainer (kl_fp8) and the unified trainer (kl_unified);
std of the sequence log-ratio; truncated / masked fractions and the ESS of the weights (the trainer's side chunk
by chunk over positions, no [B, C, V] tensor: trainer_token_stats); at eval steps, the first position where
shared-Gumbel decodes of mu and pi_train diverge                                         first_divergence

Deviations:
- FP8 is simulated: fake-quantised fp8 operands with fp32 accumulation per 128-wide K block (what the Triton
  kernel computes on a GPU); on CPU nothing gets faster. Activations are quantised from fp32 (the rest of the
  copy runs fp32), not from a bf16 residual stream.
- The rollout uses its own sampling loop (sample: Gumbel-max over the HF KV cache) instead of common.generate,
  so that it can record the full sampled distribution (exact KL) and the noise (shared-Gumbel decoding).
  --top-p is not supported; --engine vllm is refused (vLLM's real FP8 path is not wired here).
- The KV scales come from the prompt prefill of each step (padding included), as the per-step recalibration
  of the FP8 rollout stack; vLLM's own defaults differ.
- Held-out evaluation runs the trainer in fp32 (every mode), so accuracies compare across modes.
- The exact KL (and the recorded noise) needs the full distribution: only for a vocabulary of at most 4096 tokens
  (the tiny models); larger ones report k1 / k3 only.
- update is GRPO's with one more field (the behaviour log-probs mu) passed to the loss, and without grpo's
  sampler-trainer weight: the FP8 engine is the sampler, and its mismatch with the trainer is what --correction
  corrects (token-tis with --tis-cap C is grpo's min(pi_old / pi_sampler, C)); a second weight would count it twice,
  so --sampler-is-cap is 0 here and any other value is refused (make_engine) unless the FP8 sampler is the
  trainer's own computation (--rollout-dtype fp32 without an FP8 KV cache: the weight is then 1). The trainer's own
  sampler (a bf16 copy on CUDA) only decodes the held-out evaluation.

Commands:
  python algos/fp8_rollout.py                          # tiny default: add, tiny-0.6m, W8A8 rollouts, token-TIS
  python algos/fp8_rollout.py --model tiny-sums --task sums --digits 1 --max-new-tokens 48 --kv-fp8 e4m3
  python algos/fp8_rollout.py --unified --kv-fp8 e4m3  # Jet-RL: the trainer runs the same FP8 graph
  python algos/fp8_rollout.py --correction token-mis   # or none, seq-tis, seq-mis, geo-rs
  python algos/fp8_rollout.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --device cuda --max-new-tokens 512
Expected: the default lifts held-out greedy accuracy on 2-digit addition from 38.8% to 51.2% (+12.4 points) in 89 s
on 2 shared cores, with KL(mu || pi_train) per token 1.1e-2 against the fp32 trainer and 1.3e-6 against the unified
one (the fp8_rollout row of benchmarks/results/defaults.md). On the long-response tasks the W8A8 + FP8-KV mismatch per
token is 1.3e-3 on sums2 (10-token responses) and 4.6e-3 on sums6 (41 tokens; 6 seeds), while unified FP8 stays below
1e-5; within sums6 it is not monotone in the position (highest at positions 16-31; benchmarks/results/fp8_rollout.md).
Over 142 seeds per arm (100-241), token-TIS ends 20 batches at 51.1 ± 4.4% against fp32 rollouts' 51.6 ± 4.4%,
-0.5 [-1.6, +0.5] points: close, but not shown within the claims plan's 1.3 (benchmarks/README.md, the claims table).
Against FP8 with no correction (23 paired seeds, 300-322) token-TIS gains +0.7 [-1.0, +2.5] points: no credit to TIS.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import tyro

import common
from algos import _llm as llm
from algos._fp8_engine import FP8Engine, precision, sample, set_precision
from algos._llm import LLMArgs


@dataclass
class Args(LLMArgs):
    """FP8 rollouts' flags: GRPO's (algos/grpo.py), the rollout numerics and the corrections; the plumbing flags are
    LLMArgs'."""
    threads: int = 1
    """torch CPU threads per process (1: the FP8 simulation is many small ops; a second thread on a shared 2-core
    machine slowed a rollout batch about tenfold)"""
    top_p: float = 1.0
    """nucleus sampling threshold (the FP8 sampler draws from the full softmax: only 1.0)"""
    steps: int = 150
    """rollout batches"""
    # rollout
    prompts_per_step: int = 32
    """distinct prompts per rollout batch (per process)"""
    group_size: int = 8
    """completions per prompt (G)"""
    reward: tuple[str, ...] = ("correct",)
    """reward terms NAME[:WEIGHT]: built-ins correct, format, length, or module:function (TRL's convention: prompts,
    completions, answers in; a float or None per completion out); the total is their weighted sum"""
    # FP8 rollout numerics and corrections
    rollout_dtype: Literal["fp8", "bf16", "fp32"] = "fp8"
    """rollout policy mu: fp8 = blockwise W8A8 e4m3 (128x128 weights, 1x128 activations), bf16 (whole copy), fp32"""
    kv_fp8: Literal["off", "e4m3", "e5m2"] = "off"
    """FP8 KV cache of the rollout (scales |K|max/200, |V|max/100 from the first forward after each sync)"""
    kv_scale: Literal["per-layer", "per-head"] = "per-layer"
    """granularity of the KV-cache scales"""
    unified: bool = False
    """Jet-RL: the trainer's forward runs the same FP8 graph (straight-through gradients, the rollout's KV scales)"""
    correction: Literal["none", "token-tis", "seq-tis", "token-mis", "seq-mis", "geo-rs"] = "token-tis"
    """rollout correction of the mu / pi_train mismatch (see the header)"""
    tis_cap: float = 2.0
    """C of token-tis and seq-tis: w = min(rho, C)"""
    mis_low: float = 0.5
    """lower edge of the token-mis / seq-mis band (IcePop's alpha)"""
    mis_high: float = 5.0
    """upper edge of the token-mis / seq-mis band (IcePop's beta)"""
    geo_low: float = 0.98
    """geo-rs keeps a sequence when its geometric-mean ratio exp(mean_t log rho_t) is at least this"""
    geo_high: float = 1.02
    """... and at most this"""
    diag_every: int = 5
    """rollout batches between mismatch diagnostics (two extra trainer forwards; the first batch always)"""
    divergence_rows: int = 64
    """rollouts re-decoded by pi_train with the same Gumbel noise at eval steps (first divergence; 0 = off)"""
    # objective
    adv_std_norm: bool = True
    """divide the group-centred reward by the group std (GRPO); off = Dr. GRPO"""
    clip_eps_low: float = 0.2
    """lower clip range: ratio >= 1 - eps_low"""
    clip_eps_high: float = 0.2
    """upper clip range: ratio <= 1 + eps_high (DAPO's clip-higher uses 0.28)"""
    kl_coef: float = 0.0
    """weight of the k3 KL to the frozen initial policy (0 = no reference model)"""
    loss_agg: Literal["seq-mean", "token-mean", "const"] = "seq-mean"
    """seq-mean (GRPO), token-mean (DAPO), const (Dr. GRPO / AsyncWebRL: divide by --agg-const per sequence)"""
    agg_const: int = 0
    """the constant k of --loss-agg const (0 = max_new_tokens)"""
    sampler_is_cap: float = 0.0
    """grpo's sampler-trainer weight min(pi_old / pi_sampler, C): 0 here, since the FP8 sampler's mismatch is what
    --correction corrects (token-tis with --tis-cap C is that weight); refused unless the sampler is the trainer"""
    # optimisation
    ppo_epochs: int = 1
    """passes over each rollout batch"""
    minibatches: int = 1
    """optimiser steps per pass; the rollout batch is split into this many"""
    kernels: bool = False
    """use the Triton kernels (fused log-prob, fused clipped loss) when a GPU is present"""


def check_args(args: Args) -> None:
    """Fail early, naming the flag, instead of deep inside torch."""
    if args.group_size < 2:
        raise SystemExit(f"--group-size must be at least 2 for a group baseline, got {args.group_size}")
    if args.prompts_per_step < 1 or args.steps < 1 or args.max_new_tokens < 1:
        raise SystemExit("--prompts-per-step, --steps and --max-new-tokens must be positive")
    if args.minibatches < 1 or args.ppo_epochs < 1:  # before the modulo below (llm.check_plumbing: --kl-coef)
        raise SystemExit("--minibatches and --ppo-epochs must be positive")
    batch = args.prompts_per_step * args.group_size
    if batch % args.minibatches:
        raise SystemExit(f"--minibatches {args.minibatches} must divide the rollout batch "
                         f"(prompts_per_step * group_size = {batch})")
    if args.micro_batch_size < 1:
        raise SystemExit("--micro-batch-size must be positive")
    if not (0 <= args.clip_eps_low < 1 and args.clip_eps_high >= 0):
        raise SystemExit("clip ranges need 0 <= eps_low < 1 and eps_high >= 0")
    if args.temperature <= 0:
        raise SystemExit("--temperature must be > 0 (greedy decoding is used for eval only)")
    if args.engine == "vllm":
        raise SystemExit("--engine vllm: fp8_rollout simulates FP8 rollouts on the Hugging Face path; use --engine hf")
    if args.top_p != 1.0:
        raise SystemExit("--top-p: the FP8 sampler draws from the full softmax (Gumbel-max); use --top-p 1.0")
    if not (args.tis_cap >= 1 and 0 < args.mis_low <= 1 <= args.mis_high and 0 < args.geo_low <= 1 <= args.geo_high):
        raise SystemExit("corrections need --tis-cap >= 1, 0 < --mis-low <= 1 <= --mis-high and 0 < --geo-low <= 1 <= "
                         "--geo-high (identical policies must keep every token at weight 1)")
    if args.unified and args.rollout_dtype != "fp8":
        raise SystemExit("--unified shares the FP8 graph with the rollout: it needs --rollout-dtype fp8")
    if args.diag_every < 1:
        raise SystemExit("--diag-every must be at least 1")


# ---- the idea: advantage, clipped surrogate, KL, aggregation ----
def group_advantages(rewards: torch.Tensor, group_size: int, std_norm: bool = True, eps: float = 1e-6):
    """A_i = (r_i - mean_g r) / (std_g r + eps); rewards [B] group-major -> advantages [B]."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(1, keepdim=True)
    if std_norm:
        adv = adv / (r.std(1, keepdim=True) + eps)
    return adv.view(-1)


def clipped_pg_loss(logp, old_logp, adv, eps_low: float, eps_high: float):
    """Per-token PPO-clip loss -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A); logp [B, C], adv [B].

    Returns (loss [B, C], clipped [B, C] as float: where the clipped branch was the active one).
    """
    ratio = torch.exp(logp - old_logp)
    a = adv.unsqueeze(1)
    unclipped, clipped = ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).float()


def k3_kl(logp, ref_logp):
    """Schulman's k3 estimator of KL(pi_theta || pi_ref): exp(ref - logp) - (ref - logp) - 1 >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def aggregate_loss(token_loss, mask, mode: str, n_seqs: int, n_tokens: int, const: int):
    """This micro-batch's share of the step loss; summing the shares over micro-batches gives J.

    token_loss, mask: [b, C]; n_seqs, n_tokens: counted over the whole optimiser step (all ranks).
    """
    per_seq_sum = (token_loss * mask).sum(1)
    if mode == "seq-mean":
        return (per_seq_sum / mask.sum(1).clamp(min=1)).sum() / n_seqs
    if mode == "token-mean":
        return per_seq_sum.sum() / max(n_tokens, 1)
    if mode == "const":
        return per_seq_sum.sum() / (n_seqs * const)
    raise ValueError(f"unknown loss aggregation {mode!r}")


def agg_const(args: Args) -> int:
    """The constant k of --loss-agg const (default: the generation budget, as Dr. GRPO)."""
    return args.agg_const or args.max_new_tokens


def grpo_loss(logp, mb: dict, n_seqs: int, n_tokens: int, args: Args):
    """This micro-batch's share of J: clipped surrogate + kl_coef * k3 KL, aggregated over the step.

    logp [b, C] (with grad); mb holds old, ref (or None), adv [b], mask [b, C]. Returns (loss, per-token stats).
    """
    tok_loss, clipped = clipped_pg_loss(logp, mb["old"], mb["adv"], args.clip_eps_low, args.clip_eps_high)
    if mb.get("is_weight") is not None:  # the sampler is not the trainer: truncated importance weight per token
        tok_loss = tok_loss * mb["is_weight"]
    stats = {"clipfrac": clipped}
    if mb["ref"] is not None:
        kl = k3_kl(logp, mb["ref"])
        tok_loss, stats["kl"] = tok_loss + args.kl_coef * kl, kl
    return aggregate_loss(tok_loss, mb["mask"], args.loss_agg, n_seqs, n_tokens, agg_const(args)), stats


def kernel_grpo_loss(logp, mb: dict, n_seqs: int, n_tokens: int, args: Args):
    """grpo_loss from the fused Triton kernel (--kernels on a GPU): the same value and gradient.

    The kernel normalises inside the micro-batch (token or sequence mean); rescaling by this micro-batch's
    share of the step's sequences or tokens gives aggregate_loss's step-level normaliser.
    """
    from kernels.clipped_pg_loss import clipped_pg_loss as fused

    if mb.get("is_weight") is not None:  # the kernel has no per-token weight: the reference path takes it
        return grpo_loss(logp, mb, n_seqs, n_tokens, args)
    mask = mb["mask"]
    loss, kst = fused(logp, mb["old"], mb["adv"], mask, args.clip_eps_low, args.clip_eps_high, ref_logp=mb["ref"],
                      beta=args.kl_coef, reduction="seq_mean" if args.loss_agg == "seq-mean" else "token_mean")
    mb_tokens = float(mask.sum())
    scale = {"seq-mean": mask.shape[0] / n_seqs, "token-mean": mb_tokens / max(n_tokens, 1),
             "const": mb_tokens / (n_seqs * agg_const(args))}[args.loss_agg]
    return loss * scale, {"clipfrac": torch.full_like(mask, float(kst["clip_frac"]))}  # micro-batch mean



# ---- rollout corrections ----
def correction_weights(old, mu, mask, args: Args):
    """Detached weights w [b, C] for the mu -> pi_old mismatch (the header's table) and their statistics.

    old, mu: log-probs of the sampled tokens under pi_old (the trainer at the rollout's weights) and mu; mask [b, C].
    w = 0 on padding; a masked or rejected token gets w = 0 but still counts in the loss normaliser.
    """
    mask = mask.float()
    log_rho = ((old - mu).detach() * mask).clamp(-20, 20)
    rho = torch.exp(log_rho)
    seq_log = (log_rho.sum(1, keepdim=True)).clamp(-20, 20)  # [b, 1]
    mode = args.correction
    cut = torch.zeros_like(rho)  # where the cap or the band changed a weight
    if mode == "none":
        w = torch.ones_like(rho)
    elif mode == "token-tis":
        w, cut = rho.clamp(max=args.tis_cap), (rho > args.tis_cap).float()
    elif mode == "seq-tis":
        seq = torch.exp(seq_log).expand_as(rho)
        w, cut = seq.clamp(max=args.tis_cap), (seq > args.tis_cap).float()
    elif mode in ("token-mis", "seq-mis"):
        r = rho if mode == "token-mis" else torch.exp(seq_log).expand_as(rho)
        keep = (r >= args.mis_low) & (r <= args.mis_high)
        w, cut = torch.where(keep, r, torch.zeros_like(r)), (~keep).float()
    elif mode == "geo-rs":
        geo = torch.exp(log_rho.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).expand_as(rho)
        keep = (geo >= args.geo_low) & (geo <= args.geo_high)
        w, cut = keep.float(), (~keep).float()
    else:
        raise ValueError(f"unknown correction {mode!r}")
    w = w * mask
    n = mask.sum().clamp(min=1)
    stats = {"is/weight_mean": (w.sum() / n).item(), "is/cut_frac": ((cut * mask).sum() / n).item(),
             "is/masked_frac": (((w == 0).float() * mask).sum() / n).item(),
             "is/ess": (w.sum() ** 2 / (n * (w ** 2).sum()).clamp(min=1e-30)).item()}
    return w, stats


def corrected_grpo_loss(logp, mb: dict, n_seqs: int, n_tokens: int, args: Args):
    """grpo_loss with each token's clipped surrogate times its detached correction weight (mb["mu"]: behaviour)."""
    tok_loss, clipped = clipped_pg_loss(logp, mb["old"], mb["adv"], args.clip_eps_low, args.clip_eps_high)
    w, _ = correction_weights(mb["old"], mb["mu"], mb["mask"], args)
    tok_loss = tok_loss * w
    stats = {"clipfrac": clipped, "is_weight": w}
    if mb["ref"] is not None:
        kl = k3_kl(logp, mb["ref"])
        tok_loss, stats["kl"] = tok_loss + args.kl_coef * kl, kl
    return aggregate_loss(tok_loss, mb["mask"], args.loss_agg, n_seqs, n_tokens, agg_const(args)), stats


# ---- mismatch metrics ----
def trainer_token_stats(model, batch: dict, temperature: float, mu_full=None, chunk_mb: float | None = None):
    """log pi_train(y_t) [B, C] at the rollout's tokens and, given mu's full distribution mu_full [B, C, V], the exact
    KL(mu || pi_train) per token [B, C] (float64, each side renormalised: >= 0 up to 1e-16, where fp32 would show
    +-1e-9 noise). One decoder forward under the training autocast (common.decoder_hidden, as
    common.token_logprobs), then the lm_head and log-softmax over chunks of positions whose fp32 logits take about
    chunk_mb MiB (common.LOGPROB_CHUNK_MB by default): no [B, C, V] tensor of the trainer is ever built."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    P, (B, C) = batch["prompt_ids"].shape[1], batch["completion_ids"].shape
    head, tgt = model.get_output_embeddings(), batch["completion_ids"].reshape(-1)
    mu = None if mu_full is None else mu_full.reshape(B * C, -1)
    step = common.chunk_positions(head.weight.shape[0], chunk_mb)
    lp, kl = [], []
    with common.autocast(model):
        h = common.decoder_hidden(model, ids, mask, pos)[:, P - 1:-1].reshape(B * C, -1)
        for s in range(0, B * C, step):
            logp = torch.log_softmax(head(h[s:s + step]).float() / temperature, -1)
            lp.append(logp.gather(-1, tgt[s:s + step, None]).squeeze(-1))
            if mu is not None:
                a, b = mu[s:s + step].double().log_softmax(-1), logp.double().log_softmax(-1)
                kl.append((a.exp() * (a - b)).sum(-1).float())
    return torch.cat(lp).view(B, C), None if mu is None else torch.cat(kl).view(B, C)


def kl_estimates(mu_tok, pi_tok, mask, exact=None) -> dict:
    """Per-token KL(mu || pi) from the sampled tokens (k1, k3) and, given the exact per-token KL (trainer_token_stats),
    exactly. Returns masked means and the per-token tensors ([B, C]) so callers can bucket or take standard errors."""
    d = (pi_tok - mu_tok) * mask  # log r, r = pi / mu
    per = {"k1": -d, "k3": (torch.exp(d) - 1 - d) * mask}
    if exact is not None:
        per["exact"] = exact * mask
    n = mask.sum().clamp(min=1)
    return {k: (v.sum() / n).item() for k, v in per.items()}, per


BUCKETS = ((0, 8), (8, 16), (16, 32), (32, 10 ** 6))


@torch.no_grad()
def mismatch_metrics(model, batch: dict, engine: FP8Engine, args: Args) -> dict:
    """mu against pi_train on the rollout's own tokens, before any update: |dlogp|, k1 / k3 / exact KL (overall and
    per position bucket), the spread of the sequence log-ratio, and the correction's truncation / mask / ESS.

    kl_fp8 compares mu with the trainer in fp32; kl_unified with the trainer in the unified FP8 graph."""
    mask = batch["completion_mask"].float()
    mu_tok, mu_full = batch["logprobs"], batch.get("mu_full")
    trainers = {"fp8": ("off", None)}
    if args.rollout_dtype == "fp8":
        trainers["unified"] = ("ste", engine.kv)
    out, per_used = {}, None
    for name, (mode, kv) in trainers.items():
        with precision(model, mode, kv):
            pi_tok, exact = trainer_token_stats(model, batch, args.temperature, mu_full)
        pi_tok = pi_tok * mask
        means, per = kl_estimates(mu_tok, pi_tok, mask, exact)
        out[f"mismatch/kl_{name}"] = means.get("exact", means["k3"])
        if (name == "unified") == args.unified:  # the trainer this run actually uses
            per_used, tok_used = per, pi_tok
            out.update({f"mismatch/{k}": v for k, v in means.items()})
    d = (tok_used - mu_tok).abs() * mask
    seq = ((tok_used - mu_tok) * mask).sum(1)
    out.update({"mismatch/abs_dlogp_mean": (d.sum() / mask.sum().clamp(min=1)).item(),
                "mismatch/abs_dlogp_max": d.max().item(), "mismatch/seq_logratio_std": seq.std().item()})
    key = "exact" if "exact" in per_used else "k3"
    for lo, hi in BUCKETS:
        m = mask[:, lo:hi]
        if m.sum() > 0:
            name = f"{lo}-{hi - 1}" if hi < 10 ** 6 else f"{lo}+"
            out[f"mismatch/kl_pos{name}"] = (per_used[key][:, lo:hi].sum() / m.sum()).item()
    out.update(correction_weights(tok_used, mu_tok, mask, args)[1])
    return out


@torch.no_grad()
def first_divergence(model, tok, batch: dict, args: Args, rows: int) -> dict:
    """Re-decode the first `rows` rollouts with pi_train from the rollout's Gumbel noise: where do they first differ?

    Returns the fraction that diverge and, over those, the mean position of the first differing token."""
    if batch.get("noise") is None or rows <= 0:
        return {}
    idx = torch.arange(min(rows, batch["completion_ids"].shape[0]))
    prompts = [p[m.bool()].tolist() for p, m in zip(batch["prompt_ids"][idx], batch["prompt_mask"][idx])]
    ro, _, _ = sample(model, tok, prompts, 1, batch["noise"].shape[1], args.temperature, batch["noise"][idx])
    a, b = batch["completion_ids"][idx], ro.completion_ids
    C = max(a.shape[1], b.shape[1])
    pad = lambda x: torch.nn.functional.pad(x, (0, C - x.shape[1]), value=tok.pad_token_id)  # noqa: E731
    differ = pad(a) != pad(b)
    hit = differ.any(1)
    out = {"mismatch/diverged_frac": hit.float().mean().item()}
    if hit.any():
        out["mismatch/first_divergence"] = differ[hit].float().argmax(1).float().mean().item()
    return out


# ---- rollout and update ----
def score(task, examples: list, ro, per: int, args: Args, device) -> tuple[torch.Tensor, dict]:
    """--reward (llm.Rewards) on `per` completions of each example, as grpo.py's rollout: the total per row [B] and
    each term's mean where it applies (reward/<name>)."""
    per_row = lambda xs: [x for x in xs for _ in range(per)]  # noqa: E731
    total, terms = llm.Rewards(args.reward)(per_row([e.prompt for e in examples]), ro.texts,
                                            per_row([e.answer for e in examples]), task=task,
                                            completion_lengths=ro.completion_mask.sum(1).tolist(),
                                            max_new_tokens=args.max_new_tokens)
    return torch.tensor(total, device=device), {
        f"reward/{k}": float(np.mean([v for v in vs if v is not None] or [0.0])) for k, vs in terms.items()}


def rollout(model, tok, task, args: Args, rng, device, engine=None) -> dict:
    """Sample G completions for each of prompts_per_step training prompts from mu (the FP8 engine, which records its
    own log-probs, full distribution and Gumbel noise); reward them; A_i per group."""
    examples = task.sample("train", args.prompts_per_step, rng)
    ro, mu_full, noise = engine.sample(tok, common.encode_prompts(tok, [e.prompt for e in examples]), args.group_size,
                                       args.max_new_tokens, args.temperature)
    rewards, terms = score(task, examples, ro, args.group_size, args, device)
    batch = {k: getattr(ro, k).to(device) for k in
             ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs")}
    batch.update(rewards=rewards, adv=group_advantages(rewards, args.group_size, args.adv_std_norm),
                 finish_reasons=ro.finish_reasons, reward_terms=terms, mu_full=mu_full, noise=noise)
    return batch


def sampler_gap(old_logp, sampler_logp, is_weight, mask, cap: float) -> dict:
    """This micro-batch's sums for rollout/logprob_mismatch (|log pi_old - log pi_sampler| per token, on the sampler's
    weights) and, when the correction is on, the mean importance weight and the fraction truncated at C."""
    out = {"gap/sum": common.masked_sum((old_logp - sampler_logp).abs(), mask).item(), "gap/tokens": mask.sum().item()}
    if is_weight is not None:
        out.update({"gap/is_w": common.masked_sum(is_weight, mask).item(),
                    "gap/is_cut": common.masked_sum((is_weight >= cap).float(), mask).item()})
    return out


def update(model, opt, batch: dict, loss_fn, args: Args, step: int, accel, sampler, ref_model=None,
           fused_logprob=None) -> dict:
    """ppo_epochs x minibatches optimiser steps on one rollout batch (micro-batches accumulate gradients).

    pi_old (and pi_ref) are scored before any update; the loss of each micro-batch is normalised by counts
    over its whole mini-batch on all ranks, so accumulation and data parallelism leave J unchanged. The logged
    statistics are sums over all ranks divided by global counts: every rank returns the same values.
    FP8 rollouts: each micro-batch also carries mu, the FP8 sampler's log-probs, for the --correction weights
    (which take the place of grpo's sampler-trainer weight); `sampler` is the trainer's own (held-out evaluation).
    """
    B, mask = batch["completion_ids"].shape[0], batch["completion_mask"]
    micro = lambda idx: idx.split(args.micro_batch_size)  # noqa: E731
    logprobs_of = lambda m, idx, ent=False: common.token_logprobs(  # noqa: E731
        m, batch["prompt_ids"][idx], batch["prompt_mask"][idx], batch["completion_ids"][idx], mask[idx],
        args.temperature, with_entropy=ent, fused_fn=fused_logprob)
    on_policy = args.ppo_epochs == 1 and args.minibatches == 1  # then pi_old = pi_theta.detach()
    with torch.no_grad():
        old = None if on_policy else torch.cat([logprobs_of(model, i) for i in micro(torch.arange(B))])
        ref = torch.cat([logprobs_of(ref_model, i) for i in micro(torch.arange(B))]) if ref_model else None
    sums, n_opt, grad_norm = {}, 0, 0.0  # sums: this rank's share of each logged mean, summed over ranks below
    total = args.steps * args.ppo_epochs * args.minibatches
    for epoch in range(args.ppo_epochs):
        for mb_idx in (torch.randperm(B) if args.minibatches > 1 else torch.arange(B)).chunk(args.minibatches):
            n_seqs, n_tokens = llm.step_counts(mask[mb_idx], accel)
            opt.zero_grad(set_to_none=True)
            for idx in micro(mb_idx):
                logp, ent = logprobs_of(model, idx, True)
                mb = {"adv": batch["adv"][idx], "mask": mask[idx].float(),
                      "mu": batch["logprobs"][idx],  # the behaviour log-probs, for the rollout correction
                      "old": logp.detach() if old is None else old[idx], "ref": None if ref is None else ref[idx]}
                loss, token_stats = loss_fn(logp, mb, n_seqs, n_tokens, args)
                loss.backward()  # a NaN here reaches every rank's gradient: optimizer_step stops them all
                for k, v in {"pg": loss.item(), **{k: common.masked_sum(v.detach(), mb["mask"]).item() / max(
                        n_tokens, 1) for k, v in {**token_stats, "entropy": ent}.items()}}.items():
                    sums[k] = sums.get(k, 0.0) + v
                if epoch == 0:  # every token once, on the sampler's weights (pi_old)
                    for k, v in sampler_gap(mb["old"], mb["mu"], None, mb["mask"], 0.0).items():  # no grpo weight
                        sums[k] = sums.get(k, 0.0) + v
            opt_step = (step - 1) * args.ppo_epochs * args.minibatches + n_opt  # derived: resume-safe
            grad_norm += llm.optimizer_step(model, opt, args, opt_step, total, sampler)
            n_opt += 1
    tot = llm.all_ranks_sum(sums, accel, mask.device)
    return {**{f"loss/{k}": v / n_opt for k, v in tot.items() if not k.startswith("gap/")},
            "loss/grad_norm": grad_norm / n_opt, "rollout/logprob_mismatch": tot["gap/sum"] / max(tot["gap/tokens"], 1)}


def step_diagnostics(model, tok, batch: dict, engine: FP8Engine, args: Args, step: int) -> dict:
    """mismatch_metrics on the first batch and every diag_every; first_divergence at eval steps."""
    out = mismatch_metrics(model, batch, engine, args) if step == 1 or step % args.diag_every == 0 else {}
    if step % args.eval_every == 0:
        out.update(first_divergence(model, tok, batch, args, args.divergence_rows))
    return out


def make_engine(model, args: Args) -> FP8Engine:
    """mu: the FP8Engine at --rollout-dtype / --kv-fp8 / --kv-scale (with --unified the trainer then runs its FP8 graph,
    straight-through gradients and the rollout's KV scales). grpo's sampler-trainer weight is refused: this sampler is
    not the trainer's computation (but with fp32 rollouts), and --correction already corrects its mismatch."""
    engine = FP8Engine(model, args.rollout_dtype, args.kv_fp8, args.kv_scale)
    if args.sampler_is_cap > 0 and not engine.is_trainer:
        raise SystemExit("--sampler-is-cap: the FP8 sampler is not the trainer's computation, and --correction already "
                         "corrects its mismatch (token-tis with --tis-cap C is grpo's weight min(pi_old / pi_sampler, "
                         "C)); a second weight would count it twice: use --sampler-is-cap 0")
    if args.unified:  # Jet-RL: the trainer runs the rollout's FP8 graph, with straight-through gradients
        set_precision(model, "ste", engine.kv)
    return engine


def mismatch_summary(history: list[dict]) -> dict:
    """Run means of the per-step mismatch/ and is/ figures: mismatch/kl_fp8 -> kl_fp8, is/ess -> is_ess, ..."""
    out = {}
    for key in sorted({k for h in history for k in h if k.split("/")[0] in ("mismatch", "is")}):
        vals = [h[key] for h in history if h.get(key) is not None]
        name = key.split("/", 1)[1] if key.startswith("mismatch/") else key.replace("/", "_")
        out[name] = float(np.mean(vals))
    return out


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    run = llm.Run(args)  # accelerator, threads, seed, the task and its held-out sets, the run folder
    # sharded when several processes run; the sampler (the trainer itself on CPU) decodes the held-out evaluation
    model, tok, ref_model, sampler = llm.load_policy(args, run.accel, with_ref=args.kl_coef > 0)
    engine = make_engine(model, args)  # mu: the rollout copy at --rollout-dtype, re-quantised after every update
    use_kernels = args.kernels and run.accel.device.type == "cuda"
    fused_logprob = None
    if use_kernels:  # Triton: the fused lm_head + log-softmax (the loss kernel is in kernel_grpo_loss)
        from kernels.fused_logprob import fused_linear_logprob as fused_logprob
    loss_fn = kernel_grpo_loss if use_kernels and args.correction == "none" else corrected_grpo_loss
    opt = llm.make_optimizer(model.parameters(), args)

    def evaluate():  # the trainer in fp32 in every mode, so accuracies compare across modes
        with precision(model, "off"):
            return common.run_eval(sampler, tok, run.task, run.eval_sets, args.max_new_tokens, args.pass_k,
                                   args.temperature, run.hard_task)

    run.start(model, tok, opt, sampler, evaluate=evaluate)  # resume from --resume, then the step-0 evaluation
    if args.resume:
        engine.sync_weights(model)
    for step, rng in run.steps():  # every random draw of a step depends on (seed, step, rank) only
        with run.timer("gen"):
            batch = rollout(model, tok, run.task, args, rng, run.accel.device, engine)
        with run.timer("diag"):  # mu against pi_train on these tokens, before the update
            diag = step_diagnostics(model, tok, batch, engine, args, step)
        with run.timer("train"):
            stats = update(model, opt, batch, loss_fn, args, step, run.accel, sampler, ref_model, fused_logprob)
        with run.timer("sync"):  # weights copied into mu, re-quantised; KV scales recalibrate at the next rollout
            engine.sync_weights(model)
        run.log_step(step, batch, stats, extra=diag)  # rollout metrics, evaluation every --eval-every, checkpoints
    summary = mismatch_summary(run.history)
    if run.is_main:
        print(f"KL(mu || pi_train) per token: fp32 trainer {summary['kl_fp8']:.2e}, "
              f"unified {summary.get('kl_unified')}")
    return run.finish(f"FP8 rollouts ({args.rollout_dtype}, {args.correction})", extra=summary)


if __name__ == "__main__":
    main(tyro.cli(Args))
