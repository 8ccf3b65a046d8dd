"""GRPO: Group Relative Policy Optimization, the baseline most RL post-training papers build on.

Paper: Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
arXiv:2402.03300 (GRPO), with the loss-aggregation variants of DAPO (arXiv:2503.14476), Dr. GRPO
(Liu et al., "Understanding R1-Zero-Like Training", arXiv:2503.20783) and AsyncWebRL (asynchronous multi-step RL
for vision-language web agents; its constant per-trajectory normaliser 1/k).

Equations (each implemented by the function named on the right):
  group advantage   A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)       group_advantages
                    (Dr. GRPO: --no-adv-std-norm drops the division by the std)
  ratio             rho_it = pi_theta(o_it | q, o_i,<t) / pi_old(o_it | q, o_i,<t)
  clipped surrogate l_it = -min(rho_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) A_i)   clipped_pg_loss
  k3 KL to ref      kl_it = pi_ref/pi_theta - log(pi_ref/pi_theta) - 1              k3_kl
  sampler != trainer l_it <- w_it l_it,  w_it = min(pi_old / pi_sampler, C)         truncated_is_weight
  aggregation (--loss-agg), over the G*N sequences of one optimiser step:                 aggregate_loss
    seq-mean   (GRPO)      J = 1/N_seq  sum_i 1/|o_i| sum_t l_it
    token-mean (DAPO)      J = 1/sum_i |o_i|  sum_i sum_t l_it
    const      (Dr. GRPO, and AsyncWebRL's 1/k)       J = 1/(N_seq * k) sum_i sum_t l_it,  k = --agg-const
  The normaliser (N_seq, sum |o_i|) is counted once per optimiser step across all micro-batches (and all
  ranks), so gradient accumulation does not change the objective.

Parent: none. The file reads top to bottom as the method: the equations (group_advantages, clipped_pg_loss,
k3_kl, aggregate_loss, grpo_loss), then rollout -> update -> log in main. A variant copies this file and
changes a few functions (its loss_fn, its rollout); everything it does not list as changed stays an exact copy.

Deviations from the paper:
- KL to the reference is off by default (kl_coef = 0), as in DAPO and Dr. GRPO; GRPO used 0.04.
- The reward is a rule-based verifier (exact final answer) by default, not a reward model; --reward adds a format
  term, a length penalty or your own functions (weighted sum), each logged as reward/<name>.
- The std in the advantage is the unbiased sample std (as TRL); the paper does not say which.
- pi_old: with one PPO epoch and one mini-batch the update is on-policy and pi_old = pi_theta.detach()
  (ratio 1, the same gradient as REINFORCE with a group baseline); otherwise pi_old is recomputed by the
  trainer before the first update, as in PPO. The sampler's own log-probs give the rollout/logprob_mismatch
  metric, and when the sampler is not the trainer's computation (the bf16 sampler copy on CUDA, vLLM) each
  token's loss is weighted by w_t = min(pi_old / pi_sampler, C), C = --sampler-is-cap = 2 (truncated importance
  sampling, token level as verl's rollout correction; TRL's vLLM default masks whole sequences at a cap of 3):
  truncated_is_weight, logged as rollout/is_weight_mean and rollout/is_truncated_frac. On CPU the sampler is the
  trainer's own forward and the update is exactly the on-policy one.
- Several processes (torchrun / accelerate launch) shard policy and reference with torch's FSDP2 (common.shard:
  one unit per decoder layer; weights, gradients and AdamW state split across ranks). Gradients are summed, not
  averaged, because the loss already divides by step-global counts: the step equals one process's on the global
  batch (tests/test_sharding.py). Rollouts use a full copy of the weights gathered once per optimiser step
  (2 bytes per parameter in bf16 on CUDA, 4 on CPU, on every rank: benchmarks/results/memory_plan.md counts it).

Commands:
  python algos/grpo.py                                          # tiny default, 2-core CPU, ~2 minutes
  python algos/grpo.py --loss-agg const --no-adv-std-norm       # Dr. GRPO
  python algos/grpo.py --model tiny-sums --task sums --digits 1 --max-new-tokens 48 --steps 100   # long responses
  python algos/grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --engine vllm --device cuda \
      --max-new-tokens 512 --prompts-per-step 64 --lr 1e-6 --kl-coef 0.0          # one GPU
  torchrun --nproc_per_node 8 algos/grpo.py --model Qwen/Qwen2.5-7B --task gsm8k --device cuda --max-new-tokens 512 \
      --micro-batch-size 32 --grad-checkpointing --lr 1e-6 --pass-k 0     # 8 GPUs (see benchmarks/results/memory_plan.md)
  python algos/grpo.py --model smollm2-135m --task words --max-new-tokens 48 --temperature 0.7 --lr 1e-5 --steps 10 \
      --prompts-per-step 8 --group-size 4 --eval-examples 100    # pretrained, CPU: 23% -> 38% (pretrained.md)
  accelerate launch --multi_gpu --num_processes 2 algos/grpo.py --device cpu --threads 1   # 2 CPU processes
Expected: held-out greedy accuracy on 2-digit addition rises by 15+ points in under 3 minutes on 2 cores;
see benchmarks/results/grpo.md (rows in benchmarks/results/foundation.csv). On the long-response task
(5 one-digit operands with running totals, ~33-token answers) tiny-sums starts near 50%: see the grpo_sums row of
benchmarks/results/defaults.md.
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
    """GRPO's own flags; the plumbing flags (run, model, task, engine, optimiser, eval, checkpoints) are LLMArgs'."""
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
    run.start(model, tok, opt, sampler)  # resume from --resume, then the step-0 held-out evaluation
    for step, rng in run.steps():  # every random draw of a step depends on (seed, step, rank) only
        with run.timer("gen"):
            batch = rollout(sampler, tok, run.task, args, rng, run.accel.device)
        with run.timer("train"):  # includes the sampler's refresh after each optimiser step
            stats = update(model, opt, batch, loss_fn, args, step, run.accel, sampler, ref_model, fused_logprob)
        run.log_step(step, batch, stats)  # rollout metrics, evaluation every --eval-every, checkpoints
    return run.finish("GRPO")


if __name__ == "__main__":
    main(tyro.cli(Args))
