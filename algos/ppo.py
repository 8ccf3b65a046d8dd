"""PPO: Proximal Policy Optimization with a learned value function and token-level GAE (the RLHF recipe).

Papers: Schulman et al., "Proximal Policy Optimization Algorithms", arXiv:1707.06347 (clipped surrogate,
value clipping as in the OpenAI baselines); Schulman et al., "High-Dimensional Continuous Control Using
Generalized Advantage Estimation", arXiv:1506.02438 (GAE); Ouyang et al., "Training language models to
follow instructions with human feedback", arXiv:2203.02155 (per-token KL penalty to the reference in the
reward).

Parent: none (its own design). Borrows: algos/grpo.py (k3_kl, aggregate_loss, truncated_is_weight), exact copies.

What changes from GRPO: a critic replaces the group baseline, so advantages are per token (GAE over
per-token rewards) instead of one per sequence, and the KL to the reference moves from the loss into the
reward. `update` is changed because PPO needs more than a new loss_fn: V_old and the GAE advantages must be
computed from the whole batch before the first optimiser step, every micro-batch runs the critic as well,
and the optimiser steps two parameter groups (policy at --lr, critic at --vf-lr, clipped separately:
optimizer_step is llm.optimizer_step plus the critic's clip and rate). The rollout is GRPO's without the group
advantage; eval, metrics, summary and the curve are shared.

The critic is a separate tiny value model: a copy of the initial policy's decoder with a fresh scalar head
(zero-initialised), trained by its own AdamW parameter group. A separate critic keeps the value loss from
pulling on the policy's features, at the cost of one more forward/backward (cheap next to generation here).

Equations (each implemented by the function named on the right):
  values            V_t = w . h_t + b, h_t = critic decoder state before response token t   critic_values
  per-token reward  r_t = -beta (log pi_old(o_t) - log pi_ref(o_t))  +  R(o) at the last token
                    (beta = --kl-coef, 0 = no reference model)                               token_rewards
  GAE               delta_t = r_t + gamma V_{t+1} - V_t  (V after the last token = 0)
                    A_t = sum_l (gamma lambda)^l delta_{t+l},  R_t = A_t + V_t (value target)   gae
  whitening         A_t <- (A_t - mean) / (std + eps) over the batch's response tokens    whiten
                    (rewards -> GAE -> whitening for one batch: ppo_advantages)
  clipped surrogate l_t = -min(rho_t A_t, clip(rho_t, 1 - eps, 1 + eps) A_t)                clipped_pg_loss
  clipped value     v_t = 1/2 max((V_t - R_t)^2, (V_old,t + clip(V_t - V_old,t, -c, c) - R_t)^2)
                                                                                         clipped_value_loss
  sampler != trainer l_t <- w_t l_t,  w_t = min(pi_old / pi_sampler, C)                 truncated_is_weight
  objective         J = token-mean over the optimiser step of l_t + vf_coef * v_t       ppo_loss, aggregate_loss
  With gamma = lambda = 1, A_t = (sum_{k >= t} r_k) - V_t: the Monte-Carlo return minus the value.

Deviations:
- Rollouts are 256 distinct prompts x 1 sample per batch (no groups: the critic is the baseline), the
  same number of sequences per batch as algos/grpo.py's 32 x 8.
- The critic starts from the SFT policy's decoder, not from a reward model (there is none: the reward is
  the exact verifier, 0/1).
- No entropy bonus (entropy is only logged), no adaptive KL controller (fixed beta, off by default as in
  the GRPO-family scripts).
- pi_old and V_old are recomputed by the trainer after sampling, as in algos/grpo.py. The sampler's log-probs
  give the rollout/logprob_mismatch metric and, when the sampler is not the trainer's computation (the bf16
  sampler copy on CUDA, vLLM), the policy term of each token is weighted by w_t = min(pi_old / pi_sampler, C),
  C = --sampler-is-cap = 2 (grpo.py's truncated importance weight; the value loss is not weighted), logged as
  rollout/is_weight_mean and rollout/is_truncated_frac. On CPU the sampler is the trainer's own forward.
- Several processes: the critic is built from a fresh load of the initial weights (the sharded policy holds no
  full copy of its decoder), then sharded like the policy.
- No --kernels: GRPO's fused loss kernel takes one advantage per sequence, PPO's are per token.

Commands:
  python algos/ppo.py                                           # tiny default (100 batches), 2-core CPU
  python algos/ppo.py --kl-coef 0.05                            # with the per-token KL penalty in the reward
  python algos/ppo.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --engine vllm --device cuda \
      --max-new-tokens 512 --prompts-per-step 64 --lr 1e-6 --vf-lr 1e-5                 # one GPU
  accelerate launch --num_processes 4 algos/ppo.py --model ... --device cuda          # several GPUs
Expected: held-out greedy accuracy on 2-digit addition +19.9 +- 0.8 points after 40 rollout batches (3 seeds,
benchmarks/results/grpo_family.md, rows in benchmarks/results/grpo_family.csv); the 100-batch default runs longer.
"""
from __future__ import annotations

import copy
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
    """PPO's own flags; the plumbing flags (run, model, task, engine, optimiser, eval, checkpoints) are LLMArgs'."""
    # rollout
    prompts_per_step: int = 256
    """distinct prompts per rollout batch (per process)"""
    group_size: int = 1
    """completions per prompt (PPO needs no groups; >1 only to match another method's sampling)"""
    # objective
    gamma: float = 1.0
    """discount per token"""
    gae_lambda: float = 0.95
    """GAE lambda (1 = Monte-Carlo return minus value; 0 = one-step TD)"""
    whiten_adv: bool = True
    """normalise advantages over the batch's response tokens"""
    clip_eps: float = 0.2
    """policy ratio clip range"""
    vf_clip: float = 0.2
    """value clip range around the old value (0 = no value clipping)"""
    vf_coef: float = 0.5
    """weight of the value loss (it only reaches the critic's parameters)"""
    kl_coef: float = 0.0
    """beta of the per-token KL penalty to the frozen initial policy in the reward (0 = no reference)"""
    sampler_is_cap: float = 2.0
    """cap C of the truncated importance weight min(pi_old / pi_sampler, C) per token, applied when the sampler is
    not the trainer's computation (the bf16 sampler copy on CUDA, vLLM); 0 = off"""
    # optimisation
    steps: int = 100
    """rollout batches (each followed by ppo_epochs * minibatches optimiser steps); a PPO step costs about
    3.5x a GRPO step here (pi_old, V_old, two epochs of policy and critic), and learns faster per batch"""
    ppo_epochs: int = 2
    """passes over each rollout batch"""
    minibatches: int = 1
    """optimiser steps per pass; the rollout batch is split into this many"""
    vf_lr: float = 3e-4
    """critic learning rate (AdamW, on --lr-schedule like the policy's --lr; the critic is clipped on its own)"""


def check_args(args: Args) -> None:
    """Fail early, naming the flag, instead of deep inside torch."""
    if args.prompts_per_step < 1 or args.steps < 1 or args.max_new_tokens < 1 or args.group_size < 1:
        raise SystemExit("--prompts-per-step, --group-size, --steps and --max-new-tokens must be positive")
    if args.minibatches < 1 or args.ppo_epochs < 1:  # before the modulo below (llm.check_plumbing: --kl-coef)
        raise SystemExit("--minibatches and --ppo-epochs must be positive")
    batch = args.prompts_per_step * args.group_size
    if batch % args.minibatches:
        raise SystemExit(f"--minibatches {args.minibatches} must divide the rollout batch "
                         f"(prompts_per_step * group_size = {batch})")
    if args.micro_batch_size < 1:
        raise SystemExit("--micro-batch-size must be positive")
    if not 0 <= args.gamma <= 1 or not 0 <= args.gae_lambda <= 1:
        raise SystemExit(f"--gamma and --gae-lambda must be in [0, 1], got {args.gamma} and {args.gae_lambda}")
    if not 0 < args.clip_eps < 1:
        raise SystemExit(f"--clip-eps must be in (0, 1), got {args.clip_eps}")
    if args.vf_clip < 0 or args.vf_coef < 0:
        raise SystemExit("--vf-clip and --vf-coef must be >= 0")
    if args.temperature <= 0:
        raise SystemExit("--temperature must be > 0 (greedy decoding is used for eval only)")
    if args.engine == "vllm" and not torch.cuda.is_available():
        raise SystemExit("--engine vllm needs a CUDA GPU; use --engine hf on CPU")


# ---- the idea: critic, per-token rewards, GAE, clipped policy and value losses ----
class Critic(torch.nn.Module):
    """A copy of the policy's decoder with a scalar head: V(x, o_<t) for every response position."""

    def __init__(self, policy):
        super().__init__()
        self.decoder = copy.deepcopy(policy.get_decoder())
        self.head = torch.nn.Linear(policy.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, ids, mask, pos):  # a forward of its own: FSDP2 gathers a sharded root's weights in it
        return self.head(self.decoder(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state)


def critic_values(critic: Critic, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """V_t for each response token t: the value of the state that emits token t; [B, C] (0 on padding)."""
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    P = prompt_ids.shape[1]
    return critic(ids, mask, pos)[:, P - 1:-1].squeeze(-1) * completion_mask


def make_critic(model, args: Args, accel) -> Critic:
    """The critic, from the initial policy's decoder: the policy's own when it is whole, a fresh load of the weights
    when FSDP2 has sharded it (no rank holds the full decoder), with the same gradient checkpointing; sharded like
    the policy."""
    if common.is_sharded(model):
        model, _ = common.load_model(args.model)
        if args.grad_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return common.shard(Critic(model).to(accel.device).train(), accel)


def token_rewards(scores, mask, logp=None, ref_logp=None, kl_coef: float = 0.0):
    """r_t: the sequence score on the last response token, minus kl_coef * (logp - ref_logp) per token.

    scores [B]; mask, logp, ref_logp [B, C] -> [B, C].
    """
    last = (mask.sum(1) - 1).clamp(min=0).long()
    r = torch.zeros_like(mask, dtype=torch.float)
    r[torch.arange(len(scores)), last] = scores.float()
    if kl_coef and ref_logp is not None:
        r = r - kl_coef * (logp - ref_logp) * mask
    return r * mask


def gae(rewards, values, mask, gamma: float, lam: float):
    """Generalised advantage estimation over response tokens; all [B, C] -> (advantages, returns).

    The value after the last response token is 0 (the episode ends there).
    """
    B, C = rewards.shape
    adv = torch.zeros_like(rewards)
    last = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(C)):
        nxt_mask = mask[:, t + 1] if t + 1 < C else torch.zeros_like(mask[:, 0])
        next_v = values[:, t + 1] * nxt_mask if t + 1 < C else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        last = delta + gamma * lam * last * nxt_mask
        adv[:, t] = last * mask[:, t]
    return adv, (adv + values) * mask


def whiten(x, mask, eps: float = 1e-8):
    """(x - mean) / (std + eps) over the positions where mask is 1 (0 elsewhere), of the whole step's batch: with
    several processes the mean and variance are over every rank's positions."""
    dist = torch.distributed
    if dist.is_initialized() and dist.get_world_size() > 1:
        n_sum = torch.stack([mask.sum(), common.masked_sum(x, mask)]).double()
        dist.all_reduce(n_sum)
        mean = (n_sum[1] / n_sum[0].clamp(min=1)).to(x.dtype)
        sq = common.masked_sum((x - mean) ** 2, mask).double()
        dist.all_reduce(sq)
        var = (sq / n_sum[0].clamp(min=1)).to(x.dtype)
    else:
        mean = common.masked_mean(x, mask)
        var = common.masked_mean((x - mean) ** 2, mask)
    return (x - mean) / (var.sqrt() + eps) * mask


def ppo_advantages(scores, mask, old_logp, old_values, ref_logp, args: Args):
    """Per-token rewards -> GAE -> (whitened) advantages A_t, and the value targets R_t; [B, C] each."""
    rewards = token_rewards(scores, mask, old_logp, ref_logp, args.kl_coef)
    adv, returns = gae(rewards, old_values, mask, args.gamma, args.gae_lambda)
    return (whiten(adv, mask) if args.whiten_adv else adv), returns


def clipped_pg_loss(logp, old_logp, adv, eps: float):
    """Per-token PPO-clip loss -min(rho A, clip(rho, 1-eps, 1+eps) A); logp, old_logp, adv all [B, C].

    Returns (loss [B, C], clipped [B, C] as float: where the clipped branch was the active one).
    """
    ratio = torch.exp(logp - old_logp)
    unclipped, clipped = ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).float()


def clipped_value_loss(values, old_values, returns, clip: float):
    """1/2 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2) per token (c = 0: plain squared error)."""
    loss = (values - returns) ** 2
    if clip > 0:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, (v_clip - returns) ** 2)
    return 0.5 * loss


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


def truncated_is_weight(old_logp, sampler_logp, cap: float):
    """w_t = min(pi_old(o_t) / pi_sampler(o_t), C): corrects the update for samples drawn by another computation
    than the trainer's (truncated importance sampling, as verl's rollout correction); no gradient."""
    return torch.exp(old_logp - sampler_logp).clamp(max=cap).detach()


def ppo_loss(logp, mb: dict, n_seqs: int, n_tokens: int, args: Args):
    """This micro-batch's share of J: clipped surrogate + vf_coef * clipped value loss, token-mean over the step.

    logp [b, C] and mb["values"] [b, C] carry grad; mb holds old, adv, old_values, returns, mask, all [b, C], and
    is_weight (the sampler correction of the policy term, or None). Returns (loss, per-token stats).
    """
    pg, clipped = clipped_pg_loss(logp, mb["old"], mb["adv"], args.clip_eps)
    if mb.get("is_weight") is not None:  # the sampler is not the trainer: truncated importance weight per token
        pg = pg * mb["is_weight"]
    vf = clipped_value_loss(mb["values"], mb["old_values"], mb["returns"], args.vf_clip)
    moved = ((mb["values"].detach() - mb["old_values"]).abs() > args.vf_clip).float()  # value clip active
    stats = {"pg": pg, "vf": vf, "clipfrac": clipped, "vf_clipfrac": moved}
    return aggregate_loss(pg + args.vf_coef * vf, mb["mask"], "token-mean", n_seqs, n_tokens, 0), stats


def explained_variance(values, returns, mask) -> float:
    """1 - Var(R - V) / Var(R) over response tokens: 1 = perfect critic, 0 = no better than a constant."""
    v, r = values[mask.bool()], returns[mask.bool()]
    var_r = r.var()
    return float(1 - (r - v).var() / var_r) if var_r > 0 else float("nan")


# ---- rollout and update ----
def rollout(sampler, tok, task, args: Args, rng, device) -> dict:
    """Sample G completions for each of prompts_per_step training prompts; reward them (the critic gives A_t)."""
    examples = task.sample("train", args.prompts_per_step, rng)
    ro = common.generate(sampler, tok, common.encode_prompts(tok, [e.prompt for e in examples]), args.group_size,
                         args.max_new_tokens, args.temperature, args.top_p)
    answers = [e.answer for e in examples for _ in range(args.group_size)]
    rewards = torch.tensor([task.verify(t, a)[0] for t, a in zip(ro.texts, answers)], device=device)
    batch = {k: getattr(ro, k).to(device) for k in
             ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs")}
    batch.update(rewards=rewards, finish_reasons=ro.finish_reasons)
    return batch


def optimizer_step(model, opt, args: Args, step: int, total: int, sampler, critic) -> float:
    """llm.optimizer_step (the policy's clip and NaN guard, the scheduled --lr, the step, the sampler's refresh) with
    the critic: clipped on its own, and its parameter group (opt's second) stepped at --vf-lr on the same schedule
    (llm.optimizer_step gives every group the policy's rate: a hook sets the critic's just before opt.step).
    Returns the policy's gradient norm."""
    torch.nn.utils.clip_grad_norm_(critic.parameters(), args.max_grad_norm)
    vf_lr = args.vf_lr * llm.lr_factor(step, total, args)

    def critic_lr(optimizer, *_):
        optimizer.param_groups[1]["lr"] = vf_lr

    hook = opt.register_step_pre_hook(critic_lr)
    try:
        return llm.optimizer_step(model, opt, args, step, total, sampler)
    finally:
        hook.remove()


def update(model, opt, batch: dict, loss_fn, args: Args, step: int, accel, sampler, ref_model=None,
           critic=None) -> dict:
    """ppo_epochs x minibatches optimiser steps of policy and critic on one rollout batch.

    pi_old, V_old (and pi_ref) are scored before any update and give the per-token advantages and value
    targets of the whole batch (ppo_advantages); each micro-batch then runs policy and critic, its loss
    normalised by counts over its whole mini-batch on all ranks, so accumulation and data parallelism leave J
    unchanged. When the sampler is not the trainer's computation, each token's policy loss is weighted by
    truncated_is_weight(pi_old, pi_sampler), fixed for the batch.
    """
    B = batch["completion_ids"].shape[0]
    micro = lambda idx: idx.split(args.micro_batch_size)  # noqa: E731
    logprobs_of = lambda m, idx, ent=False: common.token_logprobs(  # noqa: E731
        m, batch["prompt_ids"][idx], batch["prompt_mask"][idx], batch["completion_ids"][idx],
        batch["completion_mask"][idx], args.temperature, with_entropy=ent)
    values_of = lambda idx: critic_values(critic, batch["prompt_ids"][idx], batch["prompt_mask"][idx],  # noqa: E731
                                          batch["completion_ids"][idx], batch["completion_mask"][idx])
    mask = batch["completion_mask"].float()
    with torch.no_grad():
        old = torch.cat([logprobs_of(model, i) for i in micro(torch.arange(B))])
        old_v = torch.cat([values_of(i) for i in micro(torch.arange(B))])
        ref = torch.cat([logprobs_of(ref_model, i) for i in micro(torch.arange(B))]) if ref_model else None
        adv, returns = ppo_advantages(batch["rewards"], mask, old, old_v, ref, args)
    correct = args.sampler_is_cap > 0 and not sampler.is_trainer  # the sampler is another computation
    is_weight = truncated_is_weight(old, batch["logprobs"], args.sampler_is_cap) if correct else None
    # Sampler-vs-trainer log-prob gap on the sampler's weights: measured before any update of this batch. Sums
    # over all ranks, divided by global counts (explained variance is this rank's: a ratio of variances).
    before = {"rollout/logprob_mismatch": common.masked_sum((old - batch["logprobs"]).abs(), mask).item(),
              "value/mean": common.masked_sum(old_v, mask).item(),
              "loss/kl": common.masked_sum(k3_kl(old, ref), mask).item() if ref is not None else 0.0,
              "tokens": mask.sum().item()}
    if correct:
        before.update({"rollout/is_weight_mean": common.masked_sum(is_weight, mask).item(),
                       "rollout/is_truncated_frac": common.masked_sum((is_weight >= args.sampler_is_cap).float(),
                                                                      mask).item()})
    before = llm.all_ranks_sum(before, accel, mask.device)
    before = {k: v / max(before["tokens"], 1) for k, v in before.items() if k != "tokens"}
    before["value/explained_var"] = explained_variance(old_v, returns, mask)
    stats = {"entropy": 0.0, "grad_norm": 0.0}
    n_opt, total = 0, args.steps * args.ppo_epochs * args.minibatches
    for _ in range(args.ppo_epochs):
        for mb_idx in (torch.randperm(B) if args.minibatches > 1 else torch.arange(B)).chunk(args.minibatches):
            n_seqs, n_tokens = llm.step_counts(batch["completion_mask"][mb_idx], accel)
            opt.zero_grad(set_to_none=True)
            for idx in micro(mb_idx):
                logp, ent = logprobs_of(model, idx, True)
                mb = {"adv": adv[idx], "mask": mask[idx], "old": old[idx], "values": values_of(idx),
                      "old_values": old_v[idx], "returns": returns[idx],
                      "is_weight": None if is_weight is None else is_weight[idx]}
                loss, token_stats = loss_fn(logp, mb, n_seqs, n_tokens, args)
                if not torch.isfinite(loss):
                    raise SystemExit(f"non-finite loss at step {step}; the last checkpoint is intact. "
                                     "Lower --lr / --vf-lr or check the rewards.")
                loss.backward()
                for k, v in {**token_stats, "entropy": ent}.items():
                    stats[k] = stats.get(k, 0.0) + common.masked_sum(v.detach(), mb["mask"]).item() / n_tokens
            opt_step = (step - 1) * args.ppo_epochs * args.minibatches + n_opt  # derived: resume-safe
            stats["grad_norm"] += optimizer_step(model, opt, args, opt_step, total, sampler, critic)
            n_opt += 1
    # each rank's share of the step means: summed over ranks (the norm is already global)
    stats.update(llm.all_ranks_sum({k: v for k, v in stats.items() if k != "grad_norm"}, accel, mask.device))
    return {**{f"loss/{k}": v / n_opt for k, v in stats.items()}, **before}


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    run = llm.Run(args)  # accelerator, threads, seed, the task and its held-out sets, the run folder
    # sharded when several processes run; the sampler decodes (the trainer itself on CPU)
    model, tok, ref_model, sampler = llm.load_policy(args, run.accel, with_ref=args.kl_coef > 0)
    critic = make_critic(model, args, run.accel)
    opt = llm.make_optimizer([{"params": list(model.parameters())},
                              {"params": list(critic.parameters()), "lr": args.vf_lr}], args)
    run.start(model, tok, opt, sampler, extra={"critic": critic})  # resume (the critic too), step-0 evaluation
    for step, rng in run.steps():  # every random draw of a step depends on (seed, step, rank) only
        with run.timer("gen"):
            batch = rollout(sampler, tok, run.task, args, rng, run.accel.device)
        with run.timer("train"):  # includes the sampler's refresh after each optimiser step
            stats = update(model, opt, batch, ppo_loss, args, step, run.accel, sampler, ref_model, critic)
        metrics = run.log_step(step, batch, stats)  # rollout metrics, evaluation every --eval-every, checkpoints
        if run.is_main:
            run.bar.set_postfix(reward=f"{metrics['rollout/reward']:.2f}", ev=f"{metrics['value/explained_var']:.2f}",
                                acc=f"{run.last('eval/acc'):.2f}")
    ev = [h["value/explained_var"] for h in run.history if "value/explained_var" in h]
    return run.finish("PPO", extra={"explained_var_last": float(np.nanmean(ev[-10:]))})


if __name__ == "__main__":
    main(tyro.cli(Args))
