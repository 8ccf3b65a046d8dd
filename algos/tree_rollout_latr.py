"""LATR tree rollouts for GRPO: branch into forced candidate tokens and prune branches that stay similar.

Paper: Xing et al., "Lookahead Tree-Based Rollouts for Enhanced Trajectory-Level Exploration in Reinforcement
Learning with Verifiable Rewards" (LATR), arXiv:2510.24302 (the abstract reports 131% faster policy learning and
+4.2% final pass@1 over stochastic sampling). The trees, GRPO over their G leaves and the accounting are the parent's.

Parent: algos/tree_rollout_grpo.py; changed: Args, check_args, sample_segments, branch_points, Request, sample_requests,
  attach, round_requests, grow_trees, rollout.

Equations (the parent's, and; each implemented by the function named on the right):
  candidates    per position the tokens c with pi(c) >= --force-abs and pi(c) >= --force-rel * max pi (of the
                continuations + 1 most likely)                                                 sample_segments
  branch token  --branch-token force: continuation k of a point starts with the k-th most likely candidate other
                than the parent's token (resampled once they run out); a point needs one   branch_points, round_requests
  lookahead     --lookahead R: each new child samples R tokens after its branch token; a child whose window matches
                its parent's at >= --prune-sim of the positions is pruned and its budget goes to the tree's next best
                point (one replacement, kept whatever its window); then every child is completed  lookahead_prune
Deviations from the paper (the parent's hold too):
- LATR's similarity is an edit distance over the window; here the share of equal tokens position by position.
- Forced tokens and pruning make the leaves off-policy (rollout/forced_frac and rollout/pruned_frac say how much;
  forced tokens and pruned windows count as sampled tokens); the loss treats the leaves as samples of pi.
- A forced candidate that is EOS ends its branch: the child is its prefix + EOS, finished.

Commands:
  python algos/tree_rollout_latr.py                              # forced candidates + lookahead 4, G = 4 x (1 + 3)
  python algos/tree_rollout_latr.py --lookahead 0                # forced candidates, no pruning
  python algos/tree_rollout_latr.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --engine vllm --device cuda \
      --max-new-tokens 512 --answer-marker "####" --lr 1e-6                              # one GPU
Expected: against GRPO at G = 16 (the latr arm of benchmarks/results/tree_rollout.md, 3 seeds of 8 prompts x 25
steps) LATR did not learn faster here (+5 held-out points after 21.7 +- 7.6 steps against 11.7 +- 5.8; final
accuracy 54.0 +- 5.5% against 53.5 +- 6.9%) though its groups held more distinct final answers (5.12 against 4.90).
On the claims plan's paired fresh run (21 seeds, 40-60) its mean held-out accuracy over the 25 steps, which rewards
learning sooner, was 48.7% against GRPO's 49.5%, -0.8 [-2.0, +0.5] seed by seed.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import tyro

import common
from algos import _llm as llm
from algos import _tree
from algos._llm import LLMArgs


@dataclass
class Args(LLMArgs):
    """The tree's flags and GRPO's; the plumbing flags are LLMArgs' (here with the long-response task's defaults)."""
    # defaults changed from LLMArgs (their help is LLMArgs')
    model: str = "tiny-sums"
    task: Annotated[str, tyro.conf.arg(help=f"training and held-out task: {llm.TASKS}")] = "sums"
    digits: int = 1
    threads: int = 1
    """torch CPU threads per process (1: generation here is per-call overhead; 2 threads gain little and slow ~10x
    when another 2-thread job shares the 2 cores)"""
    max_new_tokens: int = 48
    steps: int = 50
    # rollout
    prompts_per_step: int = 16
    """distinct prompts per rollout batch (per process)"""
    group_size: int = 16
    """G, leaves per prompt: must equal chains * (1 + rounds * branches * continuations)"""
    # tree
    chains: int = 4
    """M: independent chains per prompt (the roots of the trees)"""
    rounds: int = 1
    """L: branching rounds after the chains (0 = no branching: plain GRPO with G = M)"""
    branches: int = 1
    """N: branch points per tree and round"""
    continuations: int = 3
    """T: continuations drawn from each branch point"""
    branch_score: Literal["entropy", "nll", "random"] = "entropy"
    """where to branch: highest next-token entropy (EPTree), highest sampled-token NLL, or uniformly at random"""
    branch_token: Literal["resample", "force"] = "force"
    """branch token: forced to an untried candidate (LATR, off-policy) or resampled from the policy (the parent's)"""
    force_abs: float = 0.05
    """a forced candidate needs probability >= this"""
    force_rel: float = 0.1
    """... and probability >= this times the most likely token's"""
    lookahead: int = 4
    """tokens simulated after the branch token before pruning (0 = no pruning)"""
    prune_sim: float = 0.75
    """prune a child whose lookahead window equals its parent's at this share of positions or more"""
    answer_marker: str = "="
    """the final answer starts at the last token containing this string (no branching there or after it)"""
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


def check_args(args: Args) -> None:
    """Fail early, naming the flag, instead of deep inside torch."""
    if min(args.chains, args.branches, args.continuations) < 1 or args.rounds < 0:
        raise SystemExit("--chains, --branches and --continuations must be >= 1 and --rounds >= 0")
    leaves = args.chains * (1 + args.rounds * args.branches * args.continuations)
    if args.group_size != leaves:
        raise SystemExit(f"--group-size {args.group_size} must equal chains * (1 + rounds * branches * continuations) "
                         f"= {args.chains} * (1 + {args.rounds} * {args.branches} * {args.continuations}) = {leaves}")
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
    if not (0 < args.force_abs <= 1 and 0 < args.force_rel <= 1 and 0 < args.prune_sim <= 1) or args.lookahead < 0:
        raise SystemExit("--force-abs, --force-rel and --prune-sim must be in (0, 1], --lookahead >= 0")
    if not args.answer_marker:
        raise SystemExit("--answer-marker must be a non-empty string (the final answer is never branched)")
    if args.engine == "vllm" and not torch.cuda.is_available():
        raise SystemExit("--engine vllm needs a CUDA GPU; use --engine hf on CPU")


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


# ---- the idea: growing the trees ----
def sample_segments(sampler, tok, prompts, groups, prefixes, budgets, args: Args, stats=False) -> list[dict]:
    """One batched generate call from prompt + prefix for every row; row r is cut at its own budget budgets[r].

    Returns per row a segment: tokens, behaviour logprobs, finished (EOS inside the budget) and, with stats, the
    entropy and the LATR candidates [(token, logprob)] passing --force-abs / --force-rel at every position, from the
    module the sampler decodes with (the trainer itself on CPU; the trainer when an engine such as vLLM samples).
    """
    ro = common.generate(sampler, tok, [prompts[g] + p for g, p in zip(groups, prefixes)], 1, max(budgets),
                         args.temperature, args.top_p)
    lengths = ro.completion_mask.sum(1).tolist()
    if stats:
        scorer = sampler.model if sampler.engine is not None else sampler.module()
        ent, top_p, top_ids = _tree.next_token_stats(scorer, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                                                     ro.completion_mask, args.temperature, args.continuations + 1)
    segs = []
    for r, budget in enumerate(budgets):
        n = min(lengths[r], budget)
        seg = {"tokens": ro.completion_ids[r, :n].tolist(), "logprobs": ro.logprobs[r, :n].tolist(),
               "finished": ro.finish_reasons[r] == "stop" and n == lengths[r]}
        if stats:
            seg["entropy"] = ent[r, :n].tolist()
            seg["alts"] = [[(t, math.log(p)) for p, t in zip(ps, ts) if p >= args.force_abs and p >= args.force_rel * ps[0]]
                           for ps, ts in zip(top_p[r, :n].tolist(), top_ids[r, :n].tolist())]
        segs.append(seg)
    return segs


def branch_points(tree: list[dict], m: int, n: int, args: Args, rng, taken: set) -> list[tuple]:
    """Up to n legal branch points (score, j, p, candidates) of tree m, best score first.

    Legal: p inside leaf j's own segment but not its first token (pos_j < p), before its final answer (p < protect_j),
    and no branch at (j, p) yet (nor in `taken`, this round's picks). With --branch-token force, only positions where
    an untried LATR candidate exists (candidates: None when resampling).
    """
    force, cands = args.branch_token == "force", []
    for j, leaf in enumerate(tree):
        if leaf["tree"] != m:
            continue
        used = {c["pos"] for c in tree if c["parent"] == j} | {p for jj, p in taken if jj == j}
        for p in range(leaf["pos"] + 1, leaf["protect"]):
            alts = [a for a in leaf["alts"][p] if a[0] != leaf["tokens"][p]] if force else None
            if p in used or (force and not alts):
                continue
            score = {"entropy": lambda: leaf["entropy"][p], "nll": lambda: -leaf["logprobs"][p],
                     "random": rng.random}[args.branch_score]()
            cands.append((score, rng.random(), j, p, alts))
    cands.sort(key=lambda c: (c[0], c[1]), reverse=True)
    return [(c[0], c[2], c[3], c[4]) for c in cands[:n]]


class Request(NamedTuple):
    """One row of a sampling call: prompt `group`, continuing leaf `parent`'s path cut before token `pos` (parent -1,
    pos 0: a fresh chain from the prompt); the new leaf joins tree `tree` (the chain it descends from) and starts with
    `forced`, a (token, logprob) LATR candidate, or None (resampled)."""
    group: int
    parent: int
    pos: int
    tree: int
    forced: tuple | None = None

    def prefix(self, trees: list[list[dict]]) -> list[int]:
        """The completion tokens this row continues: its parent's path up to the branch point (none for a chain),
        then the forced token."""
        path = [] if self.parent < 0 else trees[self.group][self.parent]["tokens"][:self.pos]
        return path + ([self.forced[0]] if self.forced else [])


def sample_requests(sample_fn, reqs: list[Request], prefixes, budgets, prompt_lens: list[int], counts: dict,
                    eos_ids=()) -> list[dict]:
    """One sample_fn call for all requests (row i: prompt + prefixes[i], at most budgets[i] new tokens); counts the
    prefill (prompt + prefix) and the sampled tokens. A request whose forced token is EOS samples nothing: its
    segment is empty and finished."""
    live = [i for i, req in enumerate(reqs) if not (req.forced and req.forced[0] in eos_ids)]
    counts["prefill"] += sum(prompt_lens[reqs[i].group] + len(prefixes[i]) for i in live)
    segs = [{"tokens": [], "logprobs": [], "entropy": [], "alts": [], "finished": True} for _ in reqs]
    if live:
        for i, seg in zip(live, sample_fn([reqs[i].group for i in live], [prefixes[i] for i in live],
                                          [budgets[i] for i in live])):
            segs[i] = seg
    counts["sampled"] += sum(len(seg["tokens"]) for seg in segs)
    return segs


def attach(trees: list[list[dict]], req: Request, seg: dict, protect_from) -> None:
    """Add a sampled request's leaf to its tree: the parent's path up to the branch point, the forced token (with the
    parent's entropy and candidates there: the same distribution), then the new segment."""
    leaf = {k: list(seg[k]) for k in ("tokens", "logprobs", "entropy", "alts") if k in seg}
    par = trees[req.group][req.parent] if req.parent >= 0 else None
    if par is not None:
        head = {k: par[k][:req.pos + bool(req.forced)] for k in leaf}
        if req.forced:
            head["tokens"][req.pos], head["logprobs"][req.pos] = req.forced
        leaf = {k: head[k] + leaf[k] for k in leaf}
    leaf.update(finished=seg["finished"], parent=req.parent, pos=req.pos, tree=req.tree,
                depth=0 if par is None else par["depth"] + 1)
    leaf["protect"] = protect_from(leaf["tokens"])
    trees[req.group].append(leaf)


def round_requests(trees: list[list[dict]], args: Args, rng) -> list[Request]:
    """One branching round: T continuations (consecutive rows) from each of a tree's N best legal points
    (branch_points), the k-th forced to the k-th candidate while there are any, and a fresh chain for each
    continuation of a point the tree lacks (no legal point left)."""
    reqs = []
    for g, tree in enumerate(trees):
        for m in range(args.chains):
            points = branch_points(tree, m, args.branches, args, rng, set())
            reqs += [Request(g, j, p, m, ((alts or []) + [None] * args.continuations)[k])
                     for _, j, p, alts in points for k in range(args.continuations)]
            reqs += [Request(g, -1, 0, m)] * (args.continuations * (args.branches - len(points)))
    return reqs


def grow_trees(sample_fn, prompt_lens: list[int], args: Args, rng, protect_from,
               eos_ids=()) -> tuple[list[list[dict]], dict]:
    """M chains per prompt, then L rounds of N branch points x T continuations per tree, one sample_fn call each
    (--lookahead adds a window call and a replacement call): G = M (1 + L N T) leaves per prompt.

    sample_fn(groups, prefixes, budgets) -> segments (sample_segments); protect_from(tokens) -> first index of the
    final answer; prompt_lens: tokens per prompt (for the prefill count); eos_ids: the ids that end a completion (a
    forced EOS ends its branch). A leaf (parents before children): tokens, logprobs, [entropy, alts], finished, parent
    (-1 for a chain), pos (where its own segment starts), tree (its chain), depth, protect. Counts: sampled tokens
    (segment lengths, forced tokens and pruned windows), prefill tokens, branched / forced / fallback / pruned rows.
    """
    counts = dict(sampled=0, prefill=0, branched=0, forced=0, fallback=0, pruned=0, windows=0)
    trees = [[] for _ in prompt_lens]
    sample = lambda rs, prefixes, budgets: sample_requests(  # noqa: E731
        sample_fn, rs, prefixes, budgets, prompt_lens, counts, eos_ids)
    reqs = [Request(g, -1, 0, m) for g in range(len(prompt_lens)) for m in range(args.chains)]
    for r in range(args.rounds + 1):
        if r > 0:
            reqs = round_requests(trees, args, rng)
            counts["branched"] += sum(req.parent >= 0 for req in reqs)
            counts["fallback"] += sum(req.parent < 0 for req in reqs)
            counts["forced"] += sum(req.forced is not None for req in reqs)
            counts["sampled"] += sum(req.forced is not None for req in reqs)  # a forced token is a new tree token too
        if r > 0 and args.lookahead:
            reqs, segs = lookahead_prune(reqs, trees, args, rng, sample, counts)
        else:
            prefixes = [req.prefix(trees) for req in reqs]
            segs = sample(reqs, prefixes, [args.max_new_tokens - len(p) for p in prefixes])
        for req, seg in zip(reqs, segs):
            attach(trees, req, seg, protect_from)
    return trees, counts


def lookahead_prune(reqs: list[Request], trees: list[list[dict]], args: Args, rng, sample, counts: dict):
    """LATR's lookahead: draw R tokens for every new child, prune a child whose window equals its parent's at
    >= --prune-sim of the positions and give its budget to the tree's next best point (one replacement, kept
    whatever its window), then complete every child. Returns the final requests and their full segments."""
    def windows(rs):
        pres = [r.prefix(trees) for r in rs]
        return sample(rs, pres, [min(args.lookahead, args.max_new_tokens - len(p)) for p in pres])

    def similar(req, seg):  # a branched child's window against its parent's tokens after the branch token
        start = req.pos + (1 if req.forced else 0)
        theirs = trees[req.group][req.parent]["tokens"][start:start + args.lookahead]
        return sum(a == b for a, b in zip(seg["tokens"], theirs)) >= args.prune_sim * max(len(seg["tokens"]), len(theirs), 1)

    segs = windows(reqs)
    counts["windows"] += len(reqs)
    taken = {(r.group, r.parent, r.pos) for r in reqs}
    redo = []
    for i, (req, seg) in enumerate(zip(reqs, segs)):
        if req.parent < 0 or not similar(req, seg):
            continue
        g = req.group
        point = branch_points(trees[g], req.tree, 1, args, rng, {(j, p) for gg, j, p in taken if gg == g})
        if point:
            _, j, p, alts = point[0]
            taken.add((g, j, p))
            redo.append((i, Request(g, j, p, req.tree, alts[0] if alts else None)))
            counts["sampled"] += bool(alts)
    if redo:
        counts["pruned"] += len(redo)
        counts["forced"] += sum(r.forced is not None for _, r in redo) - sum(reqs[i].forced is not None for i, _ in redo)
        for (i, req), seg in zip(redo, windows([r for _, r in redo])):
            reqs[i], segs[i] = req, seg
    full = [i for i, (r, s) in enumerate(zip(reqs, segs))
            if not s["finished"] and len(r.prefix(trees)) + len(s["tokens"]) < args.max_new_tokens]
    if full:
        pres = [reqs[i].prefix(trees) + segs[i]["tokens"] for i in full]
        for i, rest in zip(full, sample([reqs[i] for i in full], pres, [args.max_new_tokens - len(p) for p in pres])):
            segs[i] = {k: segs[i][k] + rest[k] for k in segs[i] if k != "finished"} | {"finished": rest["finished"]}
    return reqs, segs


# ---- rollout and update ----
def rollout(sampler, tok, task, args: Args, rng, device) -> dict:
    """Grow one tree of G leaves for each of prompts_per_step training prompts (grow_trees); reward the leaves; GRPO's
    advantages over each prompt's leaves. The batch holds one row per leaf (group-major), as grpo.py's, plus the tree
    metrics."""
    examples = task.sample("train", args.prompts_per_step, rng)
    prompts = common.encode_prompts(tok, [e.prompt for e in examples])
    stats = args.rounds > 0 and (args.branch_score == "entropy" or args.branch_token == "force")
    sample = lambda groups, prefixes, budgets: sample_segments(  # noqa: E731
        sampler, tok, prompts, groups, prefixes, budgets, args, stats)
    pieces = _tree.token_pieces(tok)
    trees, counts = grow_trees(sample, [len(p) for p in prompts], args, rng,
                               lambda toks: _tree.answer_start(toks, pieces, args.answer_marker),
                               set(common.eos_ids(tok, sampler.model)))
    leaves = [leaf for tree in trees for leaf in tree]
    texts = tok.batch_decode([leaf["tokens"] for leaf in leaves], skip_special_tokens=True)
    answers = [e.answer for e in examples for _ in range(args.group_size)]
    rewards = torch.tensor([task.verify(t, a)[0] for t, a in zip(texts, answers)], device=device)
    batch = _tree.leaf_batch(trees, prompts, tok.pad_token_id, device)
    batch.update(rewards=rewards, adv=group_advantages(rewards, args.group_size, args.adv_std_norm),
                 finish_reasons=["stop" if l["finished"] else "length" for l in leaves],
                 tree=_tree.tree_metrics(trees, texts, rewards, counts, args))
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
    run.start(model, tok, opt, sampler)  # resume from --resume, then the step-0 held-out evaluation
    for step, rng in run.steps():  # every random draw of a step depends on (seed, step, rank) only
        with run.timer("gen"):
            batch = rollout(sampler, tok, run.task, args, rng, run.accel.device)
        with run.timer("train"):  # includes the sampler's refresh after each optimiser step
            stats = update(model, opt, batch, loss_fn, args, step, run.accel, sampler, ref_model, fused_logprob)
        sampled = batch["tree"]["rollout/sampled_tokens"]  # generated tokens: the tree's, not G full completions
        run.gen_tokens += sampled - int(batch["completion_mask"].sum())  # log_step adds the leaves' tokens
        run.log_step(step, batch, {**batch["tree"], **stats},  # rollout metrics, evaluation, checkpoints
                     extra={"rollout/tokens_per_s": sampled / max(run.timer.totals["gen"], 1e-9)})
    tree = _tree.tree_summary(run.history) if run.is_main else {}
    if run.is_main:
        print(f"token-savings {tree['token_savings']:.2f}x ({tree['sampled_tokens']:.0f} sampled tokens)")
    return run.finish("tree GRPO", extra=tree)


if __name__ == "__main__":
    main(tyro.cli(Args))
