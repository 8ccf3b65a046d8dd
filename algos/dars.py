"""DARS / DARS-B: Difficulty Adaptive Rollout Sampling, GRPO with a second round of rollouts on hard prompts.

Paper: Yang et al., "Depth-Breadth Synergy in RLVR: Unlocking LLM Reasoning Gains with Adaptive Exploration",
arXiv:2508.13755. The diagnosis: GRPO's cumulative advantage sum_i |A_i| of a prompt's group peaks at accuracy
p = 0.5 and vanishes as p -> 0, so the hard prompts that push pass@k get little weight. DARS samples hard prompts
again (multi-stage rollouts) until their groups carry more positives and more advantage; DARS-B adds breadth (a much
larger batch trained full-batch over several epochs).

Equations (each implemented by the function named on the right), for a prompt j with G first-stage rollouts:
  group advantage   A_i = (r_i - mean_g r) / (std_g r + eps) over its whole group   group_advantages,
                    (any group size: all N_j rollouts of the prompt)               ragged_group_advantages
  cumulative adv.   CA(p, n) = sum_i |A_i| = 2 n p (1 - p)                  (no std, --no-adv-std-norm)
                             = 2 sqrt(n (n - 1)) sqrt(p (1 - p))            (unbiased std, the default)
                    for a 0/1-reward group of n with a fraction p correct; peaks at p = 0.5   cumulative_advantage
  stage 1           G rollouts per prompt; p_j = their mean reward; hard when p_j < --hard-below (0.5)   rollout
  stage 2, ET       N_j = the n with CA(p_j, n) = CA(0.5, G) (equal treatment)                   rollouts_for,
  stage 2, HW       N_j = the n with CA(p_j, n) = max(1, 1.5 (1 - p_j)) CA(0.5, G) (hardness weighting);
                    p_j = 0: N_j = 4G (ET) or 6G (HW); N_j rounded, >= G; N_j - G more rollouts   target_rollouts
  breadth (DARS-B)  prompts per batch x --breadth-factor, --breadth-epochs full-batch epochs    breadth_args
  clipped surrogate, aggregation, sampler weight: grpo.py's (grpo_loss, truncated_is_weight), on all N_j rollouts

Parent: algos/grpo.py; changed: Args, Args.steps, check_args, rollout, main.

Deviations from the paper (the abstract gives neither schedule; the released code gives two tables at G = 8):
- The schedules are written as the formulas above. Without the std (Dr. GRPO's advantage, --no-adv-std-norm) they
  give the released tables exactly at G = 8: ET 32, 18, 11, 9 and HW 48, 24, 12, 9 rollouts in all for first-stage
  accuracy 0, 1/8, 2/8, 3/8, and G from 1/2 up (tested). The 1.5 (1 - p) weight and the 4G / 6G caps for p = 0 are
  read off those tables. With the std (grpo.py's default, kept here so that DARS and GRPO differ only in the
  rollouts) the same rule matches CA under the unbiased std: ET 32, 12, 9, 8 at G = 8.
- A hard prompt's first-stage accuracy is its mean reward (the accuracy under the default 0/1 reward).
- All rollouts of a prompt form one group for the advantage (as the released code). The released code also drops
  groups whose combined accuracy is 0 or 1 before the update; here they stay, with zero advantage, as in grpo.py, so
  DARS differs from GRPO only in the extra rollouts.
- Stage 2 samples at the training temperature, one generate call for all extra rollouts of a batch.
- DARS-B: --breadth multiplies the prompts per batch by --breadth-factor (4) and trains --breadth-epochs (2) full-batch
  epochs; the paper's batch sizes and epochs are for 7B models. grpo.py's default is already one full-batch step per
  rollout batch, so here breadth means a larger batch and more epochs.
- rollout/ figures (reward, zero-variance groups) are the first stage's, comparable with GRPO's; dars/ logs the
  schedule (hard fraction, extra rollouts, the hard prompts' positives and their share of sum |A|, with stage 2 and
  from stage 1 alone). --rollout-budget stops the run once both stages together have sampled that many sequences
  (all processes), so a comparison can give every arm the same rollouts.
- One process only (several are refused with a message): the second stage gives each rank a batch of its own size,
  and FSDP2 needs every rank to run the same number of forwards; equalising them (padding rows without changing the
  step-global normaliser) is left undone. One GPU with vLLM works.
- Everything else is grpo.py's (verifier reward, unbiased std, pi_old, the truncated importance weight when the
  sampler is not the trainer).

Commands:
  python algos/dars.py                                          # tiny default, 2-core CPU
  python algos/dars.py --schedule hw                            # hardness weighting
  python algos/dars.py --schedule off                           # = python algos/grpo.py --steps 100
  python algos/dars.py --breadth --steps 30                     # DARS-B: 128 prompts a batch, 2 full-batch epochs
  python algos/dars.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --engine vllm --device cuda \
      --max-new-tokens 512 --prompts-per-step 64 --lr 1e-6          # one GPU
Expected: the default takes held-out greedy accuracy on 2-digit addition from 38.8% to 58.8% (+20.0 points) and pass@8
(100 prompts) from 74% to 89%, sampling 43,454 rollouts in 100 batches (1.7x GRPO's; seed 0, one thread, 233 s on a
heavily shared 2-core machine, 60 s of CPU). At an equal 25,600 rollouts (3 seeds): pass@8 on 300 held-out prompts
DARS 82.1 +- 2.0% against GRPO's 75.0 +- 4.1% and GRPO with G = 16's 76.7 +- 2.8%; pass@16 90.7 +- 1.5% against
81.2 +- 4.9% and 83.8 +- 2.5%; sampled pass@1 38.7 +- 2.2% against 42.3 +- 1.7% (DARS spends its rollouts on the
hard prompts: 9.3% of prompts stay unsolved in 16 samples against 18.8%). Underpowered at 3 seeds
(benchmarks/results/dars.md, rows in benchmarks/results/dars.csv; the claims table gives the seeds a verdict needs).
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, replace
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
    """GRPO's flags and DARS's own: the second-stage schedule for hard prompts, breadth (DARS-B), a rollout budget."""
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
    steps: int = 100
    """rollout batches (each samples G per prompt, then the hard prompts' extra rollouts)"""
    # DARS
    schedule: Literal["et", "hw", "off"] = "et"
    """second-stage rollouts of a hard prompt: et (equal treatment: its cumulative advantage brought up to a p = 0.5
    group's), hw (hardness weighting: more the harder it is), off (no second stage: GRPO)"""
    hard_below: float = 0.5
    """a prompt is hard when its first-stage accuracy is below this (only hard prompts get a second stage)"""
    rollout_budget: int = 0
    """stop once this many sequences have been sampled, both stages and all processes together (0 = run all --steps)"""
    breadth: bool = False
    """DARS-B: breadth_factor x the prompts per rollout batch, trained full-batch (one mini-batch) for breadth_epochs"""
    breadth_factor: int = 4
    """--breadth: prompts per rollout batch = this x --prompts-per-step"""
    breadth_epochs: int = 2
    """--breadth: full-batch epochs over each rollout batch (replaces --ppo-epochs)"""


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
    if not 0.0 <= args.hard_below <= 0.5:
        raise SystemExit(f"--hard-below must be in [0, 0.5] (hard: below a p = 0.5 group), got {args.hard_below}")
    if args.rollout_budget < 0:
        raise SystemExit("--rollout-budget must be >= 0 (0 = no budget)")
    if args.breadth and (args.breadth_factor < 1 or args.breadth_epochs < 1):
        raise SystemExit("--breadth-factor and --breadth-epochs must be at least 1")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun / accelerate launch set it
        raise SystemExit("algos/dars.py runs in one process: the second stage gives each rank a batch of another size, "
                         "and FSDP2 needs every rank to run the same forwards (use one GPU, or algos/grpo.py)")
    if args.breadth and args.minibatches != 1:
        raise SystemExit("--breadth trains full-batch: it cannot take --minibatches > 1 (drop one of the two)")


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


# ---- DARS: the cumulative advantage, the second-stage schedule, groups of any size ----
def cumulative_advantage(p: float, n: int, std_norm: bool = True) -> float:
    """sum_i |A_i| of a 0/1-reward group of n rollouts with a fraction p correct, under group_advantages:
    2 n p (1 - p) without the std; 2 sqrt(n (n - 1)) sqrt(p (1 - p)) with it (the unbiased std; the population std
    gives 2 n sqrt(p (1 - p))). Either way it peaks at p = 0.5 and vanishes at p = 0 and 1: GRPO's depth bias."""
    if std_norm:
        return 2.0 * math.sqrt(n * (n - 1)) * math.sqrt(p * (1.0 - p))
    return 2.0 * n * p * (1.0 - p)


def rollouts_for(p: float, target: float, std_norm: bool) -> float:
    """The group size n at which a group with accuracy p (0 < p < 1) has cumulative advantage `target`: the inverse of
    cumulative_advantage in n (without the std n = target / (2 p (1 - p)); with it n (n - 1) = target^2 / (4 p (1 - p)))
    for the unbiased std)."""
    if std_norm:
        return (1.0 + math.sqrt(1.0 + target * target / (p * (1.0 - p)))) / 2.0
    return target / (2.0 * p * (1.0 - p))


def target_rollouts(p: float, G: int, schedule: str, std_norm: bool = True, hard_below: float = 0.5) -> int:
    """N_j, the rollouts a prompt gets in all (G in the first stage, N_j - G more in the second), from its first-stage
    accuracy p. Not hard (p >= hard_below) or schedule 'off': G. Equal treatment (et): the smallest group whose
    cumulative advantage matches a p = 0.5 group of G, N = rollouts_for(p, CA(0.5, G)). Hardness weighting (hw): that
    target times max(1, 1.5 (1 - p)). p = 0 (no signal to match): 4G (et), 6G (hw). Rounded, never below G."""
    if schedule == "off" or p >= hard_below:
        return G
    if p <= 0.0:
        return (4 if schedule == "et" else 6) * G
    weight = 1.0 if schedule == "et" else max(1.0, 1.5 * (1.0 - p))
    return max(G, round(rollouts_for(p, weight * cumulative_advantage(0.5, G, std_norm), std_norm)))


def ragged_group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, std_norm: bool = True, eps: float = 1e-6):
    """group_advantages over groups of any size: A_i = (r_i - mean_g r) / (std_g r + eps), the unbiased std of the
    group g = group_ids[i] (groups of one: std 0). rewards, group_ids [B] -> advantages [B]."""
    n = torch.bincount(group_ids).to(rewards.dtype)
    mean = torch.zeros_like(n).index_add_(0, group_ids, rewards) / n
    adv = rewards - mean[group_ids]
    if std_norm:
        var = torch.zeros_like(n).index_add_(0, group_ids, adv * adv) / (n - 1).clamp(min=1)
        adv = adv / (var.sqrt()[group_ids] + eps)
    return adv


def breadth_args(args: Args) -> Args:
    """DARS-B's breadth: breadth_factor x the prompts of a rollout batch, trained full-batch (one mini-batch) for
    breadth_epochs epochs instead of PPO mini-batches; args unchanged without --breadth."""
    if not args.breadth:
        return args
    return replace(args, prompts_per_step=args.prompts_per_step * args.breadth_factor, ppo_epochs=args.breadth_epochs,
                   minibatches=1)


# ---- rollout and update ----
def score(task, args: Args, examples: list, ro, device):
    """(rewards [B], reward terms {name: [value per row]}) of rollout rows, examples[i] the prompt of row i."""
    total, terms = llm.Rewards(args.reward)([e.prompt for e in examples], ro.texts, [e.answer for e in examples],
                                            task=task, completion_lengths=ro.completion_mask.sum(1).tolist(),
                                            max_new_tokens=args.max_new_tokens)
    return torch.tensor(total, device=device), terms


def take_rows(ro: common.Rollout, idx: torch.Tensor) -> common.Rollout:
    """The rows idx [n] of a rollout, in that order."""
    rows = idx.tolist()
    return common.Rollout(ro.prompt_ids[idx], ro.prompt_mask[idx], ro.completion_ids[idx], ro.completion_mask[idx],
                          ro.logprobs[idx], [ro.finish_reasons[i] for i in rows], [ro.texts[i] for i in rows])


def rollout(sampler, tok, task, args: Args, rng, device) -> dict:
    """Stage 1: G completions for each of prompts_per_step prompts (grpo's rollout). Stage 2: each hard prompt gets
    N_j - G more (target_rollouts, from its first-stage mean reward), all in one generate call. A_i over each prompt's
    whole group of N_j (ragged_group_advantages; grpo's group_advantages when no prompt got more). Rows are group-major.
    Also returns `stage1` (the first stage alone, for GRPO-comparable rollout metrics) and `dars` (the schedule's
    counts: hard prompts, extra rollouts, the hard prompts' positives and share of sum |A|, with and without
    stage 2)."""
    G, P = args.group_size, args.prompts_per_step
    examples = task.sample("train", P, rng)
    ro = common.generate(sampler, tok, common.encode_prompts(tok, [e.prompt for e in examples]), G,
                         args.max_new_tokens, args.temperature, args.top_p)
    r1, terms = score(task, args, [e for e in examples for _ in range(G)], ro, device)
    acc = r1.view(P, G).mean(1).clamp(0, 1).tolist()
    extra = [target_rollouts(a, G, args.schedule, args.adv_std_norm, args.hard_below) - G for a in acc]
    gid = gid1 = torch.arange(P, device=device).repeat_interleave(G)
    stage1 = {"rewards": r1, "completion_mask": ro.completion_mask, "finish_reasons": ro.finish_reasons,
              "adv": group_advantages(r1, G, args.adv_std_norm)}
    rewards, adv = r1, stage1["adv"]
    if sum(extra):  # stage 2: the hard prompts again, each repeated N_j - G times, one completion per row
        again = [e for e, k in zip(examples, extra) for _ in range(k)]
        ro2 = common.generate(sampler, tok, common.encode_prompts(tok, [e.prompt for e in again]), 1,
                              args.max_new_tokens, args.temperature, args.top_p)
        r2, terms2 = score(task, args, again, ro2, device)
        terms = {k: v + terms2[k] for k, v in terms.items()}
        gid = torch.cat([gid, torch.arange(P, device=device).repeat_interleave(torch.tensor(extra, device=device))])
        order = torch.argsort(gid, stable=True)  # group-major: each prompt's stage-1 rows, then its stage-2 rows
        ro, rewards, gid = take_rows(common.concat_rollouts([ro, ro2], tok.pad_token_id), order.cpu()), \
            torch.cat([r1, r2])[order], gid[order]
        adv = ragged_group_advantages(rewards, gid, args.adv_std_norm)
    hard = torch.tensor([k > 0 for k in extra], device=device)
    share = lambda a, g: float(a.abs()[hard[g]].sum() / a.abs().sum().clamp(min=1e-12))  # noqa: E731
    batch = {k: getattr(ro, k).to(device) for k in
             ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs")}
    batch.update(rewards=rewards, adv=adv, finish_reasons=ro.finish_reasons, group_ids=gid, stage1=stage1,
                 reward_terms={f"reward/{k}": float(np.mean([v for v in vs if v is not None] or [0.0]))
                               for k, vs in terms.items()},
                 dars={"dars/hard_frac": float(hard.float().mean()), "dars/extra_rollouts": sum(extra),
                       "dars/rollouts": len(ro.texts),
                       "dars/hard_positives_stage1": float((r1.view(P, G)[hard] > 0).sum()),
                       "dars/hard_positives": float((rewards > 0)[hard[gid]].sum()),
                       "dars/hard_adv_share_stage1": share(stage1["adv"], gid1),
                       "dars/hard_adv_share": share(adv, gid)})
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
    args = breadth_args(args)  # DARS-B: more prompts per batch, full-batch epochs
    run = llm.Run(args)  # accelerator, threads, seed, the task and its held-out sets, the run folder
    model, tok, ref_model, sampler = llm.load_policy(args, run.accel, with_ref=args.kl_coef > 0)
    use_kernels = args.kernels and run.accel.device.type == "cuda"
    fused_logprob = None
    if use_kernels:  # Triton: the fused lm_head + log-softmax (the loss kernel is in kernel_grpo_loss)
        from kernels.fused_logprob import fused_linear_logprob as fused_logprob
    loss_fn = kernel_grpo_loss if use_kernels else grpo_loss
    opt = llm.make_optimizer(model.parameters(), args)
    run.start(model, tok, opt, sampler, counters={"rollouts_spent": 0})  # both stages: what --rollout-budget counts
    for step, rng in run.steps():  # every random draw of a step depends on (seed, step, rank) only
        with run.timer("gen"):
            batch = rollout(sampler, tok, run.task, args, rng, run.accel.device)
        with run.timer("train"):  # includes the sampler's refresh after each optimiser step
            stats = update(model, opt, batch, loss_fn, args, step, run.accel, sampler, ref_model, fused_logprob)
        run.counters["rollouts_spent"] += batch["dars"]["dars/rollouts"]
        spent, first = run.counters["rollouts_spent"], batch["stage1"]  # the first stage: what GRPO's batch shows
        grpo_view = common.rollout_metrics(first["rewards"], first["completion_mask"], first["finish_reasons"],
                                           args.group_size, 0.0)
        run.log_step(step, batch, stats, {**batch["dars"], "dars/reward_all": float(batch["rewards"].mean()),
                                          "rollout/sampled": spent, **{k: grpo_view[k] for k in (
                                              "rollout/reward", "rollout/zero_var_group_frac")}},
                     group_size=1, last=bool(args.rollout_budget and spent >= args.rollout_budget))
        if args.rollout_budget and spent >= args.rollout_budget:
            break
    mean = lambda k: float(np.mean([h[k] for h in run.history if k in h]))  # noqa: E731
    return run.finish("DARS", {"rollouts_sampled": run.counters["rollouts_spent"],
                               "steps_done": run.history[-1]["step"], "hard_adv_share": mean("dars/hard_adv_share"),
                               "hard_adv_share_stage1": mean("dars/hard_adv_share_stage1")})

if __name__ == "__main__":
    main(tyro.cli(Args))
