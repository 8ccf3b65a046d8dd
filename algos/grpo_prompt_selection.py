"""GRPO with prompt selection: which prompts get rollouts, and how many (Pilot-Commit, GRESO, VADE, DAPO-style).

Papers:
  Pilot-Commit: Kim et al., "Spend Your Rollouts Where It Counts: Rollout Allocation for Group-Based RL
    Post-Training", arXiv:2605.26606 (pilot rollouts estimate each prompt's informativeness; the rest of the
    budget goes to high-variance prompts);
  GRESO: Zheng et al., "Act Only When It Pays: Efficient Reinforcement Learning for LLM Reasoning via Selective
    Rollouts", arXiv:2506.02177 (skip prompts predicted uninformative from their reward history);
  VADE: Hu et al., "VADE: Variance-Aware Dynamic Sampling via Online Sample-Level Difficulty Estimation for
    Multimodal RL", arXiv:2511.18902 (per-prompt Beta posterior, Thompson sampling, two-scale prior decay);
  DAPO's dynamic sampling (Yu et al., arXiv:2503.14476) is the comparator: sample, filter, refill.

The idea: a group of G rollouts whose rewards are all equal has zero advantage and gives no gradient, yet GRPO
pays for it. A selector decides, before each generation round, which prompts to sample and how many completions
each, and updates its state from the rewards after the round. The step trains on the groups it names.

Equations and choices (each implemented by the function or class named on the right):
  the selector interface   plan(round, groups, draw, rng, step) -> [(group, n samples)] ([] ends the step);
                           observe(prompt, rewards, step); batch(groups) -> the training groups   Selector
  uniform (= GRPO)         one round: prompts_per_step prompts, G each, all trained on         Uniform
  DAPO-style               rounds of prompts_per_step prompts x G; keep groups with 0 < #correct < G until
                           prompts_per_step are kept or --max-sample-rounds rounds are spent     DynamicSampling
  Pilot-Commit             pilot: M = --pilot-factor * prompts_per_step prompts x k = --pilot-samples;
                           score p_hat (1 - p_hat), p_hat = (s + 1) / (k + 2) (s pilot successes, Beta(1, 1)
                           prior; ties broken at random); commit: G - k more samples to the top
                           prompts_per_step; the group = k pilot + G - k commit samples         PilotCommit
  GRESO                    z = consecutive zero-variance groups a prompt has had; it is rolled out with
                           probability q = max(--greso-floor, --greso-base ** z) (drawn before rollout), then
                           DAPO-style filtering; a refill round rolls out ceil(missing / informative rate)
                           prompts (adaptive batch size)                                        Greso, greso_keep_prob
  VADE                     Beta(a, b) per prompt, prior Beta(1, 1); two-scale decay of old evidence toward the
                           prior: x <- x0 + (x - x0) * --vade-visit-decay at each new observation and
                           * --vade-step-decay ** (steps since it was last observed); Thompson draw
                           p ~ Beta(a, b) for --vade-candidates x prompts_per_step candidates, the
                           prompts_per_step with the largest p (1 - p) get G samples each       Vade, vade_posterior
  then GRPO unchanged      A_i = (r_i - mean) / (std + eps) per group, clipped surrogate, aggregation
                           (group_advantages, clipped_pg_loss, aggregate_loss, grpo_loss as algos/grpo.py)

Parent: algos/grpo.py; changed: Args, Args.steps, Args.threads, check_args, rollout, main.

Training prompts: --pool-size N fixes a training set of N prompts drawn once from the task's training split
(the papers train for epochs over a dataset; GRESO's and VADE's histories need prompts to come back); each
round draws uniformly with replacement from it (1,024 by default: on 256 prompts, seen ~19 times each in 150
steps, the tiny policy's held-out accuracy stalled near 44% while the training reward kept rising).
--pool-size 0 draws fresh prompts from the task each step, and
then `--selector uniform` is algos/grpo.py exactly (same prompts, samples, loss and update; a test checks it).
Selector state is keyed by the prompt text and saved with checkpoints, so resume stays exact.

Difficulty mix of the default task (2-digit `add`, tiny-0.6m, temperature 1, 16 samples for each of 128
training prompts): per-prompt success rate 0 for 16% of prompts, (0, 0.2) 39%, [0.2, 0.4) 20%, [0.4, 0.6) 14%,
[0.6, 0.8) 7%, [0.8, 1) 3%, 1 for 1%; mean 0.27; about 35% of G = 8 groups have zero variance at the start.
(The long-response task `--task sumsmix --model tiny-sums --max-new-tokens 48` mixes more, 53% zero-variance
groups, from 86% success at 2 operands to 0% from 7 on, but costs about 12x more per rollout.)

Deviations from the papers (each abstract leaves these open; they are this file's choices):
- Pilot-Commit: the pilot score uses the pilot samples only (no history); the pilot samples of committed prompts
  stay in their group (the group is still G samples of the same policy); the pilot samples of skipped prompts
  are paid for and dropped. The per-step cost is M k + prompts_per_step (G - k) sequences (288 by default,
  against GRPO's 256).
- GRESO: a fixed exploration base and floor instead of the paper's adaptive exploration rates; one rule for
  all-correct and all-wrong prompts. Candidates are drawn until prompts_per_step pass (at most 8 x
  prompts_per_step draws a round).
- VADE: the abstract names "a two-scale prior decay" without a formula; the two scales here are per
  observation and per training step, as above. The Thompson draw uses numpy's generator of the step.
- Metrics: rollout/sampled (sequences generated this step, all processes), rollout/cumulative_rollouts,
  rollout/zero_var_group_frac (of the training groups; 0 by construction for the filtering selectors),
  rollout/rollouts_per_informative_group (sequences generated / training groups whose rewards differ);
  the summary carries cumulative_rollouts, zero_var_group_frac and rollouts_per_informative_group.
- Several processes: each keeps its own selector state for its own prompts; after the rounds one gather makes
  every rank train on the fewest groups any rank holds (all skip the update when one holds none), as
  algos/dapo.py does.
- --rollout-budget (off by default) stops once that many sequences have been generated, for comparisons at
  equal rollouts.
- Everything else as algos/grpo.py.

Commands:
  python algos/grpo_prompt_selection.py                                       # VADE on add, 2-core CPU
  python algos/grpo_prompt_selection.py --selector pilot-commit               # or greso, dynamic, uniform
  python algos/grpo_prompt_selection.py --selector uniform --pool-size 0      # = algos/grpo.py
  python algos/grpo_prompt_selection.py --model tiny-sums --task sumsmix --digits 1 --max-new-tokens 48
  python algos/grpo_prompt_selection.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --engine vllm \
      --device cuda --max-new-tokens 512 --prompts-per-step 64 --pool-size 0 --lr 1e-6    # one GPU
  accelerate launch --num_processes 4 algos/grpo_prompt_selection.py --model ... --device cuda
Expected: the default (VADE, 150 steps, 1,024 prompts) 38.8% -> 52.8% held-out (+14.0 points) in 86 s
(benchmarks/results/defaults.md). At 10,240 generated
sequences on 256 training prompts every selector ends at 44-46% held-out greedy accuracy (from 38.8%, 3 seeds); VADE
trains on 17.2% zero-variance groups against GRPO's 26.7% at the same cost, GRESO spends 10.3 sequences per
informative group against DAPO-style dynamic sampling's 16.0, Pilot-Commit 11.1 against GRPO's 10.9; the rollouts
each needs to reach GRPO's final accuracy are dominated by run-to-run noise (benchmarks/results/prompt_selection.md).
The mean held-out accuracy over the budget (the area under the accuracy curve against cumulative rollouts), on the
claims plan's paired fresh run: Pilot-Commit 44.0 vs GRPO 44.0 (+0.0 [-2.0, +2.1], 5 seeds), Pilot-Commit 43.8 vs
DAPO-style 45.6 (-1.8 [-4.2, +0.6], 8 seeds), GRESO 45.9 vs DAPO-style 45.5 (+0.5 [-0.6, +1.6], 10 seeds); the
claims table (benchmarks/README.md) reads both comparisons with DAPO-style as short of the 2.6 points the plan was
powered to see, and the one with GRPO as underpowered.
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
    """GRPO's flags and the prompt selector's (which prompts, how many rollouts); the plumbing flags are LLMArgs'."""
    threads: int = 1
    """torch CPU threads per process (1: on a shared 2-core machine a second thread made a step 6x slower)"""
    # rollout
    prompts_per_step: int = 32
    """distinct prompts per rollout batch (per process)"""
    group_size: int = 8
    """completions per prompt (G)"""
    # prompt selection
    selector: Literal["uniform", "dynamic", "pilot-commit", "greso", "vade"] = "vade"
    """uniform (= GRPO), dynamic (DAPO-style filter and refill), pilot-commit, greso or vade"""
    pool_size: int = 1024
    """training prompts drawn once from the task's training split (0 = fresh prompts every step, as grpo.py)"""
    max_sample_rounds: int = 3
    """dynamic and greso: at most this many generation rounds per step"""
    pilot_factor: float = 1.5
    """pilot-commit: pilot prompts = this x prompts_per_step"""
    pilot_samples: int = 2
    """pilot-commit: samples per pilot prompt (k); the commit stage adds G - k"""
    greso_base: float = 0.5
    """greso: a prompt with z consecutive zero-variance groups is rolled out with probability base ** z ..."""
    greso_floor: float = 0.1
    """greso: ... but never below this exploration floor"""
    vade_candidates: float = 4.0
    """vade: candidates per step = this x prompts_per_step; the prompts_per_step best by p (1 - p) are sampled"""
    vade_visit_decay: float = 0.5
    """vade: old evidence is multiplied by this at each new observation of the prompt (fast scale)"""
    vade_step_decay: float = 0.98
    """vade: ... and by this per training step since it was observed (slow scale)"""
    rollout_budget: int = 0
    """stop once this many sequences have been generated, all processes together (0 = run all --steps)"""
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
    steps: int = 150
    """rollout batches (each followed by ppo_epochs * minibatches optimiser steps)"""
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
    if args.pool_size < 0 or args.rollout_budget < 0 or args.max_sample_rounds < 1:
        raise SystemExit("--pool-size and --rollout-budget must be >= 0 and --max-sample-rounds >= 1")
    if not 1 <= args.pilot_samples < args.group_size or args.pilot_factor < 1:
        raise SystemExit(f"--pilot-samples must be in [1, group_size={args.group_size}) and --pilot-factor >= 1")
    if not 0 < args.greso_floor <= 1 or not 0 < args.greso_base <= 1:
        raise SystemExit("--greso-floor and --greso-base must be in (0, 1]")
    if args.vade_candidates < 1 or not (0 <= args.vade_visit_decay <= 1 and 0 <= args.vade_step_decay <= 1):
        raise SystemExit("--vade-candidates must be >= 1 and the VADE decays in [0, 1]")


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


# ---- the selectors: which prompts get rollouts, and how many ----
def draw_prompts(task, pool, n: int, rng) -> list:
    """n training prompts: fresh from the task when pool is None (exactly grpo.py's draw), else from the pool."""
    if pool is None:
        return task.sample("train", n, rng)
    return [pool[i] for i in rng.integers(0, len(pool), size=n)]


def make_pool(task, args: Args):
    """The fixed training prompts, or None: a data set, the same for every seed and every process."""
    return task.sample("train", args.pool_size, np.random.default_rng(7919)) if args.pool_size else None


def new_group(example) -> dict:
    """One prompt's group in this step: its rows in the step's rollouts and their rewards, filled round by round."""
    return {"example": example, "rows": [], "rewards": []}


def informative(group: dict) -> bool:
    """The group's rewards are not all equal, so its advantages are not all zero."""
    return max(group["rewards"]) > min(group["rewards"])


class Uniform:
    """GRPO: one round of prompts_per_step prompts with G samples each; every group is trained on.

    The selector interface (every selector below has it):
      plan(rnd, groups, draw, rng, step) -> [(group, n)]: before generation round rnd = 0, 1, ... of a step, the
        groups to sample and how many completions each (a group already in `groups` gets more samples,
        new_group(prompt) starts one); [] ends the rounds. draw(n) gives n training prompts.
      observe(prompt, rewards, step): after each round, once per group sampled in it; updates `state`.
      batch(groups) -> the groups the step trains on (each with at least G samples; its first G are used).
    `state` is a JSON-able dict keyed by prompt text, saved with checkpoints.
    """

    def __init__(self, args: Args, state: dict | None = None):
        self.args, self.state = args, state or {}

    def plan(self, rnd: int, groups: list, draw, rng, step: int) -> list:
        return [(new_group(e), self.args.group_size) for e in draw(self.args.prompts_per_step)] if rnd == 0 else []

    def observe(self, prompt: str, rewards: list, step: int) -> None:
        pass

    def batch(self, groups: list) -> list:
        return groups


class DynamicSampling(Uniform):
    """DAPO's dynamic sampling (as algos/dapo.py): rounds of prompts_per_step prompts x G until prompts_per_step
    informative groups are held (at most --max-sample-rounds rounds); only those are trained on."""

    def plan(self, rnd, groups, draw, rng, step):
        a = self.args
        if sum(map(informative, groups)) >= a.prompts_per_step or rnd >= a.max_sample_rounds:
            return []
        return [(new_group(e), a.group_size) for e in self.candidates(draw, rng, groups)]

    def candidates(self, draw, rng, groups=()) -> list:
        return draw(self.args.prompts_per_step)

    def batch(self, groups):
        return [g for g in groups if informative(g)][:self.args.prompts_per_step]


def pilot_score(rewards: list) -> float:
    """Pilot-Commit's informativeness: p_hat (1 - p_hat), p_hat = (successes + 1) / (k + 2) (Beta(1, 1) prior)."""
    p = (sum(rewards) + 1) / (len(rewards) + 2)
    return p * (1 - p)


class PilotCommit(Uniform):
    """Round 0 (pilot): pilot_factor x prompts_per_step prompts, k = pilot_samples each. Round 1 (commit): the
    prompts_per_step prompts with the highest pilot_score (ties at random) get G - k more; the others are
    skipped. The step trains on the committed groups (k pilot + G - k commit samples)."""

    def plan(self, rnd, groups, draw, rng, step):
        a = self.args
        if rnd == 0:
            n_pilot = max(a.prompts_per_step, round(a.pilot_factor * a.prompts_per_step))
            return [(new_group(e), a.pilot_samples) for e in draw(n_pilot)]
        if rnd == 1:
            tie = rng.random(len(groups))
            order = sorted(range(len(groups)), key=lambda i: (-pilot_score(groups[i]["rewards"]), tie[i]))
            return [(groups[i], a.group_size - a.pilot_samples) for i in order[:a.prompts_per_step]]
        return []

    def batch(self, groups):
        return [g for g in groups if len(g["rewards"]) >= self.args.group_size]


def greso_keep_prob(z: int, base: float, floor: float) -> float:
    """GRESO's pre-rollout filter: a prompt after z consecutive zero-variance groups is rolled out with
    probability base ** z, never less than the exploration floor."""
    return max(floor, base ** z)


class Greso(DynamicSampling):
    """DAPO-style rounds whose candidates first pass GRESO's filter: state[prompt] = z, the prompt's consecutive
    zero-variance groups (0 after an informative one). Round 0 rolls out prompts_per_step prompts; a refill round
    only about as many as the missing groups need, ceil(missing / informative rate so far) (GRESO's adaptive batch
    size). Candidates are drawn until enough pass (at most 8 x prompts_per_step draws a round)."""

    def candidates(self, draw, rng, groups=()) -> list:
        a, chosen, want = self.args, [], self.args.prompts_per_step
        if groups:
            n_inf = sum(map(informative, groups))
            want = min(want, math.ceil((want - n_inf) / max(n_inf / len(groups), 1 / a.group_size)))
        for _ in range(8):
            for e in draw(a.prompts_per_step):
                z = self.state.get(e.prompt, 0)
                if len(chosen) < want and rng.random() < greso_keep_prob(z, a.greso_base, a.greso_floor):
                    chosen.append(e)
            if len(chosen) == want:
                break
        return chosen

    def observe(self, prompt, rewards, step):
        self.state[prompt] = 0 if max(rewards) > min(rewards) else self.state.get(prompt, 0) + 1


def vade_posterior(entry: list, step: int, args: Args) -> tuple[float, float]:
    """(a, b) of a prompt's Beta posterior at `step`: entry = [a, b, step of its last observation]; the evidence
    beyond the Beta(1, 1) prior decays by vade_step_decay per step since then."""
    a, b, last = entry
    f = args.vade_step_decay ** (step - last)
    return 1 + (a - 1) * f, 1 + (b - 1) * f


class Vade(Uniform):
    """One round: vade_candidates x prompts_per_step candidates; a Thompson draw p ~ Beta(a, b) per candidate
    (numpy's generator of the step); the prompts_per_step with the largest p (1 - p) get G samples each.
    observe: old evidence x vade_visit_decay, then a += successes, b += failures."""

    def plan(self, rnd, groups, draw, rng, step):
        a = self.args
        if rnd > 0:
            return []
        cands = draw(max(a.prompts_per_step, round(a.vade_candidates * a.prompts_per_step)))
        p = self.thompson([e.prompt for e in cands], rng, step)
        order = np.argsort(-p * (1 - p), kind="stable")[:a.prompts_per_step]
        return [(new_group(cands[i]), a.group_size) for i in order]

    def thompson(self, prompts: list, rng, step: int) -> np.ndarray:
        """One draw p ~ Beta(a, b) from each prompt's posterior at `step` (unseen prompts: the prior Beta(1, 1))."""
        post = np.array([vade_posterior(self.state.get(q, [1.0, 1.0, step]), step, self.args) for q in prompts])
        return rng.beta(post[:, 0], post[:, 1])

    def observe(self, prompt, rewards, step):
        a, b = vade_posterior(self.state.get(prompt, [1.0, 1.0, step]), step, self.args)
        v, s = self.args.vade_visit_decay, float(sum(rewards))
        self.state[prompt] = [1 + (a - 1) * v + s, 1 + (b - 1) * v + len(rewards) - s, step]


SELECTORS = {"uniform": Uniform, "dynamic": DynamicSampling, "pilot-commit": PilotCommit, "greso": Greso,
             "vade": Vade}


# ---- rollout and update ----
def select_rows(ro: common.Rollout, rows: list) -> common.Rollout:
    """The given rows of a rollout, in that order."""
    idx = torch.tensor(rows, dtype=torch.long)
    return common.Rollout(ro.prompt_ids[idx], ro.prompt_mask[idx], ro.completion_ids[idx], ro.completion_mask[idx],
                          ro.logprobs[idx], [ro.finish_reasons[i] for i in rows], [ro.texts[i] for i in rows])


def rollout(sampler, tok, task, args: Args, rng, device, selector=None, pool=None, step: int = 0,
            accel=None) -> dict:
    """The selector's rounds (plan -> generate -> reward -> observe), then GRPO's batch of the groups it names.

    Each round is one generation call over the planned prompts (each repeated n times). All processes then train
    on the fewest groups any of them holds (one gather). Returns the training batch (G rows per group,
    group-major, A_i per group), `drawn` (every generated sequence) and `sampling` (the counts, all processes).
    """
    G, groups, parts, all_rewards = args.group_size, [], [], []
    selector = selector or Uniform(args)
    for rnd in range(max(2, args.max_sample_rounds) + 1):  # a safety bound: every selector stops by itself
        plan = selector.plan(rnd, groups, lambda n: draw_prompts(task, pool, n, rng), rng, step)
        if not plan:
            break
        prompts = [g["example"].prompt for g, n in plan for _ in range(n)]
        ro = common.generate(sampler, tok, common.encode_prompts(tok, prompts), 1, args.max_new_tokens,
                             args.temperature, args.top_p)
        answers = [g["example"].answer for g, n in plan for _ in range(n)]
        rewards = [task.verify(t, a)[0] for t, a in zip(ro.texts, answers)]
        i = 0
        for g, n in plan:
            if not g["rows"]:  # a new prompt (a pilot group coming back for its commit samples is not)
                groups.append(g)
            g["rows"] += range(len(all_rewards) + i, len(all_rewards) + i + n)
            g["rewards"] += rewards[i:i + n]
            selector.observe(g["example"].prompt, rewards[i:i + n], step)
            i += n
        parts.append(ro), all_rewards.extend(rewards)
    train = selector.batch(groups)
    counts = torch.tensor([[len(train), len(all_rewards)]], device=device)  # [1, 2] on this process
    counts = accel.gather(counts) if accel is not None and accel.num_processes > 1 else counts  # [ranks, 2]
    train = train[:int(counts[:, 0].min())]
    n_inf = torch.tensor([sum(map(informative, train))], device=device)
    n_inf = int(accel.reduce(n_inf, "sum") if accel is not None and accel.num_processes > 1 else n_inf)
    ro = common.concat_rollouts(parts, tok.pad_token_id) if len(parts) > 1 else parts[0]
    kept = select_rows(ro, [r for g in train for r in g["rows"][:G]])
    rewards = torch.tensor([r for g in train for r in g["rewards"][:G]], device=device)
    batch = {k: getattr(kept, k).to(device) for k in
             ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs")}
    batch.update(rewards=rewards, adv=group_advantages(rewards, G, args.adv_std_norm) if train else rewards,
                 finish_reasons=kept.finish_reasons,
                 drawn={"rewards": torch.tensor(all_rewards), "completion_mask": ro.completion_mask,
                        "finish_reasons": ro.finish_reasons})
    sampled = int(counts[:, 1].sum())
    batch["sampling"] = {"rollout/sampled": sampled, "rollout/informative_groups": n_inf,
                         "rollout/rollouts_per_informative_group": sampled / n_inf if n_inf else float("nan")}
    if train:  # of the training groups: the share that carries no gradient
        batch["sampling"]["rollout/zero_var_group_frac"] = 1 - n_inf / (len(train) * counts.shape[0])
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
def budget_summary(sampled: int, informative_total: int, history: list[dict]) -> dict:
    """The run's rollout bill: rollouts sampled, steps done within --rollout-budget, rollouts per informative group."""
    return {"cumulative_rollouts": sampled, "steps_done": history[-1]["step"],
            "rollouts_per_informative_group": sampled / informative_total if informative_total else math.nan}


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
    # resume from --resume (with the rollout counts and the selector's state), then the step-0 held-out evaluation
    run.start(model, tok, opt, sampler, counters={"sampled": 0, "informative_total": 0, "selector": None})
    count = run.counters  # saved in every checkpoint
    pool, selector = make_pool(run.task, args), SELECTORS[args.selector](args, count["selector"])
    count["selector"] = selector.state  # the selector updates this dict in place
    for step, rng in run.steps():  # every random draw of a step depends on (seed, step, rank) only
        with run.timer("gen"):
            batch = rollout(sampler, tok, run.task, args, rng, run.accel.device, selector, pool, step, run.accel)
        with run.timer("train"):  # every process trains, or every process skips (one holds no training group)
            stats = update(model, opt, batch, loss_fn, args, step, run.accel, sampler, ref_model, fused_logprob) \
                if len(batch["adv"]) else {}
        count["sampled"] += batch["sampling"]["rollout/sampled"]
        count["informative_total"] += batch["sampling"]["rollout/informative_groups"]
        last = bool(args.rollout_budget and count["sampled"] >= args.rollout_budget)
        # rollout/ figures over every sequence generated (a selector's groups may differ in size: no per-group
        # figure), the selector's figures, the rollouts sampled so far
        run.log_step(step, batch["drawn"], stats, group_size=1, last=last,
                     extra={**batch["sampling"], "rollout/cumulative_rollouts": count["sampled"]})
        if last:  # the budget is counted over all processes: every process stops at the same step
            break
    return run.finish(f"GRPO + {args.selector}",
                      extra=budget_summary(count["sampled"], count["informative_total"], run.history))


if __name__ == "__main__":
    main(tyro.cli(Args))
