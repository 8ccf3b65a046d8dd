"""Step correction: GRPO whose failed rollouts are salvaged from their first wrong step, found by a step checker.

Two methods, one flag (--mode), plain GRPO (algos/grpo.py) as their control:
- SCOPE, Ren et al., "Recycling Failures: Salvaging Exploration in RLVR via Fine-Grained Off-Policy Guidance"
  (SCOPE: Step-wise Correction for On-Policy Exploration), arXiv:2602.24110. A process reward model pinpoints the
  first wrong step of a failed rollout; the correct prefix is kept and the rollout is rectified from that step with
  off-policy guidance, instead of replacing the whole trajectory; the salvaged rollout joins the group.
- R^3L, Shi et al., "R^3L: Reflect-then-Retry Reinforcement Learning with Language-Guided Exploration, Pivotal Credit,
  and Positive Amplification", arXiv:2601.03715. Generation restarts from the identified failure point; Pivotal
  Credit Assignment trains only the diverging suffix (the shared prefix is kept out of the gradient); Positive
  Amplification up-weights successful trajectories.

The process reward model here is programmatic: on addsteps and sums every step of a correct response is fixed by the
prompt and the steps before it ('7+2+9:' -> '7+2=9;9+9=18;=18'), so the first step that differs from the reference is
the first wrong step (reference_steps, first_wrong_step).

Equations (each implemented by the function named on the right; the abstracts give no formulas, these are ours):
  first wrong step  k(o) = min{k : step_k(o) != step_k*(q)}, the reference steps rebuilt from q      first_wrong_step
  reference steps   step_1*..step_K*(q): the task's own solution of prompt q, split at ';'        reference_steps
  correction        o' = o_<k (kept) + g_k (SCOPE: the reference step, written by the checker; R^3L: none)
                    + c ~ pi_theta( . | q, o_<k, g_k), for up to --corrections failures per group with k >= 1,
                    the longest correct prefix first                               choose_corrections, regenerate
  ragged baseline   A_i = (r_i - mean_{g(i)} r) / (std_{g(i)} r + eps) over a prompt's G rollouts and its
                    corrections                                                              ragged_group_advantages
  SCOPE off-policy  l_t <- w_t l_t on the checker's tokens, w_t = min(pi_old(g_t) / mu(g_t), 1), mu(g_t) = 1
                    (a deterministic guide), so w_t = pi_old(g_t); the sampler's own weight elsewhere   offpolicy_weight
  Pivotal Credit    m_it = 0 for t < |o_<k| in a retry and in the failure it restarts (R^3L)         pivotal_mask
  Positive Ampl.    A_i <- beta A_i where A_i > 0 (R^3L: beta = 2)                          positive_amplification
  clipped surrogate l_it = -min(rho_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) A_i)   clipped_pg_loss
  sampler != trainer l_it <- w_it l_it,  w_it = min(pi_old / pi_sampler, C)         truncated_is_weight
  the batch         rollouts + corrections, advantages, loss masks                               training_batch

Parent: algos/grpo.py; changed: Args, Args.model, Args.task, Args.digits, Args.max_new_tokens, Args.steps,
  check_args, rollout, update, main.

Deviations from the papers (the abstracts leave these rules open; each choice is ours and is listed here):
- The process reward model is an exact step checker (the reference solution rebuilt from the prompt), not a learned
  PRM; it only runs on tasks with checkable steps (addsteps, sums), and others are refused.
- The default task is sums with tiny-sums (49% greedy, errors mostly a wrong operand mid-way: failures with a right
  prefix to keep). The carry scratchpad (addsteps) runs too, but no shipped model leaves room there: tiny-0.6m
  solves 2 digits (99.7%) and fails 3 digits (0.5% held-out; few failures keep a right step, and none of the 63
  corrections of 15 SCOPE batches of 16 prompts succeeded).
- SCOPE's off-policy guidance (a stronger model in the paper) is the checker itself: it writes the first wrong step
  correctly (g_k), then the policy continues. Those tokens were not sampled by pi, so each one's loss is weighted by
  the truncated importance weight pi_old(g_t) / mu(g_t) with mu = 1 (the guide is deterministic), capped at 1; the
  weight is logged as loss/guided_weight and --no-guide-is trains them as if sampled (the ablation). The kept prefix
  and the continuation are the policy's own samples and train as on-policy tokens; the salvaged rollout trains on all
  of its tokens, prefix included (SCOPE's point: a largely correct prefix earns credit).
- R^3L's reflection is language feedback from the model; a 0.6M-parameter character model cannot read feedback, so
  the checker's localisation is the whole "reflection" and the retry is the policy sampling again from the kept
  prefix. Its tokens are then on-policy (the sampler's own log-probs), so no importance weight is needed there; on a
  GPU the sampler's truncated weight still applies, as in grpo.py.
- Pivotal Credit Assignment masks the shared prefix in both the retry and the failure it restarts (the paper: the
  shared prefix is excluded from the gradient); the rest of the batch trains on every token.
- Positive Amplification multiplies positive advantages (A_i > 0: successes in a group with failures, after the
  baseline) by beta = 2 (the abstract gives no value); --beta sets it for either mode (scope: 1 by default).
- Which failures are corrected: up to --corrections = 2 per group, those with the longest correct prefix, and only
  those with at least one right step (nothing to salvage otherwise); one correction per failure. Corrections join
  their prompt's group, so the group baseline is over G + (corrections) rows (ragged_group_advantages).
- A correction shares the failure's budget: prefix + guided step + continuation <= --max-new-tokens.
- Cost is counted honestly: gen_tokens adds every correction's guided and continuation tokens to the rollouts'
  (the kept prefix is not generated again and is not counted); tokens_per_success = gen_tokens / (successful
  rollouts + successful corrections). rollout/ metrics describe the G rollouts per prompt only, as in grpo.py.
- With --corrections 0 the script is grpo.py (scope; r3l adds Positive Amplification only).
- One process only (several are refused): each rank would correct a different number of failures, so sharded ranks
  would run different numbers of micro-batches through FSDP2's collectives.

Commands:
  python algos/step_correction.py                               # SCOPE, tiny-sums on sums, 2-core CPU
  python algos/step_correction.py --mode r3l                    # R^3L
  python algos/grpo.py --model tiny-sums --task sums --digits 1 --max-new-tokens 48 --steps 60   # the control
  python algos/step_correction.py --model tiny-0.6m --task addsteps --digits 2 --max-new-tokens 24   # carry steps
  python algos/step_correction.py --model Qwen/Qwen2.5-0.5B-Instruct --task sums --digits 2 --device cuda \
      --max-new-tokens 256 --lr 1e-6      # one GPU; the checker keeps prefixes only where the model writes the steps
Expected: the default (SCOPE, 60 rollout batches of 32 prompts x 8 on tiny-sums, 5 one-digit operands) takes
held-out greedy accuracy from 49.4% to 72.4% (seed 0) and 70.0% (seed 1), one thread, 10-14 minutes on a 2-core
machine shared with other jobs (about 1.5x grpo.py's time per batch); 87% of the ~55 corrections per batch end
correct, and the checker's tokens carry a mean weight pi_old of 0.93. --mode r3l: 49.4% -> 73.6% (seed 0), 69.6%
(seed 1); 47% of its retries succeed. The comparison with GRPO at an equal number of rollout batches (3 seeds per
arm; accuracy, tokens per success, salvage rate) is benchmarks/results/step_correction.md (rows in
benchmarks/results/step_correction.csv).
"""
from __future__ import annotations

import re
import sys
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
    """GRPO's flags and the step correction's: the arm (SCOPE or R^3L), how many failures a group corrects, and the
    credit rules; the plumbing flags are LLMArgs' (here with the long-response task's defaults)."""
    model: str = "tiny-sums"
    """tiny-sums, tiny-0.6m, tiny-5m, smollm2-135m, a Hugging Face id or a local path"""
    task: Annotated[str, tyro.conf.arg(help=f"training and held-out task, one with checkable steps: addsteps, sums, "
                                            f"sums<N> or sumsmix (all tasks: {llm.TASKS})")] = "sums"
    digits: int = 1
    """operand digits of the arithmetic tasks (training and the main held-out eval)"""
    max_new_tokens: int = 48
    """generation budget per completion (a correction's prefix, guided step and continuation share it)"""
    steps: int = 60
    """rollout batches"""
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
    """use the Triton kernels (fused log-prob, fused clipped loss) when a GPU is present"""
    # step correction
    mode: Literal["scope", "r3l"] = "scope"
    """scope: keep a failure's correct prefix, the checker writes the first wrong step right (off-policy guidance), the
    policy writes the rest; r3l: keep the prefix and let the policy retry from the first wrong step"""
    corrections: int = 2
    """failed rollouts corrected per group, those with the longest correct prefix first (0 under scope = grpo.py)"""
    beta: float = 0.0
    """Positive Amplification: advantages of successful trajectories (A > 0) times beta >= 1; 0 = the mode's own
    (r3l: 2, scope: 1, none)"""
    pivotal: bool = True
    """--mode r3l: Pivotal Credit Assignment, the prefix a retry shares with its failure is kept out of the gradient of
    both (off: both train on every token)"""
    guide_is: bool = True
    """--mode scope: weight each checker-written token's loss by pi_old(o_t) / mu(o_t), mu = 1 (off: train them as if
    the policy had sampled them, the ablation of the off-policy correction)"""


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
    if not re.fullmatch(r"addsteps|sums(\d+|mix)?", args.task):
        raise SystemExit(f"--task {args.task}: the step checker needs a task with checkable steps, addsteps or sums "
                         "(sums<N>, sumsmix)")
    if not 0 <= args.corrections <= args.group_size:
        raise SystemExit(f"--corrections must be in 0..group_size ({args.group_size}), got {args.corrections}")
    if args.beta != 0 and args.beta < 1:
        raise SystemExit(f"--beta must be >= 1 (an amplification) or 0 (the mode's default), got {args.beta}")
    if args.mode == "scope" and not args.pivotal or args.mode == "r3l" and not args.guide_is:
        raise SystemExit("--no-pivotal applies to --mode r3l and --no-guide-is to --mode scope only")


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


# ---- the step checker (the process reward model) ----
def reference_steps(task, prompt: str) -> list[str]:
    """The steps a correct response writes, each with its ';' and the final '=answer' last, rebuilt from the prompt by
    the task's own generator: '7+2+9:' -> ['7+2=9;', '9+9=18;', '=18'] (sums), '47+85:' -> ['7+5=12;', '4+8+1=13;',
    '=132'] (addsteps). Every step of these tasks is fixed by the prompt and the steps before it."""
    body = prompt.strip()
    if getattr(task, "kind", None) not in ("sums", "addsteps") or not re.fullmatch(r"\d+(\+\d+)+:", body):
        raise ValueError(f"the step checker reads addsteps or sums prompts such as '7+2+9:', got {prompt!r} for task "
                         f"{getattr(task, 'name', task)!r}")
    xs = [int(x) for x in body[:-1].split("+")]
    if task.kind == "addsteps" and len(xs) != 2:
        raise ValueError(f"an addsteps prompt adds two numbers, got {prompt!r}")
    solution = task.make(*xs).solution if task.kind == "addsteps" else task.make(xs).solution
    return split_steps(solution)


def split_steps(response: str) -> list[str]:
    """'7+2=9;9+9=18;=18' -> ['7+2=9;', '9+9=18;', '=18']: each step keeps its ';' (the pieces join back)."""
    return re.findall(r"[^;]*;|[^;]+", response)


def first_wrong_step(steps: list[str], response: str) -> tuple[int, int] | None:
    """The checker's verdict on one response: (k, c), the index of its first step that is not the reference step and
    the character where that step starts (the length of the correct prefix); None when every step is right. A missing
    step (the response stops early) and an extra one are wrong steps too."""
    pieces, c = split_steps(response), 0
    for k in range(max(len(pieces), len(steps))):
        got, want = (pieces[k] if k < len(pieces) else None), (steps[k] if k < len(steps) else None)
        if got != want:
            return k, c
        c += len(got)
    return None


def prefix_tokens(tok, ids: list[int], n_chars: int) -> int | None:
    """How many of a completion's first tokens spell exactly its first n_chars characters (None when no token boundary
    falls there: the prefix cannot be kept token for token)."""
    for n in range(len(ids) + 1):
        length = len(tok.decode(ids[:n], skip_special_tokens=True))
        if length >= n_chars:
            return n if length == n_chars else None
    return None


# ---- the correction: keep the prefix, regenerate from the first wrong step ----
def choose_corrections(tok, task, batch: dict, args: Args) -> tuple[list[bool], list[tuple[int, int, list[int]]]]:
    """The verifier's verdict per row and the rows to correct: per group up to --corrections failed rows with at least
    one right step, the longest correct prefix first, as (row, prefix tokens kept, guided token ids: the reference
    step k under --mode scope, none under r3l). A row whose prefix and guided step fill the budget is left alone."""
    G, examples, texts = args.group_size, batch["examples"], batch["texts"]
    ok = [task.verify(t, examples[i // G].answer)[0] == 1.0 for i, t in enumerate(texts)]
    picks = []
    for g, ex in enumerate(examples):
        steps, found = reference_steps(task, ex.prompt), []
        for i in range(g * G, (g + 1) * G):
            where = None if ok[i] else first_wrong_step(steps, texts[i])
            if where is None or where[0] == 0:  # right, or nothing right to keep
                continue
            n = prefix_tokens(tok, batch["completion_ids"][i][batch["completion_mask"][i].bool()].tolist(), where[1])
            if n is not None:
                found.append((-where[1], i, n, where[0]))
        for _, i, n, k in sorted(found)[:args.corrections]:
            guided = tok(steps[k], add_special_tokens=False)["input_ids"] if args.mode == "scope" else []
            if n + len(guided) < args.max_new_tokens:
                picks.append((i, n, guided))
    return ok, picks


def regenerate(sampler, tok, task, batch: dict, picks: list, args: Args) -> dict:
    """The correction rows: for each pick, prompt + kept prefix (+ guided step) is the context, the policy samples the
    continuation (one batched call; each row cut at what is left of the budget), and the result is rewarded like a
    rollout. Rows hold prefix + guided + continuation with their behaviour log-probs: the sampler's for sampled tokens,
    0 = log 1 for the guided ones (the checker writes them with certainty). new_tokens counts guided + continuation."""
    C = args.max_new_tokens
    out = {"rows": [i for i, _, _ in picks], "shared": [n for _, n, _ in picks], "new_tokens": 0,
           "completion_ids": torch.zeros(0, C, dtype=torch.long),
           "completion_mask": torch.zeros(0, C, dtype=torch.long),
           "logprobs": torch.zeros(0, C), "guided": torch.zeros(0, C, dtype=torch.bool), "rewards": torch.zeros(0),
           "ok": [], "texts": [], "guided_tokens": 0}
    if not picks:
        return out
    prompts, budgets = [], []
    for i, n, guided in picks:
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
        prompts.append(prompt + batch["completion_ids"][i, :n].tolist() + guided)
        budgets.append(C - n - len(guided))
    ro = common.generate(sampler, tok, prompts, 1, max(budgets), args.temperature, args.top_p)
    ids, lps, guides = [], [], []
    for j, (i, n, guided) in enumerate(picks):
        length = min(int(ro.completion_mask[j].sum()), budgets[j])
        cont = ro.completion_ids[j, :length].to(batch["completion_ids"].device)
        ids.append(torch.cat([batch["completion_ids"][i, :n], cont.new_tensor(guided), cont]))
        lps.append(torch.cat([batch["logprobs"][i, :n], cont.new_zeros(len(guided), dtype=torch.float),
                              ro.logprobs[j, :length].to(cont.device)]))
        pos = torch.arange(len(ids[-1]), device=cont.device)
        guides.append((pos >= n) & (pos < n + len(guided)))
        out["new_tokens"] += len(guided) + length
        out["guided_tokens"] += len(guided)
    pad = lambda xs, v: torch.stack([torch.nn.functional.pad(x, (0, C - len(x)), value=v) for x in xs])  # noqa: E731
    out.update(completion_ids=pad(ids, tok.pad_token_id), completion_mask=pad([torch.ones_like(x) for x in ids], 0),
               logprobs=pad(lps, 0.0), guided=pad(guides, False))
    out["texts"] = tok.batch_decode(out["completion_ids"], skip_special_tokens=True)
    examples = [batch["examples"][i // args.group_size] for i in out["rows"]]
    total, _ = llm.Rewards(args.reward)([e.prompt for e in examples], out["texts"], [e.answer for e in examples],
                                        task=task, completion_lengths=[len(x) for x in ids], max_new_tokens=C)
    out["rewards"] = torch.tensor(total, device=batch["rewards"].device)
    out["ok"] = [task.verify(t, e.answer)[0] == 1.0 for t, e in zip(out["texts"], examples)]
    return out


# ---- the credit rules ----
def ragged_group_advantages(rewards: torch.Tensor, groups: torch.Tensor, std_norm: bool = True, eps: float = 1e-6):
    """group_advantages over groups of unequal size (a prompt's G rollouts and its corrections): A_i = (r_i -
    mean_{g(i)} r) / (std_{g(i)} r + eps); rewards, groups [B'] (groups: each row's prompt index) -> advantages [B']."""
    adv = torch.empty_like(rewards)
    for g in groups.unique():
        idx = groups == g
        r = rewards[idx]
        adv[idx] = (r - r.mean()) / (r.std() + eps) if std_norm else r - r.mean()
    return adv


def positive_amplification(adv: torch.Tensor, beta: float) -> torch.Tensor:
    """R^3L's Positive Amplification: A_i <- beta A_i for the successful trajectories of a group (A_i > 0), A_i else."""
    return torch.where(adv > 0, beta * adv, adv)


def pivotal_mask(completion_mask: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """R^3L's Pivotal Credit Assignment: the loss mask of row i without its first shared[i] tokens (the prefix a retry
    shares with the failure it restarts); completion_mask [B, C], shared [B] -> [B, C]."""
    pos = torch.arange(completion_mask.shape[1], device=completion_mask.device)
    return completion_mask * (pos[None, :] >= shared[:, None]).to(completion_mask.dtype)


def offpolicy_weight(old_logp, behaviour_logp, guided, sampler_weight=None):
    """SCOPE's correction for the tokens the checker wrote: w_t = min(pi_old(o_t) / mu(o_t), 1) with mu(o_t) = 1 (a
    deterministic guide), i.e. pi_old(o_t), on guided tokens; the sampler weight (or 1) on the policy's own. [b, C]."""
    base = torch.ones_like(old_logp) if sampler_weight is None else sampler_weight
    return torch.where(guided, truncated_is_weight(old_logp, behaviour_logp, 1.0), base)


def training_batch(batch: dict, fix: dict, args: Args, pad_id: int) -> dict:
    """The rollouts and their corrections as one batch: corrections join their prompt's group (ragged baseline),
    Positive Amplification scales successes' advantages, and under --mode r3l --pivotal the prefix a retry shares with
    its failure leaves the loss mask of both. With no correction the rollout batch is grpo.py's, unchanged."""
    B, rows = batch["completion_ids"].shape[0], fix["rows"]
    C = max(batch["completion_ids"].shape[1], fix["completion_ids"].shape[1] if rows else 0)
    dev = batch["completion_ids"].device
    cat = lambda a, b, v: torch.cat([torch.nn.functional.pad(x.to(dev), (0, C - x.shape[1]), value=v)  # noqa: E731
                                     for x in (a, b)])
    out = {"prompt_ids": torch.cat([batch["prompt_ids"], batch["prompt_ids"][rows]]),
           "prompt_mask": torch.cat([batch["prompt_mask"], batch["prompt_mask"][rows]]),
           "completion_ids": cat(batch["completion_ids"], fix["completion_ids"], pad_id),
           "completion_mask": cat(batch["completion_mask"], fix["completion_mask"], 0),
           "logprobs": cat(batch["logprobs"], fix["logprobs"], 0.0),
           "guided": cat(torch.zeros_like(batch["completion_mask"], dtype=torch.bool), fix["guided"], False),
           "rewards": torch.cat([batch["rewards"], fix["rewards"]])}
    rows_t = torch.tensor(rows, dtype=torch.long, device=dev)
    groups = torch.cat([torch.arange(B, device=dev), rows_t]) // args.group_size  # each row's prompt
    adv = ragged_group_advantages(out["rewards"], groups, args.adv_std_norm) if rows else batch["adv"]
    beta = args.beta or (2.0 if args.mode == "r3l" else 1.0)
    out["adv"] = positive_amplification(adv, beta) if beta != 1.0 else adv
    shared = torch.zeros(B + len(rows), dtype=torch.long, device=dev)
    if args.mode == "r3l" and args.pivotal and rows:
        shared[rows_t] = torch.tensor(fix["shared"], device=dev)
        shared[B:] = torch.tensor(fix["shared"], device=dev)
    out["loss_mask"] = pivotal_mask(out["completion_mask"], shared)
    return out


# ---- rollout and update ----
def rollout(sampler, tok, task, args: Args, rng, device) -> dict:
    """Sample G completions for each of prompts_per_step training prompts; reward them; A_i per group. The batch also
    keeps the examples and the decoded completions, which the step checker reads."""
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
    batch.update(examples=examples, texts=ro.texts)  # what the step checker reads
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
    """ppo_epochs x minibatches optimiser steps on one rollout batch (micro-batches accumulate gradients): grpo.py's,
    with the loss over batch["loss_mask"] (the completion mask less R^3L's shared prefixes) and each token the checker
    wrote weighted by offpolicy_weight (SCOPE) on top of the sampler's truncated weight.

    pi_old (and pi_ref) are scored before any update; the loss of each micro-batch is normalised by counts
    over its whole mini-batch on all ranks, so accumulation and data parallelism leave J unchanged. The logged
    statistics are sums over all ranks divided by global counts: every rank returns the same values.
    """
    B, mask, train_mask = batch["completion_ids"].shape[0], batch["completion_mask"], batch["loss_mask"]
    guided = batch["guided"]  # tokens the checker wrote (SCOPE's guided steps)
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
            n_seqs, n_tokens = llm.step_counts(train_mask[mb_idx], accel)
            opt.zero_grad(set_to_none=True)
            for idx in micro(mb_idx):
                logp, ent = logprobs_of(model, idx, True)
                mb = {"adv": batch["adv"][idx], "mask": train_mask[idx].float(),
                      "old": logp.detach() if old is None else old[idx], "ref": None if ref is None else ref[idx]}
                mb["is_weight"] = truncated_is_weight(mb["old"], batch["logprobs"][idx], args.sampler_is_cap) \
                    if correct else None
                if args.guide_is and guided[idx].any():  # off-policy tokens: pi_old / mu on top of the sampler's weight
                    mb["is_weight"] = offpolicy_weight(mb["old"], batch["logprobs"][idx], guided[idx], mb["is_weight"])
                    for k, v in {"guide/w": common.masked_sum(mb["is_weight"], guided[idx] * mb["mask"]).item(),
                                 "guide/n": (guided[idx] * mb["mask"]).sum().item()}.items():
                        sums[k] = sums.get(k, 0.0) + v
                loss, token_stats = loss_fn(logp, mb, n_seqs, n_tokens, args)
                loss.backward()  # a NaN here reaches every rank's gradient: optimizer_step stops them all
                for k, v in {"pg": loss.item(), **{k: common.masked_sum(v.detach(), mb["mask"]).item() / max(
                        n_tokens, 1) for k, v in {**token_stats, "entropy": ent}.items()}}.items():
                    sums[k] = sums.get(k, 0.0) + v
                if epoch == 0:  # every token once, on the sampler's weights (pi_old)
                    for k, v in sampler_gap(mb["old"], batch["logprobs"][idx], mb["is_weight"], mb["mask"] *
                                            ~guided[idx], args.sampler_is_cap).items():  # the sampler's tokens
                        sums[k] = sums.get(k, 0.0) + v
            opt_step = (step - 1) * args.ppo_epochs * args.minibatches + n_opt  # derived: resume-safe
            grad_norm += llm.optimizer_step(model, opt, args, opt_step, total, sampler)
            n_opt += 1
    tot = llm.all_ranks_sum(sums, accel, mask.device)
    out = {**{f"loss/{k}": v / n_opt for k, v in tot.items() if not k.startswith(("gap/", "guide/"))},
           "loss/grad_norm": grad_norm / n_opt, "rollout/logprob_mismatch": tot["gap/sum"] / max(tot["gap/tokens"], 1)}
    if correct:
        out.update({"rollout/is_weight_mean": tot["gap/is_w"] / max(tot["gap/tokens"], 1),
                    "rollout/is_truncated_frac": tot["gap/is_cut"] / max(tot["gap/tokens"], 1)})
    if tot.get("guide/n"):
        out["loss/guided_weight"] = tot["guide/w"] / tot["guide/n"]  # mean pi_old of the checker's tokens
    return out


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    run = llm.Run(args)  # accelerator, threads, seed, the task and its held-out sets, the run folder
    if run.accel.num_processes > 1:  # ranks would correct different numbers of failures: unequal micro-batches
        raise SystemExit("step_correction.py runs in one process: each rank would correct a different number of "
                         "failures, and sharded ranks must run the same number of micro-batches")
    # sharded when several processes run; the sampler decodes (the trainer itself on CPU)
    model, tok, ref_model, sampler = llm.load_policy(args, run.accel, with_ref=args.kl_coef > 0)
    use_kernels = args.kernels and run.accel.device.type == "cuda"
    fused_logprob = None
    if use_kernels:  # Triton: the fused lm_head + log-softmax (the loss kernel is in kernel_grpo_loss)
        from kernels.fused_logprob import fused_linear_logprob as fused_logprob
    loss_fn = kernel_grpo_loss if use_kernels else grpo_loss
    opt = llm.make_optimizer(model.parameters(), args)
    counters = {"successes": 0, "corrected": 0, "salvaged": 0, "correction_tokens": 0, "guided_tokens": 0}
    run.start(model, tok, opt, sampler, counters=counters)  # resume (counters too), then the step-0 evaluation
    for step, rng in run.steps():  # every random draw of a step depends on (seed, step, rank) only
        with run.timer("gen"):  # the rollouts, the checker and the regenerated suffixes
            batch = rollout(sampler, tok, run.task, args, rng, run.accel.device)
            ok, picks = choose_corrections(tok, run.task, batch, args)
            fix = regenerate(sampler, tok, run.task, batch, picks, args)
        train = training_batch(batch, fix, args, tok.pad_token_id)
        with run.timer("train"):  # includes the sampler's refresh after each optimiser step
            stats = update(model, opt, train, loss_fn, args, step, run.accel, sampler, ref_model, fused_logprob)
        counts = {"successes": sum(ok) + sum(fix["ok"]), "corrected": len(picks), "salvaged": sum(fix["ok"]),
                  "correction_tokens": fix["new_tokens"], "guided_tokens": fix["guided_tokens"]}
        run.counters = {k: run.counters[k] + counts[k] for k in counters}
        run.gen_tokens += fix["new_tokens"]  # log_step adds the rollouts' own tokens
        run.log_step(step, batch, stats, {f"correction/{k}": v for k, v in counts.items()} | {
            "correction/salvage_rate": counts["salvaged"] / max(1, counts["corrected"])})
    c = run.counters
    return run.finish({"scope": "SCOPE", "r3l": "R^3L"}[args.mode], {
        "successes": c["successes"], "corrected": c["corrected"], "salvaged": c["salvaged"],
        "salvage_rate": c["salvaged"] / max(1, c["corrected"]), "correction_tokens": c["correction_tokens"],
        "guided_tokens": c["guided_tokens"], "tokens_per_success": run.gen_tokens / max(1, c["successes"]),
        "salvaged_share": c["salvaged"] / max(1, c["successes"])})


if __name__ == "__main__":
    main(tyro.cli(Args))
