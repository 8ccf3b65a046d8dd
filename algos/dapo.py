"""DAPO: Decoupled Clip and Dynamic sAmpling Policy Optimization (GRPO plus four changes).

Paper: Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", arXiv:2503.14476.

Equations (each implemented by the function named on the right):
  group advantage   A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)       group_advantages
  clip-higher       l_it = -min(rho_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) A_i),
                    eps_high (0.28) > eps_low (0.2)                             clipped_pg_loss
  token-level loss  J = 1/sum_i |o_i|  sum_i sum_t l_it  (--loss-agg token-mean)  aggregate_loss (grpo_loss)
  dynamic sampling  keep only groups with 0 < #correct < G; sample more prompts until the batch holds
                    prompts_per_step such groups (at most --max-sample-rounds rounds)  informative_groups, rollout
  overlong shaping  R_len(y) = 0                              if |y| <= L_max - L_cache
                               (L_max - L_cache - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                               -1                             if |y| > L_max (cannot happen: generation
                    stops at L_max);  r = r_verifier + R_len   (L_max = max_new_tokens,
                    L_cache = --overlong-buffer)                                overlong_penalty
  overlong filter   truncated responses (finish_reason 'length') get zero loss weight  (--overlong-filter)  rollout

Parent: algos/grpo.py; changed: Args, Args.clip_eps_high, Args.loss_agg, Args.steps, check_args, rollout, main.

`diff algos/grpo.py algos/dapo.py` shows the four changes and little else: the loss is grpo_loss with DAPO's
defaults (clip-higher, token-mean), and the rollout filters, refills and shapes the batch.

Deviations from the paper:
- Dynamic sampling has a cap: after --max-sample-rounds generation rounds the step trains on the
  informative groups it has (fewer than prompts_per_step), or skips the update if it has none. DAPO samples
  until the batch is full. The metric rollout/rollouts_per_informative_group = sequences sampled this step /
  informative groups kept (all processes together) is what dynamic sampling costs.
- With several processes the ranks decide together: after each round one gather (entered by every rank the
  same number of times) says how many groups each rank holds; a full rank stops drawing and waits, and all
  stop once every rank is full or the cap is spent. Each rank then trains on the fewest groups any rank holds
  (the others' extra groups are dropped), so every rank does the same work, and all skip the update together
  when one rank has none. DAPO fills one global batch instead.
- --rollout-budget (off by default) stops training once that many sequences have been sampled (all processes
  together), so that a comparison can give DAPO the same rollouts as GRPO; DAPO counts training steps.
- The soft overlong penalty is added to the 0/1 verifier reward before the group advantage, as in the
  paper; the informative-group test uses the verifier reward only (DAPO filters on accuracy), so a length
  penalty alone never makes a group informative.
- KL to the reference is off by default (as DAPO); the option is kept.
- Everything else as algos/grpo.py (exact verifier reward, unbiased std, pi_old = pi_theta.detach() when
  on-policy, rollout/logprob_mismatch measured before any update, the truncated importance weight
  min(pi_old / pi_sampler, --sampler-is-cap) when the sampler is not the trainer, accelerate for several processes).

Commands:
  python algos/dapo.py                                          # tiny default (300 steps), 2-core CPU
  python algos/dapo.py --no-dynamic-sampling --clip-eps-high 0.2 --overlong-buffer 0   # = GRPO token-mean
  python algos/dapo.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --engine vllm --device cuda \
      --max-new-tokens 512 --overlong-buffer 128 --prompts-per-step 64 --lr 1e-6          # one GPU
  accelerate launch --num_processes 4 algos/dapo.py --model ... --device cuda         # several GPUs
  accelerate launch --multi_gpu --num_processes 2 algos/dapo.py --device cpu --threads 1   # 2 CPU processes
  (`--cpu --num_processes 2` starts one process unless mpirun is set up; --multi_gpu uses torchrun + gloo)
Expected: held-out greedy accuracy on 2-digit addition +10.4 +- 2.8 points after 20 steps = 10240 sampled
sequences (3 seeds, benchmarks/results/grpo_family.md, rows in benchmarks/results/grpo_family.csv).
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import tyro

import common
from algos import _llm as llm
from algos._llm import LLMArgs


@dataclass
class Args(LLMArgs):
    """GRPO's flags with DAPO's defaults (clip-higher, token-mean) and its own: dynamic sampling, overlong shaping."""
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
    clip_eps_high: float = 0.28
    """upper clip range: ratio <= 1 + eps_high (clip-higher: larger than eps_low)"""
    kl_coef: float = 0.0
    """weight of the k3 KL to the frozen initial policy (0 = no reference model)"""
    loss_agg: Literal["seq-mean", "token-mean", "const"] = "token-mean"
    """seq-mean (GRPO), token-mean (DAPO), const (Dr. GRPO / AsyncWebRL: divide by --agg-const per sequence)"""
    agg_const: int = 0
    """the constant k of --loss-agg const (0 = max_new_tokens)"""
    sampler_is_cap: float = 2.0
    """cap C of the truncated importance weight min(pi_old / pi_sampler, C) per token, applied when the sampler is
    not the trainer's computation (the bf16 sampler copy on CUDA, vLLM); 0 = off"""
    dynamic_sampling: bool = True
    """keep only groups whose rewards are not all equal; resample prompts to refill the batch"""
    max_sample_rounds: int = 3
    """cap on generation rounds per step for dynamic sampling (each round = prompts_per_step prompts)"""
    overlong_buffer: int = 4
    """L_cache of the soft overlong penalty: lengths above max_new_tokens - this are penalised (0 = off)"""
    overlong_penalty_factor: float = 1.0
    """scale of the soft overlong penalty (-1 at max_new_tokens times this)"""
    overlong_filter: bool = False
    """give truncated responses (no EOS within max_new_tokens) zero loss weight"""
    rollout_budget: int = 0
    """stop once this many sequences have been sampled, all processes together (0 = run all --steps)"""
    # optimisation
    steps: int = 300
    """training steps (each samples 1..max_sample_rounds rollout batches, then ppo_epochs * minibatches
    optimiser steps); on the tiny default a step sampled 2 batches in the comparison's first 20 steps"""
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
    if args.max_sample_rounds < 1:
        raise SystemExit(f"--max-sample-rounds must be at least 1, got {args.max_sample_rounds}")
    if not 0 <= args.overlong_buffer < args.max_new_tokens:
        raise SystemExit(f"--overlong-buffer must be in [0, max_new_tokens={args.max_new_tokens}), "
                         f"got {args.overlong_buffer}")
    if args.rollout_budget < 0 or args.overlong_penalty_factor < 0:
        raise SystemExit("--rollout-budget (0 = no budget) and --overlong-penalty-factor (a negative one pays overlong "
                         "answers) must be >= 0")
    if args.engine == "vllm" and not torch.cuda.is_available():
        raise SystemExit("--engine vllm needs a CUDA GPU; use --engine hf on CPU")


# ---- the idea: advantage, clipped surrogate, KL, aggregation ----
def group_advantages(rewards: torch.Tensor, group_size: int, std_norm: bool = True, eps: float = 1e-6):
    """A_i = (r_i - mean_g r) / (std_g r + eps); rewards [B] group-major -> advantages [B]."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(1, keepdim=True)
    if std_norm:
        adv = adv / (r.std(1, keepdim=True) + eps)
    return adv.view(-1)

def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dynamic sampling's filter: [n_groups] bool, True where the group's rewards are not all equal."""
    r = rewards.view(-1, group_size)
    return (r.max(1).values > r.min(1).values)


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment R_len(|y|) (<= 0) for response lengths [B] (EOS counted)."""
    if buffer == 0:
        return torch.zeros_like(lengths, dtype=torch.float)
    start = max_len - buffer
    pen = (start - lengths.float()) / buffer  # in [-1, 0) inside the buffer zone
    pen = torch.where(lengths > start, pen, torch.zeros_like(pen))
    return factor * torch.where(lengths > max_len, torch.full_like(pen, -1.0), pen)



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


# ---- rollout (dynamic sampling) and update ----
def select_groups(ro: common.Rollout, keep: torch.Tensor, group_size: int) -> common.Rollout:
    """The sequences of the groups where keep [n_groups] is True (group-major order preserved)."""
    rows = torch.nonzero(keep.repeat_interleave(group_size)).squeeze(1)
    idx = rows.tolist()
    return common.Rollout(ro.prompt_ids[rows], ro.prompt_mask[rows], ro.completion_ids[rows],
                          ro.completion_mask[rows], ro.logprobs[rows], [ro.finish_reasons[i] for i in idx],
                          [ro.texts[i] for i in idx])


def rollout(sampler, tok, task, args: Args, rng, device, accel=None) -> dict:
    """Dynamic sampling: rounds of prompts_per_step prompts x G completions until prompts_per_step informative
    groups are kept (at most --max-sample-rounds rounds); reward + overlong penalty; A_i per kept group.

    All ranks end the rounds together: after each round every rank enters one gather of (groups kept,
    sequences drawn); a full rank draws no more, and each rank finally keeps the fewest groups any rank holds
    (none on every rank if one has none), so `update` sees equal work everywhere. Returns the training batch,
    `drawn` (every sampled sequence, for the rollout metrics) and `sampling` (the dynamic-sampling counts).
    """
    G, want = args.group_size, args.prompts_per_step
    parts, drawn_rewards, keeps, n_kept = [], [], [], 0
    for _round in range(args.max_sample_rounds if args.dynamic_sampling else 1):
        if n_kept < want:  # a full rank only joins the decision below
            examples = task.sample("train", want, rng)
            ro = common.generate(sampler, tok, common.encode_prompts(tok, [e.prompt for e in examples]), G,
                                 args.max_new_tokens, args.temperature, args.top_p)
            answers = [e.answer for e in examples for _ in range(G)]
            rewards = torch.tensor([task.verify(t, a)[0] for t, a in zip(ro.texts, answers)], device=device)
            keep = informative_groups(rewards, G).cpu() if args.dynamic_sampling else torch.ones(want, dtype=torch.bool)
            keep &= keep.cumsum(0) <= want - n_kept  # informative groups beyond the target are dropped
            parts.append(ro), drawn_rewards.append(rewards), keeps.append(keep)
            n_kept += int(keep.sum())
        counts = torch.tensor([[n_kept, sum(len(p.texts) for p in parts)]], device=device)  # [1, 2] on this rank
        counts = accel.gather(counts) if accel is not None and accel.num_processes > 1 else counts  # [ranks, 2]
        if int(counts[:, 0].min()) >= want:
            break
    n_each = int(counts[:, 0].min())  # equal work: every rank trains on this many groups
    keep = torch.cat(keeps)
    keep &= keep.cumsum(0) <= n_each
    ro = common.concat_rollouts(parts, tok.pad_token_id) if len(parts) > 1 else parts[0]
    rewards = torch.cat(drawn_rewards)
    kept = select_groups(ro, keep, G)
    shaped = rewards.view(-1, G)[keep.to(device)].view(-1) + overlong_penalty(
        kept.completion_mask.sum(1), args.max_new_tokens, args.overlong_buffer, args.overlong_penalty_factor).to(device)
    batch = {k: getattr(kept, k).to(device) for k in
             ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs")}
    batch.update(adv=group_advantages(shaped, G, args.adv_std_norm) if n_each else shaped,  # empty: no groups
                 finish_reasons=kept.finish_reasons,
                 drawn={"rewards": rewards, "completion_mask": ro.completion_mask, "finish_reasons": ro.finish_reasons})
    if args.overlong_filter:  # truncated responses carry no gradient
        trunc = torch.tensor([f == "length" for f in kept.finish_reasons], dtype=torch.bool, device=device)
        batch["completion_mask"] = batch["completion_mask"] * (~trunc).long().unsqueeze(1)
    sampled, n_groups = int(counts[:, 1].sum()), n_each * counts.shape[0]
    batch["sampling"] = {"rollout/sampled": sampled, "rollout/informative_groups": n_groups,
                         "rollout/rollouts_per_informative_group": sampled / n_groups if n_groups else float("nan"),
                         "rollout/informative_min_rank": n_each,  # groups held by the poorest / richest rank
                         "rollout/informative_max_rank": int(counts[:, 0].max())}
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
    # sharded when several processes run; the sampler decodes (the trainer itself on CPU)
    model, tok, ref_model, sampler = llm.load_policy(args, run.accel, with_ref=args.kl_coef > 0)
    use_kernels = args.kernels and run.accel.device.type == "cuda"
    fused_logprob = None
    if use_kernels:  # Triton: the fused lm_head + log-softmax (the loss kernel is in kernel_grpo_loss)
        from kernels.fused_logprob import fused_linear_logprob as fused_logprob
    loss_fn = kernel_grpo_loss if use_kernels else grpo_loss
    opt = llm.make_optimizer(model.parameters(), args)
    # resume from --resume (with dynamic sampling's all-rank counts), then the step-0 held-out evaluation
    run.start(model, tok, opt, sampler, counters={"rollouts_spent": 0, "informative_total": 0})
    count = run.counters  # saved in every checkpoint
    for step, rng in run.steps():  # every random draw of a step depends on (seed, step, rank) only
        with run.timer("gen"):
            batch = rollout(sampler, tok, run.task, args, rng, run.accel.device, run.accel)
        with run.timer("train"):  # every rank trains, or every rank skips (some rank holds no informative group)
            stats = update(model, opt, batch, loss_fn, args, step, run.accel, sampler, ref_model, fused_logprob) \
                if len(batch["adv"]) else {}
        count["rollouts_spent"] += batch["sampling"]["rollout/sampled"]
        count["informative_total"] += batch["sampling"]["rollout/informative_groups"]
        last = bool(args.rollout_budget and count["rollouts_spent"] >= args.rollout_budget)
        # rollout/ figures over every group drawn (informative or not), dynamic sampling's figures
        run.log_step(step, batch["drawn"], stats, extra=batch["sampling"], last=last)
        if last:  # the budget is counted over all ranks: every rank stops at the same step
            break
    spent, kept = count["rollouts_spent"], count["informative_total"]
    return run.finish("DAPO", extra={"rollouts_sampled": spent, "steps_done": run.history[-1]["step"],
                                     "rollouts_per_informative_group": spent / kept if kept else math.nan})


if __name__ == "__main__":
    main(tyro.cli(Args))
