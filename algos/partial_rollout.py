"""Partial rollouts: APRIL's over-provisioned batches and CoPRIS's fixed pool, with the off-policy corrections.

Papers: "APRIL: Active Partial Rollouts in Reinforcement Learning to Tame Long-tail Generation", arXiv:2509.18521
(over-provision rollout requests, stop once enough responses are finished, keep the unfinished ones and continue
them in later steps; rollout throughput +22.5% on average, at most +44%); "CoPRIS: Efficient and Stable
Reinforcement Learning via Concurrency-Controlled Partial Rollout with Importance Sampling", arXiv:2511.05589
(a fixed number of rollouts in flight, early termination, reuse of unfinished ones, cross-stage importance
sampling; up to 1.94x faster training); the decoupled PPO objective of "AReaL: A Large-Scale Asynchronous
Reinforcement Learning System for Language Reasoning", arXiv:2505.24298.

Parent: algos/grpo.py; changed: Args, Args.digits, Args.eval_every, Args.kernels, Args.max_new_tokens,
  Args.model, Args.prompts_per_step, Args.resume, Args.save_every, Args.seed, Args.steps, Args.task, Args.threads,
  check_args, rollout, update, main.

Two layers share one scheduler (Scheduler: which trajectories hold the S decode slots, when a step stops, what is
carried over):
  policies     sync    launch B groups of G, wait until all are finished (grpo.py's rollout)
               april   keep ceil(r * B) groups launched (carried groups first, in FIFO order), stop at B
                       complete groups, carry the rest over (r = --over)
               copris  a pool of S in-flight trajectories, refilled from the FIFO (then from new groups) on
                       every finish; stop at B complete groups, carry the rest over
               async   (simulator only) copris's pool that is never stopped: training overlaps generation
  simulator    numpy, no model (simulate of algos/_slot_sim.py, which drives this file's Scheduler): one token
               per busy slot per tick; a tick costs c0 + c1 * busy slots; lengths lognormal(median, sigma) or
               the sums task's operand mix. Idle-slot fraction = idle slot-ticks / (S * ticks); tokens/s over
               generation time; step time with training time; discarded tokens = generated - trained - in
               flight (0 for every policy here); the age (trainer version - sampling version) of every trained
               token.
  real loop    rollout: every chunk is one call of the rollout seam (common.generate) on prompt + partial
               response for the busy rows, C = --chunk new tokens each; finished rows leave and the scheduler
               refills their slots between chunks; at a weight update the unfinished rows stay in the buffer and
               continue later under the new weights. Each token keeps its behaviour log-prob mu_it (the
               sampler's, after temperature and top-p) and the version v_it that sampled it.

Equations of the corrections (--is; v = the version being trained, pi_prox = pi_old recomputed by the trainer
before the update, as in grpo.py; A_i, the clip and the aggregation as in grpo.py):    partial_loss
  recompute    rho_it = pi_theta / pi_prox for every token (stale tokens treated as on-policy: APRIL/slime's default)
  mask-stale   l_it * 1[v_it = v], the normaliser unchanged (stale tokens still count in |o_i| and sum |o_i|)
  cross-stage  rho_it = pi_theta / mu_it where v_it < v (the token's own buffered behaviour log-prob),
               pi_theta / pi_prox where v_it = v (CoPRIS)
  decoupled    min(pi_prox / mu_it, cap) * clipped surrogate of rho_it = pi_theta / pi_prox (AReaL; cap = --is-cap)
  sampler      when the sampler is not the trainer's computation, each fresh token's loss (v_it = v) is weighted by
               grpo's min(pi_prox / mu_it, C), C = --sampler-is-cap (truncated_is_weight); stale tokens keep their
               --is correction, and decoupled's own weight already is this one on the fresh tokens
With nothing interrupted every mode is grpo's loss (v_it = v everywhere and mu = pi_prox up to sampler mismatch).

Deviations from the papers:
- Chunked decoding recomputes the prefix at every chunk (the prompt + partial response is the next call's prompt;
  the KV cache lives only inside a chunk). Finished rows free their slot at the next chunk boundary, not at the
  next token as in vLLM/SGLang, so the real loop's idle-slot fraction counts chunks; the simulator is token-level.
  --max-new-tokens must be a multiple of --chunk, so that no row ever overshoots its budget.
- The real loop's throughput is CPU wall time of a 0.65M-parameter model. The simulator's gpu preset (PRESETS) is a
  roofline estimate for a 7B model, not a measurement; a slot's cost does not grow with its context length.
- The simulator's lognormal lengths are drawn per trajectory; its 'sumsmix' lengths are the reference response
  lengths of the sums task's operand mix (equal within a group).
- APRIL trains the B oldest complete groups of a step; when more completed at the same chunk boundary, the rest wait
  in the buffer for the next step (nothing is dropped). CoPRIS's pool equals the slot count S.
- rollout/logprob_mismatch (and, with the sampler weight on, rollout/is_weight_mean and rollout/is_truncated_frac)
  is measured on the fresh tokens only (those sampled with the weights being trained); loss/stale_gap is the mean
  |log pi_prox - log mu| over stale tokens times their share. --is decoupled applies no second sampler weight: its
  min(pi_prox / mu, --is-cap) is that weight on the fresh tokens (capped at --is-cap, not --sampler-is-cap).
- A resumed run restores the buffer of unfinished trajectories from the checkpoint; the sums task's running totals
  (its partial-credit component) are kept, other answer metadata is not.
- Everything of GRPO's deviations (algos/grpo.py) applies.

Commands:
  python algos/partial_rollout.py                               # CoPRIS + cross-stage, long-response task, ~4 min
  python algos/partial_rollout.py --policy april --is recompute # APRIL as in slime
  python algos/partial_rollout.py --policy sync                 # synchronous baseline through the same chunk loop
  python algos/partial_rollout.py --task sumsmix --steps 40     # heavy-tailed response lengths (2..16 operands)
  python algos/partial_rollout.py --steps 0 --sim-lengths lognormal --sim-sigma 1.5 --sim-preset gpu  # simulator only
  python algos/partial_rollout.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --engine vllm --device cuda \
      --max-new-tokens 512 --chunk 64 --prompts-per-step 64 --lr 1e-6                    # one GPU
  accelerate launch --num_processes 4 algos/partial_rollout.py --model ... --device cuda   # several GPUs
Expected: the default (CoPRIS + cross-stage on the long-response task) lifts held-out greedy accuracy 49.4 -> 66.2
(+16.8 points) in 142 s on a shared 2-core machine, with about half of the trained tokens sampled by the previous
weights and no token discarded; its simulator run (lognormal lengths, sigma 1, gpu preset) puts APRIL at 2.02x and
CoPRIS at 2.37x synchronous rollout tokens/s (the partial_rollout row of benchmarks/results/defaults.md). In
benchmarks/results/partial_rollout.md (3 seeds) the simulator holds APRIL's and CoPRIS's speed claims in direction
(APRIL 1.41x at sigma 0.5); the real CPU loop does not (APRIL 2435 vs synchronous 2801 generated tokens/s).
"""
from __future__ import annotations

import math
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import tyro

import common
from algos import _llm as llm
from algos._llm import LLMArgs
from algos._slot_sim import compare_policies


@dataclass
class Args(LLMArgs):
    """Partial rollouts' flags: GRPO's (algos/grpo.py), the scheduler's, the corrections' and the simulator's; the
    plumbing flags are LLMArgs'."""
    seed: int = 0
    """random seed: prompts and sampling of step s depend only on (seed, s, rank) and the carried buffer"""
    model: str = "tiny-sums"
    """tiny-0.6m, tiny-5m, tiny-sums, smollm2-135m, a Hugging Face id or a local path"""
    task: Annotated[str, tyro.conf.arg(help=f"training and held-out task: {llm.TASKS}")] = "sums"
    digits: int = 1
    """operand digits of the arithmetic tasks (training and the main held-out eval)"""
    threads: int = 1
    """torch CPU threads per process (1: the chunk loop is bound by per-call costs; 2 ran 4x slower on a busy 2-core
    machine)"""
    max_new_tokens: int = 48
    """generation budget per completion (a multiple of --chunk)"""
    steps: int = 40
    """training steps (each trains B complete groups; 0 = simulator only)"""
    eval_every: int = 20
    """training steps between held-out evaluations"""
    save_every: int = 0
    """training steps between checkpoints (0 = only at the end)"""
    resume: str = ""
    """checkpoint folder to resume from (the buffer of unfinished trajectories is restored too)"""
    # rollout
    prompts_per_step: int = 32
    """complete groups trained per step (B)"""
    group_size: int = 8
    """completions per prompt (G)"""
    reward: tuple[str, ...] = ("correct",)
    """reward terms NAME[:WEIGHT]: built-ins correct, format, length, or module:function (TRL's convention: prompts,
    completions, answers in; a float or None per completion out); the total is their weighted sum"""
    # partial rollouts
    policy: Literal["sync", "april", "copris"] = "copris"
    """rollout scheduler: sync (wait for all), april (over-provision, stop at B groups), copris (fixed pool)"""
    is_mode: Annotated[Literal["recompute", "mask-stale", "cross-stage", "decoupled"], tyro.conf.arg(
        name="is", help="correction for tokens sampled by older weights: recompute (pi_old recomputed, APRIL), "
                        "mask-stale, cross-stage (CoPRIS), decoupled (AReaL)")] = "cross-stage"
    """correction for tokens sampled by older weights (--is)"""
    is_cap: float = 2.0
    """decoupled: the cap on pi_prox / mu"""
    chunk: int = 8
    """tokens decoded per chunk; finished rows are refilled between chunks"""
    slots: int = 0
    """decode slots S (rows per chunk; copris's pool); 0 = prompts_per_step * group_size"""
    over: float = 2.0
    """april: groups launched per step = ceil(over * prompts_per_step), carried groups included"""
    sim: bool = True
    """run the slot simulator first (sync, april, copris, async on --sim-lengths) and put its ratios in the summary"""
    sim_lengths: Literal["lognormal", "sumsmix"] = "lognormal"
    """simulated response lengths: lognormal (median 64, capped at 1024) or the sums task's operand mix"""
    sim_sigma: float = 1.0
    """lognormal tail knob: sigma of log length"""
    sim_preset: Literal["cpu", "gpu"] = "gpu"
    """tick cost c0 + c1 * busy slots and training time per step (see PRESETS in algos/_slot_sim.py)"""
    sim_steps: int = 50
    """simulated training steps per policy"""
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
    """use the Triton kernels (fused log-prob; the fused loss with --is recompute) when a GPU is present"""


def check_args(args: Args) -> None:
    """Fail early, naming the flag, instead of deep inside torch."""
    if args.group_size < 2:
        raise SystemExit(f"--group-size must be at least 2 for a group baseline, got {args.group_size}")
    if args.prompts_per_step < 1 or args.steps < 0 or args.max_new_tokens < 1:
        raise SystemExit("--prompts-per-step and --max-new-tokens must be positive, --steps not negative")
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
    if args.chunk < 1 or args.max_new_tokens % args.chunk:
        raise SystemExit(f"--max-new-tokens ({args.max_new_tokens}) must be a multiple of --chunk ({args.chunk})")
    if args.slots < 0 or args.over < 1 or args.is_cap <= 0 or args.sim_steps < 1 or args.sim_sigma < 0:
        raise SystemExit("--slots must be >= 0, --over >= 1, --is-cap > 0, --sim-steps >= 1, --sim-sigma >= 0")


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


def partial_loss(logp, mb: dict, n_seqs: int, n_tokens: int, args: Args):
    """grpo_loss with the --is correction for stale tokens (sampled by older weights than the ones trained).

    logp [b, C] (with grad); mb as grpo_loss's plus behav [b, C] (mu: each token's behaviour log-prob) and
    stale [b, C] (1 where the sampling version is older than the trained one). mb["old"] is pi_prox; is_weight
    (or None) is grpo's sampler-trainer weight, 1 on the stale tokens.
    """
    old, stale, behav = mb["old"], mb["stale"], mb["behav"]
    if args.is_mode == "cross-stage":  # each stale token's ratio is to its own buffered behaviour log-prob
        old = torch.where(stale.bool(), behav, old)
    tok_loss, clipped = clipped_pg_loss(logp, old, mb["adv"], args.clip_eps_low, args.clip_eps_high)
    if mb.get("is_weight") is not None:  # the sampler is not the trainer: truncated importance weight per token
        tok_loss = tok_loss * mb["is_weight"]
    if args.is_mode == "mask-stale":  # zero weight; the normaliser below still counts these tokens
        tok_loss = tok_loss * (1 - stale)
    elif args.is_mode == "decoupled":  # AReaL: behaviour weight pi_prox / mu (capped) times the clip around pi_prox
        tok_loss = tok_loss * torch.exp(mb["old"] - behav).clamp(max=args.is_cap)
    stats = {"clipfrac": clipped, "stale_gap": (mb["old"] - behav).abs() * stale}
    if mb["ref"] is not None:
        kl = k3_kl(logp, mb["ref"])
        tok_loss, stats["kl"] = tok_loss + args.kl_coef * kl, kl
    return aggregate_loss(tok_loss, mb["mask"], args.loss_agg, n_seqs, n_tokens, agg_const(args)), stats


# ---- the scheduler: who holds the decode slots, when a step stops, what is carried over ----
@dataclass
class Traj:
    """One response in the making. The simulator uses `target`; the real loop the token lists."""
    group: int  # group id (G trajectories share a prompt)
    prompt: list = field(default_factory=list)  # prompt token ids (real loop)
    example: object = None  # the task example (real loop)
    target: int = 0  # simulator: the length this response will reach
    n: int = 0  # tokens generated so far
    segs: list = field(default_factory=list)  # [[version, count], ...]: which weights sampled which tokens
    tokens: list = field(default_factory=list)
    logps: list = field(default_factory=list)  # behaviour log-prob of each token
    done: bool = False
    finish: str = ""

    def add(self, count: int, version: int, tokens=(), logps=()) -> None:
        """Record `count` new tokens sampled by weights `version` (versions never decrease along a trajectory)."""
        if self.segs and self.segs[-1][0] > version:
            raise ValueError(f"version {version} after {self.segs[-1][0]}")
        if self.segs and self.segs[-1][0] == version:
            self.segs[-1][1] += count
        elif count:
            self.segs.append([version, count])
        self.n += count
        self.tokens += list(tokens)
        self.logps += list(logps)

    def versions(self) -> list[int]:
        return [v for v, c in self.segs for _ in range(c)]


class Scheduler:
    """A FIFO of unfinished trajectories (carried ones first), S slots, and the finished groups awaiting training.

    sync: launch B groups per step and wait for all; april: keep ceil(over * B) groups launched; copris and
    async: refill every free slot (new groups when the FIFO is empty). All stop once B groups are complete
    (async is never interrupted); end_step puts the running trajectories back at the head of the FIFO.
    """

    def __init__(self, policy: str, groups: int, group_size: int, slots: int, over: float = 2.0, new_group=None):
        self.policy, self.B, self.G, self.slots, self.over = policy, groups, group_size, slots, over
        self.new_group = new_group  # gid -> list of G Traj
        self.queue, self.running, self.complete = deque(), {}, deque()  # running: id(traj) -> traj, in slot order
        self.groups: dict[int, list[Traj]] = {}  # launched and not yet trained
        self.next_gid = self.generated = self.trained = 0

    def launch(self) -> None:
        gid, self.next_gid = self.next_gid, self.next_gid + 1
        self.groups[gid] = self.new_group(gid)
        self.queue.extend(self.groups[gid])

    def begin_step(self) -> None:
        if self.policy == "sync":
            if self.groups:
                raise RuntimeError("sync scheduler: trajectories left over from the previous step")
            for _ in range(self.B):
                self.launch()
        elif self.policy == "april":
            while len(self.groups) < math.ceil(self.over * self.B):
                self.launch()

    def fill(self) -> list[Traj]:
        """Place queued trajectories into free slots (FIFO); copris/async launch new groups as needed."""
        placed = []
        while len(self.running) < self.slots:
            if not self.queue:
                if self.policy not in ("copris", "async"):
                    break
                self.launch()
            t = self.queue.popleft()
            self.running[id(t)] = t
            placed.append(t)
        return placed

    def record(self, t: Traj, count: int, version: int, tokens=(), logps=()) -> None:
        t.add(count, version, tokens, logps)
        self.generated += count

    def finish(self, t: Traj, reason: str = "stop") -> None:
        t.done, t.finish = True, reason
        del self.running[id(t)]
        if all(x.done for x in self.groups[t.group]):
            self.complete.append(t.group)

    def ready(self) -> bool:
        return len(self.complete) >= self.B

    def end_step(self) -> None:
        """Interrupt: running trajectories go back to the head of the FIFO, in slot order (resumed first)."""
        self.queue.extendleft(reversed(list(self.running.values())))
        self.running = {}

    def harvest(self) -> list[list[Traj]]:
        """The B oldest complete groups; they leave the scheduler (trained exactly once)."""
        out = [self.groups.pop(self.complete.popleft()) for _ in range(self.B)]
        self.trained += sum(t.n for g in out for t in g)
        return out

    def in_flight_tokens(self) -> int:
        return sum(t.n for g in self.groups.values() for t in g)

    def discarded_tokens(self) -> int:
        """Generated, never trained and no longer in flight (0 unless a trajectory was lost)."""
        return self.generated - self.trained - self.in_flight_tokens()

    def check(self) -> None:
        """Conservation: every launched, untrained trajectory is exactly one of finished, queued or running."""
        queued = [id(t) for t in self.queue]
        qset = set(queued)
        assert len(qset) == len(queued) and not qset & set(self.running), "a trajectory is in two places"
        for g in self.groups.values():
            for t in g:
                where = t.done + (id(t) in qset) + (id(t) in self.running)
                assert where == 1, f"trajectory of group {t.group} is {'lost' if where == 0 else 'duplicated'}"
        assert self.discarded_tokens() == 0, f"{self.discarded_tokens()} tokens discarded"

    def state(self) -> dict:
        """JSON-able buffer (between steps, nothing is running) for checkpoints."""
        assert not self.running, "state() between steps only"
        order = {id(t): i for i, t in enumerate(self.queue)}
        conv = lambda t: {"prompt": t.prompt, "ex": [t.example.prompt, str(t.example.answer),  # noqa: E731
                                                      getattr(t.example.answer, "totals", None)],
                          "n": t.n, "segs": t.segs, "tokens": t.tokens, "logps": t.logps, "done": t.done,
                          "finish": t.finish, "q": order.get(id(t), -1)}
        return {"groups": {str(g): [conv(t) for t in ts] for g, ts in self.groups.items()},
                "complete": list(self.complete), "next_gid": self.next_gid, "generated": self.generated,
                "trained": self.trained}

    def load_state(self, s: dict) -> None:
        self.groups, queued = {}, []
        for g, ts in s["groups"].items():
            self.groups[int(g)] = []
            for d in ts:
                answer = llm.SumsTask.Answer(d["ex"][1]) if d["ex"][2] is not None else d["ex"][1]
                if d["ex"][2] is not None:
                    answer.totals = d["ex"][2]
                t = Traj(int(g), d["prompt"], llm.Example(d["ex"][0], answer), 0, d["n"], d["segs"], d["tokens"],
                         d["logps"], d["done"], d["finish"])
                self.groups[int(g)].append(t)
                if d["q"] >= 0:
                    queued.append((d["q"], t))
        self.queue = deque(t for _, t in sorted(queued, key=lambda x: x[0]))
        self.complete, self.running = deque(s["complete"]), {}
        self.next_gid, self.generated, self.trained = s["next_gid"], s["generated"], s["trained"]


def simulator_summary(args: Args) -> dict:
    """The summary figures of the simulator on --sim-lengths: tokens/s and step-time ratios against sync."""
    slots = args.slots or args.prompts_per_step * args.group_size
    res = compare_policies(Scheduler, Traj, args.sim_lengths, args.sim_sigma, args.sim_preset, args.sim_steps,
                           args.prompts_per_step, args.group_size, slots, args.over, args.seed)
    base = res["sync"]
    out = {"discarded_tokens_sim": sum(r["discarded_tokens"] for r in res.values())}
    for p, r in res.items():
        out[f"sim_idle_frac_{p}"] = r["idle_frac"]
        if p != "sync":
            out[f"throughput_ratio_{p}"] = r["tokens_per_s"] / base["tokens_per_s"]
            out[f"speedup_{p}"] = base["step_s"] / r["step_s"]
            out[f"sim_mean_age_{p}"] = r["mean_age"]
    print(f"simulator ({args.sim_lengths}, sigma {args.sim_sigma}, {args.sim_preset}): rollout tokens/s vs sync "
          f"april {out['throughput_ratio_april']:.2f}x, copris {out['throughput_ratio_copris']:.2f}x; idle slots "
          f"sync {base['idle_frac']:.2f}, april {out['sim_idle_frac_april']:.2f}, "
          f"copris {out['sim_idle_frac_copris']:.2f}")
    return out


# ---- rollout and update ----
def rollout(sampler, tok, task, args: Args, rng, device, sched: Scheduler = None, version: int = 0) -> dict:
    """Decode in chunks until the scheduler holds B complete groups; they form the batch (A_i per group).

    Each chunk is one call of the rollout seam on prompt + partial response for the rows in the slots; the rows
    that are unfinished when the step stops stay in `sched` and continue at the next step under newer weights.
    """
    def new_group(gid):
        ex = task.sample("train", 1, rng)[0]
        return [Traj(gid, common.encode_prompts(tok, [ex.prompt])[0], ex) for _ in range(args.group_size)]

    sched.new_group = new_group
    sched.begin_step()
    busy = chunks = 0
    while not sched.ready():
        sched.fill()
        rows = list(sched.running.values())
        ro = common.generate(sampler, tok, [t.prompt + t.tokens for t in rows], 1, args.chunk, args.temperature,
                             args.top_p)
        lens = ro.completion_mask.sum(1).tolist()
        for j, t in enumerate(rows):
            n = lens[j]
            sched.record(t, n, version, ro.completion_ids[j, :n].tolist(), ro.logprobs[j, :n].tolist())
            if ro.finish_reasons[j] == "stop" or t.n >= args.max_new_tokens:
                sched.finish(t, ro.finish_reasons[j])
        busy, chunks = busy + len(rows), chunks + 1
    sched.end_step()
    batch = assemble_batch(sched.harvest(), tok, task, args, version, device)
    batch["partial"]["rollout/idle_slot_frac"] = 1 - busy / (chunks * sched.slots) if chunks else 0.0
    return batch


def assemble_batch(groups: list[list[Traj]], tok, task, args: Args, version: int, device) -> dict:
    """Padded tensors of B complete groups, with each token's behaviour log-prob and whether it is stale."""
    trajs = [t for g in groups for t in g]
    prompt_ids, prompt_mask = common.left_pad([t.prompt for t in trajs], tok.pad_token_id)
    B, width = len(trajs), max(t.n for t in trajs)
    comp = torch.full((B, width), tok.pad_token_id, dtype=torch.long)
    cmask, versions = torch.zeros(B, width, dtype=torch.long), torch.full((B, width), version, dtype=torch.long)
    logprobs = torch.zeros(B, width)
    for i, t in enumerate(trajs):
        comp[i, :t.n], cmask[i, :t.n] = torch.tensor(t.tokens), 1
        logprobs[i, :t.n], versions[i, :t.n] = torch.tensor(t.logps), torch.tensor(t.versions())
    texts = tok.batch_decode(comp, skip_special_tokens=True)
    total, terms = llm.Rewards(args.reward)([t.example.prompt for t in trajs], texts, [t.example.answer for t in trajs],
                                            task=task, completion_lengths=[t.n for t in trajs],
                                            max_new_tokens=args.max_new_tokens)
    rewards = torch.tensor(total)
    age = (version - versions) * cmask
    batch = {k: v.to(device) for k, v in dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=comp,
                                                completion_mask=cmask, logprobs=logprobs, versions=versions,
                                                stale=(age > 0).float(), rewards=rewards).items()}
    batch.update(adv=group_advantages(batch["rewards"], args.group_size, args.adv_std_norm),
                 finish_reasons=[t.finish for t in trajs], reward_terms={  # each term's mean where it applies
                     f"reward/{k}": float(np.mean([v for v in vs if v is not None] or [0.0]))
                     for k, vs in terms.items()})
    batch["partial"] = {"partial/stale_token_frac": float((age > 0).sum() / cmask.sum()),
                        "partial/mean_age": float(age.sum() / cmask.sum()), "partial/max_age": int(age.max()),
                        "partial/resumed_frac": float(np.mean([len(t.segs) > 1 for t in trajs]))}
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
    Partial rollouts: each micro-batch also carries the behaviour log-probs and the stale-token mask (for the
    --is corrections); the sampler-vs-trainer mismatch and weight are on the fresh tokens only.
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
    # the sampler is another computation; stale tokens have their own correction (--is), and decoupled's weight
    # min(pi_prox / mu, --is-cap) already is the fresh tokens' sampler-trainer weight
    correct = args.sampler_is_cap > 0 and not sampler.is_trainer and args.is_mode != "decoupled"
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
                      "behav": batch["logprobs"][idx], "stale": batch["stale"][idx]}
                mb["is_weight"] = torch.where(mb["stale"].bool(), 1.0, truncated_is_weight(
                    mb["old"], mb["behav"], args.sampler_is_cap)) if correct else None
                loss, token_stats = loss_fn(logp, mb, n_seqs, n_tokens, args)
                loss.backward()  # a NaN here reaches every rank's gradient: optimizer_step stops them all
                for k, v in {"pg": loss.item(), **{k: common.masked_sum(v.detach(), mb["mask"]).item() / max(
                        n_tokens, 1) for k, v in {**token_stats, "entropy": ent}.items()}}.items():
                    sums[k] = sums.get(k, 0.0) + v
                if epoch == 0:  # every fresh token once, on the sampler's weights (pi_old)
                    for k, v in sampler_gap(mb["old"], mb["behav"], mb["is_weight"], mb["mask"] * (1 - mb["stale"]),
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
def partial_summary(history: list[dict], sched: Scheduler, sim: dict) -> dict:
    """Means of the partial/ figures over the run, the conservation count and the simulator's ratios."""
    rows = [h for h in history if "partial/stale_token_frac" in h]
    out = {k.split("/")[1]: float(np.mean([h[k] for h in rows])) for k in
           ("partial/stale_token_frac", "partial/mean_age", "partial/resumed_frac", "rollout/idle_slot_frac")}
    out["max_age"] = max(h["partial/max_age"] for h in rows)
    sched.check()
    out["discarded_tokens_real"] = sched.discarded_tokens()
    out["in_flight_tokens"] = sched.in_flight_tokens()
    out["discarded_tokens"] = out["discarded_tokens_real"] + sim.get("discarded_tokens_sim", 0)
    return {**sim, **out}


def make_scheduler(args: Args, state: dict) -> Scheduler:
    """The run's Scheduler (S = --slots, or B * G), with the unfinished trajectories of a checkpoint put back."""
    sched = Scheduler(args.policy, args.prompts_per_step, args.group_size,
                      args.slots or args.prompts_per_step * args.group_size, args.over)
    if state.get("scheduler") is not None:  # the unfinished trajectories carried over at the checkpoint
        sched.load_state(state["scheduler"])
    return sched


def main(args: Args) -> dict:
    check_args(args)
    run = llm.Run(args)  # accelerator, threads, seed, the task and its held-out sets, the run folder
    sim = simulator_summary(args) if args.sim and run.is_main else {}
    if args.steps == 0:
        return sim
    # sharded when several processes run; the sampler decodes (the trainer itself on CPU)
    model, tok, ref_model, sampler = llm.load_policy(args, run.accel, with_ref=args.kl_coef > 0)
    use_kernels = args.kernels and run.accel.device.type == "cuda"
    fused_logprob = None
    if use_kernels:  # Triton: the fused lm_head + log-softmax (the loss kernel only for --is recompute)
        from kernels.fused_logprob import fused_linear_logprob as fused_logprob
    loss_fn = kernel_grpo_loss if use_kernels and args.is_mode == "recompute" else partial_loss
    opt = llm.make_optimizer(model.parameters(), args)
    # resume from --resume (the scheduler's unfinished trajectories too), then the step-0 held-out evaluation
    run.start(model, tok, opt, sampler, counters={"scheduler": None})
    sched = make_scheduler(args, run.counters)
    for step, rng in run.steps():  # every random draw of a step depends on (seed, step, rank) and the carried buffer
        generated = sched.generated
        with run.timer("gen"):  # the weights that sample this step are version step - 1
            batch = rollout(sampler, tok, run.task, args, rng, run.accel.device, sched, version=step - 1)
        with run.timer("train"):  # includes the sampler's refresh after each optimiser step
            stats = update(model, opt, batch, loss_fn, args, step, run.accel, sampler, ref_model, fused_logprob)
        run.counters["scheduler"] = sched.state()  # checkpointed with the weights
        tokens_per_s = (sched.generated - generated) / run.timer.totals["gen"]  # generated, not trained
        metrics = run.log_step(step, batch, stats, extra={**batch["partial"], "rollout/tokens_per_s": tokens_per_s})
        if run.is_main:
            run.bar.set_postfix(reward=f"{metrics['rollout/reward']:.2f}",
                                stale=f"{metrics['partial/stale_token_frac']:.2f}", acc=f"{run.last('eval/acc'):.2f}")
    run.gen_tokens = sched.generated  # the summary's token count: every token generated, trained or still in flight
    return run.finish(f"{args.policy} + {args.is_mode}", extra=partial_summary(run.history, sched, sim))


if __name__ == "__main__":
    main(tyro.cli(Args))
