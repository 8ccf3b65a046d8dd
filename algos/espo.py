"""ESPO: PPO whose rollouts stop early once the sampler's own regret says the trajectory has gone wrong.

Paper: Li, Zhou, Shi et al., "ESPO: Early-Stopping Proximal Policy Optimization", arXiv:2605.29860. The abstract:
at each generation step a surrogate regret is computed from the logits already computed for sampling; a rollout
stops when the smoothed cumulative regret significantly exceeds its estimated value; the truncated trajectory is an
absorbing failure state with a terminal reward, so negative TD errors concentrate near the detected failure step.
Claimed: more than 20% of the rollout tokens saved cumulatively, at accuracy above PPO's (a 7B model on maths).

Parent: algos/ppo.py; changed: Args, Args.digits, Args.engine, Args.max_new_tokens, Args.model, Args.steps,
  Args.task, check_args, rollout, main.

What changes from PPO: only the rollout. Sampling runs through generate_with_stops, which scores the regret of
every sampled token from the sampler's logits and ends a row as soon as its smoothed regret crosses the
threshold; a stopped row gets the terminal reward --stop-reward on its last kept token. PPO's per-token rewards,
GAE, losses and update are unchanged, and they already treat the stop as an absorbing state: the episode ends at
the last kept token and nothing is bootstrapped after it (V after the last token = 0 in gae). With --stop-k inf
nothing stops and the script is ppo.py exactly (tests/test_espo.py checks the losses and weights step by step).

Equations (each implemented by the function named on the right; the abstract gives no formula, these are ours):
  regret            g_t = max_a log pi(a | x, o_<t) - log pi(o_t | x, o_<t) >= 0, from the logits the sampler drew
                    from (after temperature / top-p); 0 when the sampler took the mode              token_regret
  smoothing         z_t = alpha z_{t-1} + (1 - alpha) g_t,  z_{-1} = 0  (alpha = --regret-alpha)     smooth_regret
  threshold         tau = mu_z + k sigma_z: mean and std of z over the response tokens of earlier rollout batches
                    (exponential moving average across batches, frozen while a batch is sampled; k = --stop-k;
                    no stop before --stop-warmup batches have been measured)                RegretStats.threshold
  stop              T = min{t : z_t > tau, o_t not EOS}; the row keeps o_0..o_T and generates nothing after
                    (online: RegretStopper inside generate; post hoc, the same rule: stop_index)
  absorbing failure r_T = r_fail (--stop-reward) instead of the verifier's reward, V_{T+1} = 0, so
                    delta_T = r_fail - V_T and delta_{T-1} = gamma V_T - V_{T-1}            token_rewards, gae (PPO's)
  Everything else is PPO's: critic, GAE, whitening, clipped policy and value losses (see algos/ppo.py).

Metrics (rollout/, and the summary): stop_frac (rows stopped), tokens_saved_est (rows stopped: reference length
minus kept length, over what would have been generated), and where stops land relative to the first wrong step:
first_dev = the first token where the response leaves the task's reference solution (on `sums` the first wrong
running total or miscopied operand); stop_after_dev_frac = stopped rows whose kept prefix already contains it,
stop_lag = tokens from it to the stop, post_dev_token_frac = generated tokens that come after it (what early
stopping can save).

Deviations:
- The regret, its smoothing and the threshold are our choice (the abstract gives no formula); secondary accounts of
  the full text describe the same per-token log-prob gap but a threshold scaled by the critic's value with a
  controller on the stop rate and a critic warm-up. Here the threshold uses no critic (mean + k std), and one
  warm-up batch measures the statistics. Statistics count the tokens kept, so stopped rows' cut tails are missing.
- r_fail = 0 by default: the verifier's reward for a wrong answer (rewards here are 0/1), so a stop costs nothing
  beyond what a wrong answer costs; the stopping token is kept and carries the terminal reward.
- A row whose regret crosses on the EOS token is not stopped: it ended on its own and is verified as usual.
- Hugging Face generate only (--engine vllm is refused): the rule needs the logits of every decode step during
  sampling; a logits processor reads each step's log-probs and regret (no [B, C, V] scores are kept). Sampling
  runs as common.generate's (processors, EOS ids, the same common.Sampler copy and autocast), so --stop-k inf is
  ppo.py exactly in fp32 and in bf16 on CPU; on CUDA both decode with the sampler's bf16 weight copy (so PPO's
  sampler correction applies alike), common.generate with a static cache and this sampler with the dynamic one,
  so there the two agree up to bf16 rounding. Batched decoding
  runs until the last row of the batch ends, so the tokens saved here are tokens not generated, trained on or
  scored, not decode time (continuous batching, as in vLLM, would turn them into time).
- Default task: the long-response task (tiny-sums on 5 one-digit operands with running totals, ~33 tokens) instead
  of 2-digit addition, whose 3-token answers leave little to stop; 25 rollout batches instead of ppo.py's 100, so
  that it runs in under 5 minutes.

Commands:
  python algos/espo.py                                          # tiny default on the long-response task, 2-core CPU
  python algos/espo.py --stop-k inf                             # no stop: algos/ppo.py exactly
  python algos/espo.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --device cuda --max-new-tokens 512 \
      --prompts-per-step 64 --lr 1e-6 --vf-lr 1e-5 --stop-reward -1                          # one GPU (HF sampling)
  accelerate launch --num_processes 4 algos/espo.py --model ... --device cuda          # several GPUs (each process
                                                                                      # keeps its own statistics)
Expected: the default lifts held-out greedy accuracy on the long-response task from 49.4 to 65.2 (+15.8 points,
seed 0), with 22% of rows stopped, 90% of the stops after the first wrong token (2.8 tokens later) and an estimated
11% of rollout tokens saved (benchmarks/results/defaults.md; 840 s measured while the 2 cores were shared with other
jobs: decoding ran at 653 tokens/s, against 5000-7000 in the benchmark's runs). Against PPO, 30 batches of 64, 3
seeds: 13.5 +- 0.7% fewer rollout tokens, accuracy inconclusive (benchmarks/results/espo.md, rows in espo.csv).
"""
from __future__ import annotations

import copy
import math
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import tyro

import common
from algos import _llm as llm
from algos._llm import LLMArgs


@dataclass
class Args(LLMArgs):
    """ESPO's flags: PPO's (algos/ppo.py) and the stop rule's; the plumbing flags are LLMArgs' (here with the
    long-response task's defaults)."""
    model: str = "tiny-sums"
    """tiny-sums, tiny-0.6m, tiny-5m, smollm2-135m, a Hugging Face id or a local path"""
    task: Annotated[str, tyro.conf.arg(help=f"training and held-out task: {llm.TASKS}")] = "sums"
    digits: int = 1
    """operand digits of the arithmetic tasks (training and the main held-out eval)"""
    engine: Literal["hf", "vllm"] = "hf"
    """rollout engine: Hugging Face generate only (the stop rule needs every decode step's logits)"""
    max_new_tokens: int = 48
    """generation budget per completion"""
    # rollout
    prompts_per_step: int = 256
    """distinct prompts per rollout batch (per process)"""
    group_size: int = 1
    """completions per prompt (PPO needs no groups; >1 only to match another method's sampling)"""
    # early stopping
    stop_k: float = 3.0
    """stop a row when its smoothed regret exceeds the running mean + stop_k std (inf: never, = algos/ppo.py)"""
    regret_alpha: float = 0.5
    """smoothing of the per-token regret within a row: z_t = alpha z_{t-1} + (1 - alpha) g_t"""
    regret_momentum: float = 0.9
    """weight of the past in the running mean and variance of z across rollout batches"""
    stop_warmup: int = 1
    """rollout batches sampled without stopping first (they measure the statistics)"""
    stop_reward: float = 0.0
    """terminal reward of a stopped row (the absorbing failure); 0 = the verifier's reward for a wrong answer"""
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
    steps: int = 25
    """rollout batches (each followed by ppo_epochs * minibatches optimiser steps); 25 x 256 responses of ~33
    tokens fit in 5 minutes on 2 cores"""
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
    if args.engine == "vllm":
        raise SystemExit("--engine vllm: ESPO's stop rule needs the logits of every decode step while sampling, "
                         "which only the Hugging Face path gives here; use --engine hf")
    if not args.stop_k > 0 or not 0 <= args.regret_alpha < 1 or not 0 <= args.regret_momentum < 1:
        raise SystemExit(f"--stop-k must be > 0 (inf: never stop) and --regret-alpha, --regret-momentum in [0, 1); "
                         f"got {args.stop_k}, {args.regret_alpha}, {args.regret_momentum}")
    if args.stop_warmup < 1:
        raise SystemExit("--stop-warmup must be >= 1: the threshold needs one measured batch")


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


# ---- the idea: a regret from the sampler's logits, its smoothing, the stop rule ----
def token_regret(logp, tokens):
    """g = max_a log pi(a) - log pi(sampled) >= 0; logp [..., V] (log-softmax of the sampled logits), tokens [...]."""
    return logp.max(-1).values - logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def smooth_regret(g, alpha: float):
    """z_t = alpha z_{t-1} + (1 - alpha) g_t along each row, z_{-1} = 0; g [B, C] -> z [B, C]."""
    z, prev = torch.zeros_like(g), torch.zeros_like(g[:, 0])
    for t in range(g.shape[1]):
        prev = alpha * prev + (1 - alpha) * g[:, t]
        z[:, t] = prev
    return z


def stop_index(z, eligible, threshold: float):
    """The first t with eligible[b, t] and z[b, t] > threshold, per row; -1 where none. z, eligible [B, C] -> [B]."""
    over = (z > threshold) & eligible.bool()
    return torch.where(over.any(1), over.float().argmax(1), torch.full_like(over[:, 0], -1, dtype=torch.long))


class SampledLogprobs:
    """A logits processor, last in the list (after temperature and top-p): the log-softmax of the scores the sampler
    draws from at the current decode step only, [B, V] (O(B V) memory, never the [B, C, V] scores of every step)."""
    logp = None

    def __call__(self, input_ids, scores):
        self.logp = torch.log_softmax(scores.float(), -1)
        return scores


class RegretStopper:
    """A stopping criterion for Hugging Face generate: after each sampled token, read its log-prob and regret from
    `sampled` (the step's SampledLogprobs), update z and end the rows that cross the threshold (not on EOS: a row
    that ends on its own is verified as usual). stop_at[b] = the index of the stopping token, -1 if the row was not
    stopped; logprobs() and regret() [B, C] are the per-step columns."""

    def __init__(self, n: int, threshold: float, alpha: float, eos_ids, device, sampled: SampledLogprobs):
        self.threshold, self.alpha, self.t, self.sampled = threshold, alpha, 0, sampled
        self.eos = torch.tensor(sorted(eos_ids), device=device).view(-1)
        self.z = torch.zeros(n, device=device)
        self.alive = torch.ones(n, dtype=torch.bool, device=device)
        self.stop_at = torch.full((n,), -1, dtype=torch.long, device=device)
        self.lp_cols, self.g_cols = [], []

    def __call__(self, input_ids, scores, **kwargs):
        tokens, logp = input_ids[:, -1], self.sampled.logp
        g = token_regret(logp, tokens)
        self.lp_cols.append(logp.gather(-1, tokens[:, None]).squeeze(-1))
        self.g_cols.append(g)
        self.z = self.alpha * self.z + (1 - self.alpha) * g
        ended = torch.isin(tokens, self.eos)
        stop = self.alive & ~ended & (self.z > self.threshold)
        self.stop_at[stop] = self.t
        self.alive &= ~stop & ~ended
        self.t += 1
        return stop

    def logprobs(self) -> torch.Tensor:
        return torch.stack(self.lp_cols, 1)

    def regret(self) -> torch.Tensor:
        return torch.stack(self.g_cols, 1)


class RegretStats:
    """Running mean and variance of z over response tokens, an exponential moving average across rollout batches;
    the threshold of a batch uses only earlier batches."""

    def __init__(self, momentum: float):
        self.momentum, self.mean, self.var, self.batches = momentum, 0.0, 0.0, 0

    def update(self, z, mask) -> None:
        mean = common.masked_mean(z, mask).item()
        var = common.masked_mean((z - mean) ** 2, mask).item()
        m = self.momentum if self.batches else 0.0
        self.mean, self.var = m * self.mean + (1 - m) * mean, m * self.var + (1 - m) * var
        self.batches += 1

    def threshold(self, k: float, warmup: int) -> float:
        if math.isinf(k) or self.batches < warmup:
            return math.inf
        return self.mean + k * math.sqrt(self.var)


@torch.no_grad()
def generate_with_stops(policy, tok, prompts: list[list[int]], group_size: int, max_new_tokens: int,
                        temperature: float, top_p: float, threshold: float, alpha: float):
    """common.generate's sampling (Hugging Face, the same processors, EOS ids, the sampler's weight copy and the
    trainer's autocast when it decodes with the trainer) with RegretStopper in the loop; the log-probs and regrets
    are read step by step (SampledLogprobs), so no [B, C, V] tensor of scores is kept. `policy`: a common.Sampler
    (decoded with its module(), the dynamic cache) or a bare model, which decodes as it is.

    Returns (common.Rollout with the completion mask cut after each stop, regret g [B, C], stop_at [B]).
    """
    from transformers import (GenerationConfig, LogitsProcessorList, StoppingCriteriaList, TemperatureLogitsWarper,
                              TopPLogitsWarper)

    sampler = policy if isinstance(policy, common.Sampler) else common.Sampler(policy, fast=False)
    model, module = sampler.model, sampler.module()  # a sharded model: its full copy; on one GPU: the bf16 copy
    device = next(module.parameters()).device
    ids, mask = common.left_pad([p for p in prompts for _ in range(group_size)], tok.pad_token_id)
    ids, mask = ids.to(device), mask.to(device)
    eos = common.eos_ids(tok, model)
    # temperature and top-p as our own processors, so that the recorder sees what the sampler draws from
    warpers = [TemperatureLogitsWarper(temperature)] * (temperature != 1.0) + [TopPLogitsWarper(top_p)] * (top_p < 1.0)
    gc = GenerationConfig(max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id, eos_token_id=eos,
                          do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
    sampled = SampledLogprobs()
    stopper = RegretStopper(len(ids), threshold, alpha, eos, device, sampled)
    own, module.generation_config = module.generation_config, gc
    try:
        with common.autocast(model) if module is model else nullcontext():  # a copy already has the sampling dtype
            seqs = module.generate(input_ids=ids, attention_mask=mask, generation_config=gc,
                                   logits_processor=LogitsProcessorList(warpers + [sampled]),
                                   stopping_criteria=StoppingCriteriaList([stopper]))
    finally:
        module.generation_config = own
    comp = seqs[:, ids.shape[1]:]
    regret, logprobs = stopper.regret(), stopper.logprobs()
    is_eos = torch.isin(comp, torch.tensor(eos, device=device))
    last = torch.where(stopper.stop_at >= 0, stopper.stop_at, comp.shape[1])  # keep o_0..o_T of a stopped row
    cmask = (((is_eos.cumsum(1) - is_eos.long()) == 0) & (torch.arange(comp.shape[1], device=device) <= last[:, None]))
    comp = torch.where(cmask, comp, torch.full_like(comp, tok.pad_token_id))
    finish = ["regret" if s >= 0 else "stop" if e else "length"
              for s, e in zip(stopper.stop_at.tolist(), (is_eos & cmask).any(1).tolist())]
    zero = torch.zeros_like(logprobs)  # (where, not a product: a padded position's log-prob may be -inf)
    ro = common.Rollout(ids, mask, comp, cmask.long(), torch.where(cmask, logprobs, zero), finish,
                        tok.batch_decode(comp, skip_special_tokens=True))
    return ro, torch.where(cmask, regret, zero), stopper.stop_at


def first_deviation(completion_ids, completion_mask, references: list[list[int]]):
    """Per row, the first response position that differs from the reference token ids (-1: none within the kept
    tokens; a kept response longer than its reference deviates where the reference ends). -> [B] long."""
    out = []
    for ids, n, ref in zip(completion_ids.tolist(), completion_mask.sum(1).tolist(), references):
        ids = ids[:int(n)]
        d = next((t for t, (a, b) in enumerate(zip(ids, ref)) if a != b), -1)
        out.append(len(ref) if d < 0 and len(ids) > len(ref) else d)
    return torch.tensor(out, dtype=torch.long)


def stop_metrics(batch: dict, threshold: float) -> dict:
    """Where the stops land (see the header's Metrics), from one rollout batch."""
    stopped, dev = batch["stop_at"].cpu() >= 0, batch["first_dev"]
    lengths, ref_len = batch["completion_mask"].sum(1).cpu(), batch["ref_len"]
    saved = ((ref_len - lengths).clamp(min=0) * stopped).sum().item()  # a stopped row would have run to its reference
    out = {"rollout/stop_frac": stopped.float().mean().item(), "rollout/stop_threshold": threshold,
           "rollout/est_saved_tokens": saved,
           "rollout/post_dev_token_frac": ((lengths - dev) * (dev >= 0)).sum().item() / max(1, lengths.sum().item())}
    if stopped.any():
        after = stopped & (dev >= 0)  # the kept prefix already left the reference: the stop came after the error
        out["rollout/stop_after_dev_frac"] = after.sum().item() / stopped.sum().item()
        if after.any():
            out["rollout/stop_lag"] = (batch["stop_at"].cpu() - dev)[after].float().mean().item()
    return out


def espo_summary(history: list[dict], gen_tokens: int) -> dict:
    """The summary's ESPO figures: means over rollout batches, and the estimated share of tokens saved."""
    rows = [h for h in history if "rollout/stop_frac" in h]
    mean = lambda k: float(np.mean([h[k] for h in rows if k in h])) if any(k in h for h in rows) else float("nan")  # noqa: E731
    saved = sum(h["rollout/est_saved_tokens"] for h in rows)
    return {"stop_frac": mean("rollout/stop_frac"), "stop_after_dev_frac": mean("rollout/stop_after_dev_frac"),
            "stop_lag": mean("rollout/stop_lag"), "post_dev_token_frac": mean("rollout/post_dev_token_frac"),
            "tokens_saved_est": saved / max(1, saved + gen_tokens)}


# ---- rollout and update ----
def rollout(sampler, tok, task, args: Args, rng, device, threshold: float = math.inf) -> dict:
    """Sample G completions for each of prompts_per_step training prompts, stopping a row once its smoothed regret
    crosses `threshold`; reward them: the verifier, or --stop-reward for a stopped row (the absorbing failure)."""
    examples = task.sample("train", args.prompts_per_step, rng)
    ro, regret, stop_at = generate_with_stops(sampler, tok, common.encode_prompts(tok, [e.prompt for e in examples]),
                                              args.group_size, args.max_new_tokens, args.temperature, args.top_p,
                                              threshold, args.regret_alpha)
    rows = [e for e in examples for _ in range(args.group_size)]
    rewards = torch.tensor([args.stop_reward if s >= 0 else task.verify(t, e.answer)[0]
                            for t, e, s in zip(ro.texts, rows, stop_at.tolist())], device=device)
    refs = [tok(e.solution or e.answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for e in rows]
    batch = {k: getattr(ro, k).to(device) for k in
             ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs")}
    batch.update(rewards=rewards, finish_reasons=ro.finish_reasons, z=smooth_regret(regret, args.regret_alpha).to(device),
                 stop_at=stop_at, first_dev=first_deviation(ro.completion_ids, ro.completion_mask, refs),
                 ref_len=torch.tensor([len(r) for r in refs]))
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
    z_stats = RegretStats(args.regret_momentum)  # of the smoothed regret z: the stop threshold
    opt = llm.make_optimizer([{"params": list(model.parameters())},
                              {"params": list(critic.parameters()), "lr": args.vf_lr}], args)
    # resume (the critic and the regret statistics too), then the step-0 held-out evaluation
    run.start(model, tok, opt, sampler, extra={"critic": critic}, counters={"regret_stats": (0.0, 0.0, 0)})
    z_stats.mean, z_stats.var, z_stats.batches = run.counters["regret_stats"]
    for step, rng in run.steps():  # every random draw of a step depends on (seed, step, rank) only
        threshold = z_stats.threshold(args.stop_k, args.stop_warmup)
        with run.timer("gen"):
            batch = rollout(sampler, tok, run.task, args, rng, run.accel.device, threshold)
        z_stats.update(batch["z"], batch["completion_mask"])
        with run.timer("train"):  # includes the sampler's refresh after each optimiser step
            stats = update(model, opt, batch, ppo_loss, args, step, run.accel, sampler, ref_model, critic)
        run.counters["regret_stats"] = [z_stats.mean, z_stats.var, z_stats.batches]  # checkpointed
        metrics = run.log_step(step, batch, stats, extra=stop_metrics(batch, threshold))
        if run.is_main:
            run.bar.set_postfix(reward=f"{metrics['rollout/reward']:.2f}", stop=f"{metrics['rollout/stop_frac']:.2f}",
                                acc=f"{run.last('eval/acc'):.2f}")
    ev = [h["value/explained_var"] for h in run.history if "value/explained_var" in h]
    return run.finish("ESPO", extra={"explained_var_last": float(np.nanmean(ev[-10:])),
                                     **espo_summary(run.history, run.gen_tokens)})


if __name__ == "__main__":
    main(tyro.cli(Args))
