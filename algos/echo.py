"""ECHO: Environment Cross-entropy Hybrid Objective, on top of multi-turn GRPO.

Paper: Shrivastava et al., "ECHO: Terminal Agents Learn World Models for Free", arXiv:2605.24517 (ECHO = Environment
Cross-entropy Hybrid Objective: CLI agents trained to predict the terminal's answers to their own commands). The
policy-gradient loss of
GRPO on the action tokens, plus a cross-entropy on the environment-observation tokens that followed the policy's
own actions in the same rollout: the same forward pass, no extra rollouts, and failed rollouts give dense signal.

Equations (each implemented by the function named on the right):
  J_ECHO = J_GRPO(action tokens) + lambda * CE_env                                             echo_loss
  J_GRPO           multi-turn GRPO's clipped surrogate on action tokens (algos/multiturn_grpo.py)  grpo_loss
  CE_env           = -1/|O| sum_{t in O} log pi(o_t | context),  O = the observation tokens of the step's
                     rollouts (token mean over the optimiser step, |O| counted over all its micro-batches)
  held-out CE_env  on a fixed set of held-out rollouts of the initial policy (eval/env_ce)        env_token_ce
  lambda = --echo-coef (0 gives multi-turn GRPO exactly).

Parent: algos/multiturn_grpo.py; changed: Args, main.

Deviations:
- The environment is algos/_toolenv.py's key-value lookup (observations `=4;`, `err;`, `end;`), not a terminal:
  part of each observation is predictable from the action (`=` and `;` after a lookup, `err;` after a malformed
  action, `end;` at a limit) and the stored value's digit is not, so CE_env has a floor near log(10) / 3 = 0.77
  nats per token of a lookup's answer.
- lambda = 0.003 by default (a token-mean CE beside a sequence-mean policy loss), not the paper's value: at 0.1 the
  cross-entropy on observations takes over the 0.65M-parameter model, which stops ending its actions and fails every
  episode by batch 60. That value was chosen by a sweep (0.1, 0.01, 0.003; benchmarks/results/multiturn.md) read on
  the same held-out episodes as the default rows below, and multi-turn GRPO's learning rate had no such sweep. The
  claims rows use the clean procedure instead (benchmarks/multiturn_table.py --parts select, then final): train on
  the prompt-keyed split (--env-split prompt), score every candidate on the validation prompts (--eval-split val),
  lambda in SELECT_COEFS for ECHO and the same number of learning rates (SELECT_LRS) for GRPO, 3 seeds and the
  default length each; keep each arm's best mean validation success (the smaller value on a tie), then compare the
  two picks on the test prompts with fresh seeds. Picked: lambda = 0.01 for ECHO, lr 1e-4 for GRPO (half its default).
- The loss's CE_env is the cross-entropy of the tempered policy (the trainer scores every token at the sampling
  temperature, --temperature 0.7, so that the policy-gradient ratio is the on-policy one), while eval/env_ce reports
  the model's own distribution (temperature 1); loss/env_ce logs the tempered quantity the loss trains.
- The paper leaves warning tokens out of O, which this environment does not emit.
- Everything else as algos/multiturn_grpo.py (trajectory-level group advantages, no KL by default, the
  prompt-task flags refused, grpo.py's sampler correction on action tokens).

Commands:
  python algos/echo.py                         # tiny default, 2-core CPU, 1-4 minutes
  python algos/echo.py --echo-coef 0           # multi-turn GRPO, with the same logging
  python benchmarks/multiturn_table.py --parts select   # lambda and GRPO's lr chosen on validation prompts
Expected (3 seeds, benchmarks/results/multiturn.md): after the default 90 rollout batches the held-out
environment-token cross-entropy has fallen from 11.41 to 5.88 ± 0.03 nats per token (multi-turn GRPO: 11.01 ± 0.32),
the paper's first claim, and held-out greedy success has risen from 53.3% to 71.9 ± 4.2% (+14.0, +19.3, +22.3
points; multi-turn GRPO 68.3 ± 6.0), in 1-4 minutes on one thread (51 s for seed 0 with the default 2 threads on an
idle 2-core machine); the gain over GRPO is inside the noise of 3 seeds.
At lambda = 0.1 (60 batches) the cross-entropy falls to 3.35 ± 0.05 and success collapses to 0.0% in every seed; at
0.01 (60 batches, 1 seed) 55.7%. With each arm's pick on the test prompts (fresh seeds 10-12): environment-token CE
11.70 -> 2.94 ± 0.02 (GRPO 11.35 ± 0.20), success 43.3% -> 66.4 ± 3.1% against GRPO's 74.3 ± 2.0%: tuned alike, GRPO
leads on success (underpowered at 3 seeds by the claims rule).
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
from algos import _toolenv
from algos._llm import LLMArgs


@dataclass
class Args(LLMArgs):
    """ECHO's flags: multi-turn GRPO's and --echo-coef; the plumbing flags are LLMArgs'.
    The environment is the task: --task, --digits, --top-p, --pass-k and --eval-hard are refused (check_args)."""
    # plumbing defaults for the tool environment
    model: str = "tiny-toolenv"
    """tiny-toolenv (SFT'd on the environment's traces), a Hugging Face id or a local path"""
    max_new_tokens: int = 6
    """generation budget per action (turn)"""
    temperature: float = 0.7
    """sampling temperature (the trainer scores with the same temperature); below 1 so that more sampled episodes
    get their lookups right and reach the answer turn (at 1.0 the tiny policy solves about 20% of them)"""
    steps: int = 90
    """rollout batches (each followed by ppo_epochs * minibatches optimiser steps)"""
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
    echo_coef: float = 0.003
    """lambda: weight of the environment-token cross-entropy (0 = multi-turn GRPO; 0.1 collapses the tiny policy)"""
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


def echo_loss(logp, mb: dict, n_seqs: int, n_tokens: int, args: Args):
    """J_ECHO = J_GRPO (action tokens) + lambda * CE_env (observation tokens, token mean over the step's n_obs)."""
    loss, stats = grpo_loss(logp, mb, n_seqs, n_tokens, args)
    ce = -common.masked_sum(logp, mb["obs_mask"]) / max(mb["n_obs"], 1)
    return loss + args.echo_coef * ce, stats


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


def episode_metrics(eps: list) -> dict:
    """rollout/turns (actions per episode), rollout/truncated (actions of the batch that hit the per-turn token budget
    --max-new-tokens without EOS; each is still sent to the environment), rollout/truncated_action_frac, and the
    token budgets' counts: rollout/obs_truncated (observations cut to --max-obs-tokens), rollout/context_limited
    (episodes ended by --max-context-tokens)."""
    n = sum(len(e.actions) for e in eps)
    cut = sum(e.truncated for e in eps)
    return {"rollout/turns": n / len(eps), "rollout/truncated": float(cut),
            "rollout/truncated_action_frac": cut / max(n, 1),
            "rollout/obs_truncated": float(sum(e.obs_truncated for e in eps)),
            "rollout/context_limited": float(sum(e.context_limited for e in eps))}


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
    # resume from --resume, then the step-0 held-out evaluation
    run.start(model, tok, opt, sampler, evaluate=lambda: evaluate(sampler, tok, env, eval_seeds, ce_batch, args))
    for step, rng in run.steps():  # every random draw of a step depends on (seed, step, rank) only
        with run.timer("gen"):
            batch = rollout(sampler, tok, env, args, rng, run.accel.device)
        with run.timer("train"):  # includes the sampler's refresh after each optimiser step
            stats = update(model, opt, batch, echo_loss, args, step, run.accel, sampler, ref_model)
        # rollout metrics over the action tokens, evaluation every --eval-every, checkpoints
        run.log_step(step, {**batch, "completion_mask": batch["action_mask"]}, stats,
                     extra=episode_metrics(batch["episodes"]))
    return run.finish(f"ECHO (lambda={args.echo_coef})")


if __name__ == "__main__":
    main(tyro.cli(Args))
