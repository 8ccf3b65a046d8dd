"""Multi-turn GRPO: a policy that acts over several turns and reads what a tool environment answers.

Every agent-RL framework (TRL, verl, OpenRLHF, slime, AReaL, ROLL, prime-rl) trains policies this way; this is the
smallest version of it. Papers: GRPO from Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in
Open Language Models", arXiv:2402.03300, applied to whole trajectories as in agentic GRPO (the baselines of
"Hierarchy-of-Groups Policy Optimization for Long-Horizon Agentic Tasks", arXiv:2602.22817, and of "ECHO: Terminal
Agents Learn World Models for Free", arXiv:2605.24517; algos/hgpo.py and algos/echo.py build on this file).

The environment is algos/_toolenv.py's LookupEnv: the prompt names three keys of a hidden key-value store (`b+d+a?`),
the policy looks them up (`#b` -> `=4;`, ...) and answers their sum (`!13`). A rollout runs turn by turn (_toolenv.play):
one batched generation per turn, the sampled action and then the environment's observation tokens appended to the
context, until the policy answers, the turn limit (--max-turns) or the context limit (--max-context) ends the
episode (reward 0, observation `end;`); a malformed action is answered `err;`.

Equations (each implemented by the function named on the right):
  trajectory         tau_i = (a_i1, o_i1, a_i2, o_i2, ..., a_iT),  reward R_i at the end          rollout, pack_episodes
  group advantage    A_i = (R_i - mean(R_1..R_G)) / (std(R_1..R_G) + eps)  (G episodes of one seed)  group_advantages
                     the same A_i on every action token of tau_i
  clipped surrogate  l_it = -min(rho_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) A_i)         clipped_pg_loss
                     on action tokens only: observation tokens are in the context (attended to) but masked out of
                     the policy loss (update: mask = action_mask)
  aggregation        as grpo.py (--loss-agg), the normaliser counting action tokens                aggregate_loss
  environment CE     CE_env = -1/|O| sum_{t in O} log pi(o_t | context): observation tokens O of held-out
                     rollouts of the initial policy (eval/env_ce) and of the training batch (loss/env_ce); logged,
                     not trained on here (algos/echo.py trains on it)                              env_token_ce

Parent: algos/grpo.py; changed: Args, Args.eval_every, Args.eval_examples, Args.exp_name, Args.group_size, Args.lr,
Args.max_new_tokens, Args.model, Args.prompts_per_step, Args.seed, Args.steps, Args.temperature, check_args, rollout,
update, main.

Deviations:
- The environment is a key-value lookup with a sum of three one-digit values, not a terminal, a web shop or a
  household simulator; it needs four turns and its observations carry the values the answer depends on.
- Trajectory-level advantages only (one A_i per episode); stepwise advantages are algos/hgpo.py.
- Rollouts at temperature 0.7 by default, not 1 (the trainer scores with the same temperature, so the update is the
  on-policy one for the tempered policy): at 1.0 the tiny policy's sampled episodes fail far more often than its
  greedy ones and the same run gained nothing in its first 20 steps.
- The action budget (--max-new-tokens) is per turn; an action that hits it without EOS is still sent to the
  environment (it is usually answered `err;`).
- No Triton kernels (--kernels) and no harder held-out split: the held-out set is episodes (store and query)
  that training never plays.
- Several processes (FSDP2, as grpo.py) are untested here: the episodes and their limits run on every rank.

Commands:
  python algos/multiturn_grpo.py                                   # tiny default, 2-core CPU, 1-4 minutes
  python algos/multiturn_grpo.py --max-turns 6 --max-context 60    # looser limits
  python algos/multiturn_grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --device cuda --lr 1e-6 --max-new-tokens 16
Expected: held-out greedy episode success of tiny-toolenv 53.3% -> 68.3 ± 6.0% after the default 90 rollout batches
(3 seeds: +20.0, +8.4, +16.7 points; the lookups become perfect and the answer turn, 61% at the start, ends at 62-73%)
in 216-235 s on one thread of 2 shared cores (the default, 2 threads on an idle 2-core machine: seed 0 the same
+20.0 points in 50 s); at 60 batches (the earlier default) 62.1 ± 3.1%. The held-out
environment-token cross-entropy barely moves (11.41 -> 11.01 ± 0.32 nats). Rows: benchmarks/results/multiturn.csv,
table benchmarks/results/multiturn.md.
"""
from __future__ import annotations

import copy
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import tyro
from tqdm import tqdm

import common
from algos import _toolenv
from algos._vllm import VLLMEngine


@dataclass
class Args:
    # bookkeeping
    exp_name: str = "multiturn_grpo"
    """name of the run (the output folder is out_dir/exp_name)"""
    seed: int = 0
    """random seed: episodes and sampling of step s depend only on (seed, s, rank), which makes resume exact"""
    track: bool = False
    """log to Weights & Biases as well (WANDB_MODE=offline works without network)"""
    out_dir: str = "runs"
    """where metrics.jsonl, summary.json, the curve and checkpoints go"""
    # model and environment
    model: str = "tiny-toolenv"
    """tiny-toolenv (SFT'd on the environment's traces), a Hugging Face id or a local path"""
    n_keys: int = 4
    """keys in each episode's hidden store"""
    n_query: int = 3
    """keys whose values the answer sums (each needs a lookup turn)"""
    value_digits: int = 1
    """digits of the stored values (the answer is the sum of two of them)"""
    max_turns: int = 5
    """turn limit: an episode with this many actions and no answer ends with reward 0"""
    max_context: int = 40
    """context limit in characters of the transcript (prompt, actions, observations); passing it ends with reward 0"""
    device: str = "auto"
    """auto (CUDA if present), cpu or cuda"""
    threads: int = 2
    """torch CPU threads per process"""
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """compute dtype: auto = bf16 autocast on CUDA (fp32 weights, optimiser, log-softmax and losses), fp32 on CPU"""
    # rollout
    engine: Literal["hf", "vllm"] = "hf"
    """rollout engine: Hugging Face generate (CPU or GPU) or vLLM (GPU)"""
    vllm_gpu_memory: float = 0.3
    """fraction of GPU memory vLLM may take (the trainer shares the GPU)"""
    prompts_per_step: int = 16
    """distinct episodes (seeds) per rollout batch (per process)"""
    group_size: int = 8
    """episodes per seed (G)"""
    max_new_tokens: int = 6
    """generation budget per action (turn)"""
    temperature: float = 0.7
    """sampling temperature (the trainer scores with the same temperature); below 1 so that more sampled episodes
    get their lookups right and reach the answer turn (at 1.0 the tiny policy solves about 20% of them)"""
    top_p: float = 1.0
    """nucleus sampling threshold"""
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
    # optimisation
    steps: int = 90
    """rollout batches (each followed by ppo_epochs * minibatches optimiser steps)"""
    ppo_epochs: int = 1
    """passes over each rollout batch"""
    minibatches: int = 1
    """optimiser steps per pass; the rollout batch is split into this many"""
    micro_batch_size: int = 256
    """sequences per forward/backward (gradient accumulation inside a mini-batch)"""
    lr: float = 2e-4
    """peak learning rate (AdamW)"""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """after warm-up: constant, or cosine decay to 10% over all optimiser steps"""
    warmup_steps: int = 0
    """linear warm-up (optimiser steps)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""
    grad_checkpointing: bool = False
    """recompute each decoder layer in the backward (HF, non-reentrant): activations of one layer instead of all;
    off by default: the tiny CPU default needs no memory and its update takes 1.4x as long with it (0.87 vs 0.62 s
    for 256 sequences on one thread); on for real models on a GPU (benchmarks/results/memory_plan.md)"""
    sampler_is_cap: float = 2.0
    """cap C of the truncated importance weight min(pi_old / pi_sampler, C) per token, applied when the sampler is
    not the trainer's computation (the bf16 sampler copy on CUDA, vLLM); 0 = off"""
    # eval and checkpoints
    eval_every: int = 30
    """rollout batches between held-out evaluations"""
    eval_examples: int = 300
    """held-out episodes for greedy success and per-turn accuracy"""
    env_ce_examples: int = 64
    """held-out episodes (sampled once from the initial policy) whose observation tokens give eval/env_ce"""
    save_every: int = 0
    """rollout batches between checkpoints (0 = only at the end)"""
    resume: str = ""
    """checkpoint folder to resume from (exact: same metrics as an uninterrupted run)"""


def check_args(args: Args) -> None:
    """Fail early, naming the flag, instead of deep inside torch."""
    if args.group_size < 2:
        raise SystemExit(f"--group-size must be at least 2 for a group baseline, got {args.group_size}")
    if args.prompts_per_step < 1 or args.steps < 1 or args.max_new_tokens < 1:
        raise SystemExit("--prompts-per-step, --steps and --max-new-tokens must be positive")
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
    if args.max_turns < 1 or args.max_context < 8 or not 1 <= args.value_digits <= 4 or \
            not 2 <= args.n_query <= args.n_keys <= 26:
        raise SystemExit("--max-turns >= 1, --max-context >= 8, --value-digits in 1..4, 2 <= --n-query <= --n-keys <= 26")


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


def env_token_ce(model, batch: dict, args: Args) -> float:
    """CE_env = -mean log pi(o_t | context) over the observation tokens of a packed batch (no gradient), under the
    model's own distribution (temperature 1, whatever the sampling temperature)."""
    with torch.no_grad():
        logp = common.token_logprobs(model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                                     batch["completion_mask"], 1.0)
    return -common.masked_mean(logp, batch["obs_mask"].float()).item()


# ---- rollout and update ----
def make_env(args: Args) -> _toolenv.LookupEnv:
    return _toolenv.LookupEnv(args.n_keys, args.value_digits, args.max_turns, args.max_context, args.n_query)


def pack_episodes(eps: list, prompts: list[list[int]], tok, device) -> dict:
    """Finished episodes -> tensors: prompt [B, P] left-padded; completion [B, C] right-padded (actions and
    observations); completion_mask (attention: every real token), action_mask (the policy loss), obs_mask, turn
    (the turn of each token, -1 on padding) and behaviour log-probs (0 off actions)."""
    prompt_ids, prompt_mask = common.left_pad(prompts, tok.pad_token_id)
    C = max(1, max(len(e.ids) for e in eps))
    pad = lambda rows, v: torch.tensor([r + [v] * (C - len(r)) for r in rows])  # noqa: E731
    kind = pad([e.kind for e in eps], 0)
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
             "completion_ids": pad([e.ids for e in eps], tok.pad_token_id), "completion_mask": (kind > 0).long(),
             "action_mask": (kind == 1).long(), "obs_mask": (kind == 2).long(), "turn": pad([e.turn for e in eps], -1),
             "logprobs": pad([e.logprobs for e in eps], 0.0).float(),
             "rewards": torch.tensor([e.reward for e in eps], dtype=torch.float32)}
    return {k: v.to(device) for k, v in batch.items()}


def rollout(model, tok, env, args: Args, rng, device, engine=None) -> dict:
    """G episodes of each of prompts_per_step training seeds, played turn by turn; A_i per group of G."""
    seeds = env.seeds("train", args.prompts_per_step, rng)
    envs = [env.clone() for _ in seeds for _ in range(args.group_size)]
    prompts = common.encode_prompts(tok, [e.reset(s) for e, s in zip(envs, np.repeat(seeds, args.group_size))])
    eps = _toolenv.play(model, tok, envs, prompts, args.max_new_tokens, args.temperature, engine=engine)
    batch = pack_episodes(eps, prompts, tok, device)
    batch.update(adv=group_advantages(batch["rewards"], args.group_size, args.adv_std_norm), episodes=eps,
                 finish_reasons=["stop" if e.env.reward or e.observations[-1] == "" else "length" for e in eps])
    return batch


def lr_factor(step: int, total: int, args: Args) -> float:
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    if args.lr_schedule == "constant":
        return 1.0
    progress = (step - args.warmup_steps) / max(1, total - args.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def optimizer_step(model, opt, args: Args, accel, opt_step: int) -> float:
    """NaN guard, clip, scheduled lr, step; returns the gradient norm. With several processes FSDP2 has already
    summed the gradients over ranks (the loss used step-global normalisers) and the norm is the global one; the
    full sampler copy of a sharded model is gathered again after the step."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
    grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor when sharded
    if not math.isfinite(grad_norm):  # the same global value on every rank, so all ranks stop together
        raise SystemExit(f"non-finite loss or gradient at optimiser step {opt_step}; the last checkpoint is "
                         "intact. Lower --lr or check the rewards.")
    for group in opt.param_groups:
        group["lr"] = args.lr * lr_factor(opt_step, args.steps * args.ppo_epochs * args.minibatches, args)
    opt.step()
    common.sync_sampler(model)
    return grad_norm


def update(model, opt, batch: dict, loss_fn, args: Args, step: int, accel, ref_model=None, fused_logprob=None) -> dict:
    """ppo_epochs x minibatches optimiser steps on one rollout batch (micro-batches accumulate gradients).

    As grpo.py's update, with the policy loss on action tokens only (mb["mask"] = action_mask, and the token counts
    are action tokens; the observation tokens are attended to through completion_mask); mb also carries the
    observation mask and the step's count of observation tokens (n_obs) for losses on them (algos/echo.py), and the
    training batch's environment-token cross-entropy is logged (loss/env_ce, at the sampling temperature: the
    quantity ECHO's term trains; eval/env_ce is at temperature 1).
    """
    B = batch["completion_ids"].shape[0]
    micro = lambda idx: idx.split(args.micro_batch_size)  # noqa: E731
    logprobs_of = lambda m, idx, ent=False: common.token_logprobs(  # noqa: E731
        m, batch["prompt_ids"][idx], batch["prompt_mask"][idx], batch["completion_ids"][idx],
        batch["completion_mask"][idx], args.temperature, with_entropy=ent, fused_fn=fused_logprob)
    on_policy = args.ppo_epochs == 1 and args.minibatches == 1  # then pi_old = pi_theta.detach()
    with torch.no_grad():
        old = None if on_policy else torch.cat([logprobs_of(model, i) for i in micro(torch.arange(B))])
        ref = torch.cat([logprobs_of(ref_model, i) for i in micro(torch.arange(B))]) if ref_model else None
    correct = args.sampler_is_cap > 0 and (args.engine == "vllm" or not common.sampler_is_trainer(model))
    sums = {"pg": 0.0, "entropy": 0.0, "env_ce": 0.0}  # this rank's share of each step mean, summed over ranks below
    # Sampler-vs-trainer log-prob gap on the sampler's weights: measured before any update of this batch.
    gap = {"sum": 0.0 if on_policy else common.masked_sum((old - batch["logprobs"]).abs(),
                                                          batch["action_mask"].float()).item(),
           "tokens": float(batch["action_mask"].sum()), "is_w": 0.0, "is_cut": 0.0}
    n_opt, grad_norm = 0, 0.0
    for epoch in range(args.ppo_epochs):
        for mb_idx in (torch.randperm(B) if args.minibatches > 1 else torch.arange(B)).chunk(args.minibatches):
            counts = torch.tensor([len(mb_idx), int(batch["action_mask"][mb_idx].sum()),
                                   int(batch["obs_mask"][mb_idx].sum())], dtype=torch.float64,
                                  device=batch["adv"].device)
            n_seqs, n_tokens, n_obs = (int(c) for c in (accel.reduce(counts, "sum") if accel.num_processes > 1
                                                        else counts))
            opt.zero_grad(set_to_none=True)
            for idx in micro(mb_idx):
                logp, ent = logprobs_of(model, idx, True)
                mb = {"adv": batch["adv"][idx], "mask": batch["action_mask"][idx].float(),
                      "obs_mask": batch["obs_mask"][idx].float(), "n_obs": n_obs,
                      "old": logp.detach() if old is None else old[idx], "ref": None if ref is None else ref[idx]}
                mb["is_weight"] = truncated_is_weight(mb["old"], batch["logprobs"][idx], args.sampler_is_cap) \
                    if correct else None
                loss, token_stats = loss_fn(logp, mb, n_seqs, n_tokens, args)
                loss.backward()  # a NaN here reaches every rank's gradient: optimizer_step stops them all
                sums["pg"] += loss.item()
                sums["env_ce"] -= common.masked_sum(logp.detach(), mb["obs_mask"]).item() / max(n_obs, 1)
                for k, v in {**token_stats, "entropy": ent}.items():
                    sums[k] = sums.get(k, 0.0) + common.masked_sum(v.detach(), mb["mask"]).item() / max(n_tokens, 1)
                if on_policy:  # the only forward on the sampler's weights
                    gap["sum"] += common.masked_sum((logp.detach() - batch["logprobs"][idx]).abs(), mb["mask"]).item()
                if correct and epoch == 0:  # every token once
                    gap["is_w"] += common.masked_sum(mb["is_weight"], mb["mask"]).item()
                    gap["is_cut"] += common.masked_sum((mb["is_weight"] >= args.sampler_is_cap).float(),
                                                       mb["mask"]).item()
            opt_step = (step - 1) * args.ppo_epochs * args.minibatches + n_opt  # derived: resume-safe
            grad_norm += optimizer_step(model, opt, args, accel, opt_step)
            n_opt += 1
    keys = sorted(sums) + [f"gap_{k}" for k in gap]
    tot = torch.tensor([*(sums[k] for k in sorted(sums)), *gap.values()], dtype=torch.float64,
                       device=batch["adv"].device)
    tot = dict(zip(keys, (accel.reduce(tot, "sum") if accel.num_processes > 1 else tot).tolist()))
    out = {**{f"loss/{k}": tot[k] / n_opt for k in sums}, "loss/grad_norm": grad_norm / n_opt,
           "rollout/logprob_mismatch": tot["gap_sum"] / max(tot["gap_tokens"], 1)}
    if correct:
        out.update({"rollout/is_weight_mean": tot["gap_is_w"] / max(tot["gap_tokens"], 1),
                    "rollout/is_truncated_frac": tot["gap_is_cut"] / max(tot["gap_tokens"], 1)})
    return out


# ---- eval ----
def held_out_ce_batch(model, tok, env, args: Args, device) -> dict:
    """A fixed set of held-out rollouts of the initial policy (temperature 1): its observation tokens are where
    eval/env_ce is measured, on trajectories the trained policy did not generate."""
    seeds = env.seeds("test", args.env_ce_examples, np.random.default_rng(54321))
    envs = [env.clone() for _ in seeds]
    prompts = common.encode_prompts(tok, [e.reset(s) for e, s in zip(envs, seeds)])
    with torch.random.fork_rng():
        torch.manual_seed(54321)
        eps = _toolenv.play(model, tok, envs, prompts, args.max_new_tokens, args.temperature)
    return pack_episodes(eps, prompts, tok, device)


def evaluate(model, tok, env, seeds: list[int], ce_batch: dict, args: Args, engine=None) -> dict:
    """eval/acc (greedy held-out success), eval/tool_use, eval/turn<k>_acc (teacher-forced), eval/env_ce."""
    res = _toolenv.evaluate(model, tok, env, seeds, args.max_new_tokens, engine=engine)
    out = {"eval/acc": res.pop("success"), **{f"eval/{k}": v for k, v in res.items()}}
    return {**out, "eval/env_ce": env_token_ce(model, ce_batch, args)}


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    from accelerate import Accelerator

    accel = Accelerator(cpu=args.device == "cpu" or not torch.cuda.is_available())
    rank, is_main = accel.process_index, accel.is_main_process
    torch.set_num_threads(args.threads)
    common.set_seed(args.seed)
    env = make_env(args)
    eval_seeds = env.seeds("test", args.eval_examples, np.random.default_rng(12345))
    model, tok = common.load_model(args.model, accel.device, args.dtype)
    model.train()
    if args.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if args.kl_coef > 0 else None
    model, ref_model = common.shard(model, accel), common.shard(ref_model, accel, sampler=False)  # >1 process
    engine = VLLMEngine(common.resolve_model_path(args.model), args.vllm_gpu_memory, seed=args.seed + rank) \
        if args.engine == "vllm" else None
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    ce_batch = held_out_ce_batch(model, tok, env, args, accel.device)  # before any update (and any resume)

    run_dir = Path(args.out_dir) / args.exp_name
    state = common.load_checkpoint(args.resume, model, opt) if args.resume else {}
    if args.resume and engine is not None:
        engine.sync_weights(model)
    start_step, history = state.get("step", 0), state.get("history", [])
    gen_tokens, gen_time = state.get("gen_tokens", 0), state.get("gen_time", 0.0)
    tracker = common.Tracker(run_dir, args, args.track, run_name=args.exp_name) if is_main else None
    timer, t_start = common.Timer(), time.time() - state.get("wall_s", 0.0)
    evaluate_now = lambda: evaluate(model, tok, env, eval_seeds, ce_batch, args, engine)  # noqa: E731

    def log(metrics: dict, step: int):
        history.append({"step": step, **metrics})
        if tracker is not None:
            tracker.log(metrics, step)

    if start_step == 0 and is_main:
        log(evaluate_now(), 0)
    bar = tqdm(range(start_step + 1, args.steps + 1), desc="multiturn_grpo", dynamic_ncols=True,
               disable=not is_main, initial=start_step, total=args.steps)
    for step in bar:
        # Every random draw of this step depends on (seed, step, rank) only: resuming is exact.
        torch.manual_seed(hash((args.seed, step, rank)) % 2**31)
        rng = np.random.default_rng([args.seed, step, rank])
        with timer("gen"):
            batch = rollout(model, tok, env, args, rng, accel.device, engine)
        with timer("train"):
            stats = update(model, opt, batch, grpo_loss, args, step, accel, ref_model)
        if engine is not None:
            with timer("sync"):
                engine.sync_weights(model)
        t = timer.pop()
        gen_tokens, gen_time = gen_tokens + int(batch["action_mask"].sum()), gen_time + t["gen"]
        metrics = {**common.rollout_metrics(batch["rewards"], batch["action_mask"], batch["finish_reasons"],
                                            args.group_size, t["gen"]), **stats, "perf/lr": opt.param_groups[0]["lr"],
                   "rollout/turns": float(np.mean([len(e.actions) for e in batch["episodes"]])),
                   **{f"perf/{k}_s": v for k, v in t.items()}}
        if is_main and (step % args.eval_every == 0 or step == args.steps):
            metrics.update(evaluate_now())
        log(metrics, step)
        if is_main:
            bar.set_postfix(reward=f"{metrics['rollout/reward']:.2f}",
                            acc=f"{next(h['eval/acc'] for h in reversed(history) if 'eval/acc' in h):.2f}")
        if args.save_every and step % args.save_every == 0 or step == args.steps:  # every rank: shards
            common.save_checkpoint(run_dir / "checkpoint", accel.unwrap_model(model), tok, opt,
                                   {"step": step, "history": history, "wall_s": time.time() - t_start,
                                    "gen_tokens": gen_tokens, "gen_time": gen_time})
    if not is_main:
        return {}
    summary = common.summarize(history, gen_tokens, gen_time, time.time() - t_start)
    common.save_curve(history, run_dir / "curve.png", f"multi-turn GRPO on {env.name} ({args.model})")
    return tracker.finish(summary)


if __name__ == "__main__":
    main(tyro.cli(Args))
