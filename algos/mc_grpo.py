"""MC-GRPO: Median-Centered Group Relative Policy Optimization, for training with few rollouts per prompt.

Paper: "MC-GRPO: Median-Centered Group Relative Policy Optimization for Small-Rollout Reinforcement
Learning", arXiv:2601.22582 (authors' code: github.com/lotusroot-kim/MC-GRPO). With a small group G the mean
baseline is noisy and flips the sign of some advantages, reversing their update. MC-GRPO samples one extra
rollout (G+1, an odd group), centres on the group median, and drops the one rollout that sits at the median
(the pivot, advantage 0) before the update, so G samples carry gradient as in G-rollout GRPO. The abstract
reports the accuracy gap between G=2 and G=8 shrinking to within 1%.

Parent: algos/grpo.py; changed: Args, Args.adv_std_norm, Args.group_size, Args.reward, check_args, rollout, main.

Equations (each implemented by the function named on the right):
  median advantage  A_i = r_i - median(r_1..r_{G+1}),  G even so that G+1 is odd          median_advantages
                    pivot p = the rollout at the median (stable order): A_p = 0 and it is removed from the
                    batch before the update, so G rollouts per prompt carry gradient               (rollout)
                    (--mad-norm: also divide by MAD + 1e-3 and rescale a group's non-zero advantages by
                    (G+1)/#non-zero, as the authors' code)
                    with 0/1 rewards the median is the majority label: only the minority gets +-1
  mean baseline     --baseline mean: GRPO's A_i = (r_i - mean(r_1..r_G)) / (std + eps) from G rollouts
                    (the comparison arm)                                                   group_advantages
  sign flip         sample i is flipped when sign(A_i) = -sign(v_i - E[r | q]), v_i = r_i (the baseline's error
                    alone) or E[r | o_i] (reward noise too); counted on the rollouts that carry gradient
                                                                                            sign_flip_counts
  graded reward     --reward partial: r = (exact answer + the verifier's partial credit) / 2 (sums tasks);
                    --reward-noise s adds N(0, s^2) to the training reward                   train_rewards
  clipped surrogate, k3 KL and --loss-agg aggregation: grpo.py's (clipped_pg_loss, k3_kl, aggregate_loss,
                    grpo_loss or kernel_grpo_loss), on the G kept rollouts per prompt

Deviations from the paper:
- Advantages are r - median without scaling by default (the abstract's form). The authors' code divides by
  MAD + 1e-3 and rescales non-zero advantages (--mad-norm); with 0/1 rewards the MAD of 3 or more rewards is
  always 0, so that division only multiplies every advantage by 1000.
- The pivot is the middle element of a stable sort of the G+1 rewards (torch.median may pick any tied index);
  other rollouts tied with the median keep A = 0 and stay in the batch, as in the authors' code.
- The reward is the exact verifier (0/1); --reward partial and --reward-noise make it graded or noisy, the
  setting where a mean baseline can flip signs (with 0/1 rewards and a mean that includes the sample itself it
  cannot). rollout/reward logs the exact-answer reward of the trained rollouts, whatever --reward is.
- gen_tokens and tokens_per_s count every generated token, the pivot's included; rollout/length and
  rollout/tokens_per_s are over the G trained rollouts per prompt.
- grpo.py's other deviations hold (KL off by default, sample std, pi_old handling, FSDP2 with several processes).

Commands:
  python algos/mc_grpo.py                                       # tiny default: add, G=8 (9 rollouts), 2-core CPU
  python algos/mc_grpo.py --group-size 2                        # the small-rollout regime (3 rollouts per prompt)
  python algos/mc_grpo.py --baseline mean --group-size 2        # GRPO with the same flags, for comparison
  python algos/mc_grpo.py --task sums3 --digits 1 --reward partial --reward-noise 0.2 --max-new-tokens 24
  python algos/mc_grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --engine vllm --device cuda \
      --max-new-tokens 512 --prompts-per-step 64 --group-size 2 --lr 1e-6                  # one GPU
  accelerate launch --num_processes 4 algos/mc_grpo.py --model ... --device cuda       # several GPUs
Expected: held-out greedy accuracy on 2-digit addition rises by 10+ points in the default run (400 rollout
batches, a few minutes on 2 cores; tests/test_mc_grpo.py measured 35.3 -> 47.3% after 80); sign-flip rates of mean vs median baselines at G = 2, 4, 8 in
benchmarks/results/mc_grpo.md (python benchmarks/mc_grpo_table.py).
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
    """MC-GRPO's flags: GRPO's, with the median baseline and the noisy reward; the plumbing flags are LLMArgs'."""
    # rollout
    prompts_per_step: int = 32
    """distinct prompts per rollout batch (per process)"""
    group_size: int = 8
    """G: completions per prompt that carry gradient (even; the median baseline samples G+1)"""
    # objective
    baseline: Literal["median", "mean"] = "median"
    """median: MC-GRPO (G+1 rollouts, the pivot dropped); mean: GRPO's group mean over G rollouts"""
    mad_norm: bool = False
    """median baseline: divide by the group MAD + 1e-3 and rescale non-zero advantages (the authors' code)"""
    adv_std_norm: bool = True
    """mean baseline: divide the group-centred reward by the group std (GRPO); off = Dr. GRPO"""
    reward: Literal["correct", "partial"] = "correct"
    """training reward: the exact answer (0/1), or its mean with the verifier's partial credit (sums tasks)"""
    reward_noise: float = 0.0
    """std of Gaussian noise added to the training reward (0 = none)"""
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
    if args.baseline == "median" and args.group_size % 2:
        raise SystemExit(f"--group-size must be even with the median baseline (G+1 = {args.group_size + 1} "
                         f"rollouts must be odd for a single pivot), got {args.group_size}")
    if args.reward == "partial" and not args.task.startswith("sums"):
        raise SystemExit(f"--reward partial needs a task with partial credit (sums, sums<N>, sumsmix), got "
                         f"--task {args.task}")
    if not args.reward_noise >= 0:
        raise SystemExit(f"--reward-noise must be >= 0, got {args.reward_noise}")


# ---- the idea: advantage, clipped surrogate, KL, aggregation ----
def group_advantages(rewards: torch.Tensor, group_size: int, std_norm: bool = True, eps: float = 1e-6):
    """A_i = (r_i - mean_g r) / (std_g r + eps); rewards [B] group-major -> advantages [B]."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(1, keepdim=True)
    if std_norm:
        adv = adv / (r.std(1, keepdim=True) + eps)
    return adv.view(-1)


def median_advantages(rewards: torch.Tensor, n: int, mad_norm: bool = False, eps: float = 1e-3):
    """A_i = r_i - median of its group of n (odd) rewards; rewards [B] group-major -> (advantages [B], pivot [B]).

    The pivot is the middle of a stable sort (exactly one per group): its advantage is 0 and the caller drops it.
    mad_norm (the authors' code): divide by MAD + eps, then scale a group's non-zero advantages by n / #non-zero.
    """
    r = rewards.view(-1, n)
    mid = torch.argsort(r, dim=1, stable=True)[:, n // 2:n // 2 + 1]  # [P, 1] index of the median rollout
    adv = r - r.gather(1, mid)
    if mad_norm:
        mad = adv.abs().median(1, keepdim=True).values
        adv = adv / (mad + eps)
        nonzero = ~torch.isclose(adv, torch.zeros_like(adv), atol=1e-6)
        adv = torch.where(nonzero, adv * n / nonzero.sum(1, keepdim=True).clamp(min=1), adv)
    pivot = torch.zeros_like(r, dtype=torch.bool).scatter_(1, mid, True)
    return adv.reshape(-1), pivot.view(-1)


def sign_flip_counts(rewards: torch.Tensor, values: torch.Tensor, prompt_values: torch.Tensor, baseline: str) -> dict:
    """How often a baseline gives a sample the wrong advantage sign, against the true sign of v_i - E[r|q].

    rewards, values [P, n]: values = rewards counts the baseline's errors alone, values = E[r | o_i] counts reward
    noise too; prompt_values (E[r | q]) [P]. mean: A = r - group mean over all n;
    median: A = r - median (n odd), the pivot not counted. Returns counts of flipped (A * true < 0), zero
    advantages (A = 0 while the true sign is not) and counted samples.
    """
    P, n = rewards.shape
    if baseline == "median":
        adv, pivot = median_advantages(rewards.reshape(-1), n)
    else:
        adv, pivot = group_advantages(rewards.reshape(-1), n, std_norm=False), torch.zeros(P * n, dtype=torch.bool)
    true = (values - prompt_values[:, None]).reshape(-1)
    keep = ~pivot
    return {"flipped": int(((adv * true < 0) & keep).sum()), "zero": int(((adv == 0) & (true != 0) & keep).sum()),
            "counted": int(keep.sum())}


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
def train_rewards(scores: list, args: Args, rng) -> torch.Tensor:
    """The reward the advantages see: exact answer, or its mean with partial credit; plus optional noise.

    scores: the verifier's (reward, components) per completion.
    """
    r = np.array([c if args.reward == "correct" else (c + comp["partial"]) / 2 for c, comp in scores], dtype=float)
    if args.reward_noise > 0:
        r = r + rng.normal(0.0, args.reward_noise, size=r.shape)
    return torch.tensor(r, dtype=torch.float32)


def rollout(sampler, tok, task, args: Args, rng, device) -> dict:
    """G (mean) or G+1 (median) completions per prompt; rewards; advantages; the median's pivot rows dropped."""
    n = args.group_size + (args.baseline == "median")
    examples = task.sample("train", args.prompts_per_step, rng)
    ro = common.generate(sampler, tok, common.encode_prompts(tok, [e.prompt for e in examples]), n,
                         args.max_new_tokens, args.temperature, args.top_p)
    answers = [e.answer for e in examples for _ in range(n)]
    scores = [task.verify(t, a) for t, a in zip(ro.texts, answers)]
    r_train = train_rewards(scores, args, rng).to(device)
    if args.baseline == "median":
        adv, pivot = median_advantages(r_train, n, args.mad_norm)
    else:
        adv, pivot = group_advantages(r_train, n, args.adv_std_norm), torch.zeros_like(r_train, dtype=torch.bool)
    keep = (~pivot).nonzero().squeeze(1)  # G rows per prompt, group-major
    batch = {k: getattr(ro, k).to(device)[keep] for k in
             ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs")}
    batch.update(rewards=torch.tensor([c for c, _ in scores], device=device)[keep], adv=adv[keep],
                 finish_reasons=[ro.finish_reasons[i] for i in keep.tolist()],
                 gen_tokens=int(ro.completion_mask.sum()))
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
        run.gen_tokens += batch["gen_tokens"] - int(batch["completion_mask"].sum())  # the pivots' tokens too
        run.log_step(step, batch, stats)  # rollout metrics, evaluation every --eval-every, checkpoints
    method = "MC-GRPO" if args.baseline == "median" else "GRPO (mean baseline)"
    return run.finish(f"{method}, G={args.group_size},")


if __name__ == "__main__":
    main(tyro.cli(Args))
