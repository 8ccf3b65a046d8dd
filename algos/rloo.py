"""RLOO: REINFORCE with the leave-one-out baseline (and REINFORCE++ as --advantage reinforce++).

Papers: Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
Feedback in LLMs", arXiv:2402.14740 (RLOO; the estimator is Kool et al. 2019, "Buy 4 REINFORCE Samples, Get
a Baseline for Free!"); Hu, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
Models", arXiv:2501.03262.

Parent: algos/grpo.py; changed: Args, rollout, main.

Equations (each implemented by the function named on the right):
  leave-one-out    b_i = 1/(G-1) sum_{j != i} r_j,   A_i = r_i - b_i = G/(G-1) (r_i - mean_g r)
                   (b_i never reads r_i, so E[A_i grad log pi(o_i)] is the unbiased policy gradient)
                                                                                 rloo_advantages
  REINFORCE++      every token t of response i carries the return G_it = r_i (outcome reward, gamma = 1),
                   whitened over all the batch's response tokens: A_i = (r_i - mu_tok) / sqrt(var_tok + eps),
                   mu_tok = sum_i |o_i| r_i / N_tok, var_tok = sum_i |o_i| (r_i - mu_tok)^2 / (N_tok - 1), so a
                   sequence weighs |o_i| times; one batch-wide baseline and scale, no critic, no per-group
                   statistics (verl's masked_whiten)                             reinforce_pp_advantages
  policy gradient  l_it = -min(rho_it A_i, clip(rho_it, 1 - eps, 1 + eps) A_i), rho = pi_theta/pi_old;
                   on-policy (one epoch, one mini-batch) rho = 1 and this is plain REINFORCE  clipped_pg_loss
  aggregation      (--loss-agg) seq-mean by default: J = 1/N_seq sum_i 1/|o_i| sum_t l_it   aggregate_loss
  k3 KL to ref     optional, per token, added to l_it                              k3_kl
The loop and the loss are grpo.py's (grpo_loss, or kernel_grpo_loss with --kernels); only the advantage
that rollout attaches to the batch differs.

Deviations from the papers:
- RLOO's REINFORCE uses the summed sequence log-prob; the default here averages it over the response's
  tokens (--loss-agg seq-mean), the scale the tiny world's lr 1e-4 was tuned for. --loss-agg const
  --agg-const 1 gives the summed form.
- The update keeps the PPO-style clip (as TRL's RLOO trainer); with the default one epoch and one
  mini-batch the ratio is 1 and the clip never acts.
- REINFORCE++ puts a per-token KL penalty into the reward; here the KL (off by default) is a k3 loss term,
  as in algos/grpo.py, so every token of a response has the same return r_i and the advantage is one number per
  sequence; the token statistics are per process under accelerate.
- The reward is the exact verifier (0/1), no reward model.

Commands:
  python algos/rloo.py                                          # tiny default, 2-core CPU, ~2 minutes
  python algos/rloo.py --advantage reinforce++                  # REINFORCE++ (token-whitened, no critic)
  python algos/rloo.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --engine vllm --device cuda \
      --max-new-tokens 512 --prompts-per-step 64 --lr 1e-6                        # one GPU
  accelerate launch --num_processes 4 algos/rloo.py --model ... --device cuda         # several GPUs
Expected: held-out greedy accuracy on 2-digit addition +8.5 +- 5.0 points after 40 rollout batches (3 seeds,
benchmarks/results/grpo_family.md, rows in benchmarks/results/grpo_family.csv); the default runs 400.
"""
from __future__ import annotations

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
    """RLOO's flags (GRPO's, with --advantage in place of --adv-std-norm); the plumbing flags are LLMArgs'."""
    # rollout
    prompts_per_step: int = 32
    """distinct prompts per rollout batch (per process)"""
    group_size: int = 8
    """completions per prompt (G)"""
    # objective
    advantage: Literal["rloo", "reinforce++"] = "rloo"
    """rloo: r_i minus the mean of the other G-1 rewards; reinforce++: the reward whitened over the batch's tokens"""
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
def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """A_i = r_i - mean of the other G-1 rewards of its group; rewards [B] group-major -> [B]."""
    r = rewards.view(-1, group_size)
    baseline = (r.sum(1, keepdim=True) - r) / (group_size - 1)
    return (r - baseline).view(-1)


def reinforce_pp_advantages(rewards: torch.Tensor, lengths: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """REINFORCE++: the return r_i on each of response i's |o_i| tokens, whitened over all the batch's tokens
    (mean and unbiased variance over tokens); rewards [B], lengths [B] (tokens per response) -> A [B]."""
    w = lengths.to(torch.float64)
    r = rewards.to(torch.float64)
    n = w.sum()
    mu = (w * r).sum() / n.clamp(min=1)
    var = (w * (r - mu) ** 2).sum() / (n - 1).clamp(min=1)
    return ((r - mu) * torch.rsqrt(var + eps)).to(torch.float32)


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
    """Sample G completions for each of prompts_per_step training prompts; reward them; A_i (RLOO or REINFORCE++)."""
    examples = task.sample("train", args.prompts_per_step, rng)
    ro = common.generate(sampler, tok, common.encode_prompts(tok, [e.prompt for e in examples]), args.group_size,
                         args.max_new_tokens, args.temperature, args.top_p)
    answers = [e.answer for e in examples for _ in range(args.group_size)]
    rewards = torch.tensor([task.verify(t, a)[0] for t, a in zip(ro.texts, answers)], device=device)
    batch = {k: getattr(ro, k).to(device) for k in
             ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs")}
    adv = (rloo_advantages(rewards, args.group_size) if args.advantage == "rloo"
           else reinforce_pp_advantages(rewards, batch["completion_mask"].sum(1)))
    batch.update(rewards=rewards, adv=adv, finish_reasons=ro.finish_reasons)
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
    return run.finish(args.advantage.upper())  # RLOO or REINFORCE++


if __name__ == "__main__":
    main(tyro.cli(Args))
