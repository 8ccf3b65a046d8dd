"""Plumbing of the tree rollout scripts (algos/tree_rollout_*.py), none of it a paper's idea.

Where a completion's final answer starts (branch points stay before it), the next-token statistics that branch
points are scored by (entropy; LATR's candidate tokens), the one-row-per-leaf training batch in grpo.py's layout,
the rollout/ figures of the trees (token-savings and the rest) and their run totals. The scripts grow the trees, compute advantages and train; this file holds
what all of them use unchanged, so that each script's diff against its parent is its idea.
tests/test_tree_rollout_grpo.py tests every function here.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402


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


@torch.no_grad()
def next_token_stats(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature: float, k: int = 0,
                     chunk_mb: float | None = None):
    """Entropy [B, C] and the k most likely tokens (probs, ids [B, C, k]; k = 0: empty) of the distribution each
    token was drawn from. One decoder forward under the training autocast, then the lm_head and log-softmax over
    chunks of positions whose fp32 logits take about chunk_mb MiB (common.LOGPROB_CHUNK_MB by default; as
    common.token_logprobs): no [B, C, V] tensor is built."""
    dev = next(model.parameters()).device
    ids = torch.cat([prompt_ids, completion_ids], 1).to(dev)
    mask = torch.cat([prompt_mask, completion_mask], 1).to(dev)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    P, (B, C), head = prompt_ids.shape[1], completion_ids.shape, model.get_output_embeddings()
    step, k = common.chunk_positions(head.weight.shape[0], chunk_mb), min(k, head.weight.shape[0])
    ent, probs, top_ids = [], [], []
    with common.autocast(model):
        h = common.decoder_hidden(model, ids, mask, pos)[:, P - 1:-1].reshape(B * C, -1)
        for s in range(0, B * C, step):
            logp = torch.log_softmax(head(h[s:s + step]).float() / temperature, -1)
            top = logp.topk(k, -1)
            ent.append(-(logp.exp() * logp).sum(-1))
            probs.append(top.values.exp())
            top_ids.append(top.indices)
    return torch.cat(ent).view(B, C), torch.cat(probs).view(B, C, k), torch.cat(top_ids).view(B, C, k)


def leaf_batch(trees: list[list[dict]], prompts: list[list[int]], pad_id: int, device) -> dict:
    """One row per leaf (group-major) in grpo.py's batch layout: prompt_ids / prompt_mask (left-padded, each prompt
    once per leaf of its tree), completion_ids, behaviour logprobs and completion_mask [B, C] (right-padded)."""
    leaves = [leaf for tree in trees for leaf in tree]
    B, C = len(leaves), max(len(leaf["tokens"]) for leaf in leaves)
    comp, lp = torch.full((B, C), pad_id), torch.zeros(B, C)
    for i, leaf in enumerate(leaves):
        n = len(leaf["tokens"])
        comp[i, :n], lp[i, :n] = torch.tensor(leaf["tokens"]), torch.tensor(leaf["logprobs"])
    prompt_ids, prompt_mask = common.left_pad([p for p, tree in zip(prompts, trees) for _ in tree], pad_id)
    lengths = torch.tensor([len(leaf["tokens"]) for leaf in leaves])
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": comp, "logprobs": lp,
             "completion_mask": (torch.arange(C)[None] < lengths[:, None]).long()}
    return {k: v.to(device) for k, v in batch.items()}


def tree_metrics(trees: list[list[dict]], texts: list[str], rewards: torch.Tensor, counts: dict, args) -> dict:
    """rollout/ figures of one batch of trees: sampled, prefill and leaf tokens, token-savings, mixed-reward groups,
    distinct final answers per group, relative branch position, the forced / fallback / pruned shares (forced and
    pruned are LATR's counts, 0 in the scripts that have none), the depth histogram. args: group_size, answer_marker,
    rounds."""
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
           "rollout/forced_frac": counts.get("forced", 0) / max(counts["branched"], 1),
           "rollout/fallback_frac": counts["fallback"] / max(counts["branched"] + counts["fallback"], 1),
           "rollout/pruned_frac": counts.get("pruned", 0) / max(counts.get("windows", 0), 1)}
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
