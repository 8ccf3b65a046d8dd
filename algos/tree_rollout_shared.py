"""Tree rollouts for GRPO trained on each tree token once: shared prefixes are one forward, under tree attention.

A tree's leaves share their prefixes (the parent's trees, after Hou et al., "TreeRL: LLM Reinforcement Learning with
On-Policy Tree Search", arXiv:2506.11902, and Li et al., "TreePO: Bridging the Gap of Policy Optimization and Efficacy
and Inference Efficiency with Heuristic Tree-based Modeling", arXiv:2508.17445), so one sequence per leaf runs the
shared tokens through the model once per leaf. Packing each prompt's tree into one row with a tree attention mask
runs every tree token once; weighting each token by the leaves through it gives the same loss and gradient (a test
checks both) with fewer forward tokens. The trees, GRPO's advantages over their G leaves and the accounting are the
parent's; this file changes the training forward and the loss.

Parent: algos/tree_rollout_grpo.py; changed: Args, check_args, rollout, main.

Equations (the parent's, and; each implemented by the function named on the right):
  packing       one row per prompt: the prompt, then every leaf's own segment; a token attends to its path (the
                prompt and its ancestors' tokens) and itself; position ids are path positions        pack_trees
  forward       log pi of every tree token from the hidden state of its predecessor on its path, one forward per
                packed tree with the additive tree mask                  packed_logprobs, tree_attention_mask
  kernel        --tree-attention kernel: the same attention from each row's parent array (the prompt a chain, a
                tree token's parent its predecessor on its path) through kernels/tree_verify_attention.py, the
                tree handed to every layer as packed ancestor bits        tree_kernel_mask, tree_kernel_attention
  loss          sum_l w_l l(rho_t, A_lt) = P_t l(rho_t, +1) + N_t l(rho_t, -1) for the clipped surrogate, with
                P_t = sum_l w_l max(A_lt, 0), N_t = sum_l w_l max(-A_lt, 0) over the leaves l through token t, w_l the
                leaf's share of the aggregation (1 / (N_seq |o_l|) for seq-mean); + kl_coef sum_l w_l k3_t
                                                                                            shared_token_loss
  sampler       when the sampler is not the trainer's computation, tree token t's surrogate times grpo.py's
                v_t = min(pi_old / pi_sampler, C), C = --sampler-is-cap: one sampled token, one weight for every leaf
                through it, so the parent's per-leaf-token weight factors out of the leaf sum
                                                                            truncated_is_weight, shared_token_loss
  update        mini-batches of prompts (micro_batch_size // G trees per micro-batch); the normalisers count leaves
                and leaf tokens, as the parent's one-sequence-per-leaf batch would                 update_shared

Deviations (the parent's hold too):
- The tree mask goes to attention as an additive float mask (0 / -inf), which eager and SDPA both apply;
  flash-attention kernels take no 4-D mask and are refused with a message.
- --tree-attention kernel (default mask) computes the packed forward's attention with kernels/tree_verify_attention.py
  instead of the additive [S x S] mask: on CUDA its Triton kernels, forward and backward (an autograd.Function), so
  the update trains through them and the no-grad passes (pi_old, the reference) use them too; on CPU its pure-torch
  reference (a dense mask again, built per layer; the tests run the Triton kernels through the interpreter). The
  whole packed row is the kernel's tree (prefix length 0, the prompt a chain), so its all-visible prefix blocks go
  unused. The model's attention implementation becomes tree_kernel_attention for the run: SDPA (with transformers' own
  mask) for sampling and evaluation, whatever implementation the model was loaded with (flash attention included);
  attention dropout, logit softcapping and a sliding window shorter than a packed row are refused. Equal to the
  mask path to fp32 rounding (a test). The boolean tree mask of the packing is still built (1 byte per pair, on CPU).
- rollout/logprob_mismatch, rollout/is_weight_mean, rollout/is_truncated_frac and the loss/ statistics are means over
  tree tokens, not leaf tokens.

Commands:
  python algos/tree_rollout_shared.py                            # the parent's default tree, each token trained once
  python algos/tree_rollout_shared.py --rounds 2 --continuations 1 --chains 2   # deeper trees: more sharing
  python algos/tree_rollout_shared.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --device cuda \
      --max-new-tokens 512 --answer-marker "####" --lr 1e-6                              # one GPU
  python algos/tree_rollout_shared.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --device cuda \
      --max-new-tokens 512 --answer-marker "####" --lr 1e-6 --tree-attention kernel   # the Triton tree kernel
Expected: the parent's learning (from the same trees, the first update's loss and gradient norm equal the parent's
to 1e-4 and 1e-3, a test), from fewer forward tokens: prompt + tree tokens once per tree, not prompt + leaf per leaf.
"""
from __future__ import annotations

import contextlib
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
    # the packed forward
    tree_attention: Literal["mask", "kernel"] = "mask"
    """mask: the additive [S x S] tree mask under the model's eager or SDPA attention; kernel:
    kernels/tree_verify_attention.py from each row's parent array (Triton forward and backward on CUDA, its pure-torch
    reference on CPU); sampling and evaluation then run SDPA"""


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
    if args.prompts_per_step % args.minibatches:
        raise SystemExit(f"--minibatches {args.minibatches} must divide the rollout batch ({args.prompts_per_step} "
                         "trees: mini-batches split by prompt)")
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


# ---- advantage, clipped surrogate, KL ----
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


def agg_const(args: Args) -> int:
    """The constant k of --loss-agg const (default: the generation budget, as Dr. GRPO)."""
    return args.agg_const or args.max_new_tokens


def truncated_is_weight(old_logp, sampler_logp, cap: float):
    """w_t = min(pi_old(o_t) / pi_sampler(o_t), C): corrects the update for samples drawn by another computation
    than the trainer's (truncated importance sampling, as verl's rollout correction); no gradient."""
    return torch.exp(old_logp - sampler_logp).clamp(max=cap).detach()


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


# ---- the idea: each tree token once (tree attention), weighted by its leaves ----
def pack_trees(trees: list[list[dict]], prompts: list[list[int]], adv: torch.Tensor, args: Args, pad_id: int,
               device) -> dict:
    """Each prompt's tree as one row: the prompt, then every leaf's own segment, under a tree attention mask.

    adv: [B] per leaf (the parent's) or [B, C] per token. Per tree token (columns Q): tgt, tgt_pos (the row index whose hidden state predicts
    it: the previous token of its path), mask, behaviour logprobs, and over the leaves l through it
    pos_w = sum w_l max(A_l, 0), neg_w = sum w_l max(-A_l, 0), kl_w = sum w_l with w_l = 1/|o_l| (seq-mean), 1
    (token-mean) or 1/k (const); the step's normaliser divides later. Also leaf_tokens [R] (sum of leaf lengths) and
    leaf_index [B, C] (the column of every leaf token). Position ids are the path positions, as in the leaf batch.
    parents [R, S]: each position's predecessor on its path (--tree-attention kernel's tree): the previous prompt
    token, tgt_pos for a tree token, -1 for the first token and the padding (which sees itself only, as in attn).
    """
    B, C = adv.shape[0], max(len(l["tokens"]) for tree in trees for l in tree)
    tok_adv = adv.float().cpu() if adv.dim() == 2 else adv.float().cpu()[:, None].expand(B, C)
    leaf_index, rows, b = torch.zeros(B, C, dtype=torch.long), [], 0
    for g, tree in enumerate(trees):
        P, col, toks, pred, lps = len(prompts[g]), [], [], [], []
        pos = list(range(P))
        for leaf in tree:  # col[j][t]: the column of token t of leaf j's path (its parent's up to pos, then its own)
            col.append(col[leaf["parent"]][:leaf["pos"]] if leaf["parent"] >= 0 else [])
            for t in range(leaf["pos"], len(leaf["tokens"])):
                col[-1].append(len(toks))
                toks.append(leaf["tokens"][t])
                lps.append(leaf["logprobs"][t])
                pos.append(P + t)
                pred.append(P - 1 if t == 0 else P + col[-1][t - 1])
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
                q = col[i][t]
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
          "leaf_tokens": torch.tensor([float(r[7]) for r in rows]), "leaf_index": leaf_index,
          "parents": torch.full((R, S), -1, dtype=torch.long)}
    for k, (ids, pos, attn, pred, toks, lps, w, _) in enumerate(rows):
        s, q = len(ids), len(toks)
        pk["ids"][k, :s], pk["pos"][k, :s], pk["attn"][k, :s, :s] = torch.tensor(ids), torch.tensor(pos), attn
        pk["tgt_pos"][k, :q], pk["tgt"][k, :q], pk["mask"][k, :q] = torch.tensor(pred), torch.tensor(toks), 1.0
        pk["parents"][k, :s] = torch.tensor(list(range(-1, s - q - 1)) + pred)  # the prompt a chain, then the tree
        pk["logprobs"][k, :q], (pk["pos_w"][k, :q], pk["neg_w"][k, :q], pk["kl_w"][k, :q]) = torch.tensor(lps), w
    return {k: v.to(device) for k, v in pk.items()}


def tree_attention_mask(model, attn):
    """The boolean tree mask [b, S, S] as an additive float mask [b, 1, S, S]: 0 where a token may attend, -inf
    elsewhere, in the model's dtype. Eager attention adds the mask to the scores (a boolean one would add 0 / 1 and
    mask nothing) and SDPA takes either; flash-attention kernels take no 4-D mask, so anything but eager or SDPA is
    refused by name."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in ("eager", "sdpa"):
        raise SystemExit(f"shared-token training passes a 4-D tree attention mask, which needs eager or sdpa attention; "
                         f"the model uses {impl!r}: load it with attn_implementation='sdpa', or train one sequence per "
                         "leaf (algos/tree_rollout_grpo.py)")
    dtype = next(model.parameters()).dtype
    return torch.zeros(attn.shape, dtype=dtype, device=attn.device).masked_fill(~attn, float("-inf"))[:, None]


TREE_KERNEL = "tree_verify"  # the attention implementation's name in transformers' registries (use_tree_kernel)


def tree_kernel_mask(parents):
    """The kernel's tree [b, 1, S, 1 + W] int32, handed to every layer as the attention mask (transformers passes a
    4-D mask on unchanged): column 0 each position's parent in its row (pack_trees' parents), then its ancestor row
    packed 32 keys to a word (kernels/tree_verify_attention.ancestor_bits, W = ceil(S / 32)), built once per forward
    on the CPU instead of once per layer: S (1 + W) words a row where the additive mask holds S^2 floats."""
    from kernels import tree_verify_attention as tree_kernel

    p = parents.cpu()
    bits = tree_kernel.ancestor_bits(tree_kernel.ancestor_mask(p))
    return torch.cat([p.to(torch.int32)[..., None], bits], -1)[:, None].to(parents.device)


def tree_kernel_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """--tree-attention kernel's attention. Given the kernel's tree (tree_kernel_mask: an integer mask), every token
    of a packed row attends its path: kernels/tree_verify_attention.tree_verify_attention with the whole row as the tree
    (prefix length 0); query [b, H, S, D], key and value [b, H_kv, S, D] (repeated to H heads) -> [b, S, H, D].
    Every other call (sampling, evaluation, a plain forward) is SDPA with transformers' own mask."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    from kernels import tree_verify_attention as tree_kernel

    if attention_mask is None or attention_mask.dtype.is_floating_point or attention_mask.dtype == torch.bool:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    window = kwargs.get("sliding_window")
    if dropout > 0 or kwargs.get("softcap") is not None or (window and window < query.shape[2]):
        raise SystemExit("--tree-attention kernel computes plain softmax attention: this model asks for attention "
                         f"dropout ({dropout}), logit softcapping ({kwargs.get('softcap')}) or a sliding window "
                         f"({window}) shorter than a packed row ({query.shape[2]}); use --tree-attention mask")
    tree, n_rep = attention_mask[:, 0], query.shape[1] // key.shape[1]
    out = tree_kernel.tree_verify_attention(query, repeat_kv(key, n_rep), repeat_kv(value, n_rep), tree[..., 0],
                                            scaling, bits=tree[..., 1:].contiguous())
    return out.transpose(1, 2).contiguous(), None


def use_tree_kernel(*models) -> None:
    """--tree-attention kernel: register tree_kernel_attention with transformers (with SDPA's mask builder for the
    calls that pass no tree) and make it the models' attention, so that packed_logprobs hands them the kernel's tree.
    The implementation stays set for the run: a layer recomputed in the backward (gradient checkpointing) runs the
    same attention as in its forward."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(TREE_KERNEL, tree_kernel_attention)
    AttentionMaskInterface.register(TREE_KERNEL, sdpa_mask)
    for model in models:
        if model is not None and not isinstance(model, common.AdaptersOff):  # AdaptersOff: the policy itself
            model.config._attn_implementation = TREE_KERNEL


def packed_logprobs(model, pk: dict, idx, temperature: float = 1.0, with_entropy: bool = False,
                    chunk_mb: float | None = None):
    """log pi of every tree token [b, Q] (and the entropy, a statistic without a graph) from one forward over the
    packed trees idx under the training autocast, with the additive tree mask (tree_attention_mask), or the kernel's
    tree (tree_kernel_mask) when the model's attention is tree_kernel_attention (use_tree_kernel). The lm_head and
    log-softmax run over chunks of tree tokens of about chunk_mb MiB of fp32 logits (common.LOGPROB_CHUNK_MB), each
    recomputed in the backward (activation checkpointing, as common.token_logprobs): one [tokens x vocab] chunk alive.
    A LoRA policy's reference (common.AdaptersOff) is the policy run with its adapters disabled, as token_logprobs."""
    off = isinstance(model, common.AdaptersOff)
    model, adapters = (model.model, model.model.disable_adapter()) if off else (model, contextlib.nullcontext())
    kernel = getattr(model.config, "_attn_implementation", None) == TREE_KERNEL  # use_tree_kernel: the kernel's tree
    attn = tree_kernel_mask(pk["parents"][idx]) if kernel else tree_attention_mask(model, pk["attn"][idx])
    head = model.get_output_embeddings()
    tgt, mask = pk["tgt"][idx], pk["mask"][idx]
    b, Q = tgt.shape

    def chunk(hc, tc):
        logp = torch.log_softmax(head(hc).float() / temperature, -1)
        ent = -(logp.exp() * logp).sum(-1).detach() if with_entropy else hc.new_zeros(0)
        return logp.gather(-1, tc[:, None]).squeeze(-1), ent

    with adapters, common.autocast(model):
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
    surrogate, sum_l w_l l(rho_t, A_lt) = pos_w l(rho_t, +1) + neg_w l(rho_t, -1), times the token's truncated
    importance weight when mb holds one (is_weight), (+ kl_coef kl_w kl_t); divided by N_seq (or the leaf tokens,
    token-mean) of the step. logp and mb's tensors [b, Q]."""
    flat, ones = (lambda x: x.reshape(-1, 1)), torch.ones(logp.numel(), device=logp.device)  # noqa: E731
    up, clip_up = clipped_pg_loss(flat(logp), flat(mb["old"]), ones, args.clip_eps_low, args.clip_eps_high)
    down, clip_down = clipped_pg_loss(flat(logp), flat(mb["old"]), -ones, args.clip_eps_low, args.clip_eps_high)
    tok_loss = mb["pos_w"] * up.view_as(logp) + mb["neg_w"] * down.view_as(logp)
    if mb.get("is_weight") is not None:  # the sampler is not the trainer: one weight per tree token
        tok_loss = tok_loss * mb["is_weight"]
    weight = (mb["pos_w"] + mb["neg_w"]).clamp(min=1e-12)  # clip share weighted by each side's advantage mass
    stats = {"clipfrac": (mb["pos_w"] * clip_up.view_as(logp) + mb["neg_w"] * clip_down.view_as(logp)) / weight}
    if mb["ref"] is not None:
        kl = k3_kl(logp, mb["ref"])
        tok_loss, stats["kl"] = tok_loss + args.kl_coef * mb["kl_w"] * kl, kl
    return (tok_loss * mb["mask"]).sum() / max(n_tokens if args.loss_agg == "token-mean" else n_seqs, 1), stats


# ---- rollout and update ----
def rollout(sampler, tok, task, args: Args, rng, device) -> dict:
    """Grow one tree of G leaves for each of prompts_per_step training prompts (grow_trees); reward the leaves; GRPO's
    advantages over each prompt's leaves. The batch holds one row per leaf (group-major, for the metrics), the packed
    trees the update trains on, and the tree metrics."""
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
    batch["packed"] = pack_trees(trees, prompts, batch["adv"], args, tok.pad_token_id, device)
    return batch


def sampler_gap(old_logp, sampler_logp, is_weight, mask, cap: float) -> dict:
    """This micro-batch's sums for rollout/logprob_mismatch (|log pi_old - log pi_sampler| per token, on the sampler's
    weights) and, when the correction is on, the mean importance weight and the fraction truncated at C."""
    out = {"gap/sum": common.masked_sum((old_logp - sampler_logp).abs(), mask).item(), "gap/tokens": mask.sum().item()}
    if is_weight is not None:
        out.update({"gap/is_w": common.masked_sum(is_weight, mask).item(),
                    "gap/is_cut": common.masked_sum((is_weight >= cap).float(), mask).item()})
    return out


def update_shared(model, opt, batch: dict, args: Args, step: int, accel, sampler, ref_model=None) -> dict:
    """The parent's update with each tree scored once over its packed tokens: mini-batches of prompts.

    The normalisers count leaves and leaf tokens (as the replicated batch would), so the loss and its gradient equal
    the parent's update on one sequence per leaf; micro-batches hold micro_batch_size // G trees. The logged
    statistics are sums over all ranks divided by global counts of tree tokens: every rank returns the same values.
    """
    pk = batch["packed"]
    R, mask = pk["ids"].shape[0], pk["mask"]
    micro = lambda idx: idx.split(max(1, args.micro_batch_size // args.group_size))  # noqa: E731
    logprobs_of = lambda m, idx, ent=False: packed_logprobs(m, pk, idx, args.temperature, ent)  # noqa: E731
    on_policy = args.ppo_epochs == 1 and args.minibatches == 1  # then pi_old = pi_theta.detach()
    with torch.no_grad():
        old = None if on_policy else torch.cat([logprobs_of(model, i) for i in micro(torch.arange(R))])
        ref = torch.cat([logprobs_of(ref_model, i) for i in micro(torch.arange(R))]) if ref_model else None
    correct = args.sampler_is_cap > 0 and not sampler.is_trainer  # the sampler is another computation
    sums, n_opt, grad_norm = {}, 0, 0.0  # sums: this rank's sums over tree tokens, summed over ranks below
    total = args.steps * args.ppo_epochs * args.minibatches
    for epoch in range(args.ppo_epochs):
        for mb_idx in (torch.randperm(R) if args.minibatches > 1 else torch.arange(R)).chunk(args.minibatches):
            counts = llm.all_ranks_sum({"seqs": len(mb_idx) * args.group_size,
                                        "tokens": float(pk["leaf_tokens"][mb_idx].sum())}, accel, mask.device)
            n_seqs, n_tokens = int(counts["seqs"]), int(counts["tokens"])
            opt.zero_grad(set_to_none=True)
            for idx in micro(mb_idx):
                logp, ent = logprobs_of(model, idx, True)
                mb = {k: pk[k][idx] for k in ("pos_w", "neg_w", "kl_w", "mask")}
                mb.update(old=logp.detach() if old is None else old[idx], ref=None if ref is None else ref[idx])
                mb["is_weight"] = truncated_is_weight(mb["old"], pk["logprobs"][idx], args.sampler_is_cap) \
                    if correct else None
                loss, token_stats = shared_token_loss(logp, mb, n_seqs, n_tokens, args)
                loss.backward()  # a NaN here reaches every rank's gradient: optimizer_step stops them all
                for k, v in {"pg": loss.item(), **{k: common.masked_sum(v.detach(), mb["mask"]).item()
                                                   for k, v in {**token_stats, "entropy": ent}.items()}}.items():
                    sums[k] = sums.get(k, 0.0) + v
                if epoch == 0:  # every tree token once, on the sampler's weights (pi_old)
                    for k, v in sampler_gap(mb["old"], pk["logprobs"][idx], mb["is_weight"], mb["mask"],
                                            args.sampler_is_cap).items():
                        sums[k] = sums.get(k, 0.0) + v
            opt_step = (step - 1) * args.ppo_epochs * args.minibatches + n_opt  # derived: resume-safe
            grad_norm += llm.optimizer_step(model, opt, args, opt_step, total, sampler)
            n_opt += 1
    tot = llm.all_ranks_sum(sums, accel, mask.device)
    cols = max(tot["gap/tokens"], 1)  # tree tokens on all ranks: the per-token statistics are means over them
    out = {**{f"loss/{k}": v / (n_opt if k == "pg" else cols * args.ppo_epochs) for k, v in tot.items()
              if not k.startswith("gap/")},
           "loss/grad_norm": grad_norm / n_opt, "rollout/logprob_mismatch": tot["gap/sum"] / cols}
    if correct:
        out.update({"rollout/is_weight_mean": tot["gap/is_w"] / cols,
                    "rollout/is_truncated_frac": tot["gap/is_cut"] / cols})
    return out


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    run = llm.Run(args)  # accelerator, threads, seed, the task and its held-out sets, the run folder
    # sharded when several processes run; the sampler decodes (the trainer itself on CPU)
    model, tok, ref_model, sampler = llm.load_policy(args, run.accel, with_ref=args.kl_coef > 0)
    if args.tree_attention == "kernel":  # the packed forwards through kernels/tree_verify_attention.py
        use_tree_kernel(model, ref_model)
    opt = llm.make_optimizer(model.parameters(), args)
    run.start(model, tok, opt, sampler)  # resume from --resume, then the step-0 held-out evaluation
    for step, rng in run.steps():  # every random draw of a step depends on (seed, step, rank) only
        with run.timer("gen"):
            batch = rollout(sampler, tok, run.task, args, rng, run.accel.device)
        with run.timer("train"):  # includes the sampler's refresh after each optimiser step
            stats = update_shared(model, opt, batch, args, step, run.accel, sampler, ref_model)
        sampled = batch["tree"]["rollout/sampled_tokens"]  # generated tokens: the tree's, not G full completions
        run.gen_tokens += sampled - int(batch["completion_mask"].sum())  # log_step adds the leaves' tokens
        run.log_step(step, batch, {**batch["tree"], **stats},  # rollout metrics, evaluation, checkpoints
                     extra={"rollout/tokens_per_s": sampled / max(run.timer.totals["gen"], 1e-9)})
    tree = _tree.tree_summary(run.history) if run.is_main else {}
    if run.is_main:
        print(f"token-savings {tree['token_savings']:.2f}x ({tree['sampled_tokens']:.0f} sampled tokens)")
    return run.finish("tree GRPO, shared tokens,", extra=tree)


if __name__ == "__main__":
    main(tyro.cli(Args))
