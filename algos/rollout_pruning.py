"""ARRoL: GRPO whose groups are over-sampled, scored part-way by a learned quality head, and pruned to balance.

Paper: Hsu et al., "Prune as You Generate: Online Rollout Pruning for Faster and Better RLVR" (arrol, Accelerating
RLVR via online Rollout Pruning), arXiv:2603.24840. A lightweight quality head, trained on the fly, predicts from a
partial rollout whether it will succeed; rollouts are pruned early so that the survivors of a group are more
correctness-balanced (more groups with a learning signal), and only the survivors are finished and trained on.

Equations (each implemented by the function named on the right; the abstract gives no formulas, these are ours):
  partial rollouts  o_i,<=t ~ pi_theta( . | q), i = 1..G' = oversample * G, stopped after t = --prune-at tokens
  feature           h_i = the policy's last hidden state at the prefix's last token (decode position t), detached
                                                                                                   prefix_features
  quality head      p_i = sigmoid(f(h_i)), f linear (--head-hidden 0) or a 2-layer MLP             QualityHead
  head loss         L_head = -mean_i [y_i log p_i + (1 - y_i) log(1 - p_i)], y_i = clip(r_i, 0, 1) of each finished
                    survivor, on its prefix's h_i (before the policy update; --head-steps Adam steps)
                                                                                          head_bce_loss, train_head
  pruning           S = the floor(G/2) lowest p_i and the ceil(G/2) highest p_i of each group of G' (--prune-rule
                    balanced; random: G uniformly drawn, the control arm)                          select_survivors
  finishing         o_i = o_i,<=t + c_i, c_i ~ pi_theta( . | q, o_i,<=t) for i in S (one batched call)
                                                                                                 finish_survivors
  token count       N = sum_{i <= G'} |o_i,<=t| + sum_{i in S} |c_i|  (pruned prefixes counted)     pruned_rollout
  head quality      AUC = P(p_i > p_j | y_i = 1, y_j = 0) on the survivors, before the head sees them   head_auc
  group advantage   A_i = (r_i - mean_S r) / (std_S r + eps) over the G survivors             group_advantages
  clipped surrogate l_it = -min(rho_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) A_i)   clipped_pg_loss
  sampler != trainer l_it <- w_it l_it,  w_it = min(pi_old / pi_sampler, C)         truncated_is_weight

Parent: algos/grpo.py; changed: Args, Args.steps, check_args, rollout, main.

Deviations from the paper (its code was not released when this was written; each rule below is ours):
- Which survivors: the most-likely-wrong floor(G/2) and the most-likely-correct ceil(G/2) of the G' partial rollouts
  (select_survivors). For a calibrated head this maximises the expected spread of the survivors' rewards (the
  expected sample variance of independent Bernoulli rewards is the mean of p(1 - p) plus the spread of p), and with
  exact predictions it leaves the number of correct survivors as close to G/2 as any choice of G could (tested).
  Ties keep the lower index. --prune-rule random keeps G uniformly drawn partial rollouts: the same over-sampling and
  token cost without the head, the control that isolates the head's contribution.
- The feature is the final-norm hidden state at the prefix's last token (a rollout that stopped before t: at its
  EOS), from a separate no-grad forward of the trainer over prompt + prefix (counted as scoring, not generation:
  like the update's log-prob pass it generates nothing). The paper reads it inside the inference engine.
- The head trains on the survivors only (the pruned rollouts are never finished, so have no reward), with targets
  clip(r, 0, 1) (the 0/1 verifier by default), --head-steps full-batch Adam steps at --head-lr per rollout batch, on
  the features the batch was pruned with. It never sees a batch before pruning it: prune/head_auc is measured on
  data the head has not trained on. In the first batch the head is untrained (its random initial weights prune).
  Its Adam state is not checkpointed (a resumed run restarts the head's optimiser; the head's weights are saved).
- One pruning point per run (--prune-at tokens); the paper's engine may prune at several. A rollout that stopped
  before t is complete: it survives or is pruned like the others, and is not continued.
- The survivors are finished in one more generate call from prompt + prefix with the sampler's own weights (no update
  in between), so prefix and continuation are one on-policy sample and their behaviour log-probs are concatenated.
- Not implemented: the head weighting candidates at test time (best-of-n). Step-GRPO's Step-Aware Relative Reward (a
  redundancy penalty relative to the group, over semantic steps), an optional companion of truncated rollouts, is
  algos/step_grpo.py, on GRPO's full rollouts: it needs a task whose responses hold redundant steps, not pruning.
- --oversample 1 turns the method off: rollout is grpo.py's single generate call, no head, no feature pass; the run is
  grpo.py's, metric for metric (tested).
- One process only (several are refused): each rank would train its own head on its own survivors.

Commands:
  python algos/rollout_pruning.py                              # tiny default, 2-core CPU, about 2 minutes
  python algos/rollout_pruning.py --prune-rule random          # the control: over-sample and prune at random
  python algos/rollout_pruning.py --oversample 1               # = python algos/grpo.py --steps 100
  python algos/rollout_pruning.py --model tiny-sums --task sums --digits 1 --max-new-tokens 48 --prune-at 12 --steps 60
  python algos/rollout_pruning.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --device cuda \
      --max-new-tokens 512 --prune-at 128 --prompts-per-step 32 --lr 1e-6          # one GPU
Expected: the default (100 rollout batches of 32 prompts, G' = 16 partial rollouts of t = 1 token pruned to G = 8,
tiny-0.6m on 2-digit addition) takes held-out greedy accuracy from 38.8% to 54.8% (seed 0) and 53.8% (seed 1), one
thread, about 80 s each on a shared 2-core machine (two runs side by side). The head ranks fresh survivors with a
mean AUC of 0.61 / 0.63 (a weak but real signal one token in), 71.8% / 70.8% of the groups keep a non-zero advantage,
and 25,600 of the ~115,000 generated tokens are pruned prefixes. Against GRPO at an equal final group size (3 seeds
per arm, benchmarks/results/rollout_pruning.md, rows in benchmarks/results/rollout_pruning.csv): groups with a non-zero
advantage 71.1 +- 0.6% vs 69.4 +- 1.6% (random pruning from the same 16: 70.1 +- 0.9%), final accuracy 55.4 +- 2.0%
vs 52.9 +- 3.0% (random: 53.1 +- 2.2%), for 29% more generated tokens (115,225 vs 89,572): at this scale the head is
weak one token in, and the balance it buys is small and within the seed spread. On 23 fresh paired seeds of the
claims plan ARRoL ends at 51.9 +- 2.7% vs GRPO's 52.1 +- 2.5%, -0.2 +- 2.8 points per seed.
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
from algos._llm import LLMArgs


@dataclass
class Args(LLMArgs):
    """GRPO's flags and ARRoL's own: over-sampling, the pruning point and rule, the quality head; the plumbing flags
    are LLMArgs'."""
    steps: int = 100
    """rollout batches"""
    # rollout
    prompts_per_step: int = 32
    """distinct prompts per rollout batch (per process)"""
    group_size: int = 8
    """completions per prompt (G)"""
    reward: tuple[str, ...] = ("correct",)
    """reward terms NAME[:WEIGHT]: built-ins correct, format, length, or module:function (TRL's convention: prompts,
    completions, answers in; a float or None per completion out); the total is their weighted sum"""
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
    sampler_is_cap: float = 2.0
    """cap C of the truncated importance weight min(pi_old / pi_sampler, C) per token, applied when the sampler is
    not the trainer's computation (the bf16 sampler copy on CUDA, vLLM); 0 = off"""
    # optimisation
    ppo_epochs: int = 1
    """passes over each rollout batch"""
    minibatches: int = 1
    """optimiser steps per pass; the rollout batch is split into this many"""
    kernels: bool = False
    """use the Triton kernels (fused log-prob, fused clipped loss) when a GPU is present"""
    # online rollout pruning
    oversample: int = 2
    """G' = oversample * G partial rollouts per prompt, pruned to G at --prune-at tokens (1 = no pruning: grpo.py)"""
    prune_at: int = 1
    """pruning point t: tokens each partial rollout generates before the head scores it (< --max-new-tokens)"""
    prune_rule: Literal["balanced", "random"] = "balanced"
    """balanced: keep the floor(G/2) lowest and ceil(G/2) highest predicted successes; random: G at random (control)"""
    head_hidden: int = 0
    """quality head: 0 = a linear probe on the hidden state, N = a 2-layer MLP of width N"""
    head_lr: float = 1e-2
    """the quality head's Adam learning rate"""
    head_steps: int = 20
    """full-batch Adam steps of the head per rollout batch (BCE on the finished survivors)"""


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
    if args.oversample < 1:
        raise SystemExit(f"--oversample must be at least 1 (1 = no pruning), got {args.oversample}")
    if not 1 <= args.prune_at < args.max_new_tokens:
        raise SystemExit(f"--prune-at must be in 1..max_new_tokens - 1 ({args.max_new_tokens - 1}): the head scores a "
                         f"partial rollout, got {args.prune_at}")
    if args.head_hidden < 0 or args.head_steps < 0 or args.head_lr <= 0:
        raise SystemExit("--head-hidden and --head-steps must be >= 0 and --head-lr > 0")
    if args.oversample == 1 and args.prune_rule != "balanced":
        raise SystemExit("--prune-rule needs --oversample >= 2 (with 1 nothing is pruned)")


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


def truncated_is_weight(old_logp, sampler_logp, cap: float):
    """w_t = min(pi_old(o_t) / pi_sampler(o_t), C): corrects the update for samples drawn by another computation
    than the trainer's (truncated importance sampling, as verl's rollout correction); no gradient."""
    return torch.exp(old_logp - sampler_logp).clamp(max=cap).detach()


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


# ---- the idea: the quality head and the pruning rule ----
class QualityHead(torch.nn.Module):
    """p = sigmoid(f(h)): the predicted success of a partial rollout from the policy's hidden state h [B, H]; f is a
    linear probe (hidden = 0) or a 2-layer MLP. forward returns the logits f(h) [B]."""

    def __init__(self, dim: int, hidden: int = 0):
        super().__init__()
        self.f = torch.nn.Linear(dim, 1) if hidden == 0 else torch.nn.Sequential(
            torch.nn.Linear(dim, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.f(h).squeeze(-1)


def head_bce_loss(head: QualityHead, feats: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """L_head = -mean[y log p + (1 - y) log(1 - p)], p = sigmoid(head(h)); feats [B, H] (detached), targets [B] in
    [0, 1]."""
    return torch.nn.functional.binary_cross_entropy_with_logits(head(feats), targets)


def train_head(head: QualityHead, opt, feats: torch.Tensor, targets: torch.Tensor, steps: int) -> tuple[float, float]:
    """`steps` full-batch Adam steps of L_head on one batch of finished survivors; (loss before, loss after)."""
    feats, targets = feats.detach().float(), targets.detach().float().clamp(0, 1)
    with torch.no_grad():
        before = float(head_bce_loss(head, feats, targets))
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = head_bce_loss(head, feats, targets)
        loss.backward()
        opt.step()
    with torch.no_grad():
        return before, float(head_bce_loss(head, feats, targets))


def head_auc(p: torch.Tensor, y: torch.Tensor) -> float:
    """P(p_i > p_j | y_i = 1, y_j = 0), ties counting one half (the Mann-Whitney statistic); nan without both classes."""
    pos, neg = p[y > 0.5], p[y <= 0.5]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0).float() + 0.5 * (diff == 0).float()).mean())


def select_survivors(probs: torch.Tensor, keep: int, rule: str = "balanced", rng=None) -> torch.Tensor:
    """Which partial rollouts of each group survive: probs [n, G'] predicted successes -> indices [n, keep] into each
    group, ascending. balanced: the floor(keep/2) lowest and the ceil(keep/2) highest p (ties: the lower index first
    in the order, a stable sort); random: `keep` drawn uniformly without replacement with the numpy generator rng."""
    n, width = probs.shape
    if not 1 <= keep <= width:
        raise ValueError(f"cannot keep {keep} of a group of {width}")
    if rule == "random":
        picks = [np.sort(rng.permutation(width)[:keep]) for _ in range(n)]
        return torch.as_tensor(np.stack(picks), dtype=torch.long, device=probs.device)
    if rule != "balanced":
        raise ValueError(f"unknown pruning rule {rule!r}")
    order = torch.sort(probs, dim=1, stable=True).indices  # ascending p
    low, high = keep // 2, keep - keep // 2
    return torch.cat([order[:, :low], order[:, width - high:]], 1).sort(1).values


@torch.no_grad()
def prefix_features(model, prompt_ids, prompt_mask, completion_ids, completion_mask, micro: int = 256) -> torch.Tensor:
    """h_i: the policy's final-norm hidden state at each prefix's last token (decode position t, or the EOS of a
    rollout that stopped earlier), [B, H] in fp32, from a no-grad forward over prompt + prefix in micro-batches."""
    out = []
    for s in range(0, prompt_ids.shape[0], micro):
        sl = slice(s, s + micro)
        ids = torch.cat([prompt_ids[sl], completion_ids[sl]], 1)
        mask = torch.cat([prompt_mask[sl], completion_mask[sl]], 1)
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        with common.autocast(model):
            h = common.decoder_hidden(model, ids, mask, pos)
        last = prompt_ids.shape[1] + completion_mask[sl].sum(1) - 1
        out.append(h[torch.arange(h.shape[0], device=h.device), last].float())
    return torch.cat(out)


def finish_survivors(sampler, tok, pre, rows: list[int], args: Args) -> common.Rollout:
    """The survivors' full rollouts: each prefix that did not stop is continued by the policy from prompt + prefix
    (one batched call, the budget max_new_tokens - t); prefix and continuation (and their behaviour log-probs) are
    concatenated. Returns a Rollout of len(rows) rows in the order of `rows`."""
    budget, pad = args.max_new_tokens - args.prune_at, tok.pad_token_id
    go = [i for i in rows if pre.finish_reasons[i] == "length"]
    cont = None
    if go:
        prompts = [pre.prompt_ids[i][pre.prompt_mask[i].bool()].tolist() + pre.completion_ids[i].tolist() for i in go]
        cont = common.generate(sampler, tok, prompts, 1, budget, args.temperature, args.top_p)
    where = {i: j for j, i in enumerate(go)}
    ids, lps, reasons = [], [], []
    for i in rows:
        n = int(pre.completion_mask[i].sum())
        c_ids, c_lp = pre.completion_ids[i, :n], pre.logprobs[i, :n]
        if i in where:
            j = where[i]
            m = int(cont.completion_mask[j].sum())
            c_ids = torch.cat([c_ids, cont.completion_ids[j, :m].to(c_ids.device)])
            c_lp = torch.cat([c_lp, cont.logprobs[j, :m].to(c_lp.device)])
        ids.append(c_ids)
        lps.append(c_lp)
        reasons.append(cont.finish_reasons[where[i]] if i in where else pre.finish_reasons[i])
    C = max(len(x) for x in ids)
    right = lambda xs, v: torch.stack([torch.nn.functional.pad(x, (0, C - len(x)), value=v) for x in xs])  # noqa: E731
    comp, cmask = right(ids, pad), right([torch.ones_like(x) for x in ids], 0)
    return common.Rollout(pre.prompt_ids[rows], pre.prompt_mask[rows], comp, cmask, right(lps, 0.0), reasons,
                          tok.batch_decode(comp, skip_special_tokens=True))


def pruned_rollout(sampler, tok, prompts: list[list[int]], head: QualityHead, args: Args, rng):
    """G' partial rollouts per prompt up to t tokens, p_i from the head, G survivors per group, finished. Returns
    (the survivors' Rollout, group-major like grpo's; their features [B, H]; statistics: the pruned prefixes' tokens,
    the mean p of all partial rollouts and of the survivors)."""
    G, Gp = args.group_size, args.group_size * args.oversample
    pre = common.generate(sampler, tok, prompts, Gp, args.prune_at, args.temperature, args.top_p)
    feats = prefix_features(sampler.model, pre.prompt_ids, pre.prompt_mask, pre.completion_ids,
                            pre.completion_mask, args.micro_batch_size)
    with torch.no_grad():
        probs = torch.sigmoid(head(feats)).view(len(prompts), Gp)
    keep = select_survivors(probs, G, args.prune_rule, rng)
    rows = (torch.arange(len(prompts), device=keep.device)[:, None] * Gp + keep).flatten().tolist()
    kept = torch.zeros(len(prompts) * Gp, dtype=torch.bool, device=pre.completion_mask.device)
    kept[rows] = True
    stats = {"pruned_tokens": int(pre.completion_mask[~kept].sum()), "pred_all": float(probs.mean()),
             "pred_kept": float(probs.flatten()[rows].mean()), "kept_probs": probs.flatten()[rows].cpu()}
    return finish_survivors(sampler, tok, pre, rows, args), feats[rows], stats


# ---- rollout and update ----
def rollout(sampler, tok, task, args: Args, rng, device, head: QualityHead | None = None) -> dict:
    """Sample G completions for each of prompts_per_step training prompts; reward them; A_i per group. With a head
    (--oversample >= 2) the G are the survivors of G' partial rollouts (pruned_rollout), and the batch also carries
    their features and the pruning statistics; without one this is grpo.py's rollout."""
    examples = task.sample("train", args.prompts_per_step, rng)
    prompts, prune = common.encode_prompts(tok, [e.prompt for e in examples]), None
    if head is None:
        ro = common.generate(sampler, tok, prompts, args.group_size, args.max_new_tokens, args.temperature, args.top_p)
    else:
        ro, feats, prune = pruned_rollout(sampler, tok, prompts, head, args, rng)
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
    if prune is not None:
        batch.update(features=feats, prune=prune)
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
    correct = args.sampler_is_cap > 0 and not sampler.is_trainer  # the sampler is another computation
    sums, n_opt, grad_norm = {}, 0, 0.0  # sums: this rank's share of each logged mean, summed over ranks below
    total = args.steps * args.ppo_epochs * args.minibatches
    for epoch in range(args.ppo_epochs):
        for mb_idx in (torch.randperm(B) if args.minibatches > 1 else torch.arange(B)).chunk(args.minibatches):
            n_seqs, n_tokens = llm.step_counts(mask[mb_idx], accel)
            opt.zero_grad(set_to_none=True)
            for idx in micro(mb_idx):
                logp, ent = logprobs_of(model, idx, True)
                mb = {"adv": batch["adv"][idx], "mask": mask[idx].float(),
                      "old": logp.detach() if old is None else old[idx], "ref": None if ref is None else ref[idx]}
                mb["is_weight"] = truncated_is_weight(mb["old"], batch["logprobs"][idx], args.sampler_is_cap) \
                    if correct else None
                loss, token_stats = loss_fn(logp, mb, n_seqs, n_tokens, args)
                loss.backward()  # a NaN here reaches every rank's gradient: optimizer_step stops them all
                for k, v in {"pg": loss.item(), **{k: common.masked_sum(v.detach(), mb["mask"]).item() / max(
                        n_tokens, 1) for k, v in {**token_stats, "entropy": ent}.items()}}.items():
                    sums[k] = sums.get(k, 0.0) + v
                if epoch == 0:  # every token once, on the sampler's weights (pi_old)
                    for k, v in sampler_gap(mb["old"], batch["logprobs"][idx], mb["is_weight"], mb["mask"],
                                            args.sampler_is_cap).items():
                        sums[k] = sums.get(k, 0.0) + v
            opt_step = (step - 1) * args.ppo_epochs * args.minibatches + n_opt  # derived: resume-safe
            grad_norm += llm.optimizer_step(model, opt, args, opt_step, total, sampler)
            n_opt += 1
    tot = llm.all_ranks_sum(sums, accel, mask.device)
    out = {**{f"loss/{k}": v / n_opt for k, v in tot.items() if not k.startswith("gap/")},
           "loss/grad_norm": grad_norm / n_opt, "rollout/logprob_mismatch": tot["gap/sum"] / max(tot["gap/tokens"], 1)}
    if correct:
        out.update({"rollout/is_weight_mean": tot["gap/is_w"] / max(tot["gap/tokens"], 1),
                    "rollout/is_truncated_frac": tot["gap/is_cut"] / max(tot["gap/tokens"], 1)})
    return out


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    run = llm.Run(args)  # accelerator, threads, seed, the task and its held-out sets, the run folder
    if run.accel.num_processes > 1:  # each rank would train its own head on its own survivors
        raise SystemExit("rollout_pruning.py runs in one process: each rank would train a different quality head")
    model, tok, ref_model, sampler = llm.load_policy(args, run.accel, with_ref=args.kl_coef > 0)
    use_kernels = args.kernels and run.accel.device.type == "cuda"
    fused_logprob = None
    if use_kernels:  # Triton: the fused lm_head + log-softmax (the loss kernel is in kernel_grpo_loss)
        from kernels.fused_logprob import fused_linear_logprob as fused_logprob
    loss_fn = kernel_grpo_loss if use_kernels else grpo_loss
    opt = llm.make_optimizer(model.parameters(), args)
    head = head_opt = None
    if args.oversample > 1:  # the quality head on the policy's hidden state (--oversample 1: grpo.py, no head)
        head = QualityHead(model.config.hidden_size, args.head_hidden).to(run.accel.device)
        head_opt = torch.optim.Adam(head.parameters(), lr=args.head_lr)
    run.start(model, tok, opt, sampler, extra={"quality_head": head} if head is not None else None,
              counters={"pruned_tokens": 0})  # resume (the head's weights too), then the step-0 evaluation
    for step, rng in run.steps():  # every random draw of a step depends on (seed, step, rank) only
        with run.timer("gen"):  # partial rollouts, the head's scores, pruning and the survivors' continuations
            batch = rollout(sampler, tok, run.task, args, rng, run.accel.device, head)
        with run.timer("train"):  # includes the sampler's refresh after each optimiser step
            stats = update(model, opt, batch, loss_fn, args, step, run.accel, sampler, ref_model, fused_logprob)
        r = batch["rewards"].view(-1, args.group_size)
        extra = {"rollout/group_reward_std": r.std(1).mean().item()}
        if head is not None:  # score the head on survivors it has not seen, then train it on them
            pr = batch["prune"]
            with run.timer("head"):
                before, after = train_head(head, head_opt, batch["features"], batch["rewards"], args.head_steps)
            extra.update({"prune/head_auc": head_auc(pr["kept_probs"], batch["rewards"].cpu()),
                          "prune/head_loss": before, "prune/head_loss_after": after, "prune/pred_all": pr["pred_all"],
                          "prune/pred_kept": pr["pred_kept"], "prune/pruned_tokens": pr["pruned_tokens"]})
            run.gen_tokens += pr["pruned_tokens"]  # log_step adds the survivors' own tokens
            run.counters["pruned_tokens"] += pr["pruned_tokens"]
        run.log_step(step, batch, stats, extra)  # rollout metrics, evaluation every --eval-every, checkpoints
    hist = [h for h in run.history if "rollout/group_reward_std" in h]
    aucs = [h["prune/head_auc"] for h in hist if h.get("prune/head_auc", float("nan")) == h.get("prune/head_auc")]
    return run.finish("ARRoL" if head is not None else "GRPO", {
        "pruned_tokens": run.counters["pruned_tokens"],
        "group_reward_std": float(np.mean([h["rollout/group_reward_std"] for h in hist])),
        "nonzero_adv_group_frac": float(np.mean([1 - h["rollout/zero_var_group_frac"] for h in hist])),
        "head_auc": float(np.mean(aucs)) if aucs else float("nan")})


if __name__ == "__main__":
    main(tyro.cli(Args))
