"""NudgeRL: strategy nudging for GRPO, with P^2O's prompt search and LENS's prompt purification as flags.

Papers: Lee, Park, Kang, Hwang, "Nudging Beyond the Comfort Zone: Efficient Strategy-Guided Exploration for RLVR"
(NudgeRL), arXiv:2605.15726; Lu et al., "P^2O: Joint Policy and Prompt Optimization", arXiv:2603.21877; Guo, Hu,
Sun, Lin, "Less Noise, More Voice: Reinforcement Learning for Reasoning via Instruction Purification" (LENS),
arXiv:2601.21244.

NudgeRL: each prompt's G rollouts are split over K strategy contexts (--hints, m = G / K rollouts each), the first
usually the bare prompt. A context is a hint written before the policy's answer; on 2-digit addition (`47+85=`) the
hints are the scratchpad the tiny policy can read: `steps` asks for the column-by-column scratchpad (`47+85:`),
`units` also shows its first column (`47+85:7+5=12;`), `tens` two columns. A hinted rollout is rewarded by the
scratchpad verifier on hint + completion; its final answer is what it transfers to the bare prompt.

Equations (each implemented by the function named on the right), rewards r_{k,j} of context k, rollout j:
  intra-context  a_kj = (r_kj - mean_j r_k.) / (std_j r_k. + eps)    GRPO inside the context's m rollouts
  inter-context  b_k  = (mean_j r_kj - mean_k' mean_j r_k'j) / (std_k' mean_j r_k'j + eps)   (0 when K = 1)
  advantage      A_kj = a_kj + inter_coef * b_k                                     inter_intra_advantages
                 (--no-adv-std-norm drops both divisions, as in grpo.py)
  distillation   d_it = -w_i log pi_theta(y_it | x_i, y_i,<t)  on rows (bare prompt x_i, transferred response y_i):
                 the final answers of successful hinted rollouts (NudgeRL), of successful rollouts under a prompt
                 found by search (P^2O) or under the purified prompt (LENS)                 distill_token_loss
  objective      J = grpo.py's clipped surrogate on the rollouts (+ k3 KL)  + distill_coef * d, every row of the
                 step under one seq-mean normaliser (rollouts and distillation rows together)         nudge_loss
  P^2O (--p2o)   for every prompt whose G rollouts all fail: a random search over the hint prefixes (the scratchpad
                 with n = 0 .. digits-1 columns shown, in a random order, at most --p2o-tries of them, each with
                 --p2o-rollouts samples), stopping at the first that produces a success; its successes are
                 distilled into the bare prompt                                        random_search, p2o_pool
  LENS (--lens)  prompts carry --noise injected distractor letters (training and held-out: NoisyTask). For every
                 prompt whose rollouts all fail, the --lens-remove prompt tokens of highest surprisal under the
                 current policy, -log pi(x_j | x_<j), are removed (interference_tokens, purify); --lens-rollouts
                 samples on the purified prompt; its successes supervise the noisy prompt (distillation rows)
  The rest is grpo.py's: clipped_pg_loss, k3_kl, aggregate_loss, truncated_is_weight (the sampler correction on
  the rollouts; the distillation rows are scored by the trainer at rollout time, so their weight is 1).

Deviations:
- The strategy contexts are the scratchpad prefixes the tiny policy reads, not free-text strategies; `units` and
  `tens` show part of the worked solution (a partial oracle, weaker than self_opd.py's full scratchpad), `steps`
  only the strategy. The paper's balanced context dropout is not implemented.
- The distillation is context distillation by likelihood (SFT on the transferred final answers, one row per
  successful hinted rollout), not a KL to the hinted policy's distribution: the hinted responses are scratchpads,
  the bare prompt's response is the answer alone.
- P^2O's GEPA (reflective prompt evolution by an LLM) is replaced by a stated random search over the scratchpad
  prefixes above; found prompts are not remembered across steps (training prompts rarely repeat here).
- LENS scores interference by the current policy's surprisal of each prompt token (the paper compares with a
  reference distribution) and removes a fixed number of tokens; its calibrated objective (CRPO) is replaced by the
  same distillation rows as above (no importance correction for the off-prompt responses).
- The search and purification trigger only on all-fail groups; their extra samples are counted in
  rollout/extra_samples (the benchmark reports the budget).
- One process, Hugging Face sampling: --engine vllm, several processes and --kernels are refused.

Parent: algos/grpo.py; changed: Args, Args.prompts_per_step, Args.kernels, Args.threads, Args.steps,
  Args.max_new_tokens, Args.lr, Args.eval_every, Args.eval_examples, Args.pass_k, Args.eval_hard, check_args, rollout,
  update, main, kernel_grpo_loss (removed: the fused kernel has no distillation term).

Commands:
  python algos/nudge_rl.py                                       # NudgeRL: hints none + units, 4 rollouts each
  python algos/nudge_rl.py --hints none --distill-coef 0         # GRPO on the same settings (the reference)
  python algos/nudge_rl.py --hints none --p2o                    # P^2O: search hint prefixes for all-fail prompts
  python algos/nudge_rl.py --hints none --noise 2 --lens         # LENS on prompts with 2 distractor letters
Expected: the default (60 batches of 16 prompts x 8 rollouts, lr 2e-4) takes the bare prompt's held-out greedy
accuracy from 35.3% to 40.0 ± 5.2% over 3 seeds (about 30 s of training on one thread), where GRPO at the same
settings ends at 30.7 ± 3.8% and with twice the rollouts at 34.4 ± 2.5%; P^2O's search finds a success for ~97% of
the all-fail prompts but ends at 34.3 ± 5.7%; LENS on prompts with one distractor letter stays near 1%. Table:
benchmarks/results/nudge_rl.md.
"""
from __future__ import annotations

import hashlib
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
    """NudgeRL's own flags (and grpo.py's, inherited); the plumbing flags (run, model, task, engine, optimiser, eval,
    checkpoints) are LLMArgs'."""
    # rollout
    prompts_per_step: int = 16
    """distinct prompts per rollout batch"""
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
    """use the Triton kernels (fused log-prob, fused clipped loss) when a GPU is present (refused here)"""
    # NudgeRL
    hints: tuple[str, ...] = ("none", "units")
    """strategy contexts, each given group_size / K rollouts per prompt: none (the bare prompt), steps (ask for the
    scratchpad), units (and show its first column), tens (its first two columns)"""
    inter_coef: float = 1.0
    """weight of the inter-context advantage b_k (0 = GRPO inside each context's rollouts only)"""
    distill_coef: float = 1.0
    """weight of the distillation loss on the transferred responses (0 = none)"""
    p2o: bool = False
    """P^2O: random search over hint prefixes for prompts whose rollouts all fail; their successes are distilled"""
    p2o_tries: int = 2
    """P^2O: hint prefixes tried at most per all-fail prompt"""
    p2o_rollouts: int = 4
    """P^2O: samples per tried hint prefix"""
    noise: int = 0
    """distractor letters injected into every prompt, training and held-out (0 = clean prompts)"""
    lens: bool = False
    """LENS: purify all-fail noisy prompts (remove the highest-surprisal tokens) and distil their successes"""
    lens_remove: int = 2
    """LENS: prompt tokens removed by the purification"""
    lens_rollouts: int = 4
    """LENS: samples on each purified prompt"""
    threads: int = 1
    """torch CPU threads (1 is faster than 2 on a shared 2-core machine)"""
    steps: int = 60
    """optimiser steps (one rollout batch each)"""
    max_new_tokens: int = 16
    """generation budget (a hinted scratchpad takes up to 13 characters on 2 digits)"""
    lr: float = 2e-4
    """peak learning rate (AdamW)"""
    eval_every: int = 20
    """steps between held-out evaluations"""
    eval_examples: int = 300
    """held-out prompts per evaluation"""
    pass_k: int = 0
    """k of pass@k (0 = off)"""
    eval_hard: bool = False
    """also evaluate one digit harder"""


HINTS = {"none": None, "steps": 0, "units": 1, "tens": 2}  # hint -> scratchpad columns shown (None: the bare prompt)


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
    if args.engine == "vllm":
        raise SystemExit("--engine vllm: the hinted and searched prompts are sampled with Hugging Face generate here; "
                         "use --engine hf")
    if args.kernels:
        raise SystemExit("--kernels: the fused loss kernel has no distillation term; run without it")
    if not args.hints or any(h not in HINTS for h in args.hints) or len(set(args.hints)) < len(args.hints):
        raise SystemExit(f"--hints takes distinct names among {', '.join(HINTS)}, got {args.hints}")
    if args.group_size % len(args.hints) or args.group_size // len(args.hints) < 2:
        raise SystemExit(f"--group-size {args.group_size} must split into at least 2 rollouts for each of the "
                         f"{len(args.hints)} hints")
    uses_scratchpad = args.hints != ("none",) or args.p2o
    if uses_scratchpad and args.task != "add":
        raise SystemExit("--hints other than none and --p2o build scratchpad hints for --task add only")
    if any(HINTS[h] is not None and HINTS[h] >= args.digits for h in args.hints):
        raise SystemExit(f"--hints: a hint may show at most digits - 1 = {args.digits - 1} scratchpad columns")
    if args.inter_coef < 0 or args.distill_coef < 0:
        raise SystemExit("--inter-coef and --distill-coef must be >= 0")
    if args.p2o_tries < 1 or args.p2o_rollouts < 1 or args.lens_rollouts < 1 or args.lens_remove < 1:
        raise SystemExit("--p2o-tries, --p2o-rollouts, --lens-rollouts and --lens-remove must be positive")
    if args.noise < 0:
        raise SystemExit("--noise must be >= 0")
    if args.lens and args.noise < 1:
        raise SystemExit("--lens purifies noisy prompts: give --noise >= 1")
    if args.noise and (uses_scratchpad or args.task != "add"):
        raise SystemExit("--noise: distractors are injected into --task add prompts, with --hints none and no --p2o "
                         "(a hint built from the clean operands would remove the noise itself)")


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


def inter_intra_advantages(rewards: torch.Tensor, group_size: int, n_hints: int, inter_coef: float = 1.0,
                           std_norm: bool = True, eps: float = 1e-6):
    """A_kj = a_kj + inter_coef * b_k; rewards [B] ordered prompt-major (G = group_size rows each), then hint, then
    rollout (n_hints blocks of m = G / n_hints). a_kj: GRPO inside hint k's m rollouts; b_k: the hint's mean reward
    against the prompt's other hints (0 with one hint). Returns (A [B], a [B], b [B]: b_k over its hint's rows)."""
    r = rewards.view(-1, n_hints, group_size // n_hints)
    intra = r - r.mean(2, keepdim=True)
    if std_norm:
        intra = intra / (r.std(2, keepdim=True) + eps)
    inter = torch.zeros_like(r)
    if n_hints > 1:
        means = r.mean(2)  # [P, K]
        b = means - means.mean(1, keepdim=True)
        if std_norm:
            b = b / (means.std(1, keepdim=True) + eps)
        inter = b.unsqueeze(2).expand_as(r)
    adv = intra + inter_coef * inter
    return adv.reshape(-1), intra.reshape(-1), inter.reshape(-1)


def distill_token_loss(logp: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """d_it = -w_i log pi(y_it | x_i, y_i,<t): the likelihood loss on the distillation rows (w = 0 on rollouts)."""
    return -weight.unsqueeze(1) * logp


def nudge_loss(logp, mb: dict, n_seqs: int, n_tokens: int, args: Args):
    """This micro-batch's share of J: grpo_loss on the rollouts (the distillation rows carry A = 0) plus
    distill_coef x the distillation rows' likelihood loss, under the same step normaliser."""
    loss, stats = grpo_loss(logp, mb, n_seqs, n_tokens, args)
    if args.distill_coef and bool(mb["distill"].any()):
        d = distill_token_loss(logp, mb["distill"])
        loss = loss + args.distill_coef * aggregate_loss(d, mb["mask"], args.loss_agg, n_seqs, n_tokens,
                                                         agg_const(args))
        stats["distill"] = d.detach()
    return loss, stats


# ---- contexts: hints, search, noise and purification ----
def operands(ex) -> tuple[int, int]:
    """The two operands of an addition example (read from its clean prompt when noise was injected)."""
    a, b = getattr(ex, "clean", ex.prompt).rstrip("=:").split("+")
    return int(a), int(b)


def hint_context(ex, cols: int | None) -> tuple[str, str | None]:
    """(prompt, shown scratchpad) of a hint: cols None = the bare prompt (shown None); else the scratchpad prompt
    `a+b:` with its first `cols` columns shown ('47+85:7+5=12;' for cols = 1)."""
    if cols is None:
        return ex.prompt, None
    a, b = operands(ex)
    shown = "".join(c + ";" for c in llm.addition_scratchpad(a, b).split(";")[:cols])
    return f"{a}+{b}:{shown}", shown


def p2o_pool(digits: int) -> list[int]:
    """P^2O's candidate hint prefixes: the scratchpad with 0 .. digits - 1 columns shown."""
    return list(range(digits))


def random_search(n_groups: int, pool: list, tries: int, try_fn, rng) -> tuple[list, list]:
    """Random search over `pool` for each of n_groups prompts: round t tries, for every prompt not yet solved, the
    t-th candidate of its own random order; try_fn(list of (group, candidate)) -> successes per pair. Returns (the
    candidate that first succeeded or None, per group; the candidates tried, per group)."""
    orders = [list(rng.permutation(len(pool))) for _ in range(n_groups)]
    found, tried = [None] * n_groups, [[] for _ in range(n_groups)]
    for t in range(min(tries, len(pool))):
        todo = [(g, pool[orders[g][t]]) for g in range(n_groups) if found[g] is None]
        if not todo:
            break
        for (g, cand), ok in zip(todo, try_fn(todo)):
            tried[g].append(cand)
            if ok:
                found[g] = cand
    return found, tried


def inject_noise(prompt: str, n: int, rng) -> tuple[str, list[int]]:
    """The prompt with n random lowercase letters inserted before its last character (its '='), and their indices."""
    s = list(prompt)
    for _ in range(n):
        s.insert(int(rng.integers(0, len(s))), chr(int(rng.integers(97, 123))))
    return "".join(s), [i for i, c in enumerate(s) if c.isalpha()]


class NoisyTask:
    """A task whose prompts carry `n` injected distractor letters, the same ones for a given prompt in every run (a
    hash of the prompt seeds them); verification and parsing are the wrapped task's. ex.clean keeps the prompt."""

    def __init__(self, task, n: int):
        self.task, self.n, self.kind, self.name = task, n, getattr(task, "kind", None), f"{task.name}+noise{n}"

    def sample(self, split: str, n: int, rng):
        out = []
        for ex in self.task.sample(split, n, rng):
            seed = int(hashlib.md5(ex.prompt.encode()).hexdigest(), 16) % 2 ** 32
            noisy, _ = inject_noise(ex.prompt, self.n, np.random.default_rng(seed))
            new = llm.Example(noisy, ex.answer, ex.solution)
            new.clean = ex.prompt
            out.append(new)
        return out

    def parse(self, response: str):
        return self.task.parse(response)

    def verify(self, response: str, answer: str):
        return self.task.verify(response, answer)


def interference_tokens(surprisal: torch.Tensor, valid: torch.Tensor, k: int) -> list[list[int]]:
    """Per prompt, the positions of its k highest-surprisal tokens among the valid ones (ties: the earlier first)."""
    s = surprisal.masked_fill(~valid.bool(), float("-inf"))
    out = []
    for row, v in zip(s, valid):
        k_row = min(k, int(v.sum()))
        order = sorted(range(len(row)), key=lambda j: (-float(row[j]), j))
        out.append(sorted(order[:k_row]))
    return out


@torch.no_grad()
def prompt_surprisal(model, tok, prompts: list[str]) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """(token ids, -log pi(x_j | x_<j) [N, L] right-padded, valid [N, L]) of each prompt's tokens under the policy;
    the first token (BOS) is not scored."""
    ids = common.encode_prompts(tok, prompts)
    L = max(map(len, ids))
    x = torch.tensor([s + [tok.pad_token_id] * (L - len(s)) for s in ids], device=next(model.parameters()).device)
    mask = torch.tensor([[1] * len(s) + [0] * (L - len(s)) for s in ids], device=x.device)
    # the first token as the "prompt", the rest as a right-padded "completion": log-probs by chunks of positions,
    # never the [N x L x vocab] logits
    lp = common.token_logprobs(model, x[:, :1], mask[:, :1], x[:, 1:], mask[:, 1:])
    surprisal = torch.nn.functional.pad(-lp, (1, 0))
    valid = mask.clone()
    valid[:, 0] = 0
    return ids, surprisal, valid


def purify(tok, ids: list[list[int]], remove: list[list[int]]) -> list[str]:
    """The prompts with the given token positions removed (decoded)."""
    return [tok.decode([t for j, t in enumerate(s) if j not in set(r)], skip_special_tokens=True)
            for s, r in zip(ids, remove)]


# ---- rollout and update ----
def hinted_rewards(texts: list[str], shown: list[str | None], prompts: list[str], answers: list[str],
                   lengths: list[int], task, args: Args):
    """Rewards of rollouts under their contexts: the bare prompt's by --reward (grpo.py's), a hinted one's by the
    scratchpad verifier on shown scratchpad + completion; and the response each transfers to the bare prompt (its
    final answer; the completion itself for the bare prompt). Returns (rewards, transferred, reward terms)."""
    steps_task = llm.ArithmeticTask("addsteps", args.digits)
    bare = [i for i, s in enumerate(shown) if s is None]
    total, terms = [0.0] * len(texts), {}
    if bare:
        tb, terms = llm.Rewards(args.reward)([prompts[i] for i in bare], [texts[i] for i in bare],
                                             [answers[i] for i in bare], task=task,
                                             completion_lengths=[lengths[i] for i in bare],
                                             max_new_tokens=args.max_new_tokens)
        for i, v in zip(bare, tb):
            total[i] = v
    for i, s in enumerate(shown):
        if s is not None:
            total[i] = steps_task.verify(s + texts[i], answers[i])[0]
    transferred = [t if s is None else task.parse(t) for t, s in zip(texts, shown)]
    return total, transferred, terms


def distill_rows(tok, prompts: list[str], responses: list[str], device) -> dict:
    """Rows (bare prompt, transferred response + EOS) in the rollout batch's layout."""
    eos = common.eos_ids(tok)[0]
    comp = [tok(r, add_special_tokens=False)["input_ids"] + [eos] for r in responses]
    p_ids, p_mask = common.left_pad(common.encode_prompts(tok, prompts), tok.pad_token_id)
    C = max(map(len, comp))
    c_ids = torch.tensor([c + [tok.pad_token_id] * (C - len(c)) for c in comp])
    c_mask = torch.tensor([[1] * len(c) + [0] * (C - len(c)) for c in comp])
    return {"prompt_ids": p_ids.to(device), "prompt_mask": p_mask.to(device), "completion_ids": c_ids.to(device),
            "completion_mask": c_mask.to(device)}


def stack_rows(parts: list[dict], pad_id: int) -> dict:
    """Concatenate row dicts (prompts left-padded, completions and per-token fields right-padded)."""
    P = max(p["prompt_ids"].shape[1] for p in parts)
    C = max(p["completion_ids"].shape[1] for p in parts)
    lp = lambda x, w, v: torch.nn.functional.pad(x, (w - x.shape[1], 0), value=v)  # noqa: E731
    rp = lambda x, w, v: torch.nn.functional.pad(x, (0, w - x.shape[1]), value=v)  # noqa: E731
    out = {"prompt_ids": torch.cat([lp(p["prompt_ids"], P, pad_id) for p in parts]),
           "prompt_mask": torch.cat([lp(p["prompt_mask"], P, 0) for p in parts])}
    for k, v in (("completion_ids", pad_id), ("completion_mask", 0), ("logprobs", 0.0)):
        out[k] = torch.cat([rp(p[k], C, v) for p in parts])
    return out


def p2o_search(sampler, tok, task, args: Args, rng, hard: list, d_prompts: list, d_resp: list, extra: dict) -> int:
    """P^2O on the all-fail prompts `hard`: random_search over p2o_pool, --p2o-rollouts samples per try; every success
    appends a distillation row (bare prompt, its answer) to d_prompts / d_resp. Returns the samples drawn."""
    per_row = lambda xs, n: [x for x in xs for _ in range(n)]  # noqa: E731
    n_extra = 0

    def try_fn(pairs):
        nonlocal n_extra
        cs = [hint_context(hard[g], cols) for g, cols in pairs]
        sro = common.generate(sampler, tok, common.encode_prompts(tok, [c[0] for c in cs]), args.p2o_rollouts,
                              args.max_new_tokens, args.temperature, args.top_p)
        n_extra += len(sro.texts)
        r, tr, _ = hinted_rewards(sro.texts, per_row([c[1] for c in cs], args.p2o_rollouts),
                                  per_row([c[0] for c in cs], args.p2o_rollouts),
                                  per_row([hard[g].answer for g, _ in pairs], args.p2o_rollouts),
                                  sro.completion_mask.sum(1).tolist(), task, args)
        ok = []
        for j, (g, _) in enumerate(pairs):
            wins = [tr[j * args.p2o_rollouts + i] for i in range(args.p2o_rollouts)
                    if r[j * args.p2o_rollouts + i] > 0]
            d_prompts.extend([hard[g].prompt] * len(wins))
            d_resp.extend(wins)
            ok.append(bool(wins))
        return ok
    found, _ = random_search(len(hard), p2o_pool(args.digits), args.p2o_tries, try_fn, rng)
    extra["rollout/p2o_recovered_frac"] = sum(f is not None for f in found) / len(hard)
    return n_extra


def lens_purify(sampler, tok, task, args: Args, hard: list, d_prompts: list, d_resp: list, extra: dict) -> int:
    """LENS on the all-fail noisy prompts `hard`: remove each one's --lens-remove highest-surprisal tokens, sample
    --lens-rollouts on the purified prompt; every success appends a row (noisy prompt, that completion). Returns the
    samples drawn."""
    noisy = [e.prompt for e in hard]
    ids, surprisal, valid = prompt_surprisal(sampler.model, tok, noisy)
    clean = purify(tok, ids, interference_tokens(surprisal, valid, args.lens_remove))
    pro = common.generate(sampler, tok, common.encode_prompts(tok, clean), args.lens_rollouts,
                          args.max_new_tokens, args.temperature, args.top_p)
    answers = [e.answer for e in hard for _ in range(args.lens_rollouts)]
    r = [task.verify(t, a)[0] for t, a in zip(pro.texts, answers)]
    hit = [any(r[j * args.lens_rollouts:(j + 1) * args.lens_rollouts]) for j in range(len(hard))]
    for i, (t, ri) in enumerate(zip(pro.texts, r)):
        if ri > 0:
            d_prompts.append(noisy[i // args.lens_rollouts])
            d_resp.append(t)
    extra["rollout/lens_recovered_frac"] = sum(hit) / len(hard)
    extra["rollout/lens_clean_frac"] = float(np.mean([c == getattr(e, "clean", None) for c, e in zip(clean, hard)]))
    return len(pro.texts)


def rollout(sampler, tok, task, args: Args, rng, device) -> dict:
    """m = G / K completions of each prompt under each hint; rewards; A_kj (inter_intra_advantages); then the
    distillation rows: successful hinted rollouts (NudgeRL), P^2O's searched prompts and LENS's purified prompts for
    the prompts whose rollouts all fail. Rows: the P * G rollouts first, then the distillation rows."""
    K = len(args.hints)
    m = args.group_size // K
    examples = task.sample("train", args.prompts_per_step, rng)
    ctx = [hint_context(e, HINTS[h]) for e in examples for h in args.hints]
    ro = common.generate(sampler, tok, common.encode_prompts(tok, [c[0] for c in ctx]), m,
                         args.max_new_tokens, args.temperature, args.top_p)
    per_row = lambda xs, n: [x for x in xs for _ in range(n)]  # noqa: E731
    shown, answers = per_row([c[1] for c in ctx], m), per_row([e.answer for e in examples], args.group_size)
    total, transferred, terms = hinted_rewards(ro.texts, shown, per_row([c[0] for c in ctx], m), answers,
                                               ro.completion_mask.sum(1).tolist(), task, args)
    rewards = torch.tensor(total, device=device)
    adv, intra, inter = inter_intra_advantages(rewards, args.group_size, K, args.inter_coef,
                                               args.adv_std_norm)
    batch = {k: getattr(ro, k).to(device) for k in
             ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs")}
    d_prompts, d_resp = [], []
    if args.distill_coef:  # successful hinted rollouts -> their answers under the bare prompt
        for i, (s, r) in enumerate(zip(shown, total)):
            if s is not None and r > 0:
                d_prompts.append(examples[i // args.group_size].prompt)
                d_resp.append(transferred[i])
    all_fail = [g for g in range(len(examples)) if max(total[g * args.group_size:(g + 1) * args.group_size]) <= 0]
    extra = {"rollout/all_fail_frac": len(all_fail) / len(examples)}
    n_extra = 0
    if args.p2o and all_fail:
        n_extra += p2o_search(sampler, tok, task, args, rng, [examples[g] for g in all_fail], d_prompts, d_resp, extra)
    if args.lens and all_fail:
        n_extra += lens_purify(sampler, tok, task, args, [examples[g] for g in all_fail], d_prompts, d_resp, extra)
    extra["rollout/extra_samples"] = n_extra
    n_pg = rewards.shape[0]
    if d_prompts and args.distill_coef:
        rows = distill_rows(tok, d_prompts, d_resp, device)
        with torch.no_grad():  # scored by the trainer: the sampler correction's weight is 1 on these rows
            rows["logprobs"] = common.token_logprobs(sampler.model, rows["prompt_ids"], rows["prompt_mask"],
                                                     rows["completion_ids"], rows["completion_mask"],
                                                     args.temperature)
        batch = stack_rows([batch, rows], tok.pad_token_id)
    n_d = batch["completion_ids"].shape[0] - n_pg
    zeros = torch.zeros(n_d, device=device)
    batch.update(rewards=rewards, adv=torch.cat([adv, zeros]), distill=torch.cat([torch.zeros(n_pg, device=device),
                                                                                 torch.ones(n_d, device=device)]),
                 finish_reasons=ro.finish_reasons, n_rollouts=n_pg, reward_terms={  # each term's mean where it applies
                     f"reward/{k}": float(np.mean([v for v in vs if v is not None] or [0.0])) for k, vs in terms.items()})
    for k, h in enumerate(args.hints):  # each hint's success rate
        extra[f"rollout/reward_{h}"] = rewards.view(-1, K, m)[:, k].mean().item()
    extra.update({"rollout/adv_inter_abs": inter.abs().mean().item(), "rollout/distill_rows": n_d})
    batch["extra"] = extra
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
                mb = {"adv": batch["adv"][idx], "mask": mask[idx].float(), "distill": batch["distill"][idx],
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
def main(args: Args) -> dict:
    check_args(args)
    run = llm.Run(args)  # accelerator, threads, seed, the task and its held-out sets, the run folder
    if run.accel.num_processes > 1:
        raise SystemExit("nudge_rl.py runs in one process (its searched and purified prompts are sampled locally)")
    if args.noise:  # distractors in training and held-out prompts alike
        run.task = NoisyTask(run.task, args.noise)
        run.hard_task = NoisyTask(run.hard_task, args.noise) if run.hard_task is not None else None
        run.eval_sets = common.held_out_sets(run.task, args.eval_examples, run.hard_task)
    model, tok, ref_model, sampler = llm.load_policy(args, run.accel, with_ref=args.kl_coef > 0)
    opt = llm.make_optimizer(model.parameters(), args)
    run.start(model, tok, opt, sampler)  # resume from --resume, then the step-0 held-out evaluation
    for step, rng in run.steps():  # every random draw of a step depends on (seed, step, rank) only
        with run.timer("gen"):
            batch = rollout(sampler, tok, run.task, args, rng, run.accel.device)
        with run.timer("train"):  # includes the sampler's refresh after each optimiser step
            stats = update(model, opt, batch, nudge_loss, args, step, run.accel, sampler, ref_model)
        n = batch["n_rollouts"]  # rollout metrics on the rollouts only, not the distillation rows
        view = {"rewards": batch["rewards"], "completion_mask": batch["completion_mask"][:n],
                "finish_reasons": batch["finish_reasons"], "reward_terms": batch["reward_terms"]}
        run.log_step(step, view, stats, extra=batch["extra"])
    means = {k: float(np.mean(v)) for k in ("all_fail_frac", "p2o_recovered_frac", "lens_recovered_frac",
                                           "lens_clean_frac", "extra_samples", "distill_rows")
             if (v := [h[f"rollout/{k}"] for h in run.history if f"rollout/{k}" in h])}
    return run.finish("NudgeRL", extra=means)  # per-step means of the exploration counters


if __name__ == "__main__":
    main(tyro.cli(Args))
