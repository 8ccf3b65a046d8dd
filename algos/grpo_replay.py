"""GRPO with experience replay: a replay buffer with a reuse factor and a maximum sample age, and RLEP.

Papers:
  Arnal, Cabannes, Cohen, Kempe & Munos, "Efficient RL Training for LLMs with Experience Replay",
    arXiv:2604.08706 (a replay buffer trades staleness-induced variance, sample diversity and generation cost;
    strict on-policy sampling is suboptimal when generation is expensive);
  Zhang et al., "RLEP: Reinforcement Learning with Experience Replay for LLM Reasoning", arXiv:2507.07451
    (phase 1 collects verified successful trajectories; phase 2 blends them into every update's groups).

Equations and choices (each implemented by the function named on the right):
  fresh groups       a step generates ceil(prompts_per_step / reuse) groups of G             rollout
  replay buffer      each group is stored with its behaviour log-probs mu, its rewards and advantages and its
                     birth step; a step also trains on up to prompts_per_step - fresh buffered groups with
                     age = step - birth <= --max-age that were used fewer than --reuse times, youngest first;
                     a group that can no longer be used is dropped. reuse 1 (or max-age 0) = GRPO.  replay_pick
  importance ratio   replayed tokens: rho_it = pi_theta(o_it) / mu(o_it), mu the stored behaviour policy; fresh
                     (and RLEP) tokens: rho_it = pi_theta / pi_old as grpo.py                 behaviour_old
  loss               l_it = -min(rho_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) A_i): a replayed token is
                     importance-weighted by rho and stops pushing once rho leaves the clip range (PPO's trust
                     region, taken against the policy that sampled it); aggregated as grpo.py   replay_loss
  sampler weight     fresh tokens: l_it <- min(pi_old / pi_sampler, C) l_it when the sampler is not the trainer's
                     computation (grpo.py's truncated_is_weight, C = --sampler-is-cap); replayed tokens need none
                     (their ratio is already to mu, the sampler's own log-probs), RLEP tokens have no mu  update
  RLEP               phase 1 (--experience-out): after training, the final policy samples
                     --experience-samples completions per training prompt; the verified successes are saved.
                     Phase 2 (--experience-in): each group whose prompt has saved successes gets
                     --rlep-replay of them (at random) appended, and the advantages are computed over the mixed
                     group of G + M                                                            rlep_rows,
                     A_i = (r_i - mean_g r) / (std_g r + eps) over a group of any size         ragged_group_advantages

Parent: algos/grpo.py; changed: Args, Args.kernels, Args.steps, Args.threads, check_args, rollout, update, main.

`update` changes in three lines: each micro-batch also carries the rows' behaviour log-probs and their source
(fresh, replayed, RLEP), which replay_loss needs, grpo's sampler-trainer weight is 1 on the rows that are not fresh,
and rollout/logprob_mismatch (with rollout/is_weight_mean and rollout/is_truncated_frac) is measured on fresh rows
only (a replayed row's stored log-probs come from an older policy by design).

Training prompts: --pool-size N fixes a data set of N prompts drawn once from the task's training split (the
same for every seed), sampled with replacement each step; RLEP needs it (its successes are per prompt).
--pool-size 0 (the default) draws fresh prompts each step; with --reuse 1 this is algos/grpo.py exactly (a test
checks it). (On 256 prompts the default's held-out accuracy stalled: 38.8% -> 41.2% after 100 updates.)

Deviations and choices (the abstracts give no formulas):
- The buffer: youngest-first with a use count, so "reuse factor" and "maximum age" are the two knobs the study
  sweeps (the study's buffer samples uniformly from a FIFO queue). Advantages are the ones computed when the
  group was generated (rewards do not change; the group baseline is not re-estimated).
- Correction: the clipped ratio against the behaviour policy (as asynchronous PPO pipelines do). A first
  version weighted replayed tokens by a truncated importance weight min(pi_old / mu, 2) with the clip taken
  around the current policy (so it never clipped): at reuse 2 the training reward fell from 0.34 to 0.12 within
  30 updates (seed 0); without any correction it was no better.
- RLEP: successes come from a finished run's final policy (the paper decodes with its phase-1 policy too); they
  enter the group with weight 1 and ratio 1 to the current policy (no importance weight: the policy that made
  them is not the one being trained, and the paper mixes them in as group members). Phase 1 here is any run of
  this script with --experience-out (e.g. plain GRPO, --reuse 1), so RLEP's cost includes that whole run.
- Resume restarts with an empty replay buffer (RLEP's experience is a file and resumes exactly).
- Metrics: generated tokens count fresh rows only; replay/age_<a> is the share of training rows of age a;
  replay/replayed_frac, replay/rlep_frac; loss/entropy on the training rows. The summary adds gen_tokens (as
  always), replayed_frac, entropy_first and entropy_last.
- Everything else as algos/grpo.py.

Commands:
  python algos/grpo_replay.py                                      # reuse 2, max age 2, on add (2-core CPU)
  python algos/grpo_replay.py --reuse 1                            # = algos/grpo.py
  python algos/grpo_replay.py --reuse 1 --pool-size 256 --experience-out runs/exp.json --steps 60   # RLEP phase 1
  python algos/grpo_replay.py --reuse 1 --pool-size 256 --experience-in runs/exp.json --steps 60    # RLEP phase 2
  python algos/grpo_replay.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --engine vllm --device cuda \
      --max-new-tokens 512 --prompts-per-step 64 --lr 1e-6                                  # one GPU
  accelerate launch --num_processes 4 algos/grpo_replay.py --model ... --device cuda
Expected: the default (reuse 2, max age 2, 100 updates) 38.8% -> 48.8% held-out (+10.0 points) in 41 s
(benchmarks/results/defaults.md). After
40 updates on 256 training prompts (benchmarks/results/replay.md): with half GRPO's generated tokens reuse 2 ends
3.0 points below GRPO (42.9% vs 45.9% held-out, 110 seeds of the claims plan's fresh run) and level with GRPO at the
same tokens (44.0% vs 44.4%, 34 seeds); reuse 4 at 38.6-40.4% (2 seeds); entropy as GRPO's; RLEP reaches GRPO's
peak in 13.3 +- 8.3 updates against GRPO's own 20.0 +- 18.3 (3 seeds, counted at evaluations every 4 updates); its
mean held-out accuracy over the 40 updates (the area under the accuracy curve) is 45.3% vs GRPO's 44.1%, +1.2
[-0.5, +3.0] (4 paired seeds, the claims plan's fresh run: inconclusive).
"""
from __future__ import annotations

import json
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
    """GRPO's flags (algos/grpo.py), the replay buffer's and RLEP's; the plumbing flags are LLMArgs'."""
    threads: int = 1
    """torch CPU threads per process (1: on a shared 2-core machine a second thread made a step 6x slower)"""
    steps: int = 100
    """rollout batches"""
    # rollout
    prompts_per_step: int = 32
    """distinct prompts per rollout batch (per process)"""
    group_size: int = 8
    """completions per prompt (G)"""
    reward: tuple[str, ...] = ("correct",)
    """reward terms NAME[:WEIGHT]: built-ins correct, format, length, or module:function (TRL's convention: prompts,
    completions, answers in; a float or None per completion out); the total is their weighted sum"""
    pool_size: int = 0
    """training prompts drawn once from the task's training split (0 = fresh prompts every step, as grpo.py)"""
    # replay
    reuse: int = 2
    """reuse factor: each generated group is trained on up to this many times; a step generates
    ceil(prompts_per_step / reuse) fresh groups (1 = GRPO)"""
    max_age: int = 2
    """replayed groups at most this many updates old (0 = fresh only)"""
    experience_in: str = ""
    """RLEP phase 2: replay the verified successes saved in this JSON file"""
    experience_out: str = ""
    """RLEP phase 1: after training, save the final policy's verified successes on the training prompts here"""
    experience_samples: int = 8
    """RLEP phase 1: completions sampled per training prompt"""
    rlep_replay: int = 2
    """RLEP phase 2: saved successes appended to each group whose prompt has some (M)"""
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
    """use the Triton fused log-prob kernel when a GPU is present (the fused loss kernel takes no per-token weights)"""


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
    if args.reuse < 1 or args.max_age < 0 or args.pool_size < 0:
        raise SystemExit("--reuse must be >= 1 and --max-age and --pool-size >= 0")
    if (args.experience_in or args.experience_out) and not args.pool_size:
        raise SystemExit("RLEP (--experience-in/--experience-out) needs a fixed training set: --pool-size > 0")
    if args.experience_in and not Path(args.experience_in).is_file():
        raise SystemExit(f"--experience-in {args.experience_in}: no such file (make it with --experience-out)")
    if args.experience_in and (args.reuse > 1 or args.rlep_replay < 1):
        raise SystemExit("RLEP replays saved successes only: use --reuse 1 and --rlep-replay >= 1")


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


def behaviour_old(old_logp, behav_logp, source):
    """The log-probs the clipped ratio divides by: mu (the stored behaviour log-probs) on replayed rows
    (source 1), the trainer's pi_old elsewhere. old_logp, behav_logp: [b, C]; source: [b]."""
    return torch.where((source == 1).unsqueeze(1), behav_logp, old_logp)


def replay_loss(logp, mb: dict, n_seqs: int, n_tokens: int, args: Args):
    """grpo_loss with a replayed token's ratio taken against its behaviour policy: rho = pi_theta / mu, the
    importance weight, clipped to [1 - eps_low, 1 + eps_high] as PPO clips (with nothing replayed this is
    grpo_loss exactly). mb also holds behav [b, C], source [b] (0 fresh, 1 replayed, 2 RLEP) and is_weight
    [b, C] or None (grpo's sampler-trainer weight, 1 on the rows that are not fresh)."""
    old = behaviour_old(mb["old"], mb["behav"], mb["source"])
    tok_loss, clipped = clipped_pg_loss(logp, old, mb["adv"], args.clip_eps_low, args.clip_eps_high)
    if mb.get("is_weight") is not None:  # the sampler is not the trainer: truncated importance weight per token
        tok_loss = tok_loss * mb["is_weight"]
    stats = {"clipfrac": clipped, "ratio": torch.exp(logp.detach() - old)}
    if mb["ref"] is not None:
        kl = k3_kl(logp, mb["ref"])
        tok_loss, stats["kl"] = tok_loss + args.kl_coef * kl, kl
    return aggregate_loss(tok_loss, mb["mask"], args.loss_agg, n_seqs, n_tokens, agg_const(args)), stats


def ragged_group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, std_norm: bool = True,
                            eps: float = 1e-6):
    """group_advantages for groups of any size: rewards [B], group_ids [B] (any labels) -> advantages [B]."""
    adv = torch.empty_like(rewards)
    for g in group_ids.unique():
        rows = group_ids == g
        r = rewards[rows]
        a = r - r.mean()
        adv[rows] = a / (r.std() + eps) if std_norm else a
    return adv


# ---- replay: the buffer, RLEP's experience ----
def draw_prompts(task, pool, n: int, rng) -> list:
    """n training prompts: fresh from the task when pool is None (exactly grpo.py's draw), else from the pool."""
    if pool is None:
        return task.sample("train", n, rng)
    return [pool[i] for i in rng.integers(0, len(pool), size=n)]


def make_pool(task, args: Args):
    """The fixed training prompts, or None: a data set, the same for every seed and every process."""
    return task.sample("train", args.pool_size, np.random.default_rng(7919)) if args.pool_size else None


def replay_pick(buffer: list, step: int, n: int, args: Args) -> list:
    """Up to n stored groups for this step: age = step - birth <= max_age and used fewer than `reuse` times,
    youngest first (insertion order within a birth step); each pick counts as a use. Groups that can no longer
    be used are dropped from the buffer first, so a group older than max_age is never returned."""
    buffer[:] = [g for g in buffer if step - g["birth"] <= args.max_age and g["uses"] < args.reuse]
    picked = sorted(buffer, key=lambda g: -g["birth"])[:n]
    for g in picked:
        g["uses"] += 1
    return picked


def rows_of(ro: common.Rollout, start: int, stop: int) -> common.Rollout:
    """Rows start..stop-1 of a rollout (one group)."""
    return common.Rollout(ro.prompt_ids[start:stop], ro.prompt_mask[start:stop], ro.completion_ids[start:stop],
                          ro.completion_mask[start:stop], ro.logprobs[start:stop], ro.finish_reasons[start:stop],
                          ro.texts[start:stop])


def rlep_rows(tok, prompt: str, completions: list) -> common.Rollout:
    """Saved successes (completion token ids, EOS included) of one prompt as rollout rows; their behaviour
    log-probs are unknown (0): RLEP rows get weight 1 and no mismatch metric."""
    ids, mask = common.left_pad(common.encode_prompts(tok, [prompt]) * len(completions), tok.pad_token_id)
    comp, cmask = common.left_pad([c[::-1] for c in completions], tok.pad_token_id)
    comp, cmask = comp.flip(1), cmask.flip(1)  # right-padded
    return common.Rollout(ids, mask, comp, cmask, torch.zeros(comp.shape), ["stop"] * len(completions),
                          tok.batch_decode(comp, skip_special_tokens=True))


def score_rows(task, examples: list, ro: common.Rollout, args: Args, device) -> tuple[torch.Tensor, dict]:
    """--reward (llm.Rewards) on rollout rows, examples[i] the one of row i, as grpo.py's rollout: the total per row
    and each term's mean where it applies (reward/<name>)."""
    total, terms = llm.Rewards(args.reward)([e.prompt for e in examples], ro.texts, [e.answer for e in examples],
                                            task=task, completion_lengths=ro.completion_mask.sum(1).tolist(),
                                            max_new_tokens=args.max_new_tokens)
    return torch.tensor(total, device=device), {
        f"reward/{k}": float(np.mean([v for v in vs if v is not None] or [0.0])) for k, vs in terms.items()}


@torch.no_grad()
def collect_experience(sampler, tok, task, pool: list, args: Args) -> dict:
    """RLEP phase 1: experience_samples completions per training prompt from the policy; the distinct verified
    successes, {prompt: [completion token ids]}."""
    out = {}
    for s in range(0, len(pool), 64):
        chunk = pool[s:s + 64]
        n = args.experience_samples
        ro = common.generate(sampler, tok, common.encode_prompts(tok, [e.prompt for e in chunk]), n,
                             args.max_new_tokens, args.temperature, args.top_p)
        for i, t in enumerate(ro.texts):
            e = chunk[i // n]
            ids = ro.completion_ids[i][ro.completion_mask[i].bool()].tolist()
            if task.verify(t, e.answer)[0] == 1 and ids not in out.setdefault(e.prompt, []):
                out[e.prompt].append(ids)
    return {k: v for k, v in out.items() if v}


# ---- rollout and update ----
def rollout(sampler, tok, task, args: Args, rng, device, pool=None, buffer=None, experience=None,
            step: int = 0) -> dict:
    """Fresh groups (prompts_per_step / reuse of them) + RLEP successes appended to their groups + replayed
    groups from the buffer; A_i per group (fresh and RLEP rows together; replayed rows keep theirs).

    The fresh groups join the buffer. Returns the training batch with `source` [B] (0 fresh, 1 replayed, 2 RLEP),
    `group` [B] (RLEP rows carry their fresh group's id), `age` [B] and `drawn` (the fresh rows, for the rollout
    metrics)."""
    G = args.group_size
    examples = draw_prompts(task, pool, math.ceil(args.prompts_per_step / args.reuse), rng)
    ro = common.generate(sampler, tok, common.encode_prompts(tok, [e.prompt for e in examples]), G,
                         args.max_new_tokens, args.temperature, args.top_p)
    rewards, terms = score_rows(task, [e for e in examples for _ in range(G)], ro, args, device)
    parts, group_ids, rlep = [ro], torch.arange(len(examples), device=device).repeat_interleave(G), []
    for i, e in enumerate(examples if experience else []):  # RLEP: saved successes join the group
        saved = experience.get(e.prompt, [])
        for j in rng.choice(len(saved), size=min(args.rlep_replay, len(saved)), replace=False) if saved else []:
            rlep.append((i, saved[j]))
    if rlep:  # scored as their group's members (a saved success is correct)
        parts.append(common.concat_rollouts([rlep_rows(tok, examples[i].prompt, [c]) for i, c in rlep],
                                            tok.pad_token_id))
        group_ids = torch.cat([group_ids, torch.tensor([i for i, _ in rlep], device=device)])
        rewards = torch.cat([rewards, score_rows(task, [examples[i] for i, _ in rlep], parts[-1], args, device)[0]])
    adv = ragged_group_advantages(rewards, group_ids, args.adv_std_norm) if rlep else \
        group_advantages(rewards, G, args.adv_std_norm)
    replayed = replay_pick(buffer, step, args.prompts_per_step - len(examples), args) if buffer is not None else []
    if buffer is not None:
        buffer += [{"ro": rows_of(ro, i * G, i * G + G), "rewards": rewards[i * G:i * G + G],
                    "adv": adv[i * G:i * G + G], "birth": step, "uses": 1} for i in range(len(examples))]
    parts += [g["ro"] for g in replayed]
    both = common.concat_rollouts(parts, tok.pad_token_id) if len(parts) > 1 else ro
    n_fresh, n_rlep, n_old = len(examples) * G, len(rlep), len(replayed) * G
    batch = {k: getattr(both, k).to(device) for k in
             ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs")}
    batch.update(rewards=torch.cat([rewards] + [g["rewards"] for g in replayed]),
                 adv=torch.cat([adv] + [g["adv"] for g in replayed]), finish_reasons=both.finish_reasons,
                 source=torch.tensor([0] * n_fresh + [2] * n_rlep + [1] * n_old, device=device),
                 group=torch.cat([group_ids, len(examples) + torch.arange(n_old, device=device) // G]),
                 age=torch.tensor([0] * (n_fresh + n_rlep) + [step - g["birth"] for g in replayed for _ in range(G)],
                                  device=device),
                 reward_terms=terms, drawn={"rewards": rewards[:n_fresh], "completion_mask": ro.completion_mask,
                                            "finish_reasons": ro.finish_reasons})
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
    # the sampler's gap and weight on the rows this step generated: a replayed row's ratio is already to its stored
    # log-probs mu (an older policy's by design), and RLEP rows have none
    fresh = (batch["source"] == 0).unsqueeze(1)
    sums, n_opt, grad_norm = {}, 0, 0.0  # sums: this rank's share of each logged mean, summed over ranks below
    total = args.steps * args.ppo_epochs * args.minibatches
    for epoch in range(args.ppo_epochs):
        for mb_idx in (torch.randperm(B) if args.minibatches > 1 else torch.arange(B)).chunk(args.minibatches):
            n_seqs, n_tokens = llm.step_counts(mask[mb_idx], accel)
            opt.zero_grad(set_to_none=True)
            for idx in micro(mb_idx):
                logp, ent = logprobs_of(model, idx, True)
                mb = {"adv": batch["adv"][idx], "mask": mask[idx].float(),
                      "old": logp.detach() if old is None else old[idx], "ref": None if ref is None else ref[idx],
                      "behav": batch["logprobs"][idx], "source": batch["source"][idx]}
                mb["is_weight"] = torch.where(fresh[idx], truncated_is_weight(mb["old"], mb["behav"],
                                                                              args.sampler_is_cap), 1.0) \
                    if correct else None
                loss, token_stats = loss_fn(logp, mb, n_seqs, n_tokens, args)
                loss.backward()  # a NaN here reaches every rank's gradient: optimizer_step stops them all
                for k, v in {"pg": loss.item(), **{k: common.masked_sum(v.detach(), mb["mask"]).item() / max(
                        n_tokens, 1) for k, v in {**token_stats, "entropy": ent}.items()}}.items():
                    sums[k] = sums.get(k, 0.0) + v
                if epoch == 0:  # every fresh token once, on the sampler's weights (pi_old)
                    for k, v in sampler_gap(mb["old"], mb["behav"], mb["is_weight"], mb["mask"] * fresh[idx],
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


def replay_metrics(batch: dict, args: Args) -> dict:
    """replay/: the share of training rows replayed from the buffer, from RLEP, and of each age 0..max_age."""
    n = max(len(batch["source"]), 1)
    out = {"replay/replayed_frac": float((batch["source"] == 1).sum()) / n,
           "replay/rlep_frac": float((batch["source"] == 2).sum()) / n}
    out.update({f"replay/age_{a}": float((batch["age"] == a).sum()) / n for a in range(args.max_age + 1)})
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
    loss_fn = replay_loss  # (the fused loss kernel takes no per-token weights; --kernels fuses the log-probs)
    opt = llm.make_optimizer(model.parameters(), args)
    pool, buffer = make_pool(run.task, args), []  # a resumed run starts with an empty buffer
    experience = json.loads(Path(args.experience_in).read_text()) if args.experience_in else None
    run.start(model, tok, opt, sampler)  # resume from --resume, then the step-0 held-out evaluation
    for step, rng in run.steps():  # every random draw of a step depends on (seed, step, rank) only
        with run.timer("gen"):
            batch = rollout(sampler, tok, run.task, args, rng, run.accel.device, pool, buffer, experience, step)
        with run.timer("train"):  # includes the sampler's refresh after each optimiser step
            stats = update(model, opt, batch, loss_fn, args, step, run.accel, sampler, ref_model, fused_logprob)
        drawn = batch["drawn"]  # rollout/ metrics and token counts are over this step's fresh rollouts only
        gen_tokens = run.gen_tokens + int(drawn["completion_mask"].sum())
        run.log_step(step, {**drawn, "reward_terms": batch["reward_terms"]}, stats,
                     extra={**replay_metrics(batch, args), "rollout/gen_tokens": gen_tokens})
    if run.is_main and args.experience_out:  # RLEP phase 1: the final policy's verified successes on the prompts
        Path(args.experience_out).write_text(json.dumps(collect_experience(sampler, tok, run.task, pool, args)))
    train = [h for h in run.history if "loss/entropy" in h]
    return run.finish("GRPO + replay", extra=dict(
        replayed_frac=float(np.mean([h["replay/replayed_frac"] for h in train])),
        entropy_first=train[0]["loss/entropy"], entropy_last=train[-1]["loss/entropy"]))


if __name__ == "__main__":
    main(tyro.cli(Args))
