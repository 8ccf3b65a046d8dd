"""Semi-online RL: roll out along expert trajectories, keep the policy's own turns, patch where it diverges.

Paper: "UI-S1: Advancing GUI Automation via Semi-online Reinforcement Learning", arXiv:2509.11543. Offline step-level training sees only the expert's histories; online RL needs
the live environment for every rollout. Semi-online RL plays the policy turn by turn along a recorded expert
trajectory: the policy's own action stays in the dialogue when it matches the expert's step, and where it diverges a
Patch Module puts the expert's action (and what the environment answered to it) into the context so that the rollout
continues on the expert's path. Every step the policy proposed is scored and trained; the rewards enter through
discounted future returns, and step-level and episode-level advantages are added. The Semi-Online Performance (SOP)
read off such rollouts is the paper's proxy for online success.

The environment is algos/_toolenv.py's LookupEnv (look up three keys of a hidden store, answer their sum), whose
`expert_action` is the scripted expert of any state; the parent is algos/multiturn_grpo.py (--mode online is it).

Equations (episode i of a seed's group of G, turn t; h_it the patched history before turn t):
  proposal           a_it ~ pi(. | h_it)                                                           patched_play
  match              m_it = accepts(env, a_it): a lookup of a queried key not yet read, or the right sum  accepts
  patch              h_i,t+1 = h_it + a_it + o(a_it)            if m_it
                     h_i,t+1 = h_it + a*_it + EOS + o(a*_it)    otherwise (a*_it = the expert's action; the
                     environment steps with a*_it); after --patch-budget patches a divergence ends the episode
  step reward        r_it = 1[m_it] (the final answer's match is the task's success)              patched_play
  discounted return  G_it = sum_{k >= t} gamma^(k - t) r_ik                                        discounted_returns
  episode advantage  A^E_i = (R_i - mean_g R) / (std_g R + eps),  R_i = sum_t r_it               semi_online_advantages
  step advantage     A^S_it = (G_it - mean G_.t) / (std G_.t + eps) over the group's episodes at turn t
  advantage          A_it = A^E_i + omega * A^S_it    (omega = --step-adv-weight)
  loss               multi-turn GRPO's clipped surrogate on the tokens of a_it given h_it, one row per step: the
                     policy's own action is trained, the expert's patch and every observation are context only
                                                                                   pack_steps, update, clipped_pg_loss
  SOP                sop = mean_i 1[no patch in episode i and it succeeded] (an episode without a patch is the one
                     online play would have produced); sop_progress = mean_i (steps before the first patch) / T*
                     (T* = n_query + 1 expert steps, 2 on --env calc: expert_steps), on greedy held-out patched
                     rollouts                                                              sop_metrics, sop_evaluate
  offline baseline   --mode offline-bc: one row per expert step (expert history, expert action), advantage 1; on-policy
                     the surrogate's gradient is the log-likelihood's (behaviour cloning)          expert_rollout

Parent: algos/multiturn_grpo.py; changed: Args, Args.steps, check_args, main. New: accepts, PatchedEpisode, patched_play,
discounted_returns, semi_online_advantages, sop_metrics, expert_steps, pack_steps, semi_online_rollout, expert_rollout,
sop_evaluate (--mode online runs the parent's rollout and update unchanged).

Deviations from the paper:
- The match test accepts any lookup of a queried key that is not read yet (any order) and any answer with the right
  sum (the scratchpad form `!X+Y=N` included), not a GUI action-type and coordinate match; a rejected action is
  patched with the scripted expert's next action from the current state (the expert of this environment is defined
  for every state, so the patched rollout always continues).
- The step reward is the match alone, 1[m_it]; the paper's format and action-type terms have no counterpart here.
- R_i, the episode-level return, is the undiscounted sum of the step rewards; the step-level group is the seed's
  episodes at the same turn index (their histories can differ); omega = 1 and gamma = 0.5 by default (choices, not
  the paper's values).
- SOP is measured as task success without a patch (and progress before the first patch) on greedy patched rollouts of
  the held-out seeds; the abstract names SOP as a proxy for online performance without its exact rule.
- Training rows are steps (prompt = patched history, completion = the proposed action), so --loss-agg averages over
  steps, not episodes, and --ppo-epochs / --minibatches stay 1 outside --mode online.
- The offline step-level baseline is behaviour cloning (log-likelihood of the expert's steps at the sampling
  temperature), not an offline RL objective, on prompts_per_step * group_size expert episodes per update.
- Everything else as algos/multiturn_grpo.py (the prompt-task flags refused, grpo.py's sampler correction).

Commands:
  python algos/semi_online.py                                    # semi-online RL, tiny default, 2-core CPU
  python algos/semi_online.py --mode online                      # multi-turn GRPO (the parent)
  python algos/semi_online.py --mode offline-bc                  # step-level behaviour cloning on expert steps
  python algos/semi_online.py --patch-budget 0                   # an episode ends at its first divergence
Expected (seeds 0 and 1, one thread of 2 cores shared with other jobs, about 15 minutes each there; 5.6 s per batch
on an idle thread, so about 6 minutes): held-out greedy online success of tiny-toolenv 53.3% -> 66.0% and 60.0% after
the default 60 rollout batches (+12.7, +6.7 points), after a dip at 30 batches (51.0%, 53.0%) while the lookups are
learned first (turns 1-3 at 99-100% by batch 30; SOP progress 79.2% -> 87.5%, 87.7% at 30 and 91.5%, 90.0% at 60);
the answer turn 61% -> 66%, 60%. SOP is within 1.3 points of online success at every one of these checkpoints (52.0 vs
53.3 at the start, then 51.0 vs 51.0, 52.7 vs 53.0, 66.0 vs 66.0, 60.0 vs 60.0): on this deterministic environment a
greedy episode without a patch is the online episode. Smaller batches do not learn: --prompts-per-step 8 for 60 batches gives +4.3 and -2.3 points,
and 4 prompts for 8 batches -14 and -18 (multi-turn GRPO in that setting: -26, seed 0).
Against its baselines (benchmarks/results/semi_online.md, 3 seeds, 60 batches): semi-online 64.9 +- 4.4%, online
(--mode online) 64.8 +- 3.0%, step-level behaviour cloning of the expert (--mode offline-bc) 88.2 +- 3.9%: here the
scripted expert is right in every state, so cloning it beats learning from the policy's own turns.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import tyro

import common
from algos import _llm as llm
from algos import _toolenv
from algos._llm import LLMArgs


@dataclass
class Args(LLMArgs):
    """Semi-online RL's flags: multi-turn GRPO's (environment, rollout, objective, optimisation) and the semi-online
    ones (mode, patch budget, discount, step-advantage weight); the plumbing flags are LLMArgs'. The environment is the
    task: --task, --digits, --top-p, --pass-k and --eval-hard are refused (check_args)."""
    # semi-online
    mode: Literal["semi-online", "online", "offline-bc"] = "semi-online"
    """semi-online: patched rollouts along the expert, step + episode advantages (this paper); online: multi-turn
    GRPO exactly (algos/multiturn_grpo.py); offline-bc: step-level behaviour cloning of the expert's steps"""
    patch_budget: int = -1
    """patches allowed per episode (-1: no limit; 0: an episode ends at its first divergence from the expert)"""
    gamma: float = 0.5
    """discount of the future step rewards in the step-level return G_t = sum_k gamma^k r_(t+k)"""
    step_adv_weight: float = 1.0
    """omega in A = A^episode + omega * A^step (0: episode-level advantages only)"""
    # plumbing defaults for the tool environment
    model: str = "tiny-toolenv"
    """tiny-toolenv (SFT'd on the environment's traces), a Hugging Face id or a local path"""
    max_new_tokens: int = 6
    """generation budget per action (turn)"""
    temperature: float = 0.7
    """sampling temperature (the trainer scores with the same temperature); below 1 so that more sampled episodes
    get their lookups right and reach the answer turn (at 1.0 the tiny policy solves about 20% of them)"""
    steps: int = 60
    """rollout batches (each followed by ppo_epochs * minibatches optimiser steps); 60 here (each batch trains one
    row per step, about 4 times multi-turn GRPO's rows)"""
    lr: float = 2e-4
    """peak learning rate (AdamW)"""
    eval_every: int = 30
    """rollout batches between held-out evaluations"""
    eval_examples: int = 300
    """held-out episodes for greedy success and per-turn accuracy"""
    pass_k: int = 0
    """no pass@k here: the held-out evaluation is greedy episode success (must stay 0)"""
    eval_hard: bool = False
    """no harder held-out split here: the held-out set is episodes that training never plays (must stay off)"""
    # environment
    env: Literal["lookup", "calc"] = "lookup"
    """the environment: 'lookup' (algos/_toolenv.py's key-value store, what tiny-toolenv was trained on) or 'calc'
    (reasoning-gym's basic_arithmetic problems with a calculator tool and an answer tool, for chat models: the shipped
    tiny-toolenv was never trained on it); --n-keys, --n-query and --value-digits set the lookup only"""
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
    max_context_tokens: int = 0
    """context budget in tokens (prompt, actions, observations): a turn that would pass it ends the episode with
    reward 0, as the other limits (0 = none; --max-context counts the environment's characters)"""
    max_obs_tokens: int = 0
    """budget of one observation (tool response) in tokens: a longer one is cut, counted in rollout/obs_truncated
    (0 = none)"""
    env_ce_examples: int = 64
    """held-out episodes (sampled once from the initial policy) whose observation tokens give eval/env_ce"""
    env_split: Literal["episode", "prompt"] = "episode"
    """the environment's held-out split: 'episode' (a hash of an episode's store and query, the split tiny-toolenv was
    trained with; a held-out episode's visible prompt also occurs in training with other values) or 'prompt' (a hash
    of the visible prompt: held-out and validation prompts never occur in training)"""
    eval_split: Literal["test", "val"] = "test"
    """episodes of the eval/ metrics (and of eval/env_ce): 'test', the reported held-out set, or 'val', the
    validation split of --env-split prompt, for choosing hyperparameters without touching the reported set"""
    # rollout
    prompts_per_step: int = 16
    """distinct episodes (seeds) per rollout batch (per process)"""
    group_size: int = 8
    """episodes per seed (G)"""
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
    if args.max_turns < 1 or args.max_context < 8 or not 1 <= args.value_digits <= 4 or \
            not 2 <= args.n_query <= args.n_keys <= 26:
        raise SystemExit("--max-turns >= 1, --max-context >= 8, --value-digits in 1..4, 2 <= --n-query <= --n-keys <= 26")
    if args.env_ce_examples < 1:
        raise SystemExit(f"--env-ce-examples must be >= 1 (the held-out episodes of eval/env_ce), "
                         f"got {args.env_ce_examples}")
    if args.task != "add" or args.digits != 2:
        raise SystemExit("--task, --digits: the task is algos/_toolenv.py's lookup environment; set it with --n-keys, "
                         "--n-query, --value-digits, --max-turns and --max-context")
    if args.top_p != 1.0:
        raise SystemExit("--top-p: multi-turn rollouts sample the full distribution (the trainer scores it)")
    if args.pass_k or args.eval_hard:
        raise SystemExit("--pass-k, --eval-hard: the multi-turn evaluation is greedy success on held-out episodes, "
                         "without pass@k or a harder split")
    if args.eval_split == "val" and args.env_split != "prompt":
        raise SystemExit("--eval-split val needs --env-split prompt (the episode split has no validation set)")
    if args.max_context_tokens < 0 or args.max_obs_tokens < 0:
        raise SystemExit("--max-context-tokens and --max-obs-tokens must be >= 0 (0 = no budget)")
    if args.env == "calc" and (args.n_keys, args.n_query, args.value_digits) != (4, 3, 1):
        raise SystemExit("--n-keys, --n-query, --value-digits set the lookup environment; --env calc plays "
                         "reasoning-gym's basic_arithmetic (2 to 4 terms of 1 to 2 digits)")
    if args.patch_budget < -1:
        raise SystemExit(f"--patch-budget must be -1 (no limit) or >= 0, got {args.patch_budget}")
    if not 0 <= args.gamma <= 1 or args.step_adv_weight < 0:
        raise SystemExit(f"--gamma must be in [0, 1] and --step-adv-weight >= 0, got {args.gamma}, "
                         f"{args.step_adv_weight}")
    if args.mode != "online" and (args.ppo_epochs != 1 or args.minibatches != 1):
        raise SystemExit(f"--mode {args.mode} trains each rollout batch once (--ppo-epochs 1 --minibatches 1): "
                         "its rows are steps, whose count varies from batch to batch")
    if args.mode == "offline-bc" and args.kl_coef:
        raise SystemExit("--mode offline-bc: behaviour cloning has no KL term (--kl-coef 0)")


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
def make_env(args: Args) -> _toolenv.LookupEnv | _toolenv.CalculatorEnv:
    """The environment of --env: the key-value lookup, or reasoning-gym arithmetic with a calculator (for chat models;
    its --max-context counts the characters after the question)."""
    if args.env == "calc":
        return _toolenv.CalculatorEnv("basic_arithmetic", args.max_turns, args.max_context, args.env_split,
                                      args.max_context_tokens, args.max_obs_tokens)
    return _toolenv.LookupEnv(args.n_keys, args.value_digits, args.max_turns, args.max_context, args.n_query,
                              args.env_split, args.max_context_tokens, args.max_obs_tokens)


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


def rollout(sampler, tok, env, args: Args, rng, device) -> dict:
    """G episodes of each of prompts_per_step training seeds, played turn by turn; A_i per group of G."""
    seeds = env.seeds("train", args.prompts_per_step, rng)
    envs = [env.clone() for _ in seeds for _ in range(args.group_size)]
    prompts = _toolenv.encode_prompts(tok, [e.reset(s) for e, s in zip(envs, np.repeat(seeds, args.group_size))],
                                      env.system_prompt)
    eps = _toolenv.play(sampler, tok, envs, prompts, args.max_new_tokens, args.temperature)
    batch = pack_episodes(eps, prompts, tok, device)
    batch.update(adv=group_advantages(batch["rewards"], args.group_size, args.adv_std_norm), episodes=eps,
                 finish_reasons=["stop" if e.env.reward or e.observations[-1] == "" else "length" for e in eps])
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

    As grpo.py's update, with the policy loss on action tokens only (mb["mask"] = action_mask, and the token counts
    are action tokens; the observation tokens are attended to through completion_mask); mb also carries the
    observation mask and the step's count of observation tokens (n_obs) for losses on them (algos/echo.py), and the
    training batch's environment-token cross-entropy is logged (loss/env_ce, at the sampling temperature: the
    quantity ECHO's term trains; eval/env_ce is at temperature 1). The sampler correction is grpo.py's, on action
    tokens.
    """
    B, mask = batch["completion_ids"].shape[0], batch["completion_mask"]
    act, obs = batch["action_mask"], batch["obs_mask"]
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
            c = llm.all_ranks_sum({"seqs": len(mb_idx), "tokens": float(act[mb_idx].sum()),
                                   "obs": float(obs[mb_idx].sum())}, accel, mask.device)  # step-global counts
            n_seqs, n_tokens, n_obs = int(c["seqs"]), int(c["tokens"]), int(c["obs"])
            opt.zero_grad(set_to_none=True)
            for idx in micro(mb_idx):
                logp, ent = logprobs_of(model, idx, True)
                mb = {"adv": batch["adv"][idx], "mask": act[idx].float(), "obs_mask": obs[idx].float(), "n_obs": n_obs,
                      "old": logp.detach() if old is None else old[idx], "ref": None if ref is None else ref[idx]}
                mb["is_weight"] = truncated_is_weight(mb["old"], batch["logprobs"][idx], args.sampler_is_cap) \
                    if correct else None
                loss, token_stats = loss_fn(logp, mb, n_seqs, n_tokens, args)
                loss.backward()  # a NaN here reaches every rank's gradient: optimizer_step stops them all
                env_ce = -common.masked_sum(logp.detach(), mb["obs_mask"]).item() / max(n_obs, 1)
                for k, v in {"pg": loss.item(), "env_ce": env_ce, **{k: common.masked_sum(v.detach(), mb["mask"]).item(
                        ) / max(n_tokens, 1) for k, v in {**token_stats, "entropy": ent}.items()}}.items():
                    sums[k] = sums.get(k, 0.0) + v
                if epoch == 0:  # every action token once, on the sampler's weights (pi_old)
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


# ---- the idea: patched rollouts along the expert, discounted step returns, step + episode advantages, SOP ----
def accepts(env: _toolenv.LookupEnv, action: str) -> bool:
    """The patch rule's match test: `action` is a step the expert would accept in env's current state: a lookup of a
    queried key not looked up yet (in any order), or an answer (`!N` or `!X+Y=N`) whose N is the sum; under --env calc
    a calculator call worth the problem's value before that value was shown, or an answer the generator's scorer
    accepts."""
    a = action.strip()
    if isinstance(env, _toolenv.CalculatorEnv):
        if a.startswith("#"):
            value = _toolenv.calculate(a[1:])[0]
            return value is not None and value == _toolenv.calculate(env.expression)[0] and \
                f"={value};" not in env.transcript[len(env.question):]
        return bool(re.fullmatch(r"!-?\d{1,16}(\.\d{1,8})?", a)) and env.score(a[1:]) == 1.0
    if re.fullmatch(r"#[a-z]", a):
        return a[1] in env.query and a not in env.transcript
    return bool(re.fullmatch(r"!(\d{1,6}\+\d{1,6}=)?\d{1,6}", a)) and int(a.rsplit("=", 1)[-1].lstrip("!")) == env.answer


@dataclass
class PatchedEpisode:
    """One semi-online episode: per turn t, the context the policy saw (ctx[t], prompt included), its own action
    (ids, behaviour log-probs, text: what is scored and trained), the step reward r_t = 1[accepted] and whether the
    patch replaced the action by the expert's in the context of the later turns."""
    env: _toolenv.LookupEnv
    ctx: list = field(default_factory=list)
    ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    actions: list = field(default_factory=list)
    step_rewards: list = field(default_factory=list)
    patched: list = field(default_factory=list)
    stopped: bool = False  # the patch budget ran out: the episode ended at a divergence
    truncated: int = 0


@torch.no_grad()
def patched_play(policy, tok, envs: list, contexts: list[list[int]], max_action_tokens: int, temperature: float = 1.0,
                 greedy: bool = False, patch_budget: int = -1) -> list[PatchedEpisode]:
    """Semi-online rollout, one batched generation per turn as _toolenv.play: the policy proposes a_t given its
    context; if accepts(env, a_t), a_t (its own tokens) and the observation enter the context; otherwise the patch
    steps the environment with the expert's action a*_t and puts a*_t (ids + EOS) and its observation in the context
    instead, while a_t stays the trained action of turn t. After `patch_budget` patches (-1: no limit) the next
    divergence ends the episode (the paper's patch threshold; 0 = stop at the first divergence)."""
    eps = [PatchedEpisode(env) for env in envs]
    ctx = [list(c) for c in contexts]
    while True:
        live = [i for i, e in enumerate(eps) if not (e.env.done or e.stopped)]
        if not live:
            return eps
        ro = common.generate(policy, tok, [ctx[i] for i in live], 1, max_action_tokens, temperature, greedy=greedy)
        for row, i in enumerate(live):
            e, n = eps[i], int(ro.completion_mask[row].sum())
            a_ids, text = ro.completion_ids[row, :n].tolist(), ro.texts[row]
            ok = accepts(e.env, text)
            e.ctx.append(list(ctx[i]))
            e.ids.append(a_ids)
            e.logprobs.append(ro.logprobs[row, :n].tolist())
            e.actions.append(text)
            e.step_rewards.append(float(ok))
            e.patched.append(not ok)
            e.truncated += ro.finish_reasons[row] == "length"
            if not ok and 0 <= patch_budget <= sum(e.patched[:-1]):
                e.stopped = True
                continue
            act = text if ok else e.env.expert_action()
            shown = a_ids if ok else tok(act, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            obs, _, _ = e.env.step(act)
            ctx[i] += shown + _toolenv.encode_obs(tok, obs)


def discounted_returns(rewards: list[float], gamma: float) -> list[float]:
    """G_t = sum_{k >= t} gamma^(k - t) r_k of one episode's step rewards."""
    out, g = [0.0] * len(rewards), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        g = rewards[t] + gamma * g
        out[t] = g
    return out


def semi_online_advantages(step_rewards: list[list[float]], group_size: int, gamma: float, omega: float,
                           std_norm: bool = True, eps: float = 1e-6) -> list[list[float]]:
    """A_it = A^E_i + omega * A^S_it for episode i (group-major, group_size episodes per seed) and turn t.

    Episode level: R_i = sum_t r_it, A^E_i = (R_i - mean_g R) / (std_g R + eps) over the seed's group.
    Step level: A^S_it = (G_it - mean G_.t) / (std G_.t + eps) over the group's episodes that reached turn t (0 when
    fewer than two did), G_it the discounted return. std_norm off: centring only (Dr. GRPO)."""
    R = torch.tensor([sum(r) for r in step_rewards], dtype=torch.float32)
    a_ep = group_advantages(R, group_size, std_norm, eps)
    returns = [discounted_returns(r, gamma) for r in step_rewards]
    out = [[a_ep[i].item()] * len(r) for i, r in enumerate(step_rewards)]
    for g0 in range(0, len(step_rewards), group_size):
        for t in range(max(len(r) for r in step_rewards[g0:g0 + group_size])):
            members = [i for i in range(g0, g0 + group_size) if len(returns[i]) > t]
            if len(members) < 2:
                continue
            G = torch.tensor([returns[i][t] for i in members])
            a = G - G.mean()
            a = a / (G.std() + eps) if std_norm else a
            for i, v in zip(members, a.tolist()):
                out[i][t] += omega * v
    return out


def sop_metrics(eps: list[PatchedEpisode], n_steps: int) -> dict:
    """Semi-Online Performance of patched rollouts: sop (task success) = the fraction of episodes the policy solved
    without a patch (every step its own: the outcome an online episode would have had); sop_progress = the mean
    fraction of the n_steps expert steps the policy took before its first divergence."""
    first = [e.patched.index(True) if True in e.patched else len(e.patched) for e in eps]
    return {"sop": float(np.mean([not any(e.patched) and e.env.reward == 1.0 for e in eps])),
            "sop_progress": float(np.mean([min(f, n_steps) / n_steps for f in first]))}


def expert_steps(args: Args) -> int:
    """T*, the expert's steps per episode: n_query lookups and the answer, or (--env calc) the calculator and the
    answer."""
    return 2 if args.env == "calc" else args.n_query + 1


def pack_steps(ctxs: list, ids: list, logprobs: list, rewards: list, tok, device) -> dict:
    """One row per step: prompt = the step's context (prompt, earlier actions and observations; left-padded),
    completion = the trained action's tokens (right-padded). Observations are only ever in the prompt, so the loss
    (action_mask = completion_mask) never sees them; obs_mask is all zero."""
    prompt_ids, prompt_mask = common.left_pad(ctxs, tok.pad_token_id)
    C = max(1, max(len(a) for a in ids))
    pad = lambda rows, v: torch.tensor([r + [v] * (C - len(r)) for r in rows])  # noqa: E731
    mask = pad([[1] * len(a) for a in ids], 0)
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": pad(ids, tok.pad_token_id),
             "completion_mask": mask, "action_mask": mask.clone(), "obs_mask": torch.zeros_like(mask),
             "turn": mask - 1, "logprobs": pad(logprobs, 0.0).float(),
             "rewards": torch.tensor(rewards, dtype=torch.float32)}
    return {**{k: v.to(device) for k, v in batch.items()},
            "finish_reasons": ["stop" if a and a[-1] == tok.eos_token_id else "length" for a in ids]}


def semi_online_rollout(sampler, tok, env, args: Args, rng, device) -> dict:
    """G patched episodes of each of prompts_per_step training seeds; one training row per step with A_it."""
    seeds = env.seeds("train", args.prompts_per_step, rng)
    envs = [env.clone() for _ in seeds for _ in range(args.group_size)]
    prompts = common.encode_prompts(tok, [e.reset(s) for e, s in zip(envs, np.repeat(seeds, args.group_size))])
    eps = patched_play(sampler, tok, envs, prompts, args.max_new_tokens, args.temperature, patch_budget=args.patch_budget)
    adv = semi_online_advantages([e.step_rewards for e in eps], args.group_size, args.gamma, args.step_adv_weight,
                                 args.adv_std_norm)
    flat = lambda key: [x for e in eps for x in getattr(e, key)]  # noqa: E731
    batch = pack_steps(flat("ctx"), flat("ids"), flat("logprobs"), flat("step_rewards"), tok, device)
    batch.update(adv=torch.tensor([a for row in adv for a in row], device=device), episodes=eps,
                 sop=sop_metrics(eps, expert_steps(args)))
    return batch


def expert_rollout(sampler, tok, env, args: Args, rng, device) -> dict:
    """Offline step-level training (behaviour cloning): the expert's steps of prompts_per_step * group_size training
    seeds, one row per step (expert context, expert action + EOS), advantage 1: on-policy (ppo_epochs = minibatches
    = 1) the clipped surrogate's gradient is then the log-likelihood's. The behaviour log-probs are the trainer's."""
    seeds = env.seeds("train", args.prompts_per_step * args.group_size, rng)
    ctxs, ids = [], []
    for s in seeds:
        e = env.clone()
        ctx = common.encode_prompts(tok, [e.reset(s)])[0]
        while not e.done:
            a = e.expert_action()
            a_ids = tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ctxs.append(list(ctx)), ids.append(a_ids)
            ctx += a_ids + _toolenv.encode_obs(tok, e.step(a)[0])
    batch = pack_steps(ctxs, ids, [[0.0] * len(a) for a in ids], [1.0] * len(ids), tok, device)
    with torch.no_grad():
        batch["logprobs"] = common.token_logprobs(sampler.model, batch["prompt_ids"], batch["prompt_mask"],
                                                  batch["completion_ids"], batch["completion_mask"], args.temperature)
    batch.update(adv=torch.ones(len(ids), device=device), episodes=[])
    return batch


def sop_evaluate(sampler, tok, env, seeds: list[int], args: Args) -> dict:
    """eval/sop and eval/sop_progress: greedy patched rollouts of the held-out seeds (with --patch-budget)."""
    model = sampler.model
    was = model.training
    model.eval()
    envs = [env.clone() for _ in seeds]
    prompts = common.encode_prompts(tok, [e.reset(s) for e, s in zip(envs, seeds)])
    eps = patched_play(sampler, tok, envs, prompts, args.max_new_tokens, greedy=True, patch_budget=args.patch_budget)
    model.train(was)
    return {f"eval/{k}": v for k, v in sop_metrics(eps, expert_steps(args)).items()}


# ---- eval ----
def held_out_ce_batch(sampler, tok, env, args: Args, device) -> dict:
    """A fixed set of rollouts of the initial policy on --eval-split episodes (sampled at --temperature): their
    observation tokens are where eval/env_ce is measured (at temperature 1), on trajectories the trained policy did
    not generate."""
    seeds = env.seeds(args.eval_split, args.env_ce_examples, np.random.default_rng(54321))
    envs = [env.clone() for _ in seeds]
    prompts = _toolenv.encode_prompts(tok, [e.reset(s) for e, s in zip(envs, seeds)], env.system_prompt)
    with torch.random.fork_rng():
        torch.manual_seed(54321)
        eps = _toolenv.play(sampler, tok, envs, prompts, args.max_new_tokens, args.temperature)
    return pack_episodes(eps, prompts, tok, device)


def evaluate(sampler, tok, env, seeds: list[int], ce_batch: dict, args: Args) -> dict:
    """eval/acc (greedy held-out success, decoded by the sampler), eval/tool_use, eval/turn<k>_acc (teacher-forced),
    eval/env_ce (scored by the trainer)."""
    res = _toolenv.evaluate(sampler, tok, env, seeds, args.max_new_tokens)
    out = {"eval/acc": res.pop("success"), **{f"eval/{k}": v for k, v in res.items()}}
    return {**out, "eval/env_ce": env_token_ce(sampler.model, ce_batch, args)}


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    run = llm.Run(args, tasks=False)  # accelerator, threads, seed, the run folder; the environment is the task
    env = run.task = make_env(args)  # run.task: the curve's title names the environment
    eval_seeds = env.seeds(args.eval_split, args.eval_examples, np.random.default_rng(12345))
    # sharded when several processes run; the sampler decodes (the trainer itself on CPU)
    model, tok, ref_model, sampler = llm.load_policy(args, run.accel, with_ref=args.kl_coef > 0)
    opt = llm.make_optimizer(model.parameters(), args)
    ce_batch = held_out_ce_batch(sampler, tok, env, args, run.accel.device)  # before any update (and any resume)
    # resume from --resume, then the step-0 held-out evaluation: online success and SOP on the same held-out seeds
    run.start(model, tok, opt, sampler, evaluate=lambda: {**evaluate(sampler, tok, env, eval_seeds, ce_batch, args),
                                                          **sop_evaluate(sampler, tok, env, eval_seeds, args)})
    make_batch = {"online": rollout, "semi-online": semi_online_rollout, "offline-bc": expert_rollout}[args.mode]
    for step, rng in run.steps():  # every random draw of a step depends on (seed, step, rank) only
        with run.timer("gen"):
            batch = make_batch(sampler, tok, env, args, rng, run.accel.device)
        with run.timer("train"):  # includes the sampler's refresh after each optimiser step
            stats = update(model, opt, batch, grpo_loss, args, step, run.accel, sampler, ref_model)
        extra = {f"rollout/{k}": v for k, v in batch.get("sop", {}).items()}
        if args.mode == "online":  # rollout metrics over the action tokens, per episode
            extra["rollout/turns"] = float(np.mean([len(e.actions) for e in batch["episodes"]]))
            run.log_step(step, {**batch, "completion_mask": batch["action_mask"]}, stats, extra=extra)
        else:  # rows are steps: the reward is the step reward, no groups
            run.log_step(step, batch, stats, extra=extra, group_size=1)
    evals = [[h["step"], h["eval/acc"], h["eval/sop"], h["eval/sop_progress"]] for h in run.history if "eval/sop" in h]
    return run.finish(f"semi-online RL ({args.mode})", extra={"evals": evals})

if __name__ == "__main__":
    main(tyro.cli(Args))
