"""Asynchronous off-policy GRPO: training on stale rollouts, with the corrections proposed for it.

An asynchronous pipeline trains on rollouts that a policy k versions old generated (the rollout workers run
ahead of the trainer). This script simulates that exactly in one process: a FIFO of generated batches sits
between the sampler and the trainer (StaleFIFO), so update t trains the batch that the weights of update
t - k sampled, and compares the off-policy corrections of:
- AReaL (decoupled PPO and its staleness bound): "AReaL: A Large-Scale Asynchronous Reinforcement Learning
  System for Language Reasoning", arXiv:2505.24298;
- M2PO: "Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?",
  arXiv:2510.01161 (abstract: clipped-token fraction under high staleness 1.22% -> 0.06%);
- VCPO: "Stable Asynchrony: Variance-Controlled Off-Policy RL for LLMs", arXiv:2602.17616;
- PPO-EWMA: Hilton, Cobbe and Schulman, "Batch size-invariance for policy optimization", arXiv:2110.00641,
  adopted (revised) for missing old logits by "Missing Old Logits in Asynchronous Agentic RL: Semantic
  Mismatch and Repair Methods for Off-Policy Correction", arXiv:2605.12070;
- the strict double-sided token clip of SAO (single-rollout asynchronous optimisation, GLM).

Parent: algos/grpo.py; changed: Args, Args.eval_every, Args.kernels, Args.lr, Args.ppo_epochs, Args.resume,
  Args.sampler_is_cap, Args.seed, Args.steps, Args.threads, check_args, update, main.

Notation per completion token t of sequence i: mu = behaviour log-prob (stored by the sampler k versions ago),
prox = the proximal policy (recomputed by the trainer before the update, or the EWMA copy), logp = pi_theta
(with grad), A_i = GRPO's group advantage, w_t = exp(prox - mu), r_t = exp(logp - prox).

Equations (each implemented by the function named on the right; --correction picks one):
  staleness         FIFO of batches: batch n is made by weights v_n and trained at update n+1; admitted only if
                    n - v_n <= eta (AReaL's rule, --staleness eta); --gen-rate r > 0 is the bounded mode where
                    the workers finish r batches per update, else the bound is always reached   StaleFIFO
  plain             PPO-clip around mu: -min(e^{logp-mu} A, clip(e^{logp-mu}, 1-eps, 1+eps) A)   clipped_pg_loss
  recompute         PPO-clip around prox, mu ignored (the APRIL/slime default)                 clipped_pg_loss
  decoupled         w_t * -min(r_t A, clip(r_t) A), tokens with w_t > --is-cap masked (weight 0, still counted
                    in the normaliser), as AReaL's behav_imp_weight_cap                       decoupled_pg_loss
  decoupled-loglinear  the same with prox ~ mu + alpha (logp.detach() - mu), alpha = s / (s + 1) for a
                    batch s versions stale (AReaL's log-linear proximal approximation, no recompute)  loglinear_prox
  m2po-mask         -M_t e^{logp-mu} A (no clip); M drops the tokens with the largest (log w)^2, largest first,
                    until the mean of the rest is <= tau (--m2-tau), never all          m2po_keep_mask, m2po_mask_loss
  m2po-clip         the authors' water-filling form: over harmful tokens (A > 0 and w > 1, or A < 0 and w < 1),
                    choose c with mean_h min((log w)^2, c^2) = tau; PPO-clip around mu with range
                    [e^-c, e^c], at least [1 - 0.3, 1 + 0.5]                       m2po_clip_level, m2po_clip_range
  vcpo              sequence weight W_i = min(exp(sum_t (prox - mu)), --is-cap); ESS/B = (sum W)^2 / (B sum W^2);
                    lr x sqrt(min(1, ESS/B)); baseline b = sum_g W^2 |g|^2 R / sum_g W^2 |g|^2 per group;
                    loss W_i * PPO-clip around prox with A_i = (R_i - b) / std (|g|^2 from the logits' softmax
                    chunk by chunk over positions: no [B, C, V] tensor)  seq_is_weights, ess_ratio,
                                                                        opob_advantages, seq_score_sq_norm
  ppo-ewma          decoupled with prox = a bias-corrected EWMA of the weights (decay --ewma-decay)     EWMA
  double-sided      -m_t e^{logp-mu} A with m_t = 1 only while e^{logp-mu} is in [1-eps, 1+eps], whatever
                    the sign of A                                                          double_sided_loss
  metrics           KL(mu || pi) = E_mu[e^{d} - d - 1], d = pi - mu (k3, before the update); clipped and masked
                    token fractions; ESS/B of the untruncated sequence weights; gradient noise
                    |g_a - g_b|^2 / |g_a + g_b|^2 of two halves of each mini-batch; quantiles of w  (update)
  The group advantage, clip, k3 KL to a reference and --loss-agg aggregation are grpo.py's.

What changes from GRPO: main keeps a StaleFIFO between rollout() and update() and (ppo-ewma) the EWMA copy;
update always scores the proximal policy before the first step, precomputes each correction's per-batch
quantities (offpolicy_prepare: M2PO's mask or clip level, VCPO's weights, baseline and lr scale), measures the
off-policy metrics, and feeds offpolicy_loss; the VCPO lr scale enters optimizer_step through the lr it reads.

Deviations:
- Staleness is simulated in one process; nothing here measures asynchronous throughput. The first batches are
  made by the initial weights (stale by t - 1 < k at update t); summary staleness_mean is the mean trained age.
- M2PO's mask and clip level are computed once per update from log(prox / mu) over the whole batch (as AReaL's
  M2PO does), not at every optimiser step from the current pi_theta. Both M2PO forms use --loss-agg
  (seq-mean by default; the paper uses the token mean).
- VCPO is described for REINFORCE/GRPO; here its sequence weight multiplies the PPO-clip loss around prox, so the
  second PPO epoch stays trust-region bound. |g|^2 in the baseline is the squared norm of the gradient of
  log pi(o_i) with respect to the logits (sum over tokens of 1 - 2 p(y_t) + sum_v p_v^2), not the parameter
  gradient the paper uses (that needs one backward per sequence).
- PPO-EWMA: the EWMA is updated once per rollout batch (after the update), not after every optimiser step.
- Decoupled PPO masks tokens whose behaviour weight exceeds --is-cap (AReaL's implementation); truncating them
  to the cap instead is not offered.
- No grpo.py sampler-trainer weight: every correction divides by mu, the sampler's own log-probs (the bf16 copy's
  on CUDA, vLLM's), so the gap between sampler and trainer is part of the behaviour ratio it corrects (recompute
  ignores mu, and with it that gap, by design); a second weight would count it twice, so --sampler-is-cap is 0 here
  and any other value is refused when the sampler is not the trainer (on CPU it is, and the weight would be 1).
- --resume is not supported (the FIFO of stale batches and the EWMA copy are not checkpointed); --kernels only
  fuses the log-prob (the corrections are plain torch). With several processes the ESS, M2PO and VCPO
  statistics are per process.

Commands:
  python algos/async_offpolicy_grpo.py                                   # default correction, k = 4, 2-core CPU
  python algos/async_offpolicy_grpo.py --correction plain --staleness 16
  python algos/async_offpolicy_grpo.py --correction m2po-clip --staleness 64
  python algos/async_offpolicy_grpo.py --correction decoupled --staleness 8 --gen-rate 2   # bounded mode
  python algos/async_offpolicy_grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --engine vllm \
      --device cuda --max-new-tokens 512 --prompts-per-step 64 --lr 1e-6 --staleness 8     # one GPU
Expected: the default (decoupled PPO on rollouts 4 versions stale, lr 5e-5, 150 batches) lifts tiny-0.6m's held-out
greedy accuracy on 2-digit addition from 38.8% to 51.6% (+12.8 points) in 105 s on one shared core
(benchmarks/results/defaults.md). benchmarks/results/async_offpolicy.md (python benchmarks/async_offpolicy_table.py,
lr 1e-4, 40 batches, 3 seeds): at k = 16, KL(mu || pi) = 0.213 +- 0.056; from 35.3%, PPO-clip around mu ends at
29.1 +- 10.9% and clips 11.8% of tokens, M2PO's clip form at 28.1 +- 13.8% and clips 9.8%: no difference in
accuracy over seeds (seed 0 alone had M2PO at 44.0%).
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import math
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
from algos._llm import LLMArgs

CORRECTIONS = ("plain", "recompute", "decoupled", "decoupled-loglinear", "m2po-mask", "m2po-clip", "vcpo",
               "ppo-ewma", "double-sided")


@dataclass
class Args(LLMArgs):
    """Asynchronous off-policy GRPO's flags: GRPO's (algos/grpo.py), the staleness and the corrections; the plumbing
    flags are LLMArgs'."""
    seed: int = 0
    """random seed: prompts and sampling of batch n depend only on (seed, n, rank)"""
    threads: int = 1
    """torch CPU threads per process (1: on a shared 2-core machine two threads ran 10x slower here)"""
    steps: int = 150
    """rollout batches trained (each followed by ppo_epochs * minibatches optimiser steps)"""
    lr: float = 5e-5
    """peak learning rate (AdamW); half grpo.py's, since each batch gets two epochs (1e-4 made the tiny policy
    oscillate here); real LLMs want about 1e-6"""
    eval_every: int = 50
    """rollout batches between held-out evaluations"""
    resume: str = ""
    """not supported here (the FIFO of stale batches is not checkpointed); kept so that the flag fails clearly"""
    # rollout
    prompts_per_step: int = 32
    """distinct prompts per rollout batch (per process)"""
    group_size: int = 8
    """completions per prompt (G)"""
    reward: tuple[str, ...] = ("correct",)
    """reward terms NAME[:WEIGHT]: built-ins correct, format, length, or module:function (TRL's convention: prompts,
    completions, answers in; a float or None per completion out); the total is their weighted sum"""
    # staleness
    staleness: int = 4
    """eta: a batch is trained at most this many policy versions after the weights that sampled it (0 = on-policy)"""
    gen_rate: float = 0.0
    """bounded mode: rollout batches the workers finish per update (0 = as many as the bound admits: every batch
    is exactly eta versions old once the FIFO is full)"""
    correction: Literal["plain", "recompute", "decoupled", "decoupled-loglinear", "m2po-mask", "m2po-clip", "vcpo",
                        "ppo-ewma", "double-sided"] = "decoupled"
    """the off-policy correction (see the header)"""
    is_cap: float = 5.0
    """decoupled / ppo-ewma: mask tokens whose behaviour weight pi_prox/mu exceeds this; vcpo: truncate the
    sequence weights here"""
    m2_tau: float = 0.04
    """M2PO's bound on the mean second moment (log w)^2"""
    ewma_decay: float = 0.5
    """ppo-ewma: decay of the EWMA of the weights, per rollout batch"""
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
    """grpo's sampler-trainer weight min(pi_old / pi_sampler, C): 0 here, since the corrections take mu, the sampler's
    own log-probs, as the behaviour policy (its numerics included); refused when the sampler is not the trainer"""
    # optimisation
    ppo_epochs: int = 2
    """passes over each rollout batch (two, so that the clip binds)"""
    minibatches: int = 1
    """optimiser steps per pass; the rollout batch is split into this many"""
    kernels: bool = False
    """use the Triton fused log-prob kernel when a GPU is present"""


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
    if args.engine == "vllm" and not torch.cuda.is_available():
        raise SystemExit("--engine vllm needs a CUDA GPU; use --engine hf on CPU")
    if args.staleness < 0 or args.gen_rate < 0:
        raise SystemExit(f"--staleness and --gen-rate must be >= 0, got {args.staleness} and {args.gen_rate}")
    if args.is_cap <= 1 or args.m2_tau <= 0 or not 0 <= args.ewma_decay < 1:
        raise SystemExit("--is-cap must be > 1, --m2-tau > 0 and --ewma-decay in [0, 1)")
    if args.resume:
        raise SystemExit("--resume is not supported by async_offpolicy_grpo.py: the FIFO of stale batches and the "
                         "EWMA copy are not checkpointed")


# ---- grpo.py's advantage, clipped surrogate, KL and aggregation (unchanged) ----
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


# ---- the idea: staleness, and the off-policy corrections ----
class StaleFIFO:
    """Batches generated ahead of the trainer. Batch n (0-based) is trained at update n + 1, when the trainer
    holds version n (versions count updates), so a batch made by version v is n - v versions stale when trained.

    AReaL's admission rule: batch n may be started at version v only if n - v <= eta. With gen_rate = 0 the
    workers are never the bottleneck and make every admitted batch at once (each batch is exactly eta stale once
    the FIFO is full); with gen_rate = r > 0 they finish r batches per update (fractions carry over), and the
    trainer waits for one when the FIFO is empty (a forced batch, made by the current version).
    """

    def __init__(self, eta: int, total: int, gen_rate: float = 0.0):
        self.eta, self.total, self.gen_rate = eta, total, gen_rate
        self.queue: collections.deque = collections.deque()
        self.made, self.credit = 0, 0.0

    def admits(self, version: int) -> bool:
        return self.made < self.total and self.made - version <= self.eta

    def next_batch(self, version: int, make) -> dict:
        """Let the workers produce what they can at `version` (make(n) -> batch n), then hand over the oldest."""
        if not self.queue:  # the trainer waits: one batch from the current weights, whatever the rate
            self._make(version, make)
        self.credit = self.credit + self.gen_rate if self.gen_rate else math.inf
        while self.admits(version) and self.credit >= 1:
            self._make(version, make)
            self.credit -= 1
        if self.gen_rate and not self.admits(version):
            self.credit = min(self.credit, 1.0)  # blocked workers idle; they bank no more than one batch
        return self.queue.popleft()

    def _make(self, version: int, make) -> None:
        batch = make(self.made)
        batch["version"], batch["index"] = version, self.made
        self.queue.append(batch)
        self.made += 1


def decoupled_pg_loss(logp, prox, behav, adv, eps_low: float, eps_high: float, cap: float):
    """AReaL's decoupled PPO: w * clipped surrogate around prox, w = exp(prox - behav); tokens with w > cap get
    weight 0 (they stay in the normaliser). logp, prox, behav [B, C]; adv [B].

    Returns (loss [B, C], clipped [B, C], masked [B, C]).
    """
    w = torch.exp(prox - behav)
    keep = (w <= cap).float()
    loss, clipped = clipped_pg_loss(logp, prox, adv, eps_low, eps_high)
    return keep * w * loss, clipped * keep, 1 - keep


def loglinear_prox(behav, logp_now, staleness: int):
    """AReaL's log-linear proximal approximation without a recompute: behav + alpha (logp_now - behav), with
    alpha = (v_prox - v_behav) / (v_theta - v_behav) = s / (s + 1) for a batch s versions stale (logp_now is
    pi_theta, detached, counted one version ahead of the proximal policy)."""
    alpha = staleness / (staleness + 1)
    return behav + alpha * (logp_now - behav)


def m2po_keep_mask(log_w, mask, tau: float):
    """M2PO's second-moment mask: drop the tokens with the largest (log w)^2, largest first, until the mean of
    the rest is <= tau; at least one token always stays. log_w, mask [B, C] -> keep [B, C] (0/1 float)."""
    sel = mask.bool()
    m2 = log_w.detach()[sel].pow(2)
    keep = torch.zeros_like(log_w)
    if m2.numel() == 0:
        return keep
    order = torch.argsort(m2, descending=True, stable=True)
    suffix_mean = m2[order].flip(0).cumsum(0).flip(0) / torch.arange(len(m2), 0, -1, dtype=m2.dtype)
    ok = torch.nonzero(suffix_mean <= tau)
    n_drop = int(ok[0]) if len(ok) else len(m2) - 1
    kept = torch.ones(len(m2), dtype=log_w.dtype)
    kept[order[:n_drop]] = 0
    keep[sel] = kept
    return keep


def m2po_mask_loss(logp, behav, adv, keep):
    """-keep * exp(logp - behav) * A: M2PO's masked, unclipped importance-weighted surrogate."""
    return -keep * torch.exp(logp - behav) * adv.unsqueeze(1)


def m2po_clip_level(log_w, adv, mask, tau: float) -> float:
    """The water-filling clip level c of the M2PO authors' code: over the harmful tokens (A > 0 and w > 1, or
    A < 0 and w < 1), the c >= 0 with mean_h min((log w)^2, c^2) = tau; inf when their mean is already <= tau."""
    a = adv.unsqueeze(1).expand_as(log_w)
    harmful = mask.bool() & (((a > 0) & (log_w > 0)) | ((a < 0) & (log_w < 0)))
    d2 = torch.sort(log_w.detach()[harmful].double().pow(2)).values
    n = len(d2)
    if n == 0 or d2.mean() <= tau:
        return math.inf
    below = torch.cat([d2.new_zeros(1), d2.cumsum(0)[:-1]])  # below[j] = sum of the j smallest
    j = torch.arange(n, dtype=d2.dtype)
    c2 = (tau * n - below) / (n - j)  # if j values lie below c^2 and the n - j others are capped at c^2
    prev = torch.cat([d2.new_zeros(1), d2[:-1]])
    fits = torch.nonzero((c2 <= d2) & (c2 >= prev))  # c^2 in [d2[j-1], d2[j]]: the consistent j
    return float(c2[fits[0]].clamp(min=0).sqrt()) if len(fits) else 0.0


def m2po_clip_range(c: float, min_low: float = 0.3, min_high: float = 0.5) -> tuple[float, float]:
    """(eps_low, eps_high) of the clip [e^-c, e^c], widened to at least [1 - min_low, 1 + min_high] (the
    authors' defaults) so that a tight level never freezes every token."""
    if math.isinf(c):
        return 1.0, math.inf
    return max(1 - math.exp(-c), min_low), max(math.exp(c) - 1, min_high)


def double_sided_loss(logp, behav, adv, eps_low: float, eps_high: float):
    """SAO's strict double-sided clip: -m e^{logp-behav} A with m = 0 once the ratio leaves [1-eps_low,
    1+eps_high], whatever the sign of A. Returns (loss [B, C], masked [B, C])."""
    ratio = torch.exp(logp - behav)
    inside = ((ratio.detach() >= 1 - eps_low) & (ratio.detach() <= 1 + eps_high)).float()
    return -inside * ratio * adv.unsqueeze(1), 1 - inside


def seq_is_weights(prox, behav, mask, cap: float = math.inf):
    """Sequence importance weights W_i = min(exp(sum_t (prox - behav)), cap); [B, C] -> [B]."""
    return torch.exp(((prox - behav) * mask).sum(1)).clamp(max=cap)


def ess_ratio(w) -> float:
    """ESS / B = (sum w)^2 / (B sum w^2): 1 for equal weights, 1/B when one weight dominates."""
    w = w.double()
    return float(w.sum() ** 2 / (len(w) * w.pow(2).sum()).clamp(min=1e-300))


def opob_advantages(rewards, w, score_sq, group_size: int, std_norm: bool = True, eps: float = 1e-6):
    """VCPO's off-policy optimal baseline per group: b = sum W^2 |g|^2 R / sum W^2 |g|^2 (the group mean when the
    weights vanish); A_i = (R_i - b) / (std + eps) as GRPO (std_norm), else R_i - b. All [B], group-major."""
    r, c = rewards.view(-1, group_size), (w.pow(2) * score_sq).view(-1, group_size).double()
    den = c.sum(1, keepdim=True)
    b = torch.where(den > 0, (c * r).sum(1, keepdim=True) / den.clamp(min=1e-300), r.double().mean(1, keepdim=True))
    adv = r - b.to(r.dtype)
    if std_norm:
        adv = adv / (r.std(1, keepdim=True) + eps)
    return adv.view(-1)


@torch.no_grad()
def seq_score_sq_norm(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature: float = 1.0,
                      chunk_mb: float | None = None):
    """|d log pi(o_i) / d logits|^2 = sum_t (1 - 2 p(y_t) + sum_v p_v^2) over the completion tokens; -> [B]. One
    decoder forward under the training autocast, then the lm_head and softmax over chunks of positions whose fp32
    logits take about chunk_mb MiB (common.LOGPROB_CHUNK_MB by default; as common.token_logprobs): no [B, C, V]
    tensor is built."""
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    P, (B, C), head = prompt_ids.shape[1], completion_ids.shape, model.get_output_embeddings()
    step, tgt, per_tok = common.chunk_positions(head.weight.shape[0], chunk_mb), completion_ids.reshape(-1), []
    with common.autocast(model):
        h = common.decoder_hidden(model, ids, mask, pos)[:, P - 1:-1].reshape(B * C, -1)
        for s in range(0, B * C, step):
            p = torch.softmax(head(h[s:s + step]).float() / temperature, -1)
            py = p.gather(-1, tgt[s:s + step, None]).squeeze(-1)
            per_tok.append(1 - 2 * py + p.pow(2).sum(-1))
    return (torch.cat(per_tok).view(B, C) * completion_mask).sum(1)


class EWMA:
    """PPO-EWMA's proximal policy: a bias-corrected exponentially weighted average of the weights,
    avg_n = sum_j (1 - beta) beta^(n-j) theta_j / (1 - beta^n) over the n updates so far (theta_1 = the initial
    weights), kept in a frozen copy of the model."""

    def __init__(self, model, beta: float):
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.beta, self.norm = beta, 0.0
        self.sums = {k: torch.zeros_like(v) for k, v in model.state_dict().items() if v.is_floating_point()}
        self.update(model)

    @torch.no_grad()
    def update(self, model) -> None:
        state = model.state_dict()
        self.norm = self.beta * self.norm + (1 - self.beta)
        for k, s in self.sums.items():
            s.mul_(self.beta).add_(state[k].detach(), alpha=1 - self.beta)
        self.model.load_state_dict({k: s / self.norm for k, s in self.sums.items()}, strict=False)


def offpolicy_prepare(batch: dict, prox, args: Args, score_sq_fn=None) -> dict:
    """Per-batch quantities of the correction, from the proximal log-probs scored before the update.

    Returns per-row tensors for the loss (keep, seq_w, adv), scalars (eps_low/eps_high, staleness, lr_scale) and
    metrics (ESS of the untruncated sequence weights, quantiles of the token weights w).
    """
    behav, mask = batch["logprobs"], batch["completion_mask"].float()
    log_w = (prox - behav) * mask
    w_tok = log_w[mask.bool()].exp()
    q = torch.quantile(w_tok.double(), torch.tensor([0.5, 0.99], dtype=torch.float64)) if len(w_tok) else [1.0, 1.0]
    out = {"staleness": batch.get("staleness", 0), "lr_scale": 1.0,
           "metrics": {"offpolicy/ess_ratio": ess_ratio(seq_is_weights(prox, behav, mask)),
                       "offpolicy/w_q50": float(q[0]), "offpolicy/w_q99": float(q[1]),
                       "offpolicy/w_max": float(w_tok.max()) if len(w_tok) else 1.0}}
    if args.correction == "m2po-mask":
        out["keep"] = m2po_keep_mask(log_w, mask, args.m2_tau)
    elif args.correction == "m2po-clip":
        c = m2po_clip_level(log_w, batch["adv"], mask, args.m2_tau)
        out["eps_low"], out["eps_high"] = m2po_clip_range(c)
        out["metrics"]["offpolicy/m2po_clip_level"] = min(c, 100.0)
    elif args.correction == "vcpo":
        w = seq_is_weights(prox, behav, mask, args.is_cap)
        out["seq_w"], ess = w, ess_ratio(w)
        out["lr_scale"] = math.sqrt(min(1.0, ess))
        out["adv"] = opob_advantages(batch["rewards"].float(), w, score_sq_fn(), args.group_size, args.adv_std_norm)
        out["metrics"]["offpolicy/lr_scale"] = out["lr_scale"]
    return out


def correction_token_loss(logp, mb: dict, args: Args):
    """Per-token loss [b, C] of --correction and the per-token stats (clipped, masked) it reports."""
    c, behav, prox, adv = args.correction, mb["behav"], mb["old"], mb["adv"]
    zero = torch.zeros_like(logp)
    if c in ("plain", "recompute"):
        loss, clipped = clipped_pg_loss(logp, behav if c == "plain" else prox, adv, args.clip_eps_low,
                                        args.clip_eps_high)
        return loss, {"clipfrac": clipped, "maskfrac": zero}
    if c in ("decoupled", "decoupled-loglinear", "ppo-ewma"):
        if c == "decoupled-loglinear":
            prox = loglinear_prox(behav, logp.detach(), mb["staleness"])
        loss, clipped, masked = decoupled_pg_loss(logp, prox, behav, adv, args.clip_eps_low, args.clip_eps_high,
                                                  args.is_cap)
        return loss, {"clipfrac": clipped, "maskfrac": masked}
    if c == "vcpo":
        loss, clipped = clipped_pg_loss(logp, prox, adv, args.clip_eps_low, args.clip_eps_high)
        return mb["seq_w"].unsqueeze(1) * loss, {"clipfrac": clipped, "maskfrac": zero}
    if c == "m2po-mask":
        return m2po_mask_loss(logp, behav, adv, mb["keep"]), {"clipfrac": zero, "maskfrac": 1 - mb["keep"]}
    if c == "m2po-clip":
        loss, clipped = clipped_pg_loss(logp, behav, adv, mb["eps_low"], mb["eps_high"])
        return loss, {"clipfrac": clipped, "maskfrac": zero}
    if c == "double-sided":
        loss, masked = double_sided_loss(logp, behav, adv, args.clip_eps_low, args.clip_eps_high)
        return loss, {"clipfrac": zero, "maskfrac": masked}
    raise ValueError(f"unknown correction {c!r}")


def offpolicy_loss(logp, mb: dict, n_seqs: int, n_tokens: int, args: Args):
    """This micro-batch's share of J: the correction's per-token loss + kl_coef * k3 KL, aggregated over the step.

    logp [b, C] (with grad); mb holds old (= prox), behav (mu), ref (or None), adv [b], mask [b, C] and the
    correction's per-batch fields (offpolicy_prepare). Returns (loss, per-token stats).
    """
    tok_loss, stats = correction_token_loss(logp, mb, args)
    if mb["ref"] is not None:
        kl = k3_kl(logp, mb["ref"])
        tok_loss, stats["kl"] = tok_loss + args.kl_coef * kl, kl
    return aggregate_loss(tok_loss, mb["mask"], args.loss_agg, n_seqs, n_tokens, agg_const(args)), stats


# ---- rollout and update ----
def rollout(sampler, tok, task, args: Args, rng, device) -> dict:
    """Sample G completions for each of prompts_per_step training prompts; reward them; A_i per group."""
    examples = task.sample("train", args.prompts_per_step, rng)
    ro = common.generate(sampler, tok, common.encode_prompts(tok, [e.prompt for e in examples]), args.group_size,
                         args.max_new_tokens, args.temperature, args.top_p)
    per_row = lambda xs: [x for x in xs for _ in range(args.group_size)]  # noqa: E731
    total, terms = llm.Rewards(args.reward)(per_row([e.prompt for e in examples]), ro.texts,
                                            per_row([e.answer for e in examples]), task=task,
                                            completion_lengths=ro.completion_mask.sum(1).tolist(),
                                            max_new_tokens=args.max_new_tokens)
    rewards = torch.tensor(total, device=device)
    batch = {k: getattr(ro, k).to(device) for k in
             ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs")}
    batch.update(rewards=rewards, adv=group_advantages(rewards, args.group_size, args.adv_std_norm),
                 finish_reasons=ro.finish_reasons, reward_terms={  # each term's mean where it applies
                     f"reward/{k}": float(np.mean([v for v in vs if v is not None] or [0.0])) for k, vs in terms.items()})
    return batch


def grad_split_noise(model, first_half: list) -> float:
    """|g_a - g_b|^2 / |g_a + g_b|^2 for the gradients of two halves of a mini-batch (g_a saved, g_b = .grad - g_a):
    about 1 when the halves disagree as much as pure noise would, near 0 when they agree."""
    num = den = 0.0
    for p, ga in zip(model.parameters(), first_half):
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        num += float((2 * ga - g).pow(2).sum())
        den += float(g.pow(2).sum())
    return num / max(den, 1e-30)


def update(model, opt, batch: dict, loss_fn, args: Args, step: int, accel, sampler, ref_model=None,
           fused_logprob=None, prox_model=None) -> dict:
    """ppo_epochs x minibatches optimiser steps on one (stale) rollout batch (micro-batches accumulate gradients).

    Changed from grpo.py because the corrections need the whole batch before the first step: the proximal policy
    is always scored (the current weights, or prox_model: PPO-EWMA's copy), offpolicy_prepare computes the
    correction's per-batch quantities, and KL(mu || pi) is measured against the sampler's log-probs
    (rollout/logprob_mismatch is then mean |log pi - mu|: staleness plus any engine mismatch). Each mini-batch is
    accumulated in two halves whose gradients give the noise metric; VCPO's lr scale multiplies the lr that
    optimizer_step sets. No grpo sampler-trainer weight: mu, the behaviour policy of every correction, is the
    sampler's own log-probs (the sampler is refreshed after each optimiser step).
    """
    B = batch["completion_ids"].shape[0]
    micro = lambda idx: idx.split(args.micro_batch_size)  # noqa: E731
    logprobs_of = lambda m, idx, ent=False: common.token_logprobs(  # noqa: E731
        m, batch["prompt_ids"][idx], batch["prompt_mask"][idx], batch["completion_ids"][idx],
        batch["completion_mask"][idx], args.temperature, with_entropy=ent, fused_fn=fused_logprob)
    every, cmask = torch.arange(B), batch["completion_mask"].float()
    with torch.no_grad():
        cur = torch.cat([logprobs_of(model, i) for i in micro(every)])
        prox = cur if prox_model is None else torch.cat([logprobs_of(prox_model, i) for i in micro(every)])
        ref = torch.cat([logprobs_of(ref_model, i) for i in micro(every)]) if ref_model else None
    score_sq = lambda: torch.cat([seq_score_sq_norm(model, *(batch[k][i] for k in (  # noqa: E731
        "prompt_ids", "prompt_mask", "completion_ids", "completion_mask")), args.temperature) for i in micro(every)])
    prep = offpolicy_prepare(batch, prox, args, score_sq)
    d = cur - batch["logprobs"]  # log pi - log mu on the sampled tokens (mu sampled them)
    metrics = {**prep.pop("metrics"), "offpolicy/kl_mu_pi": common.masked_mean(d.exp() - d - 1, cmask).item(),
               "rollout/logprob_mismatch": common.masked_mean(d.abs(), cmask).item()}
    rows = {"adv": prep.pop("adv", batch["adv"]), "mask": cmask, "old": prox, "behav": batch["logprobs"], "ref": ref,
            **{k: prep.pop(k) for k in ("keep", "seq_w") if k in prep}}
    args = dataclasses.replace(args, lr=args.lr * prep["lr_scale"])  # VCPO: the lr optimizer_step sets (else x1)
    total = args.steps * args.ppo_epochs * args.minibatches
    stats = {"pg": 0.0, "entropy": 0.0, "grad_norm": 0.0, "grad_noise": 0.0}
    n_opt = 0
    for _ in range(args.ppo_epochs):
        for mb_idx in (torch.randperm(B) if args.minibatches > 1 else torch.arange(B)).chunk(args.minibatches):
            n_seqs, n_tokens = llm.step_counts(batch["completion_mask"][mb_idx], accel)
            opt.zero_grad(set_to_none=True)
            for h, half in enumerate(mb_idx.chunk(2)):
                for idx in micro(half):
                    logp, ent = logprobs_of(model, idx, True)
                    mb = {**{k: None if v is None else v[idx] for k, v in rows.items()}, **prep}
                    loss, token_stats = loss_fn(logp, mb, n_seqs, n_tokens, args)
                    loss.backward()  # a NaN here reaches every rank's gradient: optimizer_step stops them all
                    stats["pg"] += loss.item()
                    for k, v in {**token_stats, "entropy": ent}.items():
                        stats[k] = stats.get(k, 0.0) + common.masked_sum(v.detach(), mb["mask"]).item() / max(n_tokens, 1)
                if h == 0:
                    first = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
            stats["grad_noise"] += grad_split_noise(model, first)
            opt_step = (step - 1) * args.ppo_epochs * args.minibatches + n_opt  # derived: resume-safe
            stats["grad_norm"] += llm.optimizer_step(model, opt, args, opt_step, total, sampler)
            n_opt += 1
    return {**{f"loss/{k}": v / n_opt for k, v in stats.items()}, **metrics}


def offpolicy_summary(history: list[dict]) -> dict:
    """Run means of the off-policy metrics, and the correlation across updates of ESS/B with the gradient noise."""
    train = [h for h in history if "offpolicy/kl_mu_pi" in h]
    mean = lambda k: float(np.mean([h[k] for h in train if k in h])) if train else float("nan")  # noqa: E731
    out = {"staleness_mean": mean("offpolicy/staleness"), "kl_mu_pi": mean("offpolicy/kl_mu_pi"),
           "clipfrac": mean("loss/clipfrac"), "maskfrac": mean("loss/maskfrac"), "ess_ratio": mean("offpolicy/ess_ratio"),
           "grad_noise": mean("loss/grad_noise"), "w_q99": mean("offpolicy/w_q99"), "w_max": mean("offpolicy/w_max")}
    out["cut_frac"] = out["clipfrac"] + out["maskfrac"]
    ess, noise = (np.array([h[k] for h in train]) for k in ("offpolicy/ess_ratio", "loss/grad_noise"))
    if len(train) > 2 and ess.std() > 0 and noise.std() > 0:
        out["corr_ess_grad_noise"] = float(np.corrcoef(ess, noise)[0, 1])
    return out


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    run = llm.Run(args)  # accelerator, threads, seed, the task and its held-out sets, the run folder
    # sharded when several processes run; the sampler decodes (the trainer itself on CPU)
    model, tok, ref_model, sampler = llm.load_policy(args, run.accel, with_ref=args.kl_coef > 0)
    if args.sampler_is_cap > 0 and not sampler.is_trainer:
        raise SystemExit("--sampler-is-cap: the off-policy corrections take mu, the sampler's own log-probs, as the "
                         "behaviour policy, so its mismatch with the trainer is already in their ratios; grpo's weight "
                         "min(pi_old / pi_sampler, C) would count it twice: use --sampler-is-cap 0")
    ewma = EWMA(model, args.ewma_decay) if args.correction == "ppo-ewma" else None
    fused_logprob = None
    if args.kernels and run.accel.device.type == "cuda":  # Triton: the fused lm_head + log-softmax
        from kernels.fused_logprob import fused_linear_logprob as fused_logprob
    opt = llm.make_optimizer(model.parameters(), args)
    fifo = StaleFIFO(args.staleness, args.steps, args.gen_rate)  # the asynchronous pipeline, simulated

    def make(n: int) -> dict:  # rollout batch n, sampled by the current weights; its draws depend on (seed, n, rank)
        torch.manual_seed(hash((args.seed, n + 1, run.rank)) % 2**31)
        return rollout(sampler, tok, run.task, args, np.random.default_rng([args.seed, n + 1, run.rank]),
                       run.accel.device)

    run.start(model, tok, opt, sampler)  # the step-0 held-out evaluation (--resume is refused in check_args)
    for step, _ in run.steps():  # the draws of batch n are make(n)'s, those of the update seeded below
        with run.timer("gen"):
            batch = fifo.next_batch(step - 1, make)  # made by version batch["version"]; the trainer holds step - 1
        batch["staleness"] = step - 1 - batch["version"]
        torch.manual_seed(hash((args.seed, step, run.rank, 1)) % 2**31)  # mini-batch order
        with run.timer("train"):  # includes the sampler's refresh after each optimiser step
            stats = update(model, opt, batch, offpolicy_loss, args, step, run.accel, sampler, ref_model, fused_logprob,
                           ewma.model if ewma else None)
        if ewma is not None:
            ewma.update(model)
        metrics = run.log_step(step, batch, stats, extra={"offpolicy/staleness": batch["staleness"]})
        if run.is_main:
            run.bar.set_postfix(reward=f"{metrics['rollout/reward']:.2f}", kl=f"{stats['offpolicy/kl_mu_pi']:.3f}",
                                acc=f"{run.last('eval/acc'):.2f}")
    return run.finish(f"async GRPO {args.correction}, k={args.staleness}", extra=offpolicy_summary(run.history))


if __name__ == "__main__":
    main(tyro.cli(Args))
