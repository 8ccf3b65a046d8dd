"""SFPO: Slow-Fast Policy Optimization, GRPO's update split into a fast trajectory, a reposition and a slow step.

Paper: Wang et al., "Slow-Fast Policy Optimization: Reposition-Before-Update for LLM Reasoning", arXiv:2510.04072.
Rollouts, rewards, advantages and the clipped objective are grpo.py's; only the update rule on each rollout batch
changes (plug-compatible).

Equations (each implemented by the function named on the right), for the rollout batch of step s:
  group advantage   A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)       group_advantages
  clipped surrogate L(theta) = grpo's seq-mean PPO-clip loss against pi_old = pi_theta^{s,0}   grpo_loss
  Stage I, fast     theta^{s,k+1} = theta^{s,k} - eta grad L(theta^{s,k}),  k = 0..K-1,
                    each k one pass of grpo's update over the same batch (AdamW)   policy_pass
  Stage II, reposition  theta~ = theta^{s,0} + alpha (theta^{s,K} - theta^{s,0})         reposition
  Stage III, slow   theta^{s+1,0} = theta~ - eta grad L(theta~)  (one more pass)     update
  adaptive alpha    z_s = (H_s - mean(H_{s-W+1..s})) / std(H_{s-W+1..s}); once z_s >= tau, alpha = 0 and K = 0
                    for the rest of the run (plain GRPO steps); H = the policy's mean token entropy   entropy_switch
  sampler != trainer l_it <- w_it l_it,  w_it = min(pi_old / pi_sampler, C)         truncated_is_weight

Parent: algos/grpo.py; changed: Args, Args.steps, check_args, update, main.

Deviations from the paper (the abstract gives no rule for the reposition; these follow the authors' released code
where it says, and say so where it does not):
- The reposition is the linear interpolation above with the released defaults K = 3, alpha = 0.8. alpha = 1 is
  K + 1 epochs of PPO on the batch (tested equal to grpo.py --ppo-epochs K+1); alpha = 0 returns to theta^{s,0}.
- One inner step is one pass of grpo's update (ppo_epochs x minibatches optimiser steps; one step at the defaults),
  as the released code calls its PPO update K times. pi_old is the rollout policy theta^{s,0} for every pass (its
  log-probs scored once per batch), so the fast and the slow passes clip against the policy that sampled.
- AdamW's moments run on through the fast trajectory, the reposition and the slow step (neither reset nor
  interpolated), as in the released code. So alpha = 0 is not grpo's step: the moments have moved.
- The adaptive switch (released code: a window of 30 batches, threshold 1.0) reads H = the mean token entropy of
  the last pass of each update (the released code reads its actor's entropy metric); it is logged as sfpo/entropy
  and the switch as sfpo/active; --entropy-window 0 turns it off. Once off, SFPO stays off (also across --resume,
  rebuilt from the logged history).
- The learning-rate schedule reserves (K + 1) x ppo_epochs x minibatches optimiser steps per rollout batch (after the
  switch fewer are taken, so a cosine schedule then skips ahead); the released code steps its scheduler once per
  batch.
- Cost: K + 1 times grpo's training compute per rollout batch and one extra copy of the weights (theta^{s,0}, per
  rank when sharded); rollouts are unchanged, which is what the paper's claim counts.
- Everything else is grpo.py's (verifier reward, unbiased std, the truncated importance weight when the sampler is
  not the trainer, FSDP2 sharding; sfpo/drift logs ||theta^{s,K} - theta^{s,0}||).

Commands:
  python algos/sfpo.py                                          # tiny default (100 batches), 2-core CPU
  python algos/sfpo.py --fast-steps 0                           # = python algos/grpo.py --steps 100
  python algos/sfpo.py --alpha 1.0 --entropy-window 0           # = grpo.py --ppo-epochs 4 (no pull back)
  python algos/sfpo.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --engine vllm --device cuda \
      --max-new-tokens 512 --prompts-per-step 64 --lr 1e-6          # one GPU
  accelerate launch --multi_gpu --num_processes 2 algos/sfpo.py --device cpu --threads 1   # 2 CPU processes
Expected: the default takes held-out greedy accuracy on 2-digit addition from 38.8% to 53.2% (+14.4 points; seed 0,
one thread, 194 s on a shared 2-core machine; grpo.py --steps 100 gets 53.6% in 51 s). At an equal 15,360 rollouts
SFPO's mean accuracy over the run (the area under accuracy against rollouts) is 43.3 +- 2.1% against GRPO's
43.9 +- 2.4% and the alpha = 1 control's 43.8 +- 1.3%, ending at 44.7 +- 0.9% against 44.7 +- 7.2% (3 seeds): no
measurable speed-up at this scale, where every arm plateaus near 45% within 2,500 rollouts; on 55 fresh seeds of
the claims plan SFPO ends at 47.8 +- 3.8% against GRPO's 49.0 +- 3.7%
(benchmarks/results/sfpo.md, rows in benchmarks/results/sfpo.csv).
"""
from __future__ import annotations

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


@dataclass
class Args(LLMArgs):
    """GRPO's flags and SFPO's own: the fast trajectory, the reposition and the adaptive switch back to GRPO."""
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
    """rollout batches (each trains fast_steps + 1 passes: about 3.5x grpo's training time per batch at K = 3)"""
    # SFPO
    fast_steps: int = 3
    """K: passes over the rollout batch in the fast trajectory (Stage I); 0 = GRPO"""
    alpha: float = 0.8
    """reposition: theta_0 + alpha (theta_K - theta_0) (Stage II); 1 = no pull back (K + 1 PPO epochs), 0 = back to
    theta_0 (Adam's moments still moved)"""
    entropy_window: int = 30
    """W of the adaptive switch: z-score of the latest policy entropy over the last W rollout batches (0 = off)"""
    entropy_z: float = 1.0
    """once that z-score reaches this, SFPO stops for the rest of the run (alpha = 0, K = 0: plain GRPO steps)"""


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
    if args.fast_steps < 0:
        raise SystemExit(f"--fast-steps must be >= 0 (0 = GRPO), got {args.fast_steps}")
    if not 0.0 <= args.alpha <= 1.0:
        raise SystemExit(f"--alpha must be in [0, 1] (theta_0 + alpha (theta_K - theta_0)), got {args.alpha}")
    if args.entropy_window < 0 or args.entropy_window == 1:
        raise SystemExit(f"--entropy-window must be 0 (off) or at least 2 (a z-score needs a spread), "
                         f"got {args.entropy_window}")


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


def sampler_gap(old_logp, sampler_logp, is_weight, mask, cap: float) -> dict:
    """This micro-batch's sums for rollout/logprob_mismatch (|log pi_old - log pi_sampler| per token, on the sampler's
    weights) and, when the correction is on, the mean importance weight and the fraction truncated at C."""
    out = {"gap/sum": common.masked_sum((old_logp - sampler_logp).abs(), mask).item(), "gap/tokens": mask.sum().item()}
    if is_weight is not None:
        out.update({"gap/is_w": common.masked_sum(is_weight, mask).item(),
                    "gap/is_cut": common.masked_sum((is_weight >= cap).float(), mask).item()})
    return out


def policy_pass(model, opt, batch: dict, loss_fn, args: Args, accel, sampler, logprobs_of, old, ref,
                first_opt_step: int, total: int, measure_gap: bool) -> tuple[dict, int, float]:
    """One pass of grpo's update loop over the rollout batch: ppo_epochs x minibatches optimiser steps, each token's
    loss against pi_old = old [B, C] (None: pi_theta.detach(), the on-policy ratio 1), weighted by the truncated
    sampler weight when the sampler is not the trainer. Returns (this rank's sums of the logged means, optimiser
    steps taken, summed gradient norms); measure_gap adds the sampler-trainer gap sums (read once, on pi_old)."""
    B, mask = batch["completion_ids"].shape[0], batch["completion_mask"]
    micro = lambda idx: idx.split(args.micro_batch_size)  # noqa: E731
    correct = args.sampler_is_cap > 0 and not sampler.is_trainer  # the sampler is another computation
    sums, n_opt, grad_norm = {}, 0, 0.0  # sums: this rank's share of each logged mean, summed over ranks later
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
                if measure_gap and epoch == 0:  # every token once, on the sampler's weights (pi_old)
                    for k, v in sampler_gap(mb["old"], batch["logprobs"][idx], mb["is_weight"], mb["mask"],
                                            args.sampler_is_cap).items():
                        sums[k] = sums.get(k, 0.0) + v
            grad_norm += llm.optimizer_step(model, opt, args, first_opt_step + n_opt, total, sampler)
            n_opt += 1
    return sums, n_opt, grad_norm


@torch.no_grad()
def reposition(params: list, theta0: list, alpha: float) -> float:
    """Stage II, in place: theta <- theta_0 + alpha (theta_K - theta_0) for every parameter (torch.lerp, exact at
    alpha = 0 and 1). Returns ||theta_K - theta_0||, the fast trajectory's displacement (over all ranks' shards)."""
    sq = 0.0
    for p, p0 in zip(params, theta0):
        d = (p - p0).pow(2).sum()
        sq += float(d.full_tensor() if hasattr(d, "full_tensor") else d)  # a DTensor when sharded
        p.copy_(torch.lerp(p0, p, alpha))
    return math.sqrt(sq)


def entropy_switch(entropies: list, window: int, z_max: float) -> bool:
    """The adaptive alpha's trigger: z = (H_s - mean(H_{s-W+1..s})) / (std(H_{s-W+1..s}) + 1e-9) >= z_max over the
    last W logged policy entropies H (population std); False before W are logged, and always when W = 0 (off)."""
    if window <= 0 or len(entropies) < window:
        return False
    h = np.asarray(entropies[-window:], dtype=np.float64)
    return bool((h[-1] - h.mean()) / (h.std() + 1e-9) >= z_max)


def update(model, opt, batch: dict, loss_fn, args: Args, step: int, accel, sampler, ref_model=None,
           fused_logprob=None, fast: bool = True) -> dict:
    """SFPO's step on one rollout batch: Stage I, K fast passes from theta_0 (policy_pass); Stage II, reposition to
    theta_0 + alpha (theta_K - theta_0); Stage III, one slow pass from there. fast=False or K = 0: grpo's update.

    pi_old (theta_0's log-probs) and pi_ref are scored once, before any pass (pi_theta.detach() when the step is a
    single on-policy optimiser step, as grpo), so every pass clips against the rollout policy; AdamW's state runs on
    through all passes. The learning-rate schedule counts (K+1) x ppo_epochs x minibatches optimiser steps per rollout
    batch. Logged: grpo's loss/ means over every optimiser step, sfpo/entropy (the last pass's mean token entropy,
    which the adaptive switch reads) and sfpo/drift (||theta_K - theta_0||; 0 without a fast trajectory).
    """
    B, mask = batch["completion_ids"].shape[0], batch["completion_mask"]
    micro = lambda idx: idx.split(args.micro_batch_size)  # noqa: E731
    logprobs_of = lambda m, idx, ent=False: common.token_logprobs(  # noqa: E731
        m, batch["prompt_ids"][idx], batch["prompt_mask"][idx], batch["completion_ids"][idx], mask[idx],
        args.temperature, with_entropy=ent, fused_fn=fused_logprob)
    K = args.fast_steps if fast else 0
    on_policy = K == 0 and args.ppo_epochs == 1 and args.minibatches == 1  # then pi_old = pi_theta.detach()
    # theta_0, taken before any forward: FSDP2 keeps the root's parameters gathered after a forward until the next
    # backward, and the reposition must meet the same (sharded) tensors it copied
    theta0 = [p.detach().clone() for p in model.parameters()] if K else []
    with torch.no_grad():
        old = None if on_policy else torch.cat([logprobs_of(model, i) for i in micro(torch.arange(B))])
        ref = torch.cat([logprobs_of(ref_model, i) for i in micro(torch.arange(B))]) if ref_model else None
    per_pass = args.ppo_epochs * args.minibatches
    per_step = (args.fast_steps + 1) * per_pass  # the schedule's optimiser steps per rollout batch
    sums, n_opt, grad_norm, drift = {}, 0, 0.0, 0.0
    for k in range(K + 1):
        if k == K and K:  # Stage II, then the slow correction (Stage III) from the repositioned point
            drift = reposition(list(model.parameters()), theta0, args.alpha)
            sampler.refresh()
        s, n, g = policy_pass(model, opt, batch, loss_fn, args, accel, sampler, logprobs_of, old, ref,
                              (step - 1) * per_step + n_opt, args.steps * per_step, measure_gap=k == 0)
        for key, v in {**s, **({"last/entropy": s["entropy"]} if k == K else {})}.items():
            sums[key] = sums.get(key, 0.0) + v
        n_opt, grad_norm = n_opt + n, grad_norm + g
    tot = llm.all_ranks_sum(sums, accel, mask.device)
    out = {**{f"loss/{k}": v / n_opt for k, v in tot.items() if not k.startswith(("gap/", "last/"))},
           "loss/grad_norm": grad_norm / n_opt, "rollout/logprob_mismatch": tot["gap/sum"] / max(tot["gap/tokens"], 1),
           "sfpo/entropy": tot["last/entropy"] / per_pass, "sfpo/drift": drift, "sfpo/fast_steps": K}
    if "gap/is_w" in tot:
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
    run.start(model, tok, opt, sampler)  # resume from --resume, then the step-0 held-out evaluation
    entropies = [h["sfpo/entropy"] for h in run.history if "sfpo/entropy" in h]  # the switch's window (resume too)
    active = all(h.get("sfpo/active", 1.0) for h in run.history)  # once off, SFPO stays off
    for step, rng in run.steps():  # every random draw of a step depends on (seed, step, rank) only
        with run.timer("gen"):
            batch = rollout(sampler, tok, run.task, args, rng, run.accel.device)
        active = active and not entropy_switch(entropies, args.entropy_window, args.entropy_z)
        with run.timer("train"):  # includes the sampler's refresh after each optimiser step
            stats = update(model, opt, batch, loss_fn, args, step, run.accel, sampler, ref_model, fused_logprob, active)
        entropies.append(stats["sfpo/entropy"])
        run.log_step(step, batch, stats, {"sfpo/active": float(active)})  # rollout metrics, evaluation, checkpoints
    stop = next((h["step"] for h in run.history if h.get("sfpo/active") == 0.0), 0)  # 0: never switched off
    rollouts = args.steps * args.prompts_per_step * args.group_size * run.accel.num_processes
    return run.finish("SFPO", {"rollouts": rollouts, "sfpo_stop_step": stop})

if __name__ == "__main__":
    main(tyro.cli(Args))
