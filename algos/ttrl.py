"""TTRL, DARE and ECHO: test-time RL without labels, GRPO trained on rewards the group of completions votes for itself.

Papers: Zuo et al., "TTRL: Test-Time Reinforcement Learning", arXiv:2504.16084 (majority-vote pseudo-labels), and
Du, Huang and Li, "Distribution-Aware Reward Estimation for Test-Time Reinforcement Learning" (DARE),
arXiv:2601.21804 (a reward from the group's whole answer distribution, an exploration bonus, distribution pruning);
Zhao et al., "ECHO: Entropy-Confidence Hybrid Optimization for Test-Time Reinforcement Learning", arXiv:2602.02150
(tree rollouts whose branch width follows local entropy and group confidence, online confidence pruning,
confidence-adaptive clipping, entropy-confidence hybrid advantage shaping), with --rollout tree-echo.
The policy trains on unlabelled prompts: each group of G completions votes on its own answers, and the reference
answer never enters the reward. grpo.py's advantage, clipped loss and update are kept (tree-echo adds a clip range
per completion and a weight per token).

Equations (each implemented by the function named on the right), for one prompt and its G completions o_1..o_G,
a_i = the final answer o_i commits to (the task's parser, no reference; None when it gives none):
  answer            a_i = parse(o_i)                                                    answer_of
  majority vote     y^ = argmax_a n(a),  n(a) = #{i: a_i = a}; ties go to the answer sampled first   majority_vote
  TTRL reward       r_i = 1[a_i = y^]  (all 0 when no completion gives an answer)      majority_rewards
  DARE, pruning     K = {a : n(a) / G >= tau}: answers rarer than tau are dropped as noise (reward 0)
  DARE, reward      p~(a) = n(a) / sum_{b in K} n(b)  for a in K (the pruned, renormalised distribution)
                    r_i = p~(a_i) + beta c_i 1[a_i in K, n(a_i) < max_b n(b)]  (a_i in K; else 0)
                    c_i = exp(mean_t log pi_sampler(o_it)): the completion's confidence     dare_rewards
  either arm        --reward-mode majority | dare                                      pseudo_rewards
  group advantage   A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)              group_advantages
  clipped surrogate, aggregation, sampler correction: grpo.py's (grpo_loss, truncated_is_weight, update)
  ECHO tree         --chains chains per prompt, then rounds: each tree short of G unpruned leaves draws w continuations
                    from its highest-entropy legal point (j, p) (resampling y_p)    grow_trees, round_requests
  token statistics  H_t = entropy of pi(. | q, y_<t), C_t = mean of its conf_top_k largest probabilities,
                    C^G_t = mean of C over the path's last W = --conf-window tokens    sample_segments, window_mean
  branch width      w = clip(floor(1 + alpha (H_p - H_lo) / (H_hi - H_lo) - beta (C^G_p - c_0) / c_0 + 1/2), 1, w_max),
                    at most the leaves the tree lacks; --rollout tree-entropy: beta = 0     branch_width
  pruning           a leaf ends at the first t of its own segment where C^G < tau held at the last --prune-patience
                    positions of its path; it leaves the group (its tokens still count as sampled), is not branched
                    from, and the tree grows until it has G unpruned leaves (at most G pruned)   prune_point
  effective branches  distinct unpruned leaf token sequences per tree (logged, as is root_share)  effective_branches
  adaptive clip     eps_i = eps_min + (eps_max - eps_min) sigmoid(kappa (1 - C_tail,i)), C_tail,i = mean C_t over the
                    last 16 tokens of completion i; eps_min, eps_max, kappa = 0.05, 0.2, 4      adaptive_clip
  hybrid shaping    A_it = A_i w_t, w_t = 1 + a clamp(z(H_t) + z(1 - C_t), -2, 2), z standardised over the batch's
                    completion tokens; a = --shape-coef (a token-loss weight, > 0 since 2a < 1)   hybrid_weight
  logged only       label accuracy 1[y^ = y*] and wrong-majority rate 1[y^ != None, y^ != y*] per prompt, with
                    y* the reference answer, which is read only here (never by the reward)   label_stats

Parent: algos/grpo.py; changed: Args, Args.model, Args.lr, Args.steps, check_args, grpo_loss, kernel_grpo_loss,
  rollout, update, main.

Deviations from the papers (DARE's abstract gives no formulas and its code was not found; every rule below is this
file's choice, kept simple and stated):
- Training prompts are the task's held-out split (--train-split test), the papers' setting: test-time RL adapts on
  the unlabelled problems it is then scored on, so held-out accuracy here is transductive (the fixed evaluation set
  is drawn from the same split the policy trains on, without its answers). --train-split train trains on the
  training split instead and makes held-out accuracy a generalisation figure. eval/acc_hard (one digit more) stays
  out of distribution either way.
- The vote and the reward use the same G completions; TTRL's released recipe votes over 64 samples and trains on 32.
- Answers are compared as the parser's strings (exact match: what the arithmetic verifier does); on real data two
  forms of one number ("1/2", "0.5") vote apart, where a math-equivalence grouping would merge them.
- Ties in the vote go to the answer sampled first in the group (collections.Counter.most_common keeps first-seen
  order among equal counts); sampling order is random, so this is a random tie-break. A group in which no completion
  gives an answer has no pseudo-label: all rewards 0 (no gradient).
- DARE's distribution reward is the answer's share among the kept answers, p~(a_i); its pruning drops answers whose
  share of the group is below tau = --prune-threshold = 0.2 (with G = 8, the answers seen once), which then get
  reward 0 like completions without an answer; its exploration bonus goes to kept answers below the top count (every
  answer tied for the top is "majority" and gets none: DARE's reward does not depend on the sampling order) and is
  beta = --explore-bonus = 0.5 times the completion's confidence c_i, the geometric-mean probability of its tokens under
  the sampler. The paper's figure says the bonus favours low-uncertainty non-majority rollouts; the exact weighting,
  tau and beta are not in the abstract. --prune-threshold 0 --explore-bonus 0 leaves the bare distribution reward.
- The defaults are tiny-5m and lr 1e-5, not grpo.py's tiny-0.6m and 1e-4: tiny-0.6m's group vote is right on only
  about 40% of held-out prompts, so the vote teaches wrong answers (held-out accuracy 39% -> 14% in 20 batches at
  1e-4, seed 0), and tiny-5m (vote right on about 73%) also locks in at 3e-5 and above.
- ECHO (--rollout tree-echo) follows the rules of its released code (a vLLM rollout and verl trainer) with these
  choices: a tree grows from --chains = 2 chains by rounds of one branch point per tree (the code branches one chain
  once at its first point past the gates, then tops the group up with independent samples); the point is the tree's
  highest-entropy legal token (the code's gates, entropy >= 3.5 nats, a rising entropy and min depth 4, do not fit
  3-token answers); the token at the point is resampled from pi (the code forces distinct top tokens). Token
  confidence is the paper's mean top-k probability with k = 1 (the code's rollout uses DeepConf's -mean log top-k
  probability, its trainer the mean of the top 5 probabilities, at most 1/5); H_lo, H_hi, c_0, tau = 0.1, 1.0, 0.8,
  0.7 are set for tiny-5m on `add` (its token entropies: median 0.04 nats, 90th percentile 0.8), W = 2 and
  patience 2 (the code: windows of 4 and 8, pruning at a running minimum below its threshold, plus tail-decline
  and entropy-spike rules, left out here). A pruned leaf leaves the group and the tree grows another (the code keeps
  it truncated in the group with a penalty term, and tops groups up with independent samples). The shaping's
  multiplicative form and a = 0.1, s_max = 2 are the code's defaults (its additive form is off there too). Tokens
  a pruned leaf would sample after its cut, and those past a row's budget, are generated by the batched call but not
  counted as sampled (--token-budget counts sampled tokens).
  With the default single on-policy pass the ratio is 1, so the adaptive clip binds only with --ppo-epochs or
  --minibatches above 1. --rollout tree-entropy is the control: the same trees, width from entropy alone, no
  pruning, grpo.py's update. --chains G is the group rollout (same draws; tests/test_ttrl.py checks it).
- The reference answer is read once per batch, after the rewards are made, for the logged ttrl/ figures only:
  ttrl/label_acc (pseudo-label accuracy), ttrl/wrong_majority (prompts whose vote is a wrong answer), ttrl/locked_wrong
  (a wrong vote held by at least 3/4 of the group: the group has converged on it), ttrl/true_reward (the fraction of
  completions that are right). tests/test_ttrl.py plants a wrong answer key and checks that rewards and advantages
  do not change.
- Everything else is grpo.py's (unbiased std, seq-mean loss, the truncated importance weight when the sampler is not
  the trainer, FSDP2 sharding). grpo.py's --reward (verifier terms) is not a flag here: the reward is the vote.

Commands:
  python algos/ttrl.py                                          # TTRL, tiny default, 2-core CPU
  python algos/ttrl.py --reward-mode dare                       # DARE
  python algos/ttrl.py --train-split train                      # unlabelled training prompts, held-out eval
  python algos/ttrl.py --rollout tree-echo                      # ECHO's trees and update (tree-entropy: control)
  python algos/ttrl.py --model Qwen/Qwen2.5-Math-1.5B --task gsm8k --engine vllm --device cuda \
      --max-new-tokens 512 --prompts-per-step 32 --group-size 16 --lr 1e-6 --reward-mode dare   # one GPU
  accelerate launch --multi_gpu --num_processes 2 algos/ttrl.py --device cpu --threads 1   # 2 CPU processes
Expected: `python algos/ttrl.py` (TTRL, tiny-5m, lr 1e-5, 60 rollout batches; about 100 s on one thread) takes
held-out greedy accuracy on 2-digit addition from 71.2% to 72.8% (seed 0) and 73.6% (seed 1) without a label, while
pass@8 falls (95 -> 89%, 92 -> 87%: the policy sharpens onto its vote). The gain is small: the vote it learns to agree
with is right on only about 73% of prompts at the start. benchmarks/results/ttrl.md (300 held-out prompts, 3 seeds):
TTRL 70.3% -> 72.7 +- 1.2%, its vote wrong on 27.3 +- 1.7% of the prompts of the first 10 batches and 31.5 +- 1.0% of
the last 10; DARE at the same lr ends at 67.8 +- 6.7%. At lr 3e-5 both lock onto wrong answers: TTRL ends at
45.8 +- 14.1% with a wrong vote on 54.0 +- 9.4% of prompts, DARE at 52.0 +- 7.1% and 46.2 +- 8.0%: DARE's way, but 3
seeds decide neither accuracy nor lock-in (the claims rows are underpowered: 27 to 259 seeds per arm would give 80%
power). Rows in benchmarks/results/ttrl.csv. ECHO (benchmarks/results/ttrl_echo.md, 3 seeds, 12,000 sampled tokens per
run): its trees and entropy-only trees keep the same 2.10 distinct leaves of 8 per tree, with 54% of the leaves under
one of the 2 chains in both (3-token answers leave no collapse to prevent), and end at 70.3 +- 2.6% and 70.7 +- 5.4%.
"""
from __future__ import annotations

import math
import sys
from collections import Counter
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
    """GRPO's flags less --reward (the reward is the group's vote) and test-time RL's own: the arm, the prompts it
    trains on, DARE's pruning threshold and exploration bonus."""
    # rollout
    prompts_per_step: int = 32
    """distinct prompts per rollout batch (per process)"""
    group_size: int = 8
    """completions per prompt (G)"""
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
    model: str = "tiny-5m"
    """tiny-5m (its group vote is right on about 73% of held-out prompts; tiny-0.6m's on about 40%, and a vote that is
    mostly wrong teaches wrong answers), tiny-0.6m, tiny-sums, smollm2-135m, a Hugging Face id or a local path"""
    lr: float = 1e-5
    """peak learning rate (AdamW); the vote's errors are reinforced too: tiny-5m loses accuracy at 3e-5 and above"""
    steps: int = 60
    """rollout batches"""
    # test-time RL
    reward_mode: Literal["majority", "dare"] = "majority"
    """majority: TTRL's 0/1 reward for agreeing with the group's majority answer; dare: DARE's reward from the
    group's pruned answer distribution plus an exploration bonus"""
    train_split: Literal["test", "train"] = "test"
    """the unlabelled prompts trained on: test = the held-out split itself (test-time RL), train = the training split"""
    prune_threshold: float = 0.2
    """DARE's distribution pruning: answers whose share of the group is below this get reward 0 (0 = keep all)"""
    explore_bonus: float = 0.5
    """DARE's exploration bonus: beta times the completion's confidence, for kept answers below the top count"""
    token_budget: int = 0
    """stop once this many tokens have been sampled (all ranks; a tree's shared prefixes once); 0 = --steps batches"""
    # ECHO's tree rollout and update
    rollout: Literal["group", "tree-echo", "tree-entropy"] = "group"
    """group: G independent completions per prompt; tree-echo: ECHO's trees (width from entropy and group confidence,
    confidence pruning, adaptive clip, hybrid advantage shaping); tree-entropy: width from entropy alone, no pruning"""
    chains: int = 2
    """tree rollouts: independent chains per prompt; branching grows each tree to G (unpruned) leaves (G: none)"""
    width_max: int = 4
    """tree rollouts: most continuations drawn from one branch point (w_max)"""
    width_entropy_coef: float = 2.0
    """tree rollouts: alpha, the width added from entropy_low to entropy_high"""
    width_conf_coef: float = 1.0
    """tree-echo: beta, the width removed per relative unit of group confidence above branch_conf"""
    entropy_low: float = 0.1
    """tree rollouts: H_lo (nats), the entropy at which the width is 1"""
    entropy_high: float = 1.0
    """tree rollouts: H_hi (nats), the entropy at which the width is 1 + alpha"""
    branch_conf: float = 0.8
    """tree-echo: c_0, the group confidence at which the confidence term is 0"""
    conf_top_k: int = 1
    """token confidence C_t = mean probability of the k most likely next tokens (1: the top token's probability)"""
    conf_window: int = 2
    """tree-echo: W, tokens in the group-confidence window C^G_t (the path's last W tokens up to t)"""
    prune_conf: float = 0.7
    """tree-echo: a leaf is ended where C^G_t stays below this for prune_patience tokens in a row (0 = no pruning)"""
    prune_patience: int = 2
    """tree-echo: consecutive low-confidence tokens that end a leaf"""
    adaptive_clip: bool = True
    """tree-echo: per-completion clip range from its tail confidence (replaces --clip-eps-low/high)"""
    shape_coef: float = 0.1
    """tree-echo: a, the hybrid advantage shaping A_i (1 + a S_t); 0 = off"""


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
    if args.reward_mode not in ("majority", "dare"):
        raise SystemExit(f"--reward-mode must be majority or dare, got {args.reward_mode!r}")
    if args.train_split not in ("test", "train"):
        raise SystemExit(f"--train-split must be test or train, got {args.train_split!r}")
    if not 0.0 <= args.prune_threshold <= 1.0:
        raise SystemExit(f"--prune-threshold is a share of the group, in [0, 1]; got {args.prune_threshold}")
    if not (args.explore_bonus >= 0 and math.isfinite(args.explore_bonus)):
        raise SystemExit(f"--explore-bonus must be a finite number >= 0, got {args.explore_bonus}")
    check_tree_args(args)


def check_tree_args(args: Args) -> None:
    """The tree rollout's flags (check_args' second half)."""
    if args.rollout not in ("group", "tree-echo", "tree-entropy"):
        raise SystemExit(f"--rollout must be group, tree-echo or tree-entropy, got {args.rollout!r}")
    if args.token_budget < 0:
        raise SystemExit(f"--token-budget must be >= 0, got {args.token_budget}")
    if not 1 <= args.chains <= args.group_size:
        raise SystemExit(f"--chains must be in [1, --group-size], got {args.chains}")
    if args.width_max < 1 or args.conf_top_k < 1 or args.conf_window < 1 or args.prune_patience < 1:
        raise SystemExit("--width-max, --conf-top-k, --conf-window and --prune-patience must be >= 1")
    if not args.entropy_high > args.entropy_low >= 0:
        raise SystemExit(f"need --entropy-high > --entropy-low >= 0, got {args.entropy_low}, {args.entropy_high}")
    if not (0 < args.branch_conf <= 1 and 0 <= args.prune_conf <= 1):
        raise SystemExit("--branch-conf must be in (0, 1] and --prune-conf in [0, 1]")
    if args.width_entropy_coef < 0 or args.width_conf_coef < 0:
        raise SystemExit("--width-entropy-coef and --width-conf-coef must be >= 0")
    if not 0 <= args.shape_coef * SHAPE_CLAMP < 1:
        raise SystemExit(f"--shape-coef must be in [0, {1 / SHAPE_CLAMP}) so that every token's weight stays positive")


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
    eps = mb.get("clip_eps")  # ECHO's adaptive clip: each completion's own range [b, 1]
    tok_loss, clipped = clipped_pg_loss(logp, mb["old"], mb["adv"], args.clip_eps_low if eps is None else eps,
                                        args.clip_eps_high if eps is None else eps)
    if mb.get("is_weight") is not None:  # the sampler is not the trainer: truncated importance weight per token
        tok_loss = tok_loss * mb["is_weight"]
    if mb.get("tok_weight") is not None:  # ECHO's hybrid advantage shaping: A_i w_t, w_t > 0
        tok_loss = tok_loss * mb["tok_weight"]
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

    if any(mb.get(k) is not None for k in ("is_weight", "tok_weight", "clip_eps")):  # the kernel has no per-token
        return grpo_loss(logp, mb, n_seqs, n_tokens, args)  # weight nor per-sequence clip: the reference path
    mask = mb["mask"]
    loss, kst = fused(logp, mb["old"], mb["adv"], mask, args.clip_eps_low, args.clip_eps_high, ref_logp=mb["ref"],
                      beta=args.kl_coef, reduction="seq_mean" if args.loss_agg == "seq-mean" else "token_mean")
    mb_tokens = float(mask.sum())
    scale = {"seq-mean": mask.shape[0] / n_seqs, "token-mean": mb_tokens / max(n_tokens, 1),
             "const": mb_tokens / (n_seqs * agg_const(args))}[args.loss_agg]
    return loss * scale, {"clipfrac": torch.full_like(mask, float(kst["clip_frac"]))}  # micro-batch mean


# ---- the idea: rewards voted by the group, no labels ----
LOCKED_SHARE = 0.75  # ttrl/locked_wrong: a wrong vote held by at least this share of the group


def answer_of(task, response: str) -> str | None:
    """a_i: the final answer a completion commits to, read by the task's own parser without any reference answer
    (stripped); None when it gives none."""
    a = task.parse(response)
    a = a.strip() if isinstance(a, str) else None
    return a or None


def majority_vote(answers: list) -> str | None:
    """y^ = the most frequent answer among those given (None ignored); a tie goes to the one sampled first
    (Counter.most_common keeps first-seen order among equal counts); None when no completion gives an answer."""
    counts = Counter(a for a in answers if a is not None)
    return counts.most_common(1)[0][0] if counts else None


def majority_rewards(answers: list) -> list[float]:
    """TTRL: r_i = 1 when a_i is the group's majority answer, else 0 (all 0 when there is no majority answer)."""
    y = majority_vote(answers)
    return [float(y is not None and a == y) for a in answers]


def dare_rewards(answers: list, confidence: list[float], prune: float, bonus: float) -> list[float]:
    """DARE, one group: answers with share n(a) / G below `prune` are dropped (reward 0, as no answer); a kept answer
    gets its share of the kept ones, p~(a) = n(a) / sum_{b kept} n(b), plus bonus * c_i when its count is below the
    top count (a non-majority answer; answers tied at the top all count as majority). c_i in [0, 1]: the confidence."""
    g, counts = len(answers), Counter(a for a in answers if a is not None)
    kept = {a: n for a, n in counts.items() if n / g >= prune}
    if not kept:
        return [0.0] * g
    total, top = sum(kept.values()), max(kept.values())
    return [kept[a] / total + (bonus * c if kept[a] < top else 0.0) if a in kept else 0.0
            for a, c in zip(answers, confidence)]


def pseudo_rewards(answers: list, confidence: list[float], group_size: int, args: Args) -> list[float]:
    """The training reward of every completion, group by group (group-major lists), from the answers the completions
    give and their confidences only: the reference answer is not an argument."""
    out = []
    for s in range(0, len(answers), group_size):
        a, c = answers[s:s + group_size], confidence[s:s + group_size]
        out += majority_rewards(a) if args.reward_mode == "majority" else \
            dare_rewards(a, c, args.prune_threshold, args.explore_bonus)
    return out


def label_stats(answers: list, texts: list[str], truths: list[str], group_size: int, task) -> dict:
    """The logged ttrl/ figures, the only place the reference answers y* are read. Per prompt: the group's vote y^ is
    right (label_acc; judged by the task's verifier on the first completion that voted for it), a wrong answer
    (wrong_majority), a wrong answer held by at least LOCKED_SHARE of the group (locked_wrong); per completion: it is
    right (true_reward, what the verifier would have paid)."""
    right, wrong, locked, true = [], [], [], []
    for s, y_star in zip(range(0, len(answers), group_size), truths):
        a, t = answers[s:s + group_size], texts[s:s + group_size]
        true += [task.verify(x, y_star)[0] for x in t]
        y = majority_vote(a)
        ok = y is not None and true[s + a.index(y)] == 1.0
        right.append(ok)
        wrong.append(y is not None and not ok)
        locked.append(wrong[-1] and a.count(y) >= LOCKED_SHARE * group_size)
    return {"ttrl/label_acc": float(np.mean(right)), "ttrl/wrong_majority": float(np.mean(wrong)),
            "ttrl/locked_wrong": float(np.mean(locked)), "ttrl/true_reward": float(np.mean(true))}


# ---- the idea: ECHO's tree rollout ----
SHAPE_CLAMP = 2.0  # s_max: the hybrid score S_t is clamped to [-s_max, s_max]
TAIL_WINDOW = 16  # tokens of a completion's tail in its tail confidence
CLIP_MIN, CLIP_MAX, CLIP_KAPPA = 0.05, 0.2, 4.0  # adaptive clip: eps_min, eps_max, kappa (ECHO's released defaults)


def window_mean(x: list[float], t: int, w: int) -> float:
    """C^G_t: the mean of x over the last w positions up to t (fewer at the start of the path)."""
    return float(np.mean(x[max(0, t - w + 1):t + 1]))


def branch_width(entropy: float, group_conf: float, args: Args) -> int:
    """w = clip(floor(1 + alpha (H - H_lo) / (H_hi - H_lo) - beta (C^G - c_0) / c_0 + 1/2), 1, w_max): continuations
    drawn from a branch point of next-token entropy H and group confidence C^G; tree-entropy drops the C^G term."""
    raw = 1 + args.width_entropy_coef * (entropy - args.entropy_low) / (args.entropy_high - args.entropy_low)
    if args.rollout == "tree-echo":
        raw -= args.width_conf_coef * (group_conf - args.branch_conf) / args.branch_conf
    return int(min(max(math.floor(raw + 0.5), 1), args.width_max))


def prune_point(conf: list[float], start: int, window: int, threshold: float, patience: int) -> int | None:
    """Online pruning: the first t >= start at which C^G (window_mean of the path's token confidences) has been below
    threshold at each of the last `patience` positions t - patience + 1 .. t of the path; None when there is none.
    The leaf keeps its tokens up to t: an engine deciding token by token would stop sampling there."""
    run = 0
    for t in range(len(conf)):
        run = run + 1 if window_mean(conf, t, window) < threshold else 0
        if t >= start and run >= patience:
            return t
    return None


def make_leaf(parent: dict | None, pos: int, seg: dict, root: int, args: Args, may_prune: bool = True) -> dict:
    """A new leaf: its parent's path before `pos`, then the sampled segment; under tree-echo (and may_prune) cut at
    its prune point (pruned: it leaves the group). A leaf: tokens, logprobs, entropy, conf [path], pos (own segment
    start), root (its chain), finished, pruned, used (positions branched from)."""
    keys = ("tokens", "logprobs", "entropy", "conf")
    leaf = {k: (parent[k][:pos] if parent else []) + list(seg[k]) for k in keys}
    leaf.update(pos=pos, root=root, finished=seg["finished"], pruned=False, used=set())
    t = prune_point(leaf["conf"], pos, args.conf_window, args.prune_conf, args.prune_patience) \
        if args.rollout == "tree-echo" and args.prune_conf > 0 and may_prune else None
    if t is not None:
        leaf.update({k: leaf[k][:t + 1] for k in keys}, finished=False, pruned=True)
    return leaf


def best_point(tree: list[dict], rng) -> tuple | None:
    """The legal branch point (H, C^G, j, p) of highest next-token entropy (random tie-break): p inside leaf j's own
    segment but not its first token, j not pruned, no branch at (j, p) yet; None when there is none."""
    cands = [(leaf["entropy"][p], rng.random(), j, p) for j, leaf in enumerate(tree) if not leaf["pruned"]
             for p in range(leaf["pos"] + 1, len(leaf["tokens"])) if p not in leaf["used"]]
    if not cands:
        return None
    h, _, j, p = max(cands)
    return h, tree[j]["conf"], j, p


def round_requests(trees: list[list[dict]], args: Args, rng, counts: dict) -> list[tuple]:
    """One branching round: each tree short of G unpruned leaves draws w = branch_width continuations (at most the
    leaves it lacks) from its best point, or fresh chains for all it lacks when it has no legal point. Rows (group,
    j, p); a fresh chain is (group, -1, 0)."""
    reqs = []
    for g, tree in enumerate(trees):
        need = args.group_size - sum(not leaf["pruned"] for leaf in tree)
        if need <= 0:
            continue
        point = best_point(tree, rng)
        if point is None:
            reqs += [(g, -1, 0)] * need
            counts["fallback"] += need
            continue
        h, conf, j, p = point
        w = min(branch_width(h, window_mean(conf, p, args.conf_window), args), need)
        tree[j]["used"].add(p)
        reqs += [(g, j, p)] * w
        counts["points"] += 1
    return reqs


def grow_trees(sample_fn, n_prompts: int, args: Args, rng) -> tuple[list[list[dict]], dict]:
    """--chains chains per prompt, then rounds of round_requests until every tree has G unpruned leaves (a tree prunes
    at most G leaves: later ones are kept, so growth ends). sample_fn(groups, prefixes, budgets) -> segments
    (sample_segments). Counts: sampled tokens (own segments, up to a prune point), branch points, fallback chains,
    pruned leaves."""
    counts = dict(sampled=0, points=0, fallback=0, pruned=0)
    trees = [[] for _ in range(n_prompts)]
    reqs = [(g, -1, 0) for g in range(n_prompts) for _ in range(args.chains)]
    while reqs:
        prefixes = [trees[g][j]["tokens"][:p] if j >= 0 else [] for g, j, p in reqs]
        segs = sample_fn([g for g, _, _ in reqs], prefixes, [args.max_new_tokens - len(x) for x in prefixes])
        for (g, j, p), seg in zip(reqs, segs):
            par = trees[g][j] if j >= 0 else None
            may_prune = sum(leaf["pruned"] for leaf in trees[g]) < args.group_size
            leaf = make_leaf(par, p, seg, par["root"] if par else len(trees[g]), args, may_prune)
            counts["sampled"] += len(leaf["tokens"]) - p
            counts["pruned"] += leaf["pruned"]
            trees[g].append(leaf)
        reqs = round_requests(trees, args, rng, counts)
    return trees, counts


@torch.no_grad()
def next_token_stats(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature: float, k: int = 0,
                     chunk_mb: float | None = None):
    """Entropy [B, C] and the k most likely tokens (probs, ids [B, C, k]; k = 0: empty) of the distribution each
    token was drawn from. One decoder forward under the training autocast, then the lm_head and log-softmax over
    chunks of positions whose fp32 logits take about chunk_mb MiB (common.LOGPROB_CHUNK_MB by default; as
    common.token_logprobs): no [B, C, V] tensor is built."""
    dev = next(model.parameters()).device
    ids = torch.cat([prompt_ids, completion_ids], 1).to(dev)
    mask = torch.cat([prompt_mask, completion_mask], 1).to(dev)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    P, (B, C), head = prompt_ids.shape[1], completion_ids.shape, model.get_output_embeddings()
    step, k = common.chunk_positions(head.weight.shape[0], chunk_mb), min(k, head.weight.shape[0])
    ent, probs, top_ids = [], [], []
    with common.autocast(model):
        h = common.decoder_hidden(model, ids, mask, pos)[:, P - 1:-1].reshape(B * C, -1)
        for s in range(0, B * C, step):
            logp = torch.log_softmax(head(h[s:s + step]).float() / temperature, -1)
            top = logp.topk(k, -1)
            ent.append(-(logp.exp() * logp).sum(-1))
            probs.append(top.values.exp())
            top_ids.append(top.indices)
    return torch.cat(ent).view(B, C), torch.cat(probs).view(B, C, k), torch.cat(top_ids).view(B, C, k)


def sample_segments(sampler, tok, prompts, groups, prefixes, budgets, args: Args) -> list[dict]:
    """One batched generate call from prompt + prefix for every row, row r cut at its own budget budgets[r]; per row
    tokens, behaviour logprobs, finished (EOS inside the budget), entropy H_t and confidence C_t (the mean of the
    conf_top_k largest next-token probabilities) at every position, from the module the sampler decodes with."""
    ro = common.generate(sampler, tok, [prompts[g] + p for g, p in zip(groups, prefixes)], 1, max(budgets),
                         args.temperature, args.top_p)
    scorer = sampler.model if sampler.engine is not None else sampler.module()
    ent, top, _ = next_token_stats(scorer, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask,
                                   args.temperature, args.conf_top_k)
    lengths, conf = ro.completion_mask.sum(1).tolist(), top.mean(-1)
    segs = []
    for r, budget in enumerate(budgets):
        n = min(lengths[r], budget)
        segs.append({"tokens": ro.completion_ids[r, :n].tolist(), "logprobs": ro.logprobs[r, :n].tolist(),
                     "entropy": ent[r, :n].tolist(), "conf": conf[r, :n].tolist(),
                     "finished": ro.finish_reasons[r] == "stop" and n == lengths[r]})
    return segs


def leaf_batch(trees: list[list[dict]], prompts: list[list[int]], pad_id: int, device) -> dict:
    """One row per leaf (group-major) in grpo.py's batch layout: prompt_ids / prompt_mask (left-padded, each prompt
    once per leaf of its tree), completion_ids, behaviour logprobs and completion_mask [B, C] (right-padded)."""
    leaves = [leaf for tree in trees for leaf in tree]
    B, C = len(leaves), max(len(leaf["tokens"]) for leaf in leaves)
    comp, lp = torch.full((B, C), pad_id), torch.zeros(B, C)
    for i, leaf in enumerate(leaves):
        n = len(leaf["tokens"])
        comp[i, :n], lp[i, :n] = torch.tensor(leaf["tokens"]), torch.tensor(leaf["logprobs"])
    prompt_ids, prompt_mask = common.left_pad([p for p, tree in zip(prompts, trees) for _ in tree], pad_id)
    lengths = torch.tensor([len(leaf["tokens"]) for leaf in leaves])
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": comp, "logprobs": lp,
             "completion_mask": (torch.arange(C)[None] < lengths[:, None]).long()}
    return {k: v.to(device) for k, v in batch.items()}


def effective_branches(trees: list[list[dict]]) -> float:
    """The number of distinct trajectories (leaf token sequences) per tree, pruned leaves left out (they give no
    answer), averaged over the trees."""
    return float(np.mean([len({tuple(leaf["tokens"]) for leaf in tree if not leaf["pruned"]}) for tree in trees]))


def tree_metrics(trees: list[list[dict]], counts: dict) -> dict:
    """rollout/ figures of one batch of trees: effective branches, the share of a tree's unpruned leaves under its
    most branched chain (1 / chains when the branching is spread evenly, 1 when it all goes to one chain: collapse),
    the pruned share of all leaves grown, branch points per tree, fallback chains, sampled and (unpruned) leaf
    tokens."""
    n, leaves = len(trees), sum(len(t) for t in trees)
    leaf_tokens = sum(len(leaf["tokens"]) for tree in trees for leaf in tree if not leaf["pruned"])
    return {"rollout/effective_branches": effective_branches(trees),
            "rollout/root_share": float(np.mean([max(Counter(l["root"] for l in t if not l["pruned"]).values()) /
                                                 sum(not l["pruned"] for l in t) for t in trees])),
            "rollout/pruned_frac": counts["pruned"] / leaves, "rollout/branch_points": counts["points"] / n,
            "rollout/fallback_frac": counts["fallback"] / leaves, "rollout/sampled_tokens": counts["sampled"],
            "rollout/leaf_tokens": leaf_tokens}


# ---- the idea: ECHO's update (tree-echo) ----
def adaptive_clip(conf, mask):
    """eps_i = eps_min + (eps_max - eps_min) sigmoid(kappa (1 - C_tail,i)), C_tail,i = the mean C_t over the last
    TAIL_WINDOW tokens of completion i: a wider range for less confident completions. conf, mask [B, C] -> [B, 1]."""
    n = mask.sum(1, keepdim=True)
    tail = mask * (torch.arange(mask.shape[1], device=mask.device)[None] >= n - TAIL_WINDOW)
    c_tail = (conf * tail).sum(1, keepdim=True) / tail.sum(1, keepdim=True).clamp(min=1)
    return CLIP_MIN + (CLIP_MAX - CLIP_MIN) * torch.sigmoid(CLIP_KAPPA * (1 - c_tail))


def hybrid_weight(entropy, conf, mask, coef: float):
    """w_t = 1 + a clamp(z(H_t) + z(1 - C_t), -s_max, s_max), z: standardised over all completion tokens of the batch;
    the loss of token t takes A_i w_t (w_t > 0 since a s_max < 1: the clipped surrogate of A_i w_t is w_t times A_i's).
    entropy, conf, mask [B, C] -> [B, C]."""
    def z(x):
        m = common.masked_mean(x, mask)
        return (x - m) / torch.sqrt(common.masked_mean((x - m) ** 2, mask) + 1e-8)
    return (1 + coef * (z(entropy) + z(1 - conf)).clamp(-SHAPE_CLAMP, SHAPE_CLAMP)) * mask


# ---- rollout and update ----
def rollout(sampler, tok, task, args: Args, rng, device) -> dict:
    """Sample G completions for each of prompts_per_step unlabelled prompts (--train-split): independent ones
    (--rollout group) or the G leaves of a tree (tree_rollout); reward each by its group's vote (vote_batch)."""
    examples = task.sample(args.train_split, args.prompts_per_step, rng)
    prompts = common.encode_prompts(tok, [e.prompt for e in examples])
    if args.rollout != "group":
        return tree_rollout(sampler, tok, task, examples, prompts, args, rng, device)
    ro = common.generate(sampler, tok, prompts, args.group_size, args.max_new_tokens, args.temperature, args.top_p)
    batch = {k: getattr(ro, k).to(device) for k in
             ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs")}
    answers = [answer_of(task, t) for t in ro.texts]
    return vote_batch(batch, ro, answers, ro.finish_reasons, examples, task, args, device)


def vote_batch(batch: dict, ro, answers: list, finish_reasons: list, examples: list, task, args: Args, device) -> dict:
    """Reward every completion by its group's vote (pseudo_rewards, from the answers and confidences alone); A_i per
    group. ro: the rollout's texts, behaviour logprobs and completion_mask. The reference answers are read
    afterwards, only for the logged ttrl/ figures (label_stats)."""
    mask = ro.completion_mask.bool()  # c_i: the geometric-mean probability of the completion's tokens
    confidence = torch.exp(torch.where(mask, ro.logprobs.float(), 0.0).sum(1) / mask.sum(1).clamp(min=1)).tolist()
    rewards = torch.tensor(pseudo_rewards(answers, confidence, args.group_size, args), device=device)
    groups = [answers[s:s + args.group_size] for s in range(0, len(answers), args.group_size)]
    batch.update(rewards=rewards, adv=group_advantages(rewards, args.group_size, args.adv_std_norm),
                 finish_reasons=finish_reasons, reward_terms={
                     **label_stats(answers, ro.texts, [e.answer for e in examples], args.group_size, task),
                     "ttrl/answered": float(np.mean([a is not None for a in answers])),
                     "ttrl/distinct_answers": float(np.mean([len({a for a in g if a is not None}) for g in groups]))})
    return batch


def tree_rollout(sampler, tok, task, examples, prompts, args: Args, rng, device) -> dict:
    """Grow one tree of G unpruned leaves per prompt (grow_trees; pruned leaves cost their tokens, then leave the
    group). The batch holds one row per unpruned leaf (group-major) as the group rollout's, the tree figures and,
    under tree-echo, each completion's clip range (adaptive_clip) and each token's shaping weight (hybrid_weight)."""
    sample = lambda groups, prefixes, budgets: sample_segments(  # noqa: E731
        sampler, tok, prompts, groups, prefixes, budgets, args)
    trees, counts = grow_trees(sample, len(prompts), args, rng)
    kept = [[leaf for leaf in tree if not leaf["pruned"]] for tree in trees]
    leaves = [leaf for tree in kept for leaf in tree]
    batch = leaf_batch(kept, prompts, tok.pad_token_id, "cpu")
    C, texts = batch["completion_ids"].shape[1], tok.batch_decode([leaf["tokens"] for leaf in leaves],
                                                                   skip_special_tokens=True)
    pad = lambda k: torch.tensor([leaf[k] + [0.0] * (C - len(leaf[k])) for leaf in leaves])  # noqa: E731
    ro = common.Rollout(batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"],
                        batch["logprobs"], [], texts)
    answers = [answer_of(task, t) for t in texts]
    out = vote_batch({k: v.to(device) for k, v in batch.items()}, ro, answers,
                     ["stop" if leaf["finished"] else "length" for leaf in leaves], examples, task, args, device)
    if args.rollout == "tree-echo":
        mask, conf = batch["completion_mask"].float(), pad("conf")
        if args.adaptive_clip:
            out["clip_eps"] = adaptive_clip(conf, mask).to(device)
        if args.shape_coef > 0:
            out["tok_weight"] = hybrid_weight(pad("entropy"), conf, mask, args.shape_coef).to(device)
    out["tree"] = tree_metrics(trees, counts)
    return out


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
                      "old": logp.detach() if old is None else old[idx], "ref": None if ref is None else ref[idx],
                      **{k: batch[k][idx] for k in ("clip_eps", "tok_weight") if k in batch}}  # tree-echo's
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
def lock_in_summary(history: list[dict], window: int = 10) -> dict:
    """The ttrl/ figures (and a tree rollout's) of the first and of the last `window` rollout batches (means), and
    the number of batches, for summary.json."""
    rows = [h for h in history if "ttrl/wrong_majority" in h]
    out = {"batches": len(rows)}
    for key in ("wrong_majority", "locked_wrong", "label_acc", "true_reward", "distinct_answers"):
        vals = [h[f"ttrl/{key}"] for h in rows]
        if vals:
            out[f"{key}_first"], out[f"{key}_last"] = float(np.mean(vals[:window])), float(np.mean(vals[-window:]))
    trees = [h for h in history if "rollout/effective_branches" in h]  # tree rollouts: their figures' run means
    for key in ("effective_branches", "root_share", "pruned_frac", "branch_points", "fallback_frac"):
        if trees:
            out[key] = float(np.mean([h[f"rollout/{key}"] for h in trees]))
            out[f"{key}_first"], out[f"{key}_last"] = (float(np.mean([h[f"rollout/{key}"] for h in part]))
                                                       for part in (trees[:window], trees[-window:]))
    if trees:
        out["tree_sampled_tokens"] = float(sum(h["rollout/sampled_tokens"] for h in trees))
    return out


def main(args: Args) -> dict:
    check_args(args)
    run = llm.Run(args)  # accelerator, threads, seed, the task and its held-out sets, the run folder
    # sharded when several processes run; the sampler decodes (the trainer itself on CPU)
    model, tok, ref_model, sampler = llm.load_policy(args, run.accel, with_ref=args.kl_coef > 0)
    use_kernels = args.kernels and run.accel.device.type == "cuda"
    fused_logprob = None
    if use_kernels:  # Triton: the fused lm_head + log-softmax (the loss kernel is in kernel_grpo_loss)
        from kernels.fused_logprob import fused_linear_logprob as fused_logprob
    loss_fn = kernel_grpo_loss if use_kernels else grpo_loss
    opt = llm.make_optimizer(model.parameters(), args)
    run.start(model, tok, opt, sampler)  # resume from --resume, then the step-0 held-out evaluation
    for step, rng in run.steps():  # every random draw of a step depends on (seed, step, rank) only
        with run.timer("gen"):  # the rewards are the group's vote: no reference answer reaches them
            batch = rollout(sampler, tok, run.task, args, rng, run.accel.device)
        with run.timer("train"):  # includes the sampler's refresh after each optimiser step
            stats = update(model, opt, batch, loss_fn, args, step, run.accel, sampler, ref_model, fused_logprob)
        leaf_tokens = int(batch["completion_mask"].sum())
        sampled = batch["tree"]["rollout/sampled_tokens"] if "tree" in batch else leaf_tokens
        run.gen_tokens += sampled - leaf_tokens  # log_step adds the leaves' tokens: a tree samples shared ones once
        spent = llm.all_ranks_sum({"t": run.gen_tokens + leaf_tokens}, run.accel, run.accel.device)["t"]
        last = bool(args.token_budget and spent >= args.token_budget)
        run.log_step(step, batch, {**batch.get("tree", {}), **stats}, last=last)  # metrics, evaluation, checkpoints
        if last:  # counted over all ranks: every rank stops at the same step
            break
    title = ("TTRL" if args.reward_mode == "majority" else "DARE") + \
        {"group": "", "tree-echo": ", ECHO trees", "tree-entropy": ", entropy trees"}[args.rollout]
    return run.finish(title, lock_in_summary(run.history))


if __name__ == "__main__":
    main(tyro.cli(Args))
