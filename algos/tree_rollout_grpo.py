"""Tree rollouts for GRPO: one tree of G leaves per prompt instead of G independent samples (TreeRL, TreePO).

Papers: Hou et al., "TreeRL: LLM Reinforcement Learning with On-Policy Tree Search", arXiv:2506.11902 (EPTree:
M chains, then L rounds that branch N times per tree at the most uncertain tokens with T continuations each); Li et
al., "TreePO: Bridging the Gap of Policy Optimization and Efficacy and Inference Efficiency with Heuristic Tree-based
Modeling", arXiv:2508.17445 (segment trees whose leaves share their prefixes). The tree samples fewer tokens than G
independent completions (token-savings); GRPO's group is the G leaves. Children, one idea each: tree_rollout_adv.py
(TreeRL's segment and TreePO's subgroup advantages), tree_rollout_latr.py (LATR's forced tokens and lookahead
pruning), tree_rollout_alloc.py (branch points allocated by p(1 - p)), tree_rollout_shared.py (each shared tree
token trained once, under tree attention), all in algos/. Their shared plumbing (where the final answer starts, the
next-token statistics, the leaf batch, run totals) is algos/_tree.py.

Parent: algos/grpo.py; changed: Args, Args.digits, Args.group_size, Args.max_new_tokens, Args.model,
  Args.prompts_per_step, Args.steps, Args.task, Args.threads, check_args, rollout, main.

Equations (each implemented by the function named on the right):
  tree growth   per prompt: M chains (one batched call), then L rounds; in each round every tree picks N branch
                points (j, p) = (leaf segment, position) and draws T continuations from prompt + prefix y_j[:p] (one
                batched call for the whole batch): G = M (1 + L N T) leaves     grow_trees, round_requests, attach
  branch point  the highest score: entropy H(pi(. | q, y_<p)) of the next-token distribution (EPTree), the sampled
                token's NLL -log pi(y_p | q, y_<p), or random; never at a segment's first token (p > start of j),
                never at or after the last answer marker of the leaf (the final answer), never twice at one prefix;
                a tree with no legal point left samples a fresh chain instead (rollout/fallback_frac)  branch_points
  branch token  resampled y'_p ~ pi(. | q, y_<p): every leaf is a sample of pi when the points do not depend on the
                tokens (the random score; a test checks the leaf marginals)                    sample_segments
  advantage     GRPO's A_i over the G leaves of a prompt; one sequence per leaf in grpo.py's update
                                                                                       group_advantages, update
  accounting    sampled tokens = sum of segment lengths; token_savings = sum of leaf lengths (what G independent
                completions of the same lengths would sample) / sampled tokens                _tree.tree_metrics
  clipped surrogate, k3 KL and --loss-agg aggregation: grpo.py's (clipped_pg_loss, k3_kl, aggregate_loss, grpo_loss)

Deviations from the papers:
- Branch points are tokens, not reasoning steps; EPTree's top-N entropy per tree is kept, TreePO's fixed-length
  segments and its fallback heuristics are not.
- A round's continuations come from one `generate` call with the round's largest budget; each row is cut at its
  own budget (max_new_tokens - prefix length), and tokens cut that way are not counted as sampled (an engine with
  per-request budgets, such as vLLM, does not produce them).
- Entropy scores need the full next-token distribution, which common.generate does not return: one no-grad forward
  over each new segment computes them (on the copy the sampler decodes with; the trainer under vLLM), chunk by chunk
  over positions (_tree.next_token_stats).
- --threads defaults to 1 (grpo.py: 2): on a shared 2-core machine two 2-thread jobs oversubscribe the cores and
  this script's many small generate calls slowed from about 4 s to 20-30 s per step.
- grpo.py's other deviations hold (KL off by default, sample std, pi_old handling, the truncated importance weight
  per token when the sampler is not the trainer's computation, FSDP2 with several processes).

Commands:
  python algos/tree_rollout_grpo.py                             # long-response task (tiny-sums, sums), G = 4 x (1 + 3)
  python algos/tree_rollout_grpo.py --rounds 0 --chains 16      # no branching: GRPO with G = 16
  python algos/tree_rollout_grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --engine vllm --device cuda \
      --max-new-tokens 512 --answer-marker "####" --lr 1e-6                              # one GPU
  accelerate launch --num_processes 4 algos/tree_rollout_grpo.py --model ... --device cuda  # several GPUs
Expected: the default (16 prompts x 16 leaves, 50 steps) lifts held-out greedy accuracy 49.4 -> 61.4% (+12.0 points)
in 139 s on the shared 2-core machine, sampling 1.70x fewer tokens than 16 independent completions (token_savings);
see the tree_rollout_grpo row of benchmarks/results/defaults.md. Against GRPO at G = 16 (benchmarks/results/
tree_rollout.md, 3 seeds of 8 prompts x 25 steps) the trees sample 1.71x fewer tokens per step but did not learn
faster: the accuracy differences are within the seed noise, and GRPO reached +5 points first. On the claims plan's
paired fresh run (14 seeds, 40-53), over the first 60,000 sampled tokens the trees' mean held-out accuracy was 47.6%
against GRPO's 49.5%, -1.9 [-3.1, -0.7] seed by seed: at equal tokens here they learn slower, not faster.
"""
from __future__ import annotations

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
    entropy at every position, from the module the sampler decodes with (the trainer itself on CPU; the trainer
    when an engine such as vLLM samples).
    """
    ro = common.generate(sampler, tok, [prompts[g] + p for g, p in zip(groups, prefixes)], 1, max(budgets),
                         args.temperature, args.top_p)
    lengths = ro.completion_mask.sum(1).tolist()
    if stats:
        scorer = sampler.model if sampler.engine is not None else sampler.module()
        ent, _, _ = _tree.next_token_stats(scorer, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                                           ro.completion_mask, args.temperature)
    segs = []
    for r, budget in enumerate(budgets):
        n = min(lengths[r], budget)
        seg = {"tokens": ro.completion_ids[r, :n].tolist(), "logprobs": ro.logprobs[r, :n].tolist(),
               "finished": ro.finish_reasons[r] == "stop" and n == lengths[r]}
        if stats:
            seg["entropy"] = ent[r, :n].tolist()
        segs.append(seg)
    return segs


def branch_points(tree: list[dict], m: int, n: int, args: Args, rng, taken: set) -> list[tuple]:
    """Up to n legal branch points (score, j, p) of tree m, best score first.

    Legal: p inside leaf j's own segment but not its first token (pos_j < p), before its final answer (p < protect_j),
    and no branch at (j, p) yet (nor in `taken`, this round's picks).
    """
    cands = []
    for j, leaf in enumerate(tree):
        if leaf["tree"] != m:
            continue
        used = {c["pos"] for c in tree if c["parent"] == j} | {p for jj, p in taken if jj == j}
        for p in range(leaf["pos"] + 1, leaf["protect"]):
            if p in used:
                continue
            score = {"entropy": lambda: leaf["entropy"][p], "nll": lambda: -leaf["logprobs"][p],
                     "random": rng.random}[args.branch_score]()
            cands.append((score, rng.random(), j, p))
    cands.sort(key=lambda c: (c[0], c[1]), reverse=True)
    return [(c[0], c[2], c[3]) for c in cands[:n]]


class Request(NamedTuple):
    """One row of a sampling call: prompt `group`, continuing leaf `parent`'s path cut before token `pos` (parent -1,
    pos 0: a fresh chain from the prompt); the new leaf joins tree `tree` (the chain it descends from)."""
    group: int
    parent: int
    pos: int
    tree: int

    def prefix(self, trees: list[list[dict]]) -> list[int]:
        """The completion tokens this row continues: its parent's path up to the branch point (none for a chain)."""
        return [] if self.parent < 0 else trees[self.group][self.parent]["tokens"][:self.pos]


def sample_requests(sample_fn, reqs: list[Request], prefixes, budgets, prompt_lens: list[int],
                    counts: dict) -> list[dict]:
    """One sample_fn call for all requests (row i: prompt + prefixes[i], at most budgets[i] new tokens); counts the
    prefill (prompt + prefix) and the sampled tokens."""
    counts["prefill"] += sum(prompt_lens[req.group] + len(p) for req, p in zip(reqs, prefixes))
    segs = sample_fn([req.group for req in reqs], prefixes, budgets)
    counts["sampled"] += sum(len(seg["tokens"]) for seg in segs)
    return segs


def attach(trees: list[list[dict]], req: Request, seg: dict, protect_from) -> None:
    """Add a sampled request's leaf to its tree: the parent's path up to the branch point, then the new segment."""
    leaf = {k: list(seg[k]) for k in ("tokens", "logprobs", "entropy") if k in seg}
    par = trees[req.group][req.parent] if req.parent >= 0 else None
    if par is not None:
        leaf = {k: par[k][:req.pos] + leaf[k] for k in leaf}
    leaf.update(finished=seg["finished"], parent=req.parent, pos=req.pos, tree=req.tree,
                depth=0 if par is None else par["depth"] + 1)
    leaf["protect"] = protect_from(leaf["tokens"])
    trees[req.group].append(leaf)


def round_requests(trees: list[list[dict]], args: Args, rng) -> list[Request]:
    """One branching round: T continuations (consecutive rows) from each of a tree's N best legal points
    (branch_points), and a fresh chain for each continuation of a point the tree lacks (no legal point left)."""
    reqs = []
    for g, tree in enumerate(trees):
        for m in range(args.chains):
            points = branch_points(tree, m, args.branches, args, rng, set())
            reqs += [Request(g, j, p, m) for _, j, p in points for _ in range(args.continuations)]
            reqs += [Request(g, -1, 0, m)] * (args.continuations * (args.branches - len(points)))
    return reqs


def grow_trees(sample_fn, prompt_lens: list[int], args: Args, rng, protect_from) -> tuple[list[list[dict]], dict]:
    """M chains per prompt, then L rounds of N branch points x T continuations per tree, one sample_fn call each:
    G = M (1 + L N T) leaves per prompt.

    sample_fn(groups, prefixes, budgets) -> segments (sample_segments); protect_from(tokens) -> first index of the
    final answer; prompt_lens: tokens per prompt (for the prefill count). A leaf (parents before children): tokens,
    logprobs, [entropy], finished, parent (-1 for a chain), pos (where its own segment starts), tree (its chain),
    depth, protect. Counts: sampled tokens (the sum of segment lengths), prefill tokens, branched / fallback rows.
    """
    counts = dict(sampled=0, prefill=0, branched=0, fallback=0)
    trees = [[] for _ in prompt_lens]
    reqs = [Request(g, -1, 0, m) for g in range(len(prompt_lens)) for m in range(args.chains)]
    for r in range(args.rounds + 1):
        if r > 0:
            reqs = round_requests(trees, args, rng)
            counts["branched"] += sum(req.parent >= 0 for req in reqs)
            counts["fallback"] += sum(req.parent < 0 for req in reqs)
        prefixes = [req.prefix(trees) for req in reqs]
        budgets = [args.max_new_tokens - len(p) for p in prefixes]
        for req, seg in zip(reqs, sample_requests(sample_fn, reqs, prefixes, budgets, prompt_lens, counts)):
            attach(trees, req, seg, protect_from)
    return trees, counts


# ---- rollout and update ----
def rollout(sampler, tok, task, args: Args, rng, device) -> dict:
    """Grow one tree of G leaves for each of prompts_per_step training prompts (grow_trees); reward the leaves; GRPO's
    advantages over each prompt's leaves. The batch holds one row per leaf (group-major), as grpo.py's, plus the tree
    metrics."""
    examples = task.sample("train", args.prompts_per_step, rng)
    prompts = common.encode_prompts(tok, [e.prompt for e in examples])
    stats = args.rounds > 0 and args.branch_score == "entropy"
    sample = lambda groups, prefixes, budgets: sample_segments(  # noqa: E731
        sampler, tok, prompts, groups, prefixes, budgets, args, stats)
    pieces = _tree.token_pieces(tok)
    trees, counts = grow_trees(sample, [len(p) for p in prompts], args, rng,
                               lambda toks: _tree.answer_start(toks, pieces, args.answer_marker))
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
