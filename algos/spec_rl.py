"""SPEC-RL: GRPO whose rollouts are speculative, with the previous epoch's rollouts as drafts.

Papers: Liu et al., "SPEC-RL: Accelerating On-Policy Reinforcement Learning via Speculative Rollouts",
arXiv:2509.23232 (the previous epoch's rollout of the same prompt is the draft); Iso et al., "Accelerating RL
Post-Training Rollouts via System-Integrated Speculative Decoding", arXiv:2604.26779 (lossless speculation in
RL rollouts); Kim, Lee, Oh et al., "EfficientRollout: System-Aware Self-Speculative Decoding for RL Rollouts",
arXiv:2606.18967 (a quantised self-drafter; acceptance-aware draft length); Qin et al., "Seer: Online Context
Learning for Fast Synchronous LLM Reinforcement Learning", arXiv:2511.14617 (drafts from sibling responses).

Parent: algos/grpo.py; changed: Args, check_args, rollout, main.

Parent: algos/spec_decode.py; changed: Args, check_args, main.

The update is grpo.py's (update, grpo_loss); rollout changes: prompts come from a fixed pool revisited every
epoch, and spec_decode.py's sampler (spec_generate, copied) samples each group with a drafter. Speculative
sampling is lossless: the rollouts have the policy's own distribution, the behaviour log-probs are the target's
processed log-probs, and the update stays on-policy (ratio 1).

Equations (each implemented by the function named on the right):
  accept draft x_j       u_j < min(1, p_j(x_j) / q_j(x_j))                                      accept_prob
  reject at j            emit y ~ norm(max(0, p_j - q_j)); all accepted: bonus y ~ p_gamma        verify
  SPEC-RL                draft = the previous epoch's completion o'_i of the same prompt (row i of its group),
                         q_j = pi_old(. | x, o'_<j), stored when o'_i was sampled; the longest accepted prefix is
                         kept and sampling continues from the first rejection                     PrevDrafter
  sibling n-gram (Seer)  draft = majority continuation of the longest matching suffix in the group's other
                         responses and the previous epoch's responses; q one-hot               NgramDrafter
  self-draft             q from an int8 (per-row absmax) copy of the current policy, re-made every step
                         (EfficientRollout)                                                  fake_int8_copy
  frozen draft           q from a frozen model (default: the initial policy)                   ModelDrafter
  group advantage, clipped surrogate, aggregation: as algos/grpo.py            group_advantages, grpo_loss
  reused fraction        accepted draft tokens / generated tokens                                 SpecStats
  tokens per target call E[n] = (1 - alpha^(gamma+1)) / (1 - alpha)                  tokens_per_call_theory

Deviations:
- Training prompts come from a fixed pool (--pool-size, per process) revisited every epoch, so that SPEC-RL
  has a previous rollout of each prompt; plain GRPO draws fresh prompts each step.
- SPEC-RL's exactness: min(1, p_new / p_old) with residual resampling is exact when the draft is a fresh sample
  of p_old. Here p_new was trained on (among others) that very draft, so strictly the guarantee holds only up
  to that dependence (the paper shares it). After the reused prefix we sample plainly (gamma = 0), as the paper
  continues generation from the first rejection. The paper's lenience (accepting more than min(1, p/q)) is not
  implemented: the rollouts stay lossless. The full q [len, V] of every stored rollout is kept: cheap for the
  tiny vocabulary, too much memory for a real one (where it would be kept sparse or recomputed).
- The self-drafter is fake-quantized (int8 weights rounded, compute in fp32): it reproduces the distribution
  mismatch of a quantized drafter, not its speed, and there is no system-aware on/off toggle.
- No vLLM engine, no resume (the previous-epoch drafts are not checkpointed), no Triton kernels: the rollout
  engine is the speculative sampler (HF model, KV cache with rollback).
- Batched in lock-step: the batch needs as many target calls as its slowest row; we log both the batched calls
  and the per-sequence target forwards per token (what a continuous-batching engine would save).

Commands:
  python algos/spec_rl.py                              # SPEC-RL drafts, tiny-0.6m on add, 2-core CPU
  python algos/spec_rl.py --drafter none               # plain GRPO through the same sampler (the baseline)
  python algos/spec_rl.py --drafter prev+ngram         # SPEC-RL, then n-gram drafts after the first rejection
  python algos/spec_rl.py --drafter ngram              # sibling / previous-epoch n-gram drafter (Seer)
  python algos/spec_rl.py --drafter model              # frozen draft model (the initial policy): acceptance decays
  python algos/spec_rl.py --drafter self               # int8 copy of the current policy: acceptance holds
Expected: held-out greedy accuracy on 2-digit addition rises by 10+ points (as plain GRPO) while SPEC-RL reuses
most rollout tokens and needs fewer target forwards per token; see benchmarks/results/spec_rollout.md.
"""
from __future__ import annotations

import copy
import math
import sys
import time
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import tyro
from tqdm import tqdm

import common

warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated")


@dataclass
class Args:
    # bookkeeping
    exp_name: str = "spec_rl"
    """name of the run (the output folder is out_dir/exp_name)"""
    seed: int = 0
    """random seed: the pool, and the prompts and sampling of step s, depend only on (seed, s, rank)"""
    track: bool = False
    """log to Weights & Biases as well (WANDB_MODE=offline works without network)"""
    out_dir: str = "runs"
    """where metrics.jsonl, summary.json, the curves and checkpoints go"""
    # model and task
    model: str = "tiny-0.6m"
    """tiny-0.6m, tiny-5m, smollm2-135m, a Hugging Face id or a local path"""
    task: str = "add"
    """add, addsteps, jsonl:PATH (prompt/answer records) or gsm8k"""
    digits: int = 2
    """operand digits of the arithmetic tasks (training and the main held-out eval)"""
    device: str = "auto"
    """auto (CUDA if present), cpu or cuda"""
    threads: int = 2
    """torch CPU threads per process"""
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """compute dtype: auto = bf16 autocast on CUDA (fp32 weights, optimiser, log-softmax and losses), fp32 on CPU"""
    # rollout
    drafter: Literal["prev", "prev+ngram", "ngram", "model", "self", "none"] = "prev"
    """prev = SPEC-RL (last epoch's rollout; +ngram: n-gram drafts after a rejection), ngram = siblings (Seer),
    model = frozen draft, self = int8 policy (EfficientRollout), none = plain sampling"""
    draft_model: str = ""
    """the frozen draft model of --drafter model ('' = a frozen copy of the initial policy)"""
    gamma: int = 4
    """draft tokens per round for ngram / model / self (prev drafts the whole previous completion)"""
    adaptive_gamma: bool = False
    """pick gamma each round from the running acceptance estimate (EfficientRollout)"""
    pool_size: int = 512
    """training prompts in the fixed pool, revisited every epoch"""
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
    steps: int = 200
    """rollout batches (each followed by ppo_epochs * minibatches optimiser steps)"""
    ppo_epochs: int = 1
    """passes over each rollout batch"""
    minibatches: int = 1
    """optimiser steps per pass; the rollout batch is split into this many"""
    micro_batch_size: int = 256
    """sequences per forward/backward (gradient accumulation inside a mini-batch)"""
    lr: float = 1e-4
    """peak learning rate (AdamW); >= 3e-4 is unstable on the tiny policy, real LLMs want about 1e-6"""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """after warm-up: constant, or cosine decay to 10% over all optimiser steps"""
    warmup_steps: int = 0
    """linear warm-up (optimiser steps)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""
    # eval and checkpoints
    eval_every: int = 40
    """rollout batches between held-out evaluations"""
    eval_examples: int = 500
    """held-out prompts for greedy accuracy"""
    pass_k: int = 8
    """k of pass@k (on the first 100 held-out prompts; 0 = off)"""
    eval_hard: bool = True
    """also evaluate one digit harder than training (out of distribution)"""
    save_every: int = 0
    """rollout batches between checkpoints (0 = only at the end)"""


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
    if not 0 < args.top_p <= 1:
        raise SystemExit(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.gamma < 0:
        raise SystemExit(f"--gamma must be >= 0, got {args.gamma}")
    if args.pool_size < args.prompts_per_step:
        raise SystemExit(f"--pool-size ({args.pool_size}) must be at least --prompts-per-step "
                         f"({args.prompts_per_step})")


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
    stats = {"clipfrac": clipped}
    if mb["ref"] is not None:
        kl = k3_kl(logp, mb["ref"])
        tok_loss, stats["kl"] = tok_loss + args.kl_coef * kl, kl
    return aggregate_loss(tok_loss, mb["mask"], args.loss_agg, n_seqs, n_tokens, agg_const(args)), stats


# ---- speculative sampling, as algos/spec_decode.py: processed distributions ----
def process_logits(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0,
                   greedy: bool = False) -> torch.Tensor:
    """The distribution the sampler draws from: softmax(z / T) restricted to the top-p nucleus, renormalised.

    Same rule as transformers' TopPLogitsWarper (sort ascending, drop tokens whose cumulative mass is
    <= 1 - top_p, keep at least one). Greedy: one-hot on the argmax. logits [..., V] -> probs [..., V] fp32.
    """
    logits = logits.float()
    if greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / temperature
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum <= (1 - top_p)
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


# ---- the accept rule and the verifier ----
def accept_prob(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)): the rule that makes speculative sampling exact (a test swaps in min(1, q/p))."""
    return torch.clamp(p_x / q_x.clamp(min=1e-30), max=1.0)


def verify(drafts, q, p, n_draft, u):
    """Accept a prefix of each row's draft, then emit one more token (the resample or the bonus).

    drafts [B, K] (entries past n_draft ignored), q [B, K, V] draft distributions, p [B, K + 1, V] target
    distributions at the K + 1 positions, n_draft [B] draft length of each row (0..K), u [B, K + 1] uniforms
    (column j < K tests position j, column K drives the final draw, as in kernels/spec_rejection.py).
    Returns tokens [B, K + 1] (-1 after the last emitted token) and n_acc [B]; row i emits n_acc_i + 1 tokens.
    """
    B, K = drafts.shape
    V = p.shape[-1]
    ar = torch.arange(B, device=p.device)
    if K > 0:
        px = p[:, :K].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        qx = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        ok = (u[:, :K] < accept_prob(px, qx)) & (torch.arange(K, device=p.device)[None] < n_draft[:, None])
        n_acc = ok.long().cumprod(1).sum(1)
    else:
        n_acc = torch.zeros(B, dtype=torch.long, device=p.device)
    rejected = n_acc < n_draft
    p_r = p[ar, n_acc]
    q_r = q[ar, n_acc.clamp(max=max(K - 1, 0))] if K > 0 else torch.zeros_like(p_r)
    resid = torch.clamp(p_r - torch.where(rejected[:, None], q_r, torch.zeros_like(q_r)), min=0)
    use_res = rejected & (resid.sum(-1) > 0)  # rounding can leave no residual mass: fall back to p
    w = torch.where(use_res[:, None], resid, p_r)
    y = (w.cumsum(-1) <= (u[:, K] * w.sum(-1))[:, None]).sum(-1).clamp(max=V - 1)  # inverse CDF
    tokens = torch.full((B, K + 1), -1, dtype=torch.long, device=p.device)
    if K > 0:
        keep = torch.arange(K, device=p.device)[None] < n_acc[:, None]
        tokens[:, :K] = torch.where(keep, drafts, torch.full_like(drafts, -1))
    tokens[ar, n_acc] = y
    return tokens, n_acc


def expected_acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """beta = sum_v min(p(v), q(v)) = P(accept) at one position; alpha is its mean over tested positions."""
    return torch.minimum(p, q).sum(-1)


# ---- theory ----
def tokens_per_call_theory(alpha: float, gamma: int) -> float:
    """E[tokens emitted per target call] = (1 - alpha^(gamma+1)) / (1 - alpha) (= gamma + 1 at alpha = 1)."""
    return float(gamma + 1) if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def speedup_theory(alpha: float, gamma: int, c: float) -> float:
    """Expected wall-clock speedup over plain decoding when a draft call costs c target calls."""
    return tokens_per_call_theory(alpha, gamma) / (gamma * c + 1)


def best_gamma(alpha: float, c: float, gamma_max: int) -> int:
    """The draft length that maximises speedup_theory (EfficientRollout's acceptance-aware draft length); 0 = do
    not draft."""
    return max(range(gamma_max + 1), key=lambda g: (speedup_theory(alpha, g, c), -g))


# ---- a model with a KV cache that can take back rejected tokens ----
class CachedLM:
    """One model's KV cache over B rows that grow by different amounts each round.

    `step(seqs, keep)` feeds each row the tokens of seqs[j] not yet in the cache (right-aligned in one chunk;
    the unused slots are holes with attention mask 0) and returns the logits of the last `keep` slots [B, keep, V].
    `sync(seqs)` keeps, per row, the longest cached prefix that agrees with seqs[j] (minus its last token, which
    is always fed again) and masks out the rest: rejected drafts become holes, never recomputed.
    """

    def __init__(self, model, n_rows: int, pad_id: int):
        self.model, self.pad_id = model, pad_id
        self.device = next(model.parameters()).device
        self.cache, self.width = None, 0
        self.mask = torch.zeros(n_rows, 0, dtype=torch.long)
        self.cols: list[list[tuple[int, int]]] = [[] for _ in range(n_rows)]  # (column, token) of valid entries
        self.calls = 0

    def sync(self, seqs: list[list[int]]) -> None:
        for j, s in enumerate(seqs):
            if s is None:
                continue
            cols, n = self.cols[j], 0
            while n < len(cols) and n < len(s) - 1 and cols[n][1] == s[n]:
                n += 1
            for c, _ in cols[n:]:
                self.mask[j, c] = 0
            del cols[n:]

    @torch.no_grad()
    def step(self, seqs: list[list[int]], keep: int) -> torch.Tensor:
        self.sync(seqs)
        feeds = [s[len(self.cols[j]):] if s is not None else [] for j, s in enumerate(seqs)]
        m = max(max(len(f) for f in feeds), keep)
        ids = torch.full((len(seqs), m), self.pad_id, dtype=torch.long)
        pos = torch.zeros(len(seqs), m, dtype=torch.long)
        chunk_mask = torch.zeros(len(seqs), m, dtype=torch.long)
        for j, f in enumerate(feeds):
            if f:
                n0 = len(self.cols[j])
                ids[j, m - len(f):] = torch.tensor(f)
                pos[j, m - len(f):] = torch.arange(n0, n0 + len(f))
                chunk_mask[j, m - len(f):] = 1
                self.cols[j] += [(self.width + m - len(f) + t, tok) for t, tok in enumerate(f)]
        self.mask = torch.cat([self.mask, chunk_mask], 1)
        self.width += m
        out = self.model(input_ids=ids.to(self.device), attention_mask=self.mask.to(self.device),
                         position_ids=pos.to(self.device), past_key_values=self.cache, use_cache=True,
                         logits_to_keep=keep)
        self.cache = out.past_key_values
        self.calls += 1
        return out.logits.float().cpu()


# ---- drafters ----
class ModelDrafter:
    """A smaller model samples k tokens autoregressively from its processed distribution q (k cached forwards)."""

    name = "model"

    def __init__(self, model, pad_id: int, temperature: float, top_p: float, greedy: bool):
        self.model, self.pad_id = model, pad_id
        self.temperature, self.top_p, self.greedy = temperature, top_p, greedy
        self.lm, self.calls = None, 0

    def reset(self, n_rows: int) -> None:
        self.lm = CachedLM(self.model, n_rows, self.pad_id)

    @torch.no_grad()
    def propose(self, all_seqs: list[list[int]], rows: list[int], k: int):
        cur: list = [None] * len(all_seqs)
        for r in rows:
            cur[r] = list(all_seqs[r])
        toks, qs = [], []
        for _ in range(k):
            logits = self.lm.step(cur, 1)[rows, -1]
            q = process_logits(logits, self.temperature, self.top_p, self.greedy)
            x = q.argmax(-1) if self.greedy else torch.multinomial(q, 1).squeeze(-1)
            self.calls += 1
            toks.append(x)
            qs.append(q)
            for r, t in zip(rows, x.tolist()):
                cur[r].append(t)
        n = torch.full((len(rows),), k, dtype=torch.long)
        if k == 0:
            return torch.zeros(len(rows), 0, dtype=torch.long), None, n
        return torch.stack(toks, 1), torch.stack(qs, 1), n


def ngram_draft(ctx: list[int], corpus: list[list[int]], k: int, n_max: int) -> list[int]:
    """Continue ctx by the longest suffix (n_max..1 tokens) found in the corpus; among the continuations of
    that suffix, extend token by token with the majority next token (a vote over siblings)."""
    for n in range(min(n_max, len(ctx)), 0, -1):
        suf = ctx[-n:]
        conts = [seq[i + n:i + n + k] for seq in corpus for i in range(len(seq) - n)
                 if seq[i:i + n] == suf]
        conts = [c for c in conts if c]
        if not conts:
            continue
        out = []
        while conts and len(out) < k:
            counts: dict[int, int] = {}
            for c in conts:
                counts[c[0]] = counts.get(c[0], 0) + 1
            best = max(counts, key=lambda t: (counts[t], -t))
            out.append(best)
            conts = [c[1:] for c in conts if c[0] == best and len(c) > 1]
        return out
    return []


class NgramDrafter:
    """Suffix drafter over the text of the same group: the prompt, the siblings so far and any `extra`
    texts of the same prompt (e.g. earlier rollouts). Deterministic: q is one-hot on the drafted token."""

    name = "ngram"

    def __init__(self, group_size: int, vocab: int, n_max: int = 4, extra: dict | None = None):
        self.G, self.V, self.n_max, self.extra = group_size, vocab, n_max, extra or {}
        self.calls = 0

    def reset(self, n_rows: int) -> None:
        pass

    def propose(self, all_seqs: list[list[int]], rows: list[int], k: int):
        toks = torch.zeros(len(rows), k, dtype=torch.long)
        n = torch.zeros(len(rows), dtype=torch.long)
        for j, r in enumerate(rows):
            g, s = r // self.G, all_seqs[r]
            corpus = [all_seqs[o] for o in range(g * self.G, (g + 1) * self.G) if o != r]
            corpus += self.extra.get(g, [])
            d = ngram_draft(s, corpus, k, self.n_max) if k else []
            toks[j, :len(d)] = torch.tensor(d, dtype=torch.long)
            n[j] = len(d)
        q = torch.nn.functional.one_hot(toks, self.V).float() if k else None
        return toks, q, n


# ---- the speculative generation loop ----
@dataclass
class SpecStats:
    target_calls: int = 0  # batched target forwards
    row_calls: int = 0  # sum over target forwards of the rows in them (per-sequence forwards)
    draft_calls: int = 0  # batched draft-model forwards
    rounds_with_draft: int = 0  # row-rounds that had at least one drafted token
    drafted: int = 0  # drafted tokens offered to the verifier
    tested: int = 0  # drafted positions whose acceptance was tested (up to and including the first rejection)
    accepted: int = 0  # drafted tokens accepted
    alpha_sum: float = 0.0  # sum over tested positions of sum_v min(p, q)
    emitted: int = 0  # tokens kept (up to EOS and the budget)
    reused: int = 0  # accepted draft tokens that were kept (drafts accepted past an EOS are not)
    target_s: float = 0.0
    draft_s: float = 0.0

    def summary(self) -> dict:
        return {"target_calls": self.target_calls, "row_calls": self.row_calls, "draft_calls": self.draft_calls,
                "alpha": self.alpha_sum / max(self.tested, 1),
                "accept_rate": self.accepted / max(self.drafted, 1),
                "mean_accepted": self.accepted / max(self.rounds_with_draft, 1),
                "tokens_per_row_call": self.emitted / max(self.row_calls, 1),
                "row_calls_per_token": self.row_calls / max(self.emitted, 1),
                "emitted": self.emitted, "reused_frac": self.reused / max(self.emitted, 1),
                "target_s": self.target_s, "draft_s": self.draft_s}


@torch.no_grad()
def spec_generate(target, prompts: list[list[int]], group_size: int, max_new_tokens: int, pad_id: int,
                  eos_id: int, drafter=None, gamma: int = 4, temperature: float = 1.0, top_p: float = 1.0,
                  greedy: bool = False, adaptive_gamma: bool = False, draft_cost: float = -1.0, waves: int = 1,
                  keep_probs: bool = False):
    """Sample group_size completions per prompt with speculative sampling; rows group-major as common.generate.

    Returns (completions: list of token lists (EOS included when the row stopped), logprobs: list of lists
    (log p of each emitted token under the target's processed distribution), SpecStats, probs: per row a
    [len, V] tensor of p at each emitted position when keep_probs, else None).
    """
    seqs = [list(p) for p in prompts for _ in range(group_size)]  # prompt + generated, per row
    B = len(seqs)
    plen = [len(s) for s in seqs]
    lps: list[list[float]] = [[] for _ in range(B)]
    probs: list[list[torch.Tensor]] = [[] for _ in range(B)]
    done = [False] * B
    st = SpecStats()
    alpha_hat, c_hat = 0.8, (draft_cost if draft_cost >= 0 else 0.5)
    lm = CachedLM(target, B, pad_id)
    if drafter is not None:
        drafter.reset(B)
    wave_of = [min((r % group_size) * waves // group_size, waves - 1) for r in range(B)]
    for wave in range(waves):
        while True:
            rows = [r for r in range(B) if not done[r] and wave_of[r] == wave]
            if not rows:
                break
            room = torch.tensor([max_new_tokens - (len(seqs[r]) - plen[r]) - 1 for r in rows])  # leave 1 slot
            g = gamma if not adaptive_gamma else best_gamma(alpha_hat, c_hat, gamma)
            k = min(g, int(room.max())) if drafter is not None else 0
            t0 = time.perf_counter()
            q = None
            if k > 0:
                calls0 = drafter.calls
                drafts, q, n_draft = drafter.propose(seqs, rows, k)
                st.draft_calls += drafter.calls - calls0
                n_draft = torch.minimum(n_draft, room)
                k = int(n_draft.max())
                drafts, q = drafts[:, :k], q[:, :k] if q is not None else None
            if k == 0:
                drafts, n_draft = torch.zeros(len(rows), 0, dtype=torch.long), torch.zeros(len(rows), dtype=torch.long)
            t1 = time.perf_counter()
            ext: list = [None] * B
            for j, r in enumerate(rows):
                ext[r] = seqs[r] + drafts[j, :int(n_draft[j])].tolist()
            logits = lm.step(ext, k + 1)[rows]  # [n, k+1, V]; each row's chunk ends at the right edge
            # row j's n_j + 1 predictions sit in the last n_j + 1 slots: move them to the front
            idx = (torch.arange(k + 1)[None] + (k - n_draft)[:, None]).clamp(max=k)
            p = process_logits(logits.gather(1, idx[..., None].expand(-1, -1, logits.shape[-1])), temperature,
                               top_p, greedy)
            t2 = time.perf_counter()
            st.target_calls += 1
            st.row_calls += len(rows)
            u = torch.rand(len(rows), k + 1)
            qq = q if k > 0 else torch.zeros(len(rows), 0, p.shape[-1])
            tokens, n_acc = verify(drafts, qq, p, n_draft, u)
            if k > 0:
                tested = torch.minimum(n_acc + 1, n_draft)
                tmask = torch.arange(k)[None] < tested[:, None]
                beta = (expected_acceptance(p[:, :k], qq) * tmask).sum()
                st.alpha_sum += float(beta)
                st.tested += int(tested.sum())
                st.drafted += int(n_draft.sum())
                st.accepted += int(n_acc.sum())
                st.rounds_with_draft += int((n_draft > 0).sum())
                if int(tested.sum()):
                    alpha_hat = 0.7 * alpha_hat + 0.3 * float(beta / tested.sum())
            st.target_s += t2 - t1
            st.draft_s += t1 - t0
            if k > 0 and draft_cost < 0 and st.draft_calls:
                c_hat = (st.draft_s / st.draft_calls) / max(st.target_s / st.target_calls, 1e-9)
            logp_all = torch.log(p.clamp(min=1e-30))
            for j, r in enumerate(rows):
                for pos in range(int(n_acc[j]) + 1):
                    t = int(tokens[j, pos])
                    seqs[r].append(t)
                    lps[r].append(float(logp_all[j, pos, t]))
                    if keep_probs:
                        probs[r].append(p[j, pos])
                    st.emitted += 1
                    st.reused += int(pos < int(n_acc[j]))
                    if t == eos_id or len(seqs[r]) - plen[r] >= max_new_tokens:
                        done[r] = True
                        break
    comp = [s[n:] for s, n in zip(seqs, plen)]
    return comp, lps, st, ([torch.stack(x) if x else torch.zeros(0) for x in probs] if keep_probs else None)


def to_rollout(tok, prompts, group_size, comp, lps, eos_id) -> common.Rollout:
    """Pack the lists into the common.Rollout layout (left-padded prompts, right-padded completions)."""
    ids, mask = common.left_pad([p for p in prompts for _ in range(group_size)], tok.pad_token_id)
    C = max(1, max(len(c) for c in comp))
    cids = torch.full((len(comp), C), tok.pad_token_id, dtype=torch.long)
    cmask, lp = torch.zeros(len(comp), C, dtype=torch.long), torch.zeros(len(comp), C)
    for i, (c, l) in enumerate(zip(comp, lps)):
        cids[i, :len(c)], cmask[i, :len(c)], lp[i, :len(c)] = torch.tensor(c), 1, torch.tensor(l)
    finish = ["stop" if c and c[-1] == eos_id else "length" for c in comp]
    return common.Rollout(ids, mask, cids, cmask, lp, finish, tok.batch_decode(cids, skip_special_tokens=True))


# ---- SPEC-RL's drafter, the int8 self-drafter, and the rollout engine that holds them ----
class PrevDrafter:
    """SPEC-RL: the first round of each row drafts its previous-epoch completion with the stored q.

    With `then` (an NgramDrafter over the group's previous completions and siblings) the rows rejected in the
    first round keep drafting instead of decoding one token per call (--drafter prev+ngram)."""

    name = "prev"

    def __init__(self, group_size: int, then=None, then_gamma: int = 4):
        self.G, self.calls, self.then, self.then_gamma = group_size, 0, then, then_gamma
        self.prior: dict = {}  # group index in this batch -> [(tokens, q [len, V])] * G (set before each rollout)
        self.plen: list[int] = []

    def reset(self, n_rows: int) -> None:
        pass

    def propose(self, all_seqs, rows, k):
        V = next(iter(self.prior.values()))[0][1].shape[-1] if self.prior else 1
        toks = torch.zeros(len(rows), k, dtype=torch.long)
        q = torch.zeros(len(rows), k, V)
        n = torch.zeros(len(rows), dtype=torch.long)
        later = []  # rows past their first round: the `then` drafter (if any) continues them
        for j, r in enumerate(rows):
            old = self.prior.get(r // self.G)
            if len(all_seqs[r]) != self.plen[r]:
                later.append(j)
                continue
            if old is None:
                continue
            t, qr = old[r % self.G]
            m = min(len(t), k)
            toks[j, :m], q[j, :m], n[j] = torch.tensor(t[:m], dtype=torch.long), qr[:m], m
        if later and self.then is not None and self.prior:
            tt, tq, tn = self.then.propose(all_seqs, [rows[j] for j in later], min(k, self.then_gamma))
            for i, j in enumerate(later):
                m = int(tn[i])
                toks[j, :m], q[j, :m], n[j] = tt[i, :m], tq[i, :m], m
        if len(rows) == 0 or int(n.max()) == 0:
            return torch.zeros(len(rows), 0, dtype=torch.long), None, n
        return toks, q, n


@torch.no_grad()
def fake_int8_copy(model):
    """EfficientRollout's self-drafter: a copy of the policy with every weight matrix rounded to int8 (per-row
    absmax)."""
    m = copy.deepcopy(model).eval().requires_grad_(False)
    for p in m.parameters():
        if p.dim() == 2:
            s = p.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
            p.copy_(torch.round(p / s).clamp(-127, 127) * s)
    return m


def make_drafter(args: Args, model, tok, device):
    """The drafter of --drafter (None: plain sampling through the same loop, the baseline)."""
    sampling = (tok.pad_token_id, args.temperature, args.top_p, False)
    if args.drafter == "model":
        dm, dtok = common.load_model(args.draft_model, device, args.dtype) if args.draft_model else (copy.deepcopy(model), tok)
        if dtok.get_vocab() != tok.get_vocab():
            raise SystemExit(f"--draft-model {args.draft_model} has a different tokenizer from --model")
        return ModelDrafter(dm.eval().requires_grad_(False), *sampling)
    if args.drafter == "self":  # its model is an int8 copy of the policy, re-made before every rollout
        return ModelDrafter(None, *sampling)
    ngram = NgramDrafter(args.group_size, model.config.vocab_size)
    return {"ngram": ngram, "prev": PrevDrafter(args.group_size),
            "prev+ngram": PrevDrafter(args.group_size, ngram, args.gamma)}.get(args.drafter)


class Speculator:
    """The rollout engine: the fixed prompt pool, the drafter, each prompt's last rollout, the running SpecStats."""

    def __init__(self, args: Args, model, tok, task, device, rank: int = 0):
        self.args, self.drafter, self.total = args, make_drafter(args, model, tok, device), SpecStats()
        self.gamma = args.max_new_tokens if args.drafter.startswith("prev") else args.gamma
        self.pool = task.sample("train", args.pool_size, np.random.default_rng([args.seed, 777, rank]))
        self.pool_prompts = common.encode_prompts(tok, [e.prompt for e in self.pool])
        self.memory: dict[int, list] = {}  # pool index -> [(completion tokens, q [len, V] or None)] * G

    def batch_of(self, step: int) -> tuple[int, list[int]]:
        """(epoch, pool indices) of rollout batch `step`: each epoch visits the pool once, in a new order."""
        n = self.args.prompts_per_step
        epoch, slot = divmod(step - 1, self.args.pool_size // n)
        order = np.random.default_rng([self.args.seed, epoch]).permutation(self.args.pool_size)
        return epoch, order[slot * n:(slot + 1) * n].tolist()

    def summary(self, history: list[dict]) -> dict:
        """Target forwards per token, reused fraction, acceptance overall and early / late in the run."""
        s, train = self.total.summary(), [h for h in history if "rollout/alpha" in h]
        later = [h for h in train if h["rollout/epoch"] >= 1] or train  # SPEC-RL has no draft in epoch 0
        tenth = max(1, len(later) // 10)
        return {**{k: s[k] for k in ("target_calls", "row_calls", "draft_calls", "row_calls_per_token",
                                     "reused_frac", "alpha")},
                "target_calls_per_step": s["target_calls"] / max(len(train), 1),
                "alpha_early": float(np.mean([h["rollout/alpha"] for h in later[:tenth]])),
                "alpha_late": float(np.mean([h["rollout/alpha"] for h in later[-tenth:]]))}


# ---- rollout and update ----
def rollout(model, tok, task, args: Args, step: int, device, spec: Speculator) -> dict:
    """Sample G completions for each of prompts_per_step pool prompts speculatively; reward them; A_i per group.

    The drafter sees what it may: SPEC-RL the group's rollout of the last epoch (with the q it was sampled
    from), the n-gram drafter that rollout and the siblings, the self-drafter an int8 copy of the policy.
    """
    epoch, idx = spec.batch_of(step)
    examples, prompts = [spec.pool[i] for i in idx], [spec.pool_prompts[i] for i in idx]
    d, prev, G = spec.drafter, [spec.memory.get(i) for i in idx], args.group_size
    if args.drafter == "self":
        d.model = fake_int8_copy(model)
    if args.drafter.startswith("prev"):
        d.prior, d.plen = {g: m for g, m in enumerate(prev) if m}, [len(p) for p in prompts for _ in range(G)]
    if args.drafter in ("ngram", "prev+ngram"):
        ngram = d.then if args.drafter == "prev+ngram" else d  # n-grams also from last epoch's rollouts
        ngram.extra = {g: [prompts[g] + t for t, _ in m] for g, m in enumerate(prev) if m}
    model.eval()
    comp, lps, st, probs = spec_generate(model, prompts, G, args.max_new_tokens, tok.pad_token_id, tok.eos_token_id,
                                         d, spec.gamma, args.temperature, args.top_p, False, args.adaptive_gamma,
                                         keep_probs=args.drafter.startswith("prev"))
    model.train()
    if args.drafter in ("prev", "prev+ngram", "ngram"):  # remember this visit: the next epoch's drafts
        for g, i in enumerate(idx):
            spec.memory[i] = [(comp[r], probs[r] if probs is not None else None) for r in range(g * G, (g + 1) * G)]
    for f in fields(SpecStats):
        setattr(spec.total, f.name, getattr(spec.total, f.name) + getattr(st, f.name))
    ro = to_rollout(tok, prompts, G, comp, lps, tok.eos_token_id)
    answers = [e.answer for e in examples for _ in range(G)]
    rewards = torch.tensor([task.verify(t, a)[0] for t, a in zip(ro.texts, answers)], device=device)
    batch = {k: getattr(ro, k).to(device) for k in
             ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs")}
    s = st.summary()
    batch.update(rewards=rewards, adv=group_advantages(rewards, G, args.adv_std_norm), finish_reasons=ro.finish_reasons,
                 spec_metrics={"rollout/epoch": epoch, **{f"rollout/{k}": s[k] for k in (
                     "alpha", "accept_rate", "mean_accepted", "target_calls", "row_calls_per_token", "reused_frac")}})
    return batch


def lr_factor(step: int, total: int, args: Args) -> float:
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    if args.lr_schedule == "constant":
        return 1.0
    progress = (step - args.warmup_steps) / max(1, total - args.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def optimizer_step(model, opt, args: Args, accel, opt_step: int) -> float:
    """All-reduce (sum: the loss used global normalisers), NaN guard, clip, scheduled lr, step; returns the norm."""
    if accel.num_processes > 1:
        for p in model.parameters():
            if p.grad is not None:
                p.grad = accel.reduce(p.grad, "sum")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm))
    if not math.isfinite(grad_norm):  # the same all-reduced value on every rank, so all ranks stop together
        raise SystemExit(f"non-finite loss or gradient at optimiser step {opt_step}; the last checkpoint is "
                         "intact. Lower --lr or check the rewards.")
    for group in opt.param_groups:
        group["lr"] = args.lr * lr_factor(opt_step, args.steps * args.ppo_epochs * args.minibatches, args)
    opt.step()
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
    # Sampler-vs-trainer log-prob gap on the sampler's weights: measured before any update of this batch.
    mismatch = 0.0 if on_policy else common.masked_mean((old - batch["logprobs"]).abs(),
                                                        batch["completion_mask"].float()).item()
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
                      "old": logp.detach() if old is None else old[idx], "ref": None if ref is None else ref[idx]}
                loss, token_stats = loss_fn(logp, mb, n_seqs, n_tokens, args)
                loss.backward()  # a NaN here reaches every rank's gradient: optimizer_step stops them all
                stats["pg"] += loss.item()
                for k, v in {**token_stats, "entropy": ent}.items():
                    stats[k] = stats.get(k, 0.0) + common.masked_sum(v.detach(), mb["mask"]).item() / max(n_tokens, 1)
                if on_policy:  # the only forward on the sampler's weights
                    mismatch += common.masked_sum((logp.detach() - batch["logprobs"][idx]).abs(),
                                                  mb["mask"]).item() / max(n_tokens, 1)
            opt_step = (step - 1) * args.ppo_epochs * args.minibatches + n_opt  # derived: resume-safe
            stats["grad_norm"] += optimizer_step(model, opt, args, accel, opt_step)
            n_opt += 1
    return {**{f"loss/{k}": v / n_opt for k, v in stats.items()}, "rollout/logprob_mismatch": mismatch}


def save_drift(history: list[dict], path: Path, title: str) -> None:
    """Acceptance (alpha) and reused fraction per rollout batch: how drafting keeps up with the moving policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [h for h in history if "rollout/alpha" in h]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([h["step"] for h in rows], [h["rollout/alpha"] for h in rows], label="acceptance alpha")
    ax.plot([h["step"] for h in rows], [h["rollout/reused_frac"] for h in rows], label="reused fraction")
    ax.set(xlabel="rollout batch", ylim=(0, 1), title=title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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
    model, tok = common.load_model(args.model, accel.device, args.dtype)
    model.train()
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if args.kl_coef > 0 else None
    spec = Speculator(args, model, tok, task, accel.device, rank)  # the rollout engine: speculative sampling
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    run_dir = Path(args.out_dir) / args.exp_name
    history, gen_tokens, gen_time = [], 0, 0.0
    tracker = common.Tracker(run_dir, args, args.track, run_name=args.exp_name) if is_main else None
    timer, t_start = common.Timer(), time.time()
    evaluate = lambda: common.run_eval(model, tok, task, eval_sets, args.max_new_tokens, args.pass_k,  # noqa: E731
                                       args.temperature, hard_task)

    def log(metrics: dict, step: int):
        history.append({"step": step, **metrics})
        if tracker is not None:
            tracker.log(metrics, step)

    if is_main:
        log(evaluate(), 0)
    bar = tqdm(range(1, args.steps + 1), desc=f"spec_rl[{args.drafter}]", dynamic_ncols=True, disable=not is_main)
    for step in bar:
        # Every random draw of this step depends on (seed, step, rank) only.
        torch.manual_seed(hash((args.seed, step, rank)) % 2**31)
        with timer("gen"):
            batch = rollout(model, tok, task, args, step, accel.device, spec)
        with timer("train"):
            stats = update(model, opt, batch, grpo_loss, args, step, accel, ref_model)
        t = timer.pop()
        gen_tokens, gen_time = gen_tokens + int(batch["completion_mask"].sum()), gen_time + t["gen"]
        metrics = {**common.rollout_metrics(batch["rewards"], batch["completion_mask"], batch["finish_reasons"],
                                            args.group_size, t["gen"]), **batch["spec_metrics"], **stats,
                   "perf/lr": opt.param_groups[0]["lr"], **{f"perf/{k}_s": v for k, v in t.items()}}
        if is_main and (step % args.eval_every == 0 or step == args.steps):
            metrics.update(evaluate())
        log(metrics, step)
        if is_main:
            bar.set_postfix(reward=f"{metrics['rollout/reward']:.2f}", alpha=f"{metrics['rollout/alpha']:.2f}",
                            acc=f"{next(h['eval/acc'] for h in reversed(history) if 'eval/acc' in h):.2f}")
        if is_main and (args.save_every and step % args.save_every == 0 or step == args.steps):
            common.save_checkpoint(run_dir / "checkpoint", accel.unwrap_model(model), tok, opt,
                                   {"step": step, "history": history, "wall_s": time.time() - t_start,
                                    "gen_tokens": gen_tokens, "gen_time": gen_time})
    if not is_main:
        return {}
    summary = {**common.summarize(history, gen_tokens, gen_time, time.time() - t_start), **spec.summary(history),
               "gen_s": gen_time}
    common.save_curve(history, run_dir / "curve.png", f"GRPO with {args.drafter} drafts on {task.name} ({args.model})")
    save_drift(history, run_dir / "drift.png", f"drafter {args.drafter}: acceptance as the policy trains")
    return tracker.finish(summary)


if __name__ == "__main__":
    main(tyro.cli(Args))
