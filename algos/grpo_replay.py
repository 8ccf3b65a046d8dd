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
  RLEP               phase 1 (--experience-out): after training, the final policy samples
                     --experience-samples completions per training prompt; the verified successes are saved.
                     Phase 2 (--experience-in): each group whose prompt has saved successes gets
                     --rlep-replay of them (at random) appended, and the advantages are computed over the mixed
                     group of G + M                                                            rlep_rows,
                     A_i = (r_i - mean_g r) / (std_g r + eps) over a group of any size         ragged_group_advantages

Parent: algos/grpo.py; changed: Args, Args.exp_name, Args.steps, Args.threads, check_args, rollout, update, main.

`update` changes in two lines: each micro-batch also carries the rows' behaviour log-probs and their source
(fresh, replayed, RLEP), which replay_loss needs, and rollout/logprob_mismatch is measured on fresh rows only
(a replayed row's stored log-probs come from an older policy by design).

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
40 updates on 256 training prompts (benchmarks/results/replay.md): reuse 2 ends at 44.8% held-out accuracy with half
GRPO's generated tokens (GRPO 45.1%, but 46.5% at the same tokens), reuse 4 at 38.6-40.4%; entropy as GRPO's;
RLEP reaches GRPO's peak in 13.3 +- 8.3 updates against GRPO's own 20.0 +- 18.3 (inconclusive).
"""
from __future__ import annotations

import copy
import json
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
from algos import _llm as llm
from algos._vllm import VLLMEngine


@dataclass
class Args:
    # bookkeeping
    exp_name: str = "grpo_replay"
    """name of the run (the output folder is out_dir/exp_name)"""
    seed: int = 0
    """random seed: prompts and sampling of step s depend only on (seed, s, rank), which makes resume exact"""
    track: bool = False
    """log to Weights & Biases as well (WANDB_MODE=offline works without network)"""
    out_dir: str = "runs"
    """where metrics.jsonl, summary.json, the curve and checkpoints go"""
    # model and task
    model: str = "tiny-0.6m"
    """tiny-0.6m, tiny-5m, smollm2-135m, a Hugging Face id or a local path"""
    task: str = "add"
    """add, addsteps, jsonl:PATH (prompt/answer records) or gsm8k"""
    digits: int = 2
    """operand digits of the arithmetic tasks (training and the main held-out eval)"""
    device: str = "auto"
    """auto (CUDA if present), cpu or cuda"""
    threads: int = 1
    """torch CPU threads per process (1: on a shared 2-core machine a second thread made a step 6x slower)"""
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """compute dtype: auto = bf16 autocast on CUDA (fp32 weights, optimiser, log-softmax and losses), fp32 on CPU"""
    # rollout
    engine: Literal["hf", "vllm"] = "hf"
    """rollout engine: Hugging Face generate (CPU or GPU) or vLLM (GPU)"""
    vllm_gpu_memory: float = 0.3
    """fraction of GPU memory vLLM may take (the trainer shares the GPU)"""
    prompts_per_step: int = 32
    """distinct prompts per rollout batch (per process)"""
    group_size: int = 8
    """completions per prompt (G)"""
    max_new_tokens: int = 8
    """generation budget per completion"""
    temperature: float = 1.0
    """sampling temperature (the trainer scores with the same temperature)"""
    top_p: float = 1.0
    """nucleus sampling threshold"""
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
    # optimisation
    steps: int = 100
    """rollout batches (each followed by ppo_epochs * minibatches optimiser steps)"""
    ppo_epochs: int = 1
    """passes over each rollout batch"""
    minibatches: int = 1
    """optimiser steps per pass; the rollout batch is split into this many"""
    micro_batch_size: int = 256
    """sequences per forward/backward (gradient accumulation inside a mini-batch)"""
    lr: float = 1e-4
    """peak learning rate (AdamW); 1e-3 collapses the tiny policy, real LLMs want about 1e-6"""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """after warm-up: constant, or cosine decay to 10% over all optimiser steps"""
    warmup_steps: int = 0
    """linear warm-up (optimiser steps)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""
    kernels: bool = False
    """use the Triton kernels (fused log-prob, fused clipped loss) when a GPU is present"""
    grad_checkpointing: bool = False
    """recompute each decoder layer in the backward (HF, non-reentrant): activations of one layer instead of all;
    off by default: the tiny CPU default needs no memory and its update takes 1.4x as long with it (0.87 vs 0.62 s
    for 256 sequences on one thread); on for real models on a GPU (benchmarks/results/memory_plan.md)"""
    sampler_is_cap: float = 2.0
    """cap C of the truncated importance weight min(pi_old / pi_sampler, C) per token, applied when the sampler is
    not the trainer's computation (the bf16 sampler copy on CUDA, vLLM); 0 = off"""
    # eval and checkpoints
    eval_every: int = 25
    """rollout batches between held-out evaluations"""
    eval_examples: int = 500
    """held-out prompts for greedy accuracy"""
    pass_k: int = 8
    """k of pass@k (on the first 100 held-out prompts; 0 = off)"""
    eval_hard: bool = True
    """also evaluate one digit harder than training (out of distribution)"""
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
    grpo_loss exactly). mb also holds behav [b, C] and source [b] (0 fresh, 1 replayed, 2 RLEP)."""
    old = behaviour_old(mb["old"], mb["behav"], mb["source"])
    tok_loss, clipped = clipped_pg_loss(logp, old, mb["adv"], args.clip_eps_low, args.clip_eps_high)
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


@torch.no_grad()
def collect_experience(model, tok, task, pool: list, args: Args) -> dict:
    """RLEP phase 1: experience_samples completions per training prompt from the policy; the distinct verified
    successes, {prompt: [completion token ids]}."""
    out = {}
    for s in range(0, len(pool), 64):
        chunk = pool[s:s + 64]
        n = args.experience_samples
        ro = common.generate(model, tok, common.encode_prompts(tok, [e.prompt for e in chunk]), n,
                             args.max_new_tokens, args.temperature, args.top_p)
        for i, t in enumerate(ro.texts):
            e = chunk[i // n]
            ids = ro.completion_ids[i][ro.completion_mask[i].bool()].tolist()
            if task.verify(t, e.answer)[0] == 1 and ids not in out.setdefault(e.prompt, []):
                out[e.prompt].append(ids)
    return {k: v for k, v in out.items() if v}


# ---- rollout and update ----
def rollout(model, tok, task, args: Args, rng, device, engine=None, pool=None, buffer=None, experience=None,
            step: int = 0) -> dict:
    """Fresh groups (prompts_per_step / reuse of them) + RLEP successes appended to their groups + replayed
    groups from the buffer; A_i per group (fresh and RLEP rows together; replayed rows keep theirs).

    The fresh groups join the buffer. Returns the training batch with `source` [B] (0 fresh, 1 replayed, 2 RLEP),
    `group` [B] (RLEP rows carry their fresh group's id), `age` [B] and `drawn` (the fresh rows, for the rollout
    metrics)."""
    G = args.group_size
    examples = draw_prompts(task, pool, math.ceil(args.prompts_per_step / args.reuse), rng)
    ro = common.generate(model, tok, common.encode_prompts(tok, [e.prompt for e in examples]), G,
                         args.max_new_tokens, args.temperature, args.top_p, engine=engine)
    answers = [e.answer for e in examples for _ in range(G)]
    rewards = torch.tensor([task.verify(t, a)[0] for t, a in zip(ro.texts, answers)], device=device)
    parts, group_ids, rlep = [ro], torch.arange(len(examples), device=device).repeat_interleave(G), []
    for i, e in enumerate(examples if experience else []):  # RLEP: saved successes join the group
        saved = experience.get(e.prompt, [])
        for j in rng.choice(len(saved), size=min(args.rlep_replay, len(saved)), replace=False) if saved else []:
            rlep.append((i, saved[j]))
    if rlep:
        parts.append(common.concat_rollouts([rlep_rows(tok, examples[i].prompt, [c]) for i, c in rlep],
                                            tok.pad_token_id))
        group_ids = torch.cat([group_ids, torch.tensor([i for i, _ in rlep], device=device)])
        rewards = torch.cat([rewards, torch.ones(len(rlep), device=device)])
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
                 drawn={"rewards": rewards[:n_fresh], "completion_mask": ro.completion_mask,
                        "finish_reasons": ro.finish_reasons})
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

    pi_old (and pi_ref) are scored before any update; the loss of each micro-batch is normalised by counts
    over its whole mini-batch on all ranks, so accumulation and data parallelism leave J unchanged.
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
    stats = {"pg": 0.0, "entropy": 0.0, "grad_norm": 0.0}
    # Sampler-vs-trainer log-prob gap on the sampler's weights: measured before any update of this batch, on the
    # rows this step generated (a replayed row's log-probs come from an older policy by design).
    fresh = batch["completion_mask"].float() * (batch["source"] == 0).float().unsqueeze(1)
    mismatch = 0.0 if on_policy else common.masked_mean((old - batch["logprobs"]).abs(), fresh).item()
    n_opt = 0
    for _ in range(args.ppo_epochs):
        for mb_idx in (torch.randperm(B) if args.minibatches > 1 else torch.arange(B)).chunk(args.minibatches):
            counts = torch.tensor([len(mb_idx), int(batch["completion_mask"][mb_idx].sum())], dtype=torch.float64,
                                  device=batch["adv"].device)
            n_seqs, n_tokens = (int(c) for c in (accel.reduce(counts, "sum") if accel.num_processes > 1 else counts))
            opt.zero_grad(set_to_none=True)
            for idx in micro(mb_idx):
                logp, ent = logprobs_of(model, idx, True)
                mb = {"adv": batch["adv"][idx], "mask": batch["completion_mask"][idx].float(),
                      "old": logp.detach() if old is None else old[idx], "ref": None if ref is None else ref[idx],
                      "behav": batch["logprobs"][idx], "source": batch["source"][idx]}
                loss, token_stats = loss_fn(logp, mb, n_seqs, n_tokens, args)
                loss.backward()  # a NaN here reaches every rank's gradient: optimizer_step stops them all
                stats["pg"] += loss.item()
                for k, v in {**token_stats, "entropy": ent}.items():
                    stats[k] = stats.get(k, 0.0) + common.masked_sum(v.detach(), mb["mask"]).item() / max(n_tokens, 1)
                if on_policy:  # the only forward on the sampler's weights
                    mismatch += common.masked_sum((logp.detach() - batch["logprobs"][idx]).abs(),
                                                  fresh[idx]).item() / max(float(fresh.sum()), 1)
            opt_step = (step - 1) * args.ppo_epochs * args.minibatches + n_opt  # derived: resume-safe
            stats["grad_norm"] += optimizer_step(model, opt, args, accel, opt_step)
            n_opt += 1
    return {**{f"loss/{k}": v / n_opt for k, v in stats.items()}, "rollout/logprob_mismatch": mismatch}


def replay_metrics(batch: dict, args: Args) -> dict:
    """replay/: the share of training rows replayed from the buffer, from RLEP, and of each age 0..max_age."""
    n = max(len(batch["source"]), 1)
    out = {"replay/replayed_frac": float((batch["source"] == 1).sum()) / n,
           "replay/rlep_frac": float((batch["source"] == 2).sum()) / n}
    out.update({f"replay/age_{a}": float((batch["age"] == a).sum()) / n for a in range(args.max_age + 1)})
    return out


def load_policy(args: Args, accel):
    """(policy in train mode, tokenizer, frozen reference or None): gradient checkpointing when asked, the reference
    only when kl_coef > 0, both sharded with FSDP2 when several processes run (common.shard)."""
    model, tok = common.load_model(args.model, accel.device, args.dtype)
    model.train()
    if args.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if args.kl_coef > 0 else None
    return common.shard(model, accel), tok, common.shard(ref_model, accel, sampler=False)


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    from accelerate import Accelerator

    accel = Accelerator(cpu=args.device == "cpu" or not torch.cuda.is_available())
    rank, is_main = accel.process_index, accel.is_main_process
    torch.set_num_threads(args.threads)
    common.set_seed(args.seed)
    task = llm.make_task(args.task, args.digits)
    hard_task = llm.make_task(args.task, args.digits + 1) if args.eval_hard and hasattr(task, "digits") else None
    eval_sets = common.held_out_sets(task, args.eval_examples, hard_task)
    model, tok, ref_model = load_policy(args, accel)  # sharded when several processes run
    engine = VLLMEngine(common.resolve_model_path(args.model), args.vllm_gpu_memory, seed=args.seed + rank) \
        if args.engine == "vllm" else None
    use_kernels = args.kernels and accel.device.type == "cuda"
    fused_logprob = None
    if use_kernels:  # Triton: the fused lm_head + log-softmax (the loss kernel is in kernel_grpo_loss)
        from kernels.fused_logprob import fused_linear_logprob as fused_logprob
    loss_fn = replay_loss  # (the fused loss kernel takes no per-token weights; --kernels fuses the log-probs)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    run_dir = Path(args.out_dir) / args.exp_name
    state = common.load_checkpoint(args.resume, model, opt) if args.resume else {}
    if args.resume and engine is not None:
        engine.sync_weights(model)
    start_step, history = state.get("step", 0), state.get("history", [])
    gen_tokens, gen_time = state.get("gen_tokens", 0), state.get("gen_time", 0.0)
    pool, buffer = make_pool(task, args), []  # a resumed run starts with an empty buffer
    experience = json.loads(Path(args.experience_in).read_text()) if args.experience_in else None
    tracker = common.Tracker(run_dir, args, args.track, run_name=args.exp_name) if is_main else None
    timer, t_start = common.Timer(), time.time() - state.get("wall_s", 0.0)
    evaluate = lambda: common.run_eval(model, tok, task, eval_sets, args.max_new_tokens, args.pass_k,  # noqa: E731
                                       args.temperature, hard_task, engine)

    def log(metrics: dict, step: int):
        history.append({"step": step, **metrics})
        if tracker is not None:
            tracker.log(metrics, step)

    if start_step == 0 and is_main:
        log(evaluate(), 0)
    bar = tqdm(range(start_step + 1, args.steps + 1), desc="replay", dynamic_ncols=True, disable=not is_main,
               initial=start_step, total=args.steps)
    for step in bar:
        # Every random draw of this step depends on (seed, step, rank) only: resuming is exact.
        torch.manual_seed(hash((args.seed, step, rank)) % 2**31)
        rng = np.random.default_rng([args.seed, step, rank])
        with timer("gen"):
            batch = rollout(model, tok, task, args, rng, accel.device, engine, pool, buffer, experience, step)
        with timer("train"):
            stats = update(model, opt, batch, loss_fn, args, step, accel, ref_model, fused_logprob)
        if engine is not None:
            with timer("sync"):
                engine.sync_weights(model)
        t, drawn = timer.pop(), batch["drawn"]
        gen_tokens, gen_time = gen_tokens + int(drawn["completion_mask"].sum()), gen_time + t["gen"]
        metrics = {**common.rollout_metrics(drawn["rewards"], drawn["completion_mask"], drawn["finish_reasons"],
                                            args.group_size, t["gen"]), **replay_metrics(batch, args), **stats,
                   "rollout/gen_tokens": gen_tokens, "perf/lr": opt.param_groups[0]["lr"],
                   **{f"perf/{k}_s": v for k, v in t.items()}}
        if is_main and (step % args.eval_every == 0 or step == args.steps):
            metrics.update(evaluate())
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
    if args.experience_out:  # RLEP phase 1: the final policy's verified successes on the training prompts
        Path(args.experience_out).write_text(json.dumps(collect_experience(model, tok, task, pool, args)))
    summary = common.summarize(history, gen_tokens, gen_time, time.time() - t_start)
    train = [h for h in history if "loss/entropy" in h]
    summary.update(replayed_frac=float(np.mean([h["replay/replayed_frac"] for h in train])),
                   entropy_first=train[0]["loss/entropy"], entropy_last=train[-1]["loss/entropy"])
    common.save_curve(history, run_dir / "curve.png", f"GRPO + replay on {task.name} ({args.model})")
    return tracker.finish(summary)


if __name__ == "__main__":
    main(tyro.cli(Args))
