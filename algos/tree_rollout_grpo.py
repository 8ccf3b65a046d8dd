"""Tree rollouts for GRPO: one tree of G leaves per prompt instead of G independent samples (TreeRL, TreePO, LATR).

Papers: Hou et al., "TreeRL: LLM Reinforcement Learning with On-Policy Tree Search", arXiv:2506.11902 (EPTree:
M chains, then L rounds that branch N times per tree at the most uncertain tokens with T continuations each; node
values from the leaves give segment advantages); Li et al., "TreePO: Bridging the Gap of Policy Optimization and
Efficacy and Inference Efficiency with Heuristic Tree-based Modeling", arXiv:2508.17445 (advantages against the
means of the ancestor subgroups); Xing et al., "Lookahead Tree-Based Rollouts for Enhanced Trajectory-Level
Exploration in Reinforcement Learning with Verifiable Rewards" (LATR), arXiv:2510.24302 (force a different candidate
token at uncertain steps, simulate a few tokens ahead, prune branches that stay similar; the abstract reports 131%
faster policy learning and +4.2% final pass@1 over stochastic sampling). Leaves share their prefixes,
so the tree samples fewer tokens than G independent completions (token-savings), and a node's leaves compare
continuations of one prefix.

Parent: algos/grpo.py; changed: Args, Args.adv_std_norm, Args.digits, Args.exp_name, Args.group_size,
  Args.max_new_tokens, Args.model, Args.prompts_per_step, Args.steps, Args.task, Args.threads, check_args, rollout,
  main.

Equations (each implemented by the function named on the right):
  tree growth       per prompt: M chains (one batched call), then L rounds; in each round every tree picks N
                    branch points (j, p) = (leaf segment, position) by a score and draws T continuations from
                    prompt + prefix y_j[:p] (one batched call for the whole batch), G = M (1 + L N T)    grow_trees
                    score: entropy H(pi(. | q, y_<p)) of the next-token distribution (EPTree), the sampled token's
                    NLL -log pi(y_p | q, y_<p), or random                                       branch_points
                    branch token: resampled y'_p ~ pi(. | q, y_<p) (on-policy: every leaf is a sample of pi when
                    the points do not depend on the tokens), or --branch-token force: the most likely untried
                    token c with pi(c) >= --force-abs and pi(c) >= --force-rel * max pi (LATR; off-policy)
                    rules: never at a segment's first token (p > start of j), never at or after the last answer
                    marker of the leaf (the final answer), never twice at one prefix; a tree with no legal point
                    left samples a fresh chain instead (rollout/fallback_frac)
                    allocation (--allocation pq, TRACE-style): a round's M N points of a group go to its trees in
                    proportion to p_m (1 - p_m), p_m = mean reward of tree m's leaves so far (largest remainders,
                    capped by the legal points; all-certain trees share them evenly)          allocate_branches
                    lookahead (--lookahead R, LATR): a child whose first R tokens after the branch token match the
                    parent's at >= --prune-sim of the positions is pruned and its budget goes to the next point
  leaf advantage    --adv leaf: GRPO's A_i over the G leaves (group_advantages);  --adv loo: A_i = r_i - mean_{j!=i} r_j
                                                                                          loo_advantages
  node value        a node = a maximal run of tokens shared by the same set of leaves L(s); V(s) = mean_{l in L(s)} r_l,
                    V(root) = mean of all G leaves                                               tree_nodes
  TreeRL            segment advantage A(s) = [V(s) - V_out(s)] + [V(s) - V(parent(s))] (global + local), divided by
                    sqrt(|L(s)|) with --sqrt-weight; V_out(s) = mean over the leaves outside L(s) (leave-one-out:
                    for a leaf, the other G - 1 leaves); every token of s gets A(s)                treerl_advantages
  TreePO            A_i = mean over the distinct ancestor subgroups S of leaf i (the root and every shared node,
                    |L(S)| >= 2) of (r_i - V(S)), then whitened over the group: (A - mean A) / (std A + eps)
                                                                                        treepo_advantages
  training          --train leaf: one sequence per leaf, grpo.py's update with per-token advantages   tree_loss
                    --train shared: every tree token once (tree attention over the packed tree), weighted by the
                    leaves through it: sum_l w_l l(rho_t, A_lt) = P_t l(rho_t, +1) + N_t l(rho_t, -1) with
                    P_t = sum_l w_l max(A_lt, 0), N_t = sum_l w_l max(-A_lt, 0), w_l = the leaf's share of the
                    aggregation (1 / (N_seq |o_l|) for seq-mean): the same loss and gradient with fewer forward
                    tokens                                      pack_trees, packed_logprobs, shared_token_loss, update_shared
  accounting        sampled tokens = sum of segment lengths; token_savings = sum of leaf lengths (what G independent
                    completions of the same lengths would sample) / sampled tokens                  tree_metrics
  clipped surrogate, k3 KL and --loss-agg aggregation: grpo.py's (clipped_pg_loss, k3_kl, aggregate_loss, grpo_loss)

Deviations from the papers:
- Branch points are tokens, not reasoning steps; EPTree's top-N entropy per tree is kept, TreePO's fixed-length
  segments and its fallback heuristics are not. Node values use the leaves of one prompt's trees only.
- TreeRL's global advantage compares with V(root); here with the leaves outside the node (leave-one-out), so the
  leaf-level global terms sum to zero and a leaf is not its own baseline.
- All continuations of a round come from one batched `generate` call with the largest budget of the round; each
  row is cut at its own budget (max_new_tokens - prefix length). Tokens cut that way are not counted as sampled
  (an engine with per-request budgets, such as vLLM, does not produce them).
- Entropy scores and LATR candidates need the full next-token distribution, which common.generate does not return:
  one no-grad forward over each new segment computes them, chunk by chunk over positions (next_token_stats); the NLL
  and random scores need none. A forced candidate that is EOS ends its branch (the child is its prefix + EOS).
- --train shared hands the tree mask to attention as an additive float mask (0 / -inf, tree_attention_mask), which
  eager and SDPA both apply; flash-attention kernels take no 4-D mask and are refused with a message.
- LATR's similarity is an edit distance over the lookahead window; here the share of equal tokens position by
  position. Forced tokens and pruning make the leaves off-policy: rollout/forced_frac and rollout/pruned_frac say
  how much; the loss treats them as samples of pi.
- TRACE-style allocation splits a group's branch points over its M trees (the subtrees of the root), not over
  every node; p is the tree's mean leaf reward so far, so in the first round (one leaf per tree, p in {0, 1}) it
  is even: the flag acts from --rounds 2 on. Leaves are rewarded during growth for it (the same verifier).
- --threads defaults to 1 (grpo.py: 2): on a shared 2-core machine two 2-thread jobs oversubscribe the cores and
  this script's many small generate calls slowed from about 4 s to 20-30 s per step.
- grpo.py's other deviations hold (KL off by default, sample std, pi_old handling, FSDP2 with several processes).

Commands:
  python algos/tree_rollout_grpo.py                             # long-response task (tiny-sums, sums), G = 4 x (1 + 3)
  python algos/tree_rollout_grpo.py --adv treerl                # TreeRL's segment advantages
  python algos/tree_rollout_grpo.py --adv treepo --train shared # TreePO advantages, each shared token trained once
  python algos/tree_rollout_grpo.py --branch-token force --lookahead 4   # LATR: forced candidates + pruning
  python algos/tree_rollout_grpo.py --rounds 0 --chains 16      # no branching: GRPO with G = 16
  python algos/tree_rollout_grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --engine vllm --device cuda \
      --max-new-tokens 512 --answer-marker "####" --lr 1e-6                              # one GPU
  accelerate launch --num_processes 4 algos/tree_rollout_grpo.py --model ... --device cuda  # several GPUs
Expected: the default (16 prompts x 16 leaves, 50 steps) lifts held-out greedy accuracy 49.4 -> 61.4% (+12.0 points)
in 139 s on the shared 2-core machine, sampling 1.70x fewer tokens than 16 independent completions (token_savings);
see the tree_rollout_grpo row of benchmarks/results/defaults.md. Against GRPO at G = 16 (benchmarks/results/
tree_rollout.md, 3 seeds of 8 prompts x 25 steps) the trees sample 1.71x fewer tokens per step, but neither they nor
LATR learned faster here: the differences in accuracy are within the seed noise, and GRPO reached +5 points first.
"""
from __future__ import annotations

import bisect
import copy
import functools
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
from algos._vllm import VLLMEngine


@dataclass
class Args:
    # bookkeeping
    exp_name: str = "tree_rollout_grpo"
    """name of the run (the output folder is out_dir/exp_name)"""
    seed: int = 0
    """random seed: prompts and sampling of step s depend only on (seed, s, rank), which makes resume exact"""
    track: bool = False
    """log to Weights & Biases as well (WANDB_MODE=offline works without network)"""
    out_dir: str = "runs"
    """where metrics.jsonl, summary.json, the curve and checkpoints go"""
    # model and task
    model: str = "tiny-sums"
    """tiny-0.6m, tiny-5m, smollm2-135m, a Hugging Face id or a local path"""
    task: str = "sums"
    """sums (5 operands with running totals), sums<N>, add, addsteps, jsonl:PATH (prompt/answer records) or gsm8k"""
    digits: int = 1
    """operand digits of the arithmetic tasks (training and the main held-out eval)"""
    device: str = "auto"
    """auto (CUDA if present), cpu or cuda"""
    threads: int = 1
    """torch CPU threads per process (1: generation here is per-call overhead; 2 threads gain little and slow ~10x
    when another 2-thread job shares the 2 cores)"""
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """compute dtype: auto = bf16 autocast on CUDA (fp32 weights, optimiser, log-softmax and losses), fp32 on CPU"""
    # rollout
    engine: Literal["hf", "vllm"] = "hf"
    """rollout engine: Hugging Face generate (CPU or GPU) or vLLM (GPU)"""
    vllm_gpu_memory: float = 0.3
    """fraction of GPU memory vLLM may take (the trainer shares the GPU)"""
    prompts_per_step: int = 16
    """distinct prompts per rollout batch (per process)"""
    group_size: int = 16
    """G, leaves per prompt: must equal chains * (1 + rounds * branches * continuations)"""
    max_new_tokens: int = 48
    """generation budget per completion"""
    temperature: float = 1.0
    """sampling temperature (the trainer scores with the same temperature)"""
    top_p: float = 1.0
    """nucleus sampling threshold"""
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
    branch_token: Literal["resample", "force"] = "resample"
    """branch token: resampled from the policy (on-policy), or forced to an untried candidate (LATR, off-policy)"""
    allocation: Literal["even", "pq"] = "even"
    """branch points per tree in a round: N each (even), or the group's M N split in proportion to p(1 - p) of each
    tree's success rate so far (TRACE-style; with --rounds >= 2, after the first round)"""
    force_abs: float = 0.05
    """LATR: a forced candidate needs probability >= this"""
    force_rel: float = 0.1
    """LATR: ... and probability >= this times the most likely token's"""
    lookahead: int = 0
    """LATR: tokens simulated after the branch token before pruning (0 = no pruning)"""
    prune_sim: float = 0.75
    """LATR: prune a child whose lookahead window equals its parent's at this share of positions or more"""
    answer_marker: str = "="
    """the final answer starts at the last token containing this string (no branching there or after it)"""
    # objective
    adv: Literal["leaf", "loo", "treerl", "treepo"] = "leaf"
    """advantage: GRPO over leaves, leave-one-out over leaves, TreeRL segment advantages, TreePO subgroup means"""
    sqrt_weight: bool = True
    """TreeRL: divide a segment's advantage by sqrt(number of leaves through it)"""
    train: Literal["leaf", "shared"] = "leaf"
    """leaf: one sequence per leaf; shared: each tree token once (tree attention), weighted by its leaves"""
    adv_std_norm: bool = True
    """divide the group-centred reward by the group std (GRPO; --adv leaf); off = Dr. GRPO"""
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
    steps: int = 50
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
    units = args.prompts_per_step * (args.group_size if args.train == "leaf" else 1)
    if units % args.minibatches:
        raise SystemExit(f"--minibatches {args.minibatches} must divide the rollout batch ({units} "
                         f"{'sequences' if args.train == 'leaf' else 'trees: --train shared splits by prompt'})")
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
@torch.no_grad()
def next_token_stats(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature: float, k: int,
                     chunk_mb: float | None = None):
    """Entropy [B, C] and the k most likely tokens (probs, ids [B, C, k]) of the distribution each token was drawn
    from. One decoder forward under the training autocast, then the lm_head and log-softmax over chunks of positions
    whose fp32 logits take about chunk_mb MiB (common.LOGPROB_CHUNK_MB by default; as common.token_logprobs): no
    [B, C, V] tensor is built."""
    dev = next(model.parameters()).device
    ids = torch.cat([prompt_ids, completion_ids], 1).to(dev)
    mask = torch.cat([prompt_mask, completion_mask], 1).to(dev)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    P, (B, C), head = prompt_ids.shape[1], completion_ids.shape, model.get_output_embeddings()
    step = common.chunk_positions(head.weight.shape[0], chunk_mb)
    ent, probs, top_ids = [], [], []
    with common.autocast(model):
        h = common.decoder_hidden(model, ids, mask, pos)[:, P - 1:-1].reshape(B * C, -1)
        for s in range(0, B * C, step):
            logp = torch.log_softmax(head(h[s:s + step]).float() / temperature, -1)
            top = logp.topk(min(k, logp.shape[-1]), -1)
            ent.append(-(logp.exp() * logp).sum(-1))
            probs.append(top.values.exp())
            top_ids.append(top.indices)
    return torch.cat(ent).view(B, C), torch.cat(probs).view(B, C, -1), torch.cat(top_ids).view(B, C, -1)


def sample_segments(model, tok, prompts, groups, prefixes, budgets, args: Args, engine=None, stats=False) -> list[dict]:
    """One batched generate call from prompt + prefix for every row; row r is cut at its own budget budgets[r].

    Returns per row a segment: tokens, behaviour logprobs, finished (EOS inside the budget) and, with stats, the
    entropy and the LATR candidates [(token, logprob)] passing --force-abs / --force-rel at every position.
    """
    ro = common.generate(model, tok, [prompts[g] + p for g, p in zip(groups, prefixes)], 1, max(budgets),
                         args.temperature, args.top_p, engine=engine)
    lengths = ro.completion_mask.sum(1).tolist()
    if stats:
        ent, top_p, top_ids = next_token_stats(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
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


@functools.lru_cache(maxsize=4)
def token_pieces(tok) -> list[str]:
    """The text of every vocabulary id alone (special tokens: empty)."""
    return tok.batch_decode([[i] for i in range(len(tok))], skip_special_tokens=True)


def answer_start(tokens: list[int], pieces: list[str], marker: str) -> int:
    """Index of the token holding the start of the last `marker` (the final answer); 0 when there is none."""
    text = "".join(pieces[t] for t in tokens)
    at, n = text.rfind(marker), 0
    if at < 0:
        return 0
    for i, t in enumerate(tokens):
        n += len(pieces[t])
        if n > at:
            return i
    return len(tokens)


def branch_points(tree: list[dict], m: int, n: int, args: Args, rng, taken: set) -> list[tuple]:
    """Up to n legal branch points (score, j, p, candidates) of tree m, best score first.

    Legal: p inside leaf j's own segment but not its first token (pos_j < p), before its final answer (p < protect_j),
    and no branch at (j, p) yet (nor in `taken`, this round's picks). With --branch-token force, only positions where
    an untried LATR candidate exists.
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


def allocate_branches(success: list[float], budget: int, caps: list[int]) -> list[int]:
    """Split `budget` branch points over trees in proportion to p (1 - p) of their success rates (largest
    remainders, ties to the lower index), each tree at most its legal points `caps`; when every p is 0 or 1,
    evenly. What a capped tree cannot take goes to the others by the same rule."""
    alloc, left = [0] * len(success), budget
    while left > 0:
        open_ = [m for m in range(len(success)) if alloc[m] < caps[m]]
        if not open_:
            break
        w = {m: success[m] * (1 - success[m]) for m in open_}
        if sum(w.values()) <= 0:
            w = {m: 1.0 for m in open_}
        total = sum(w.values())
        share = {m: left * w[m] / total for m in open_}
        give = {m: min(int(share[m]), caps[m] - alloc[m]) for m in open_}
        rest = left - sum(give.values())
        for m in sorted(open_, key=lambda m: -(share[m] - int(share[m]))):
            if rest > 0 and give[m] < caps[m] - alloc[m] and w[m] > 0:
                give[m], rest = give[m] + 1, rest - 1
        if not any(give.values()):
            break
        for m in open_:
            alloc[m] += give[m]
        left -= sum(give.values())
    return alloc


def grow_trees(sample_fn, prompt_lens: list[int], args: Args, rng, protect_from,
               reward_fn=None, eos_ids=()) -> tuple[list[list[dict]], dict]:
    """M chains per prompt, then L rounds of N branch points x T continuations per tree (one sample_fn call per
    round; --lookahead adds a window call and a replacement call). G = M (1 + L N T) leaves per prompt.

    sample_fn(groups, prefixes, budgets) -> segments (see sample_segments); protect_from(tokens) -> first index of
    the final answer; prompt_lens: tokens per prompt (for the prefill count); reward_fn(group, tokens) -> reward,
    needed by --allocation pq only; eos_ids: the ids that end a completion (a forced EOS ends its branch: the
    child is its prefix and the EOS, finished, and nothing is sampled after it).
    A leaf (parents before children): tokens, logprobs, [entropy, alts], finished, parent (-1 for a
    chain), pos (where its own segment starts), tree (its chain), depth, protect. Counts: sampled tokens (= sum of
    segment lengths, plus pruned windows), prefill tokens, branched / forced / fallback / pruned rows.
    """
    counts = dict(sampled=0, prefill=0, branched=0, forced=0, fallback=0, pruned=0, windows=0)
    n_groups = len(prompt_lens)
    trees = [[] for _ in range(n_groups)]

    def prefix(req):  # req = (group, parent leaf or -1, position, forced (token, logprob) or None, tree)
        g, j, p, forced, _ = req
        return ([] if j < 0 else trees[g][j]["tokens"][:p]) + ([forced[0]] if forced else [])

    def sample(reqs, prefixes, budgets):
        live = [i for i, r in enumerate(reqs) if not (r[3] and r[3][0] in eos_ids)]  # a forced EOS samples nothing
        counts["prefill"] += sum(prompt_lens[reqs[i][0]] + len(prefixes[i]) for i in live)
        segs = [{"tokens": [], "logprobs": [], "entropy": [], "alts": [], "finished": True} for _ in reqs]
        if live:
            for i, seg in zip(live, sample_fn([reqs[i][0] for i in live], [prefixes[i] for i in live],
                                              [budgets[i] for i in live])):
                segs[i] = seg
        counts["sampled"] += sum(len(s["tokens"]) for s in segs)
        return segs

    def attach(req, seg):
        g, j, p, forced, m = req
        leaf = {k: list(seg[k]) for k in ("tokens", "logprobs", "entropy", "alts") if k in seg}
        if j >= 0:
            par = trees[g][j]
            head = {k: par[k][:p] + ([par[k][p]] if forced else []) for k in leaf}
            if forced:
                head["tokens"][p], head["logprobs"][p] = forced
            leaf = {k: head[k] + leaf[k] for k in leaf}
        leaf.update(finished=seg["finished"], parent=j, pos=p, tree=m, depth=0 if j < 0 else trees[g][j]["depth"] + 1)
        leaf["protect"] = protect_from(leaf["tokens"])
        trees[g].append(leaf)

    reqs = [(g, -1, 0, None, m) for g in range(n_groups) for m in range(args.chains)]
    for req, seg in zip(reqs, sample(reqs, [[]] * len(reqs), [args.max_new_tokens] * len(reqs))):
        attach(req, seg)
    for _ in range(args.rounds):
        reqs = []
        for g, tree in enumerate(trees):
            if args.allocation == "pq":  # rank every legal point once; each tree takes its allocated prefix
                for leaf in tree:
                    if "reward" not in leaf:
                        leaf["reward"] = reward_fn(g, leaf["tokens"])
                success = [float(np.mean([l["reward"] for l in tree if l["tree"] == m])) for m in range(args.chains)]
                ranked = [branch_points(tree, m, 10**9, args, rng, set()) for m in range(args.chains)]
                caps = [len(r) for r in ranked]
                per_tree = allocate_branches(success, args.chains * args.branches, caps)
            for m in range(args.chains):
                points = ranked[m][:per_tree[m]] if args.allocation == "pq" else \
                    branch_points(tree, m, args.branches, args, rng, set())
                for _, j, p, alts in points:
                    forced = (alts or []) + [None] * args.continuations
                    reqs += [(g, j, p, forced[k], m) for k in range(args.continuations)]
                reqs += [(g, -1, 0, None, m)] * (args.continuations * (args.branches - len(points)))
            if args.allocation == "pq":  # the group's points sum to M N; only what no tree could take is a fresh chain
                reqs = [r for r in reqs if not (r[0] == g and r[1] < 0)]
                short = args.chains * args.branches - sum(min(n, c) for n, c in zip(per_tree, caps))
                reqs += [(g, -1, 0, None, k % args.chains) for k in range(args.continuations * short)]
        counts["branched"] += sum(r[1] >= 0 for r in reqs)
        counts["forced"] += sum(r[3] is not None for r in reqs)
        counts["sampled"] += sum(r[3] is not None for r in reqs)  # a forced token is a new tree token too
        counts["fallback"] += sum(r[1] < 0 for r in reqs)
        if args.lookahead:
            reqs, segs = lookahead_prune(reqs, trees, args, rng, prefix, sample, counts)
        else:
            pres = [prefix(r) for r in reqs]
            segs = sample(reqs, pres, [args.max_new_tokens - len(p) for p in pres])
        for req, seg in zip(reqs, segs):
            attach(req, seg)
    return trees, counts


def lookahead_prune(reqs, trees, args: Args, rng, prefix, sample, counts):
    """LATR's lookahead: draw R tokens for every new child, prune a child whose window equals its parent's at
    >= --prune-sim of the positions and give its budget to the tree's next best point (one replacement, kept
    whatever its window), then complete every child. Returns the final requests and their full segments."""
    def windows(rs):
        pres = [prefix(r) for r in rs]
        return sample(rs, pres, [min(args.lookahead, args.max_new_tokens - len(p)) for p in pres])

    def similar(req, seg):
        g, j, p, forced, _ = req
        if j < 0:
            return False
        start = p + (1 if forced else 0)
        theirs = trees[g][j]["tokens"][start:start + args.lookahead]
        return sum(a == b for a, b in zip(seg["tokens"], theirs)) >= args.prune_sim * max(len(seg["tokens"]), len(theirs), 1)

    segs = windows(reqs)
    counts["windows"] += len(reqs)
    taken = {(r[0], r[1], r[2]) for r in reqs}
    redo = []
    for i, (req, seg) in enumerate(zip(reqs, segs)):
        if not similar(req, seg):
            continue
        g, m = req[0], req[4]
        point = branch_points(trees[g], m, 1, args, rng, {(j, p) for gg, j, p in taken if gg == g})
        if point:
            _, j, p, alts = point[0]
            taken.add((g, j, p))
            redo.append((i, (g, j, p, alts[0] if alts else None, m)))
            counts["sampled"] += bool(alts)
    if redo:
        counts["pruned"] += len(redo)
        counts["forced"] += sum(r[3] is not None for _, r in redo) - sum(reqs[i][3] is not None for i, _ in redo)
        for (i, req), seg in zip(redo, windows([r for _, r in redo])):
            reqs[i], segs[i] = req, seg
    # complete the children whose window neither ended nor used up the budget
    full = [i for i, (r, s) in enumerate(zip(reqs, segs))
            if not s["finished"] and len(prefix(r)) + len(s["tokens"]) < args.max_new_tokens]
    if full:
        pres = [prefix(reqs[i]) + segs[i]["tokens"] for i in full]
        for i, rest in zip(full, sample([reqs[i] for i in full], pres, [args.max_new_tokens - len(p) for p in pres])):
            segs[i] = {k: segs[i][k] + rest[k] for k in segs[i] if k != "finished"} | {"finished": rest["finished"]}
    return reqs, segs


# ---- the idea: tree advantages ----
def token_owner(parents: list[int], starts: list[int], i: int, t: int) -> int:
    """The leaf whose own segment holds token t of leaf i's path (walk up while t is before the segment's start)."""
    while t < starts[i]:
        i = parents[i]
    return i


def tree_nodes(parents: list[int], starts: list[int], lengths: list[int]):
    """One prompt's tree as nodes: maximal runs of tokens shared by the same set of leaves.

    A leaf's own segment [start, length) is cut wherever a child branches off it. Returns node_of (per leaf, the node
    of each of its tokens), node_parent [K] (-1: the prompt) and member [K, G] bool (leaf l passes through node k).
    """
    cuts = [{s, n} for s, n in zip(starts, lengths)]
    for c, p in enumerate(parents):
        if p >= 0:
            cuts[p].add(starts[c])
    cuts = [sorted(c) for c in cuts]
    ids: dict[tuple[int, int], int] = {}
    node_of = []
    for i, n in enumerate(lengths):
        row = []
        for t in range(n):
            j = token_owner(parents, starts, i, t)
            row.append(ids.setdefault((j, cuts[j][bisect.bisect_right(cuts[j], t) - 1]), len(ids)))
        node_of.append(row)
    node_parent = [-1] * len(ids)
    for (j, a), k in ids.items():
        node_parent[k] = node_of[j][a - 1] if a > 0 else -1
    member = torch.zeros(len(ids), len(parents), dtype=torch.bool)
    for i, row in enumerate(node_of):
        member[row, i] = True
    return node_of, node_parent, member


def loo_advantages(rewards: torch.Tensor, group_size: int):
    """A_i = r_i - mean of the other G - 1 rewards of its group (RLOO's baseline); sums to zero per group."""
    r = rewards.view(-1, group_size)
    return (r - (r.sum(1, keepdim=True) - r) / (group_size - 1)).view(-1)


def treerl_advantages(r: torch.Tensor, nodes, sqrt_weight: bool = True) -> torch.Tensor:
    """TreeRL's segment advantage per node [K]: (V(s) - V_out(s)) + (V(s) - V(parent)), / sqrt(|L(s)|) if asked.

    r [G]: one prompt's leaf rewards; V(s) = mean reward of the leaves through s, V_out(s) = mean of the others
    (0 global term when none), V of the prompt (parent -1) = mean of all G.
    """
    _, node_parent, member = nodes
    m = member.to(r.dtype)
    cnt, out = m.sum(1), (1 - m).sum(1)
    value = m @ r / cnt
    glob = torch.where(out > 0, value - (1 - m) @ r / out.clamp(min=1), torch.zeros_like(value))
    parent_value = torch.stack([value[p] if p >= 0 else r.mean() for p in node_parent])
    adv = glob + value - parent_value
    return adv / cnt.sqrt() if sqrt_weight else adv


def treepo_advantages(r: torch.Tensor, nodes, eps: float = 1e-6) -> torch.Tensor:
    """TreePO per leaf [G]: mean over its distinct ancestor subgroups S (the prompt's G leaves and every node on its
    path shared by >= 2 leaves) of r_i - mean_S r, then whitened over the group (unbiased std, as group_advantages)."""
    node_of, _, member = nodes
    G = len(r)
    adv = torch.zeros_like(r)
    for i, row in enumerate(node_of):
        groups = {tuple(range(G))} | {tuple(member[k].nonzero().flatten().tolist()) for k in set(row)
                                      if member[k].sum() >= 2}
        adv[i] = torch.stack([r[i] - r[list(s)].mean() for s in groups]).mean()
    return (adv - adv.mean()) / (adv.std() + eps)


def tree_advantages(rewards: torch.Tensor, trees: list[list[dict]], args: Args, width: int) -> torch.Tensor:
    """Advantages of all leaves (group-major): [B] per leaf (leaf, loo, treepo) or [B, width] per token (treerl)."""
    G = args.group_size
    if args.adv == "leaf":
        return group_advantages(rewards, G, args.adv_std_norm)
    if args.adv == "loo":
        return loo_advantages(rewards, G)
    out = []
    for g, tree in enumerate(trees):
        r = rewards[g * G:(g + 1) * G].float()
        nodes = tree_nodes([l["parent"] for l in tree], [l["pos"] for l in tree], [len(l["tokens"]) for l in tree])
        if args.adv == "treepo":
            out.append(treepo_advantages(r, nodes))
            continue
        seg = treerl_advantages(r, nodes, args.sqrt_weight)
        tok_adv = torch.zeros(G, width, device=rewards.device)
        for i, row in enumerate(nodes[0]):
            tok_adv[i, :len(row)] = seg[row]
        out.append(tok_adv)
    return torch.cat(out)


# ---- the idea: losses (one sequence per leaf, or each tree token once) ----
def tree_loss(logp, mb: dict, n_seqs: int, n_tokens: int, args: Args):
    """grpo_loss with one advantage per token (TreeRL's segments): mb["adv"] [b, C]; with adv [b] it is grpo_loss."""
    if mb["adv"].dim() == 1:
        return grpo_loss(logp, mb, n_seqs, n_tokens, args)
    flat = lambda x: x.reshape(-1, 1)  # noqa: E731  (each token its own row: clipped_pg_loss takes one A per row)
    tok_loss, clipped = clipped_pg_loss(flat(logp), flat(mb["old"]), mb["adv"].reshape(-1), args.clip_eps_low,
                                        args.clip_eps_high)
    tok_loss, clipped = tok_loss.view_as(logp), clipped.view_as(logp)
    stats = {"clipfrac": clipped}
    if mb["ref"] is not None:
        kl = k3_kl(logp, mb["ref"])
        tok_loss, stats["kl"] = tok_loss + args.kl_coef * kl, kl
    return aggregate_loss(tok_loss, mb["mask"], args.loss_agg, n_seqs, n_tokens, agg_const(args)), stats


def pack_trees(trees: list[list[dict]], prompts: list[list[int]], adv: torch.Tensor, args: Args, pad_id: int,
               device) -> dict:
    """Each prompt's tree as one row: the prompt, then every leaf's own segment, under a tree attention mask.

    adv: tree_advantages' output. Per tree token (columns Q): tgt, tgt_pos (the row index whose hidden state predicts
    it: the previous token of its path), mask, behaviour logprobs, and over the leaves l through it
    pos_w = sum w_l max(A_l, 0), neg_w = sum w_l max(-A_l, 0), kl_w = sum w_l with w_l = 1/|o_l| (seq-mean), 1
    (token-mean) or 1/k (const); the step's normaliser divides later. Also leaf_tokens [R] (sum of leaf lengths) and
    leaf_index [B, C] (the column of every leaf token). Position ids are the path positions, as in the leaf batch.
    """
    B, C = adv.shape[0], max(len(l["tokens"]) for tree in trees for l in tree)
    tok_adv = adv.float().cpu() if adv.dim() == 2 else adv.float().cpu()[:, None].expand(B, C)
    leaf_index, rows, b = torch.zeros(B, C, dtype=torch.long), [], 0
    for g, tree in enumerate(trees):
        P, parents, starts = len(prompts[g]), [l["parent"] for l in tree], [l["pos"] for l in tree]
        col, toks, pred, lps, pos = {}, [], [], [], list(range(P))
        for j, leaf in enumerate(tree):
            for t in range(leaf["pos"], len(leaf["tokens"])):
                col[(j, t)] = len(toks)
                toks.append(leaf["tokens"][t])
                lps.append(leaf["logprobs"][t])
                pos.append(P + t)
                pred.append(P - 1 if t == 0 else P + col[(token_owner(parents, starts, j, t - 1), t - 1)])
        Q = len(toks)
        attn = torch.zeros(P + Q, P + Q, dtype=torch.bool)
        attn[:P, :P] = torch.ones(P, P, dtype=torch.bool).tril()
        for q in range(Q):  # a token sees its predecessor's context and itself
            attn[P + q] = attn[pred[q]]
            attn[P + q, P + q] = True
        w = torch.zeros(3, Q)
        for i, leaf in enumerate(tree):
            n = len(leaf["tokens"])
            f = {"seq-mean": 1 / n, "token-mean": 1.0, "const": 1 / agg_const(args)}[args.loss_agg]
            for t in range(n):
                q = col[(token_owner(parents, starts, i, t), t)]
                a = float(tok_adv[b + i, t])
                w[:, q] += torch.tensor([f * max(a, 0.0), f * max(-a, 0.0), f])
                leaf_index[b + i, t] = q
        rows.append((prompts[g] + toks, pos, attn, pred, toks, lps, w, sum(len(l["tokens"]) for l in tree)))
        b += len(tree)
    R, S, Q = len(rows), max(len(r[0]) for r in rows), max(len(r[4]) for r in rows)
    pk = {"ids": torch.full((R, S), pad_id), "pos": torch.zeros(R, S, dtype=torch.long),
          "attn": torch.eye(S, dtype=torch.bool).repeat(R, 1, 1), "tgt_pos": torch.zeros(R, Q, dtype=torch.long),
          "tgt": torch.full((R, Q), pad_id), "mask": torch.zeros(R, Q), "logprobs": torch.zeros(R, Q),
          "pos_w": torch.zeros(R, Q), "neg_w": torch.zeros(R, Q), "kl_w": torch.zeros(R, Q),
          "leaf_tokens": torch.tensor([float(r[7]) for r in rows]), "leaf_index": leaf_index}
    for k, (ids, pos, attn, pred, toks, lps, w, _) in enumerate(rows):
        s, q = len(ids), len(toks)
        pk["ids"][k, :s], pk["pos"][k, :s], pk["attn"][k, :s, :s] = torch.tensor(ids), torch.tensor(pos), attn
        pk["tgt_pos"][k, :q], pk["tgt"][k, :q], pk["mask"][k, :q] = torch.tensor(pred), torch.tensor(toks), 1.0
        pk["logprobs"][k, :q], (pk["pos_w"][k, :q], pk["neg_w"][k, :q], pk["kl_w"][k, :q]) = torch.tensor(lps), w
    return {k: v.to(device) for k, v in pk.items()}


def tree_attention_mask(model, attn):
    """The boolean tree mask [b, S, S] as an additive float mask [b, 1, S, S]: 0 where a token may attend, -inf
    elsewhere, in the model's dtype. Eager attention adds the mask to the scores (a boolean one would add 0 / 1 and
    mask nothing) and SDPA takes either; flash-attention kernels take no 4-D mask, so anything but eager or SDPA is
    refused by name."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in ("eager", "sdpa"):
        raise SystemExit(f"--train shared passes a 4-D tree attention mask, which needs eager or sdpa attention; the "
                         f"model uses {impl!r}: load it with attn_implementation='sdpa' or use --train leaf")
    dtype = next(model.parameters()).dtype
    return torch.zeros(attn.shape, dtype=dtype, device=attn.device).masked_fill(~attn, float("-inf"))[:, None]


def packed_logprobs(model, pk: dict, idx, temperature: float = 1.0, with_entropy: bool = False,
                    chunk_mb: float | None = None):
    """log pi of every tree token [b, Q] (and the entropy, a statistic without a graph) from one forward over the
    packed trees idx under the training autocast, with the additive tree mask (tree_attention_mask). The lm_head and
    log-softmax run over chunks of tree tokens of about chunk_mb MiB of fp32 logits (common.LOGPROB_CHUNK_MB), each
    recomputed in the backward (activation checkpointing, as common.token_logprobs): one [tokens x vocab] chunk alive."""
    attn, head = tree_attention_mask(model, pk["attn"][idx]), model.get_output_embeddings()
    tgt, mask = pk["tgt"][idx], pk["mask"][idx]
    b, Q = tgt.shape

    def chunk(hc, tc):
        logp = torch.log_softmax(head(hc).float() / temperature, -1)
        ent = -(logp.exp() * logp).sum(-1).detach() if with_entropy else hc.new_zeros(0)
        return logp.gather(-1, tc[:, None]).squeeze(-1), ent

    with common.autocast(model):
        hidden = common.decoder_hidden(model, pk["ids"][idx], attn, pk["pos"][idx])
        h = hidden.gather(1, pk["tgt_pos"][idx].unsqueeze(-1).expand(-1, -1, hidden.shape[-1])).reshape(b * Q, -1)
        step, t = common.chunk_positions(head.weight.shape[0], chunk_mb), tgt.reshape(-1)
        grad = torch.is_grad_enabled() and h.requires_grad
        parts = [torch.utils.checkpoint.checkpoint(chunk, h[s:s + step], t[s:s + step], use_reentrant=False) if grad
                 else chunk(h[s:s + step], t[s:s + step]) for s in range(0, b * Q, step)]
    lp = torch.cat([p[0] for p in parts]).view(b, Q) * mask
    return (lp, torch.cat([p[1] for p in parts]).view(b, Q) * mask) if with_entropy else lp


def shared_token_loss(logp, mb: dict, n_seqs: int, n_tokens: int, args: Args):
    """The replicated-leaf loss from each tree token once: since l(rho, A) = |A| l(rho, sign A) for the clipped
    surrogate, sum_l w_l l(rho_t, A_lt) = pos_w l(rho_t, +1) + neg_w l(rho_t, -1) (+ kl_coef kl_w kl_t); divided by
    N_seq (or the leaf tokens, token-mean) of the step. logp and mb's tensors [b, Q]."""
    flat, ones = (lambda x: x.reshape(-1, 1)), torch.ones(logp.numel(), device=logp.device)  # noqa: E731
    up, clip_up = clipped_pg_loss(flat(logp), flat(mb["old"]), ones, args.clip_eps_low, args.clip_eps_high)
    down, clip_down = clipped_pg_loss(flat(logp), flat(mb["old"]), -ones, args.clip_eps_low, args.clip_eps_high)
    tok_loss = mb["pos_w"] * up.view_as(logp) + mb["neg_w"] * down.view_as(logp)
    weight = (mb["pos_w"] + mb["neg_w"]).clamp(min=1e-12)  # clip share weighted by each side's advantage mass
    stats = {"clipfrac": (mb["pos_w"] * clip_up.view_as(logp) + mb["neg_w"] * clip_down.view_as(logp)) / weight}
    if mb["ref"] is not None:
        kl = k3_kl(logp, mb["ref"])
        tok_loss, stats["kl"] = tok_loss + args.kl_coef * mb["kl_w"] * kl, kl
    return (tok_loss * mb["mask"]).sum() / max(n_tokens if args.loss_agg == "token-mean" else n_seqs, 1), stats


# ---- rollout and update ----
def rollout(model, tok, task, args: Args, rng, device, engine=None) -> dict:
    """Grow one tree of G leaves for each of prompts_per_step training prompts (grow_trees); reward the leaves;
    tree advantages. The batch holds one row per leaf (group-major), as grpo.py's, plus the packed trees
    (--train shared) and the tree metrics."""
    examples = task.sample("train", args.prompts_per_step, rng)
    prompts = common.encode_prompts(tok, [e.prompt for e in examples])
    stats = args.rounds > 0 and (args.branch_score == "entropy" or args.branch_token == "force")
    sample = lambda groups, prefixes, budgets: sample_segments(  # noqa: E731
        model, tok, prompts, groups, prefixes, budgets, args, engine, stats)
    pieces = token_pieces(tok)
    reward = lambda g, toks: task.verify(tok.decode(toks, skip_special_tokens=True), examples[g].answer)[0]  # noqa: E731
    trees, counts = grow_trees(sample, [len(p) for p in prompts], args, rng,
                               lambda toks: answer_start(toks, pieces, args.answer_marker), reward,
                               set(common.eos_ids(tok, model)))
    leaves = [leaf for tree in trees for leaf in tree]
    texts = tok.batch_decode([leaf["tokens"] for leaf in leaves], skip_special_tokens=True)
    answers = [e.answer for e in examples for _ in range(args.group_size)]
    rewards = torch.tensor([task.verify(t, a)[0] for t, a in zip(texts, answers)], device=device)
    B, C = len(leaves), max(len(leaf["tokens"]) for leaf in leaves)
    comp, lp = torch.full((B, C), tok.pad_token_id), torch.zeros(B, C)
    for i, leaf in enumerate(leaves):
        comp[i, :len(leaf["tokens"])], lp[i, :len(leaf["tokens"])] = torch.tensor(leaf["tokens"]), torch.tensor(leaf["logprobs"])
    prompt_ids, prompt_mask = common.left_pad([p for p in prompts for _ in range(args.group_size)], tok.pad_token_id)
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": comp, "logprobs": lp,
             "completion_mask": (torch.arange(C)[None] < torch.tensor([len(l["tokens"]) for l in leaves])[:, None]).long()}
    batch = {k: v.to(device) for k, v in batch.items()}
    adv = tree_advantages(rewards, trees, args, C)
    batch.update(rewards=rewards, adv=adv, finish_reasons=["stop" if l["finished"] else "length" for l in leaves],
                 tree=tree_metrics(trees, texts, rewards, counts, args))
    if args.train == "shared":
        batch["packed"] = pack_trees(trees, prompts, adv, args, tok.pad_token_id, device)
    return batch


def tree_metrics(trees: list[list[dict]], texts: list[str], rewards: torch.Tensor, counts: dict, args: Args) -> dict:
    """rollout/ figures of the trees: sampled, prefill and leaf tokens, token-savings, mixed-reward groups, distinct
    final answers per group, relative branch position, forced / fallback / pruned shares, the depth histogram."""
    leaves = [leaf for tree in trees for leaf in tree]
    G, leaf_tokens = args.group_size, sum(len(leaf["tokens"]) for leaf in leaves)
    finals = [t.strip().rsplit(args.answer_marker, 1)[-1].strip() for t in texts]
    r = rewards.view(-1, G)
    rel = [l["pos"] / len(tree[l["parent"]]["tokens"]) for tree in trees for l in tree if l["parent"] >= 0]
    out = {"rollout/sampled_tokens": counts["sampled"], "rollout/prefill_tokens": counts["prefill"],
           "rollout/leaf_tokens": leaf_tokens, "rollout/token_savings": leaf_tokens / max(counts["sampled"], 1),
           "rollout/mixed_group_frac": float((r.max(1).values > r.min(1).values).float().mean()),
           "rollout/distinct_answers": float(np.mean([len(set(finals[g:g + G])) for g in range(0, len(finals), G)])),
           "rollout/branch_pos_rel": float(np.mean(rel)) if rel else 0.0,
           "rollout/forced_frac": counts["forced"] / max(counts["branched"], 1),
           "rollout/fallback_frac": counts["fallback"] / max(counts["branched"] + counts["fallback"], 1),
           "rollout/pruned_frac": counts["pruned"] / max(counts["windows"], 1)}
    for d in range(args.rounds + 1):
        out[f"rollout/depth{d}_frac"] = float(np.mean([leaf["depth"] == d for leaf in leaves]))
    return out


def tree_summary(history: list[dict]) -> dict:
    """Run totals of the tree figures: token_savings = all leaf tokens / all sampled tokens; the rest step means."""
    rows = [h for h in history if "rollout/sampled_tokens" in h]
    total = lambda k: float(sum(h[f"rollout/{k}"] for h in rows))  # noqa: E731
    out = {"sampled_tokens": total("sampled_tokens"), "prefill_tokens": total("prefill_tokens"),
           "leaf_tokens": total("leaf_tokens"), "token_savings": total("leaf_tokens") / max(total("sampled_tokens"), 1)}
    for k in [k for k in rows[0] if k.endswith("_frac") or k in ("rollout/distinct_answers", "rollout/branch_pos_rel")]:
        out[k[len("rollout/"):]] = float(np.mean([h[k] for h in rows]))
    return out


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
    over its whole mini-batch on all ranks, so accumulation and data parallelism leave J unchanged. The logged
    statistics are sums over all ranks divided by global counts: every rank returns the same values.
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
    correct = args.sampler_is_cap > 0 and (args.engine == "vllm" or not common.sampler_is_trainer(model))
    sums = {"pg": 0.0, "entropy": 0.0}  # this rank's share of each step mean, summed over ranks below
    # Sampler-vs-trainer log-prob gap on the sampler's weights: measured before any update of this batch.
    gap = {"sum": 0.0 if on_policy else common.masked_sum((old - batch["logprobs"]).abs(),
                                                          batch["completion_mask"].float()).item(),
           "tokens": float(batch["completion_mask"].sum()), "is_w": 0.0, "is_cut": 0.0}
    n_opt, grad_norm = 0, 0.0
    for epoch in range(args.ppo_epochs):
        for mb_idx in (torch.randperm(B) if args.minibatches > 1 else torch.arange(B)).chunk(args.minibatches):
            counts = torch.tensor([len(mb_idx), int(batch["completion_mask"][mb_idx].sum())], dtype=torch.float64,
                                  device=batch["adv"].device)
            n_seqs, n_tokens = (int(c) for c in (accel.reduce(counts, "sum") if accel.num_processes > 1 else counts))
            opt.zero_grad(set_to_none=True)
            for idx in micro(mb_idx):
                logp, ent = logprobs_of(model, idx, True)
                mb = {"adv": batch["adv"][idx], "mask": batch["completion_mask"][idx].float(),
                      "old": logp.detach() if old is None else old[idx], "ref": None if ref is None else ref[idx]}
                mb["is_weight"] = truncated_is_weight(mb["old"], batch["logprobs"][idx], args.sampler_is_cap) \
                    if correct else None
                loss, token_stats = loss_fn(logp, mb, n_seqs, n_tokens, args)
                loss.backward()  # a NaN here reaches every rank's gradient: optimizer_step stops them all
                sums["pg"] += loss.item()
                for k, v in {**token_stats, "entropy": ent}.items():
                    sums[k] = sums.get(k, 0.0) + common.masked_sum(v.detach(), mb["mask"]).item() / max(n_tokens, 1)
                if on_policy:  # the only forward on the sampler's weights
                    gap["sum"] += common.masked_sum((logp.detach() - batch["logprobs"][idx]).abs(), mb["mask"]).item()
                if correct and epoch == 0:  # every token once
                    gap["is_w"] += common.masked_sum(mb["is_weight"], mb["mask"]).item()
                    gap["is_cut"] += common.masked_sum((mb["is_weight"] >= args.sampler_is_cap).float(),
                                                       mb["mask"]).item()
            opt_step = (step - 1) * args.ppo_epochs * args.minibatches + n_opt  # derived: resume-safe
            grad_norm += optimizer_step(model, opt, args, accel, opt_step)
            n_opt += 1
    keys = sorted(sums) + [f"gap_{k}" for k in gap]
    tot = torch.tensor([*(sums[k] for k in sorted(sums)), *gap.values()], dtype=torch.float64,
                       device=batch["adv"].device)
    tot = dict(zip(keys, (accel.reduce(tot, "sum") if accel.num_processes > 1 else tot).tolist()))
    out = {**{f"loss/{k}": tot[k] / n_opt for k in sums}, "loss/grad_norm": grad_norm / n_opt,
           "rollout/logprob_mismatch": tot["gap_sum"] / max(tot["gap_tokens"], 1)}
    if correct:
        out.update({"rollout/is_weight_mean": tot["gap_is_w"] / max(tot["gap_tokens"], 1),
                    "rollout/is_truncated_frac": tot["gap_is_cut"] / max(tot["gap_tokens"], 1)})
    return out


def update_shared(model, opt, batch: dict, args: Args, step: int, accel, ref_model=None) -> dict:
    """update() for --train shared: mini-batches of prompts, each tree scored once over its packed tokens.

    The normalisers count leaves and leaf tokens (as the replicated batch would), so the loss and its gradient equal
    update()'s on one sequence per leaf; micro-batches hold micro_batch_size // G trees.
    """
    pk = batch["packed"]
    R = pk["ids"].shape[0]
    micro = lambda idx: idx.split(max(1, args.micro_batch_size // args.group_size))  # noqa: E731
    logprobs_of = lambda m, idx, ent=False: packed_logprobs(m, pk, idx, args.temperature, ent)  # noqa: E731
    on_policy = args.ppo_epochs == 1 and args.minibatches == 1  # then pi_old = pi_theta.detach()
    with torch.no_grad():
        old = None if on_policy else torch.cat([logprobs_of(model, i) for i in micro(torch.arange(R))])
        ref = torch.cat([logprobs_of(ref_model, i) for i in micro(torch.arange(R))]) if ref_model else None
    stats = {"pg": 0.0, "entropy": 0.0, "grad_norm": 0.0}
    n_cols = max(int(pk["mask"].sum()), 1)  # tree tokens: the per-token stats are means over them
    mismatch = 0.0 if on_policy else common.masked_mean((old - pk["logprobs"]).abs(), pk["mask"]).item()
    n_opt = 0
    for _ in range(args.ppo_epochs):
        for mb_idx in (torch.randperm(R) if args.minibatches > 1 else torch.arange(R)).chunk(args.minibatches):
            counts = torch.tensor([len(mb_idx) * args.group_size, float(pk["leaf_tokens"][mb_idx].sum())],
                                  dtype=torch.float64, device=pk["mask"].device)
            n_seqs, n_tokens = (int(c) for c in (accel.reduce(counts, "sum") if accel.num_processes > 1 else counts))
            opt.zero_grad(set_to_none=True)
            for idx in micro(mb_idx):
                logp, ent = logprobs_of(model, idx, True)
                mb = {k: pk[k][idx] for k in ("pos_w", "neg_w", "kl_w", "mask")}
                mb.update(old=logp.detach() if old is None else old[idx], ref=None if ref is None else ref[idx])
                loss, token_stats = shared_token_loss(logp, mb, n_seqs, n_tokens, args)
                loss.backward()
                stats["pg"] += loss.item()
                for k, v in {**token_stats, "entropy": ent}.items():
                    stats[k] = stats.get(k, 0.0) + common.masked_sum(v.detach(), mb["mask"]).item() / (n_cols * args.ppo_epochs)
                if on_policy:
                    mismatch += common.masked_sum((logp.detach() - pk["logprobs"][idx]).abs(), mb["mask"]).item() / n_cols
            opt_step = (step - 1) * args.ppo_epochs * args.minibatches + n_opt
            stats["grad_norm"] += optimizer_step(model, opt, args, accel, opt_step)
            n_opt += 1
    return {**{f"loss/{k}": v / n_opt if k in ("pg", "grad_norm") else v for k, v in stats.items()},
            "rollout/logprob_mismatch": mismatch}


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
    task = common.make_task(args.task, args.digits)
    hard_task = common.make_task(args.task, args.digits + 1) if args.eval_hard and hasattr(task, "digits") else None
    eval_sets = common.held_out_sets(task, args.eval_examples, hard_task)
    model, tok, ref_model = load_policy(args, accel)  # sharded when several processes run
    engine = VLLMEngine(common.resolve_model_path(args.model), args.vllm_gpu_memory, seed=args.seed + rank) \
        if args.engine == "vllm" else None
    use_kernels = args.kernels and accel.device.type == "cuda"
    fused_logprob = None
    if use_kernels:  # Triton: the fused lm_head + log-softmax (the loss kernel is in kernel_grpo_loss)
        from kernels.fused_logprob import fused_linear_logprob as fused_logprob
    loss_fn = kernel_grpo_loss if use_kernels and args.adv != "treerl" else tree_loss  # treerl: one A per token
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    run_dir = Path(args.out_dir) / args.exp_name
    state = common.load_checkpoint(args.resume, model, opt) if args.resume else {}
    if args.resume and engine is not None:
        engine.sync_weights(model)
    start_step, history = state.get("step", 0), state.get("history", [])
    gen_tokens, gen_time = state.get("gen_tokens", 0), state.get("gen_time", 0.0)
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
    bar = tqdm(range(start_step + 1, args.steps + 1), desc="tree", dynamic_ncols=True, disable=not is_main,
               initial=start_step, total=args.steps)
    for step in bar:
        # Every random draw of this step depends on (seed, step, rank) only: resuming is exact.
        torch.manual_seed(hash((args.seed, step, rank)) % 2**31)
        rng = np.random.default_rng([args.seed, step, rank])
        with timer("gen"):
            batch = rollout(model, tok, task, args, rng, accel.device, engine)
        with timer("train"):
            stats = (update_shared(model, opt, batch, args, step, accel, ref_model) if args.train == "shared" else
                     update(model, opt, batch, loss_fn, args, step, accel, ref_model, fused_logprob))
        if engine is not None:
            with timer("sync"):
                engine.sync_weights(model)
        t = timer.pop()
        sampled = batch["tree"]["rollout/sampled_tokens"]  # generated tokens: the tree's, not G full completions
        gen_tokens, gen_time = gen_tokens + sampled, gen_time + t["gen"]
        metrics = {**common.rollout_metrics(batch["rewards"], batch["completion_mask"], batch["finish_reasons"],
                                            args.group_size, t["gen"]), **batch["tree"], **stats,
                   "rollout/tokens_per_s": sampled / max(t["gen"], 1e-9), "perf/lr": opt.param_groups[0]["lr"],
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
    summary = {**common.summarize(history, gen_tokens, gen_time, time.time() - t_start), **tree_summary(history)}
    print(f"token-savings {summary['token_savings']:.2f}x ({summary['sampled_tokens']:.0f} sampled tokens)")
    common.save_curve(history, run_dir / "curve.png", f"tree GRPO ({args.adv}) on {task.name} ({args.model})")
    return tracker.finish(summary)


if __name__ == "__main__":
    main(tyro.cli(Args))
