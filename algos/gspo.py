"""GSPO: Group Sequence Policy Optimization (GRPO with a sequence-level importance ratio).

Paper: Zheng et al., "Group Sequence Policy Optimization", arXiv:2507.18071.

Parent: algos/grpo.py; changed: Args, Args.clip_eps_high, Args.clip_eps_low, Args.kernels, Args.minibatches, main.

Equations (each implemented by the function named on the right):
  group advantage   A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)       group_advantages
  sequence ratio    s_i = (pi_theta(o_i | q) / pi_old(o_i | q))^(1/|o_i|)
                        = exp( 1/|o_i| sum_t (log pi_theta(o_it|.) - log pi_old(o_it|.)) )  sequence_ratio
  sequence clip     l_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)         sequence_clipped_loss
  objective         J = 1/N_seq sum_i l_i (every sequence weighs the same; the length normalisation lives
                    inside s_i), N_seq counted once per optimiser step across micro-batches and ranks  gspo_loss
  k3 KL to ref      (optional, per token, token-mean over the step, added to J)          k3_kl
  sampler != trainer l_i <- w_i l_i,  w_i = (prod_t w_it)^(1/|o_i|),  w_it = min(pi_old / pi_sampler, C)
                    (the truncated token weights of grpo.py, averaged in log space as s_i)  gspo_loss
The loop is grpo.py's: rollout -> update(..., gspo_loss) -> log; only the loss_fn differs.

Why it differs from GRPO only off-policy: with one epoch and one mini-batch pi_old = pi_theta.detach(),
s_i = 1 and grad l_i = -A_i/|o_i| sum_t grad log pi(o_it): exactly GRPO with --loss-agg seq-mean. The
sequence ratio and clip matter when a rollout batch is reused, so the default here takes 4 optimiser steps
per rollout batch (--minibatches 4), as the paper does.

Deviations from the paper:
- Clip ranges: the paper uses eps_low = 3e-4, eps_high = 4e-4 on Qwen3 models with responses of thousands
  of tokens, where the 1/|o_i| mean averages the per-token drift down; on 2-4-token answers it averages
  little, so the default here is wider, 0.02 / 0.02.
- loss/clipfrac is the share of response tokens whose sequence was clipped (they get no gradient), not the
  share of sequences: update() averages every statistic over tokens.
- The optional KL is a per-token k3 term (as algos/grpo.py), not part of the paper's objective.
- --kernels uses the fused log-prob kernel only; the loss is per sequence, so grpo.py's fused token-level
  loss kernel does not apply.
- The sampler correction (when the sampler is not the trainer's computation: the bf16 sampler copy on CUDA,
  vLLM) weights each sequence's loss by the geometric mean over its tokens of grpo.py's truncated weights
  w_it = min(pi_old / pi_sampler, C), C = --sampler-is-cap: the length-normalised form GSPO gives its own ratio.
  The paper recomputes pi_old with the trainer and applies no such weight; rollout/is_weight_mean and
  rollout/is_truncated_frac log the token weights. On CPU the sampler is the trainer and no weight applies.
- Everything else as algos/grpo.py (exact verifier reward, unbiased std, accelerate for several processes).

Commands:
  python algos/gspo.py                                          # tiny default, 2-core CPU, ~3 minutes
  python algos/gspo.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --engine vllm --device cuda \
      --max-new-tokens 512 --prompts-per-step 64 --lr 1e-6 --clip-eps-low 3e-4 --clip-eps-high 4e-4   # one GPU
  accelerate launch --num_processes 4 algos/gspo.py --model ... --device cuda         # several GPUs
Expected: held-out greedy accuracy on 2-digit addition +11.0 +- 2.2 points after 40 rollout batches (3 seeds,
benchmarks/results/grpo_family.md, rows in benchmarks/results/grpo_family.csv); the default runs 400.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import tyro

import common
from algos import _llm as llm
from algos._llm import LLMArgs


@dataclass
class Args(LLMArgs):
    """GSPO's flags (GRPO's, with sequence-level clip ranges and 4 mini-batches); the plumbing flags are LLMArgs'."""
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
    clip_eps_low: float = 0.02
    """lower clip range of the sequence ratio: s_i >= 1 - eps_low"""
    clip_eps_high: float = 0.02
    """upper clip range of the sequence ratio: s_i <= 1 + eps_high"""
    kl_coef: float = 0.0
    """weight of the k3 KL to the frozen initial policy (0 = no reference model)"""
    sampler_is_cap: float = 2.0
    """cap C of the truncated importance weight min(pi_old / pi_sampler, C) per token, applied when the sampler is
    not the trainer's computation (the bf16 sampler copy on CUDA, vLLM); 0 = off"""
    # optimisation
    ppo_epochs: int = 1
    """passes over each rollout batch"""
    minibatches: int = 4
    """optimiser steps per pass; the rollout batch is split into this many (1 with 1 epoch = GRPO)"""
    kernels: bool = False
    """use the fused log-prob Triton kernel when a GPU is present"""


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


# ---- the idea: advantage, sequence ratio, sequence clip, KL ----
def group_advantages(rewards: torch.Tensor, group_size: int, std_norm: bool = True, eps: float = 1e-6):
    """A_i = (r_i - mean_g r) / (std_g r + eps); rewards [B] group-major -> advantages [B]."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(1, keepdim=True)
    if std_norm:
        adv = adv / (r.std(1, keepdim=True) + eps)
    return adv.view(-1)


def sequence_ratio(logp, old_logp, mask):
    """s_i = exp(mean_t (logp_it - old_it)) over the response's own tokens; [B, C] -> [B]."""
    return torch.exp(common.masked_sum(logp - old_logp, mask, 1) / mask.sum(1).clamp(min=1))


def sequence_clipped_loss(logp, old_logp, adv, mask, eps_low: float, eps_high: float):
    """Per-sequence GSPO loss -min(s A, clip(s, 1-eps_low, 1+eps_high) A); logp [B, C], adv [B].

    Returns (loss [B], clipped [B] as float: where the clipped branch was the active one).
    """
    s = sequence_ratio(logp, old_logp, mask)
    unclipped, clipped = s * adv, s.clamp(1 - eps_low, 1 + eps_high) * adv
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).float()


def k3_kl(logp, ref_logp):
    """Schulman's k3 estimator of KL(pi_theta || pi_ref): exp(ref - logp) - (ref - logp) - 1 >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def truncated_is_weight(old_logp, sampler_logp, cap: float):
    """w_t = min(pi_old(o_t) / pi_sampler(o_t), C): corrects the update for samples drawn by another computation
    than the trainer's (truncated importance sampling, as verl's rollout correction); no gradient."""
    return torch.exp(old_logp - sampler_logp).clamp(max=cap).detach()


def gspo_loss(logp, mb: dict, n_seqs: int, n_tokens: int, args: Args):
    """This micro-batch's share of J: sum_i l_i / N_seq + kl_coef * token-mean k3 KL over the step.

    logp [b, C] (with grad); mb holds old, ref (or None), adv [b], mask [b, C]. Returns (loss, per-token stats).
    """
    mask = mb["mask"]
    seq_loss, clipped = sequence_clipped_loss(logp, mb["old"], mb["adv"], mask, args.clip_eps_low, args.clip_eps_high)
    if mb.get("is_weight") is not None:  # the sampler is not the trainer: l_i <- w_i l_i, w_i the geometric mean
        w = mb["is_weight"].clamp(min=torch.finfo(mb["is_weight"].dtype).tiny)  # log 0 would poison the sum
        log_w = common.masked_sum(torch.log(w), mask, 1) / mask.sum(1).clamp(min=1)
        seq_loss = seq_loss * torch.exp(log_w)
    loss, stats = seq_loss.sum() / n_seqs, {"clipfrac": clipped.unsqueeze(1).expand_as(mask)}
    if mb["ref"] is not None:
        kl = k3_kl(logp, mb["ref"])
        loss, stats["kl"] = loss + args.kl_coef * common.masked_sum(kl, mask) / n_tokens, kl
    return loss, stats


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
    if use_kernels:  # Triton: the fused lm_head + log-softmax
        from kernels.fused_logprob import fused_linear_logprob as fused_logprob
    loss_fn = gspo_loss  # per sequence: grpo.py's token-level loss kernel does not apply
    opt = llm.make_optimizer(model.parameters(), args)
    run.start(model, tok, opt, sampler)  # resume from --resume, then the step-0 held-out evaluation
    for step, rng in run.steps():  # every random draw of a step depends on (seed, step, rank) only
        with run.timer("gen"):
            batch = rollout(sampler, tok, run.task, args, rng, run.accel.device)
        with run.timer("train"):  # includes the sampler's refresh after each optimiser step
            stats = update(model, opt, batch, loss_fn, args, step, run.accel, sampler, ref_model, fused_logprob)
        run.log_step(step, batch, stats)  # rollout metrics, evaluation every --eval-every, checkpoints
    return run.finish("GSPO")


if __name__ == "__main__":
    main(tyro.cli(Args))
