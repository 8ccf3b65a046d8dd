"""AsyncOPD: on-policy distillation from stale rollouts, with a finite teacher-score cache.

Paper: "AsyncOPD: How Stale Can On-Policy Distillation Be?", arXiv:2606.24143.

Asynchronous OPD samples rollouts with a student snapshot that is --staleness k optimiser steps old
(simulated exactly: the sampler loads the weights of k updates ago), and the teacher's scores are not
full-vocabulary logits but a finite cache per position.

Per completion position t (prefix sampled by the stale policy b = pi_{theta_{n-k}}), s = log pi_theta (now),
q = teacher log-probs, b = behaviour log-probs:

  fkl            forward KL, teacher-weighted:  sum_v p_t(v) (q(v) - s(v))             forward_kl
                 (over the cache's top-k when --cache-k is set: sum over the cached ids, renormalised)
  rkl-stale      sampled reverse KL with the signal frozen at rollout time:              rkl_sampled_loss
                 r_t = -(b(y_t) - q(y_t)),  loss = -r_t s(y_t)
  rkl-tis        rkl-stale times a truncated importance weight min(pi_theta/b, --tis-cap) (an async-RL
                 stabiliser)
  rkl-recompute  the signal recomputed under the current student at learner time:
                 r_t = -(s(y_t) - q(y_t)).detach()
  rkl-mc         multi-sample Monte Carlo: M = --mc-samples extra tokens per position drawn from b at
                 rollout time (mc_draws), their teacher scores cached; at learner time
                 loss = 1/M sum_m w_m (s(z_m) - q(z_m)).detach() s(z_m),  w_m = pi_theta(z_m)/b(z_m)  mc_rkl_loss
                 Unbiased per prefix ("MC correctability"): at a given prefix, E_{z~b}[w (s - q) grad s] is the
                 exact gradient of the local KL(pi_theta || pi_t) there, however stale b is. It is not unbiased
                 for the on-policy objective: the prefixes themselves were sampled by the stale b, so a batch
                 weights each prefix by its probability under b, not under pi_theta (nothing here reweights
                 whole prefixes): a bias that is 0 at staleness 0 and grows as b drifts from pi_theta.
  rkl-sparse     reverse KL on the cached top-k support: KL(p~_s || p~_t) with both renormalised over
                 the k cached ids (biased when k < V; exact at k = V)                     sparse_rkl
  aggregation    token mean over the step's completion tokens (each variant per token: token_loss)
                                                                                          async_opd_loss

Teacher cache (teacher_cache): the top-k teacher log-probs per position plus the teacher log-prob of every
token the estimator will need (the sampled token, and the M Monte Carlo tokens); with k = V the sparse
loss equals the exact reverse KL.

cache_bias_variance() measures, on one real batch, the bias and variance of the per-position gradient
(w.r.t. the student logits) of the sparse, 1-sample and M-sample estimators against the exact reverse-KL
gradient, for several k; for the sampled estimators it also gives the bias net of the Var/draws noise floor
that the mean of finitely many draws keeps. The draws come from the student itself at fixed prefixes, so
this is the cache's bias per prefix, not the stale-prefix bias above. benchmarks/async_opd_staleness.py
tabulates it with accuracy vs staleness.

The truncation-collapse signals of StableOPD ("Demystifying OPD: Length Inflation and Stabilization Strategies
for Large Language Models", arXiv:2604.08527), rollout/length, rollout/truncated_frac and rollout/repeat_frac,
are logged every step, and rollout/logprob_mismatch (opd.py's sampler-vs-trainer gap) is here the staleness:
the mean |log pi_theta(y_t) - log b(y_t)| on the sampled tokens.

Parent: algos/opd.py; changed: Args, Args.eval_every, Args.eval_hard, Args.group_size, Args.lr_schedule,
  Args.prompts_per_step, Args.steps, Args.teacher, check_args, rollout, lr_at, main.

What changes from OPD: the sampler is a snapshot k updates old (main keeps the last k + 1 weights), and the
loss_fn fed to opd.py's `update` is async_opd_loss, which reads the teacher only through the finite cache
(teacher_cache, token_loss). rollout samples every prompt with the stale student; for rkl-mc it also draws the
Monte Carlo tokens from b and keeps b's log-probs of them (rollout-time quantities). The teacher's forward
stays in `update` (learner time): the teacher is frozen, so its scores are those a rollout-time cache would
hold. lr_at: llm.lr_factor's schedule (by default a warm-up, then constant: no decay). Eval, metrics, summary and
curve are common.py's.

Deviations:
- Staleness is simulated in one process (a snapshot k updates old samples); no throughput claim.
- KL is local (per position at the sampled prefix), as in algos/opd.py.
- The paper's exact cache layout and estimator normalisations are not in the abstract; the ones here are
  the plainest choices (renormalised top-k; importance-weighted M-sample average).
- The teacher's scores for the sampled tokens are always kept (a real cache stores them with the rollout).
- One process, Hugging Face sampling (--engine vllm is refused); the checkpoint holds the student but not the k
  stale snapshots, so --resume is refused. On CUDA the snapshot samples with common.Sampler's bf16 weight copy;
  the estimators read its log-probs as b (rkl-stale, rkl-tis), and rkl-mc draws from the snapshot's own forward.

Commands:
  python algos/async_opd.py                                            # rkl-mc (M = 4), k = 2, ~3 min
  python algos/async_opd.py --variant rkl-stale --staleness 8
  python algos/async_opd.py --variant fkl --staleness 8 --cache-k 8
  python algos/async_opd.py --variant rkl-mc --mc-samples 4 --staleness 2
Expected: held-out greedy accuracy of tiny-0.6m on 2-digit addition rises from 35% toward the teacher's
~72%; in 40 steps (3 seeds, benchmarks/results/async_opd.md) fkl keeps 44.9 / 45.2 / 45.2% at k = 0 / 2 / 8,
rkl-stale collapses (46.9% at k = 0, 2.3% at k = 2), rkl-mc keeps 48.2% at k = 2 (50.1% at k = 0).
"""
from __future__ import annotations

import collections
import copy
import dataclasses
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

VARIANTS = ("fkl", "rkl-stale", "rkl-tis", "rkl-recompute", "rkl-mc", "rkl-sparse")


@dataclass
class Args(LLMArgs):
    """AsyncOPD's own flags; the plumbing flags (run, --model: the student, task, optimiser, eval, checkpoints) are
    LLMArgs'."""
    teacher: str = "tiny-5m"
    """the teacher (same tokenizer as the student)"""
    threads: int = 1
    """torch CPU threads (1 is faster than 2 on a shared 2-core machine)"""
    variant: Literal["fkl", "rkl-stale", "rkl-tis", "rkl-recompute", "rkl-mc", "rkl-sparse"] = "rkl-mc"
    """the loss / signal (see the header)"""
    staleness: int = 2
    """k: rollouts come from the student of k optimiser steps ago (0 = synchronous)"""
    cache_k: int = 0
    """top-k teacher log-probs kept per position (0 = the full vocabulary)"""
    mc_samples: int = 4
    """M of rkl-mc"""
    tis_cap: float = 2.0
    """cap of the truncated importance weight of rkl-tis"""
    steps: int = 120
    """optimiser steps (one rollout batch each)"""
    prompts_per_step: int = 32
    """prompts per batch"""
    group_size: int = 4
    """completions per prompt"""
    warmup_steps: int = 10
    """linear learning-rate warm-up (Adam's first steps are sign-like and overshoot at full lr)"""
    eval_every: int = 30
    """steps between held-out evaluations"""
    eval_hard: bool = False
    """also evaluate one digit harder (out of distribution)"""
    pass_k: int = 0
    """k of pass@k (on the first 100 held-out prompts; 0 = off)"""


def check_args(args: Args) -> None:
    """Fail early, naming the flag, instead of deep inside torch."""
    if args.staleness < 0:
        raise SystemExit(f"--staleness must be >= 0, got {args.staleness}")
    if args.cache_k < 0:
        raise SystemExit(f"--cache-k must be >= 0 (0 = full vocabulary), got {args.cache_k}")
    if args.mc_samples < 1:
        raise SystemExit("--mc-samples must be >= 1")
    if args.tis_cap <= 0:
        raise SystemExit("--tis-cap must be > 0")
    if args.steps < 1 or args.prompts_per_step < 1 or args.group_size < 1 or args.max_new_tokens < 1:
        raise SystemExit("--steps, --prompts-per-step, --group-size and --max-new-tokens must be positive")
    if args.temperature <= 0:
        raise SystemExit("--temperature must be > 0")
    if args.micro_batch_size < 1:
        raise SystemExit("--micro-batch-size must be positive")
    if args.engine == "vllm":
        raise SystemExit("--engine vllm: the k-step-old snapshot samples through Hugging Face generate here (a vLLM "
                         "engine would have to load each snapshot's weights); use --engine hf")
    if args.resume:
        raise SystemExit("--resume: an AsyncOPD checkpoint holds the student, not the k stale snapshots that sample "
                         "the next steps; start a new run (--model the checkpoint folder continues from its weights)")


def check_teacher(tok_s, tok_t, student, teacher, name: str) -> None:
    """The teacher must share the student's tokenizer: same vocabulary and same output size."""
    vs, vt = tok_s.get_vocab(), tok_t.get_vocab()
    if vs != vt:
        diff = len(set(vs.items()) ^ set(vt.items()))
        raise SystemExit(f"--teacher {name}: its tokenizer differs from the student's ({len(vt)} vs {len(vs)} "
                         f"tokens, {diff} mismatched entries); OPD needs one shared vocabulary")
    ns, nt = student.get_output_embeddings().weight.shape[0], teacher.get_output_embeddings().weight.shape[0]
    if ns != nt:
        raise SystemExit(f"--teacher {name}: output layer has {nt} logits, the student's has {ns}")


# ---- divergences (as algos/opd.py) ----
def reverse_kl(s_logp: torch.Tensor, t_logp: torch.Tensor) -> torch.Tensor:
    """KL(pi_s || pi_t) per position: sum_v p_s (s - q); inputs [..., V] log-probs -> [...]."""
    return (s_logp.exp() * (s_logp - t_logp)).sum(-1)


def forward_kl(s_logp: torch.Tensor, t_logp: torch.Tensor) -> torch.Tensor:
    """KL(pi_t || pi_s) per position: sum_v p_t (q - s)."""
    return (t_logp.exp() * (t_logp - s_logp)).sum(-1)


# ---- the idea: cache and estimators ----
def teacher_cache(t_logp: torch.Tensor, k: int, extra_ids: torch.Tensor | None = None) -> dict:
    """What a finite teacher-score cache holds per position: top-k (ids, log-probs) and, for extra_ids
    [..., M] (sampled tokens the estimators need), their teacher log-probs. k = 0 or >= V keeps all."""
    V = t_logp.shape[-1]
    k = V if k <= 0 or k >= V else k
    vals, ids = t_logp.topk(k, -1)
    out = {"ids": ids, "vals": vals}
    if extra_ids is not None:
        out["extra_ids"], out["extra_vals"] = extra_ids, t_logp.gather(-1, extra_ids)
    return out


def sparse_rkl(s_logp, cache):
    """Reverse KL on the cached support, both sides renormalised over the k ids (exact when k = V)."""
    s = s_logp.gather(-1, cache["ids"])
    s = s - torch.logsumexp(s, -1, keepdim=True)
    q = cache["vals"] - torch.logsumexp(cache["vals"], -1, keepdim=True)
    return reverse_kl(s, q)


def sparse_fkl(s_logp, cache):
    """Forward KL on the cached support (teacher-weighted), both renormalised (exact when k = V)."""
    s = s_logp.gather(-1, cache["ids"])
    s = s - torch.logsumexp(s, -1, keepdim=True)
    q = cache["vals"] - torch.logsumexp(cache["vals"], -1, keepdim=True)
    return forward_kl(s, q)


def rkl_sampled_loss(s_tok, signal_logp, t_tok, weight=None):
    """-r s(y), r = -(signal(y) - q(y)).detach(); signal = behaviour (stale) or current log-probs."""
    r = -(signal_logp - t_tok).detach()
    w = 1.0 if weight is None else weight.detach()
    return -w * r * s_tok


def mc_draws(behav_logp: torch.Tensor, m: int, gen=None) -> torch.Tensor:
    """M tokens per position drawn from the behaviour policy b (with replacement): [..., V] -> [..., M]."""
    z = torch.multinomial(behav_logp.exp().reshape(-1, behav_logp.shape[-1]), m, replacement=True, generator=gen)
    return z.view(*behav_logp.shape[:-1], m)


def mc_rkl_loss(s_logp, z_ids, z_teacher, z_behav):
    """M-sample Monte Carlo reverse KL: mean_m w_m (s(z_m) - q(z_m)).detach() s(z_m), w = pi_theta/b.

    s_logp [..., V]; z_ids, z_teacher, z_behav [..., M] (draws from b, their cached teacher and behaviour
    log-probs). E_b[w (s - q) grad s] = grad KL(pi_theta || pi_t) at the position.
    """
    s = s_logp.gather(-1, z_ids)
    w = (s - z_behav).exp().detach()
    return (w * (s - z_teacher).detach() * s).mean(-1)


def cache_bias_variance(s_logits, t_logp, ks=(1, 4, 16, 0), mc=(1, 4), draws: int = 64, seed: int = 0) -> list[dict]:
    """Bias and variance of per-position gradient estimators of KL(pi_s || pi_t) w.r.t. the student logits.

    s_logits [N, V] (student), t_logp [N, V] (teacher); memory stays a few [N, V] tensors whatever `draws` is
    (the draws' mean and spread are accumulated, not stacked). For each estimator, with g_bar the mean of `draws`
    draws: rel_bias = mean over positions of |g_bar - g_exact|^2, rel_var = mean over positions of the draws'
    spread mean_d |g_d - g_bar|^2, both relative to the mean |g_exact|^2. For a sampled estimator rel_bias is
    not its squared bias: E|g_bar - g_exact|^2 = bias^2 + Var/draws, and Var/draws is the noise floor that an
    unbiased estimator still shows. rel_bias_net = rel_bias - rel_var / (draws - 1) removes it (an unbiased
    estimate of bias^2, since E[rel_var] = Var (draws - 1) / draws); it scatters around 0 when unbiased.
    """
    gen = torch.Generator().manual_seed(seed)
    s_logits = s_logits.detach()

    def grad_of(fn):
        x = s_logits.clone().requires_grad_(True)
        fn(torch.log_softmax(x, -1)).sum().backward()
        return x.grad

    exact = grad_of(lambda s: reverse_kl(s, t_logp))
    scale = exact.pow(2).sum(-1).mean().item()
    rows = []
    p = torch.softmax(s_logits, -1)
    for k in ks:
        cache = teacher_cache(t_logp, k)
        g = grad_of(lambda s: sparse_rkl(s, cache))
        bias = (g - exact).pow(2).sum(-1).mean().item() / scale
        rows.append({"estimator": "sparse top-k", "k": k or t_logp.shape[-1], "M": 0, "draws": 1,
                     "rel_bias": bias, "rel_var": 0.0, "rel_bias_net": bias})
    for M in mc:
        mean, sq_dev = torch.zeros_like(exact), torch.zeros_like(exact)  # Welford: no [draws, N, V] stack is kept
        for d in range(1, draws + 1):
            z = torch.multinomial(p, M, replacement=True, generator=gen)
            c = teacher_cache(t_logp, 1, z)
            b = torch.log_softmax(s_logits, -1).gather(-1, z)
            g = grad_of(lambda s: mc_rkl_loss(s, z, c["extra_vals"], b))
            before = g - mean
            mean += before / d
            sq_dev += before * (g - mean)  # sum over draws of |g_d - g_bar|^2, per coordinate
        bias = (mean - exact).pow(2).sum(-1).mean().item() / scale
        var = sq_dev.sum(-1).mean().item() / draws / scale
        rows.append({"estimator": f"{M}-sample MC", "k": 0, "M": M, "draws": draws, "rel_bias": bias,
                     "rel_var": var, "rel_bias_net": bias - var / max(draws - 1, 1)})
    return rows


def completion_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """The decoder's last hidden states at the positions that predict the completion tokens, [B, C, H]: the decoder
    runs once, under the model's autocast; the lm_head runs later on chunks of positions (chunk_logprobs)."""
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with common.autocast(model):
        return common.decoder_hidden(model, ids, mask, pos)[:, prompt_ids.shape[1] - 1:-1]


def chunk_logprobs(model, h: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Full-vocabulary log-probs [n, V] (fp32) at a chunk of n positions, from their hidden states h [n, H]."""
    with common.autocast(model):
        logits = model.get_output_embeddings()(h)
    return torch.log_softmax(logits.float() / temperature, -1)


def position_rows(mb: dict) -> dict:
    """A part's tensors per completion position, [b*C, ...]: each [b, C, ...] tensor flattened, each per-sequence
    [b] tensor repeated over its sequence's positions, plus seq_len (the sequence's completion length); other
    entries (the loss kind, None, numbers) as they are. Prompt-shaped tensors are dropped."""
    b, C = mb["completion_ids"].shape
    rows = {k: v for k, v in mb.items() if not torch.is_tensor(v)}
    for k, v in mb.items():
        if torch.is_tensor(v) and v.shape[:2] == (b, C):
            rows[k] = v.reshape(b * C, *v.shape[2:])
        elif torch.is_tensor(v) and v.shape == (b,):
            rows[k] = v[:, None].expand(b, C).reshape(b * C)
    rows["seq_len"] = mb["completion_mask"].sum(1, keepdim=True).expand(b, C).reshape(b * C).float()
    return rows


class PrecomputedGrad(torch.autograd.Function):
    """A loss whose gradients were computed in its forward: the value passes through, and the backward hands
    grad_h to the hidden states h and grad_w to the lm_head weight (times the upstream gradient)."""

    @staticmethod
    def forward(ctx, value, h, weight, grad_h, grad_w):
        ctx.save_for_backward(grad_h, grad_w)
        return value.clone()

    @staticmethod
    def backward(ctx, g):
        grad_h, grad_w = ctx.saved_tensors
        return None, g * grad_h, g * grad_w, None, None


def chunked_loss(model, teacher, h, t_h, mb: dict, loss_fn, n_seqs: int, n_tokens: int, args: Args):
    """One part's loss, chunk by chunk over its b*C completion positions (the design of Liger-Kernel's fused
    linear JSD): for each chunk of positions, whose fp32 [chunk x V] logits take about common.LOGPROB_CHUNK_MB MiB,
    the student's and the teacher's lm_heads and log-softmaxes run on the chunk's hidden states only, loss_fn gives
    the chunk's share of J, and its gradient w.r.t. the chunk's hidden states and the lm_head weight is taken at
    once (torch.autograd.grad), so the chunk's logits are freed before the next. The returned loss carries the
    accumulated gradients (PrecomputedGrad): its backward is one backward through the student's decoder.

    h [b, C, H] (the student's, with grad), t_h [b, C, H_t] (the teacher's, no grad). Returns (loss, per-token
    stats [b, C]: loss_fn's, kl/reverse, kl/forward, loss/entropy and s_tok, the student's log-prob of each token).
    """
    b, C, H = h.shape
    rows, weight = position_rows(mb), model.get_output_embeddings().weight
    h_flat, t_flat = h.detach().reshape(b * C, H), t_h.reshape(b * C, -1)
    grad_h, grad_w, total, stats = torch.zeros_like(h_flat), torch.zeros_like(weight), 0.0, {}
    step = common.chunk_positions(weight.shape[0])
    for s in range(0, b * C, step):
        hc = h_flat[s:s + step].detach().requires_grad_(True)
        chunk = {k: v[s:s + step] if torch.is_tensor(v) else v for k, v in rows.items()}
        with torch.no_grad():
            chunk["teacher"] = t_logp = chunk_logprobs(teacher, t_flat[s:s + step], args.temperature)
        with torch.enable_grad():
            s_logp = chunk_logprobs(model, hc, args.temperature)  # [n, V], with grad
            loss, token_stats = loss_fn(s_logp, chunk, n_seqs, n_tokens, args)
        gh, gw = torch.autograd.grad(loss, (hc, weight), allow_unused=True)
        grad_h[s:s + step] = gh if gh is not None else 0.0
        grad_w += gw if gw is not None else 0.0
        total = total + loss.detach()
        with torch.no_grad():
            s_logp = s_logp.detach()
            token_stats = {**{k: v.detach() for k, v in token_stats.items()}, "kl/reverse": reverse_kl(s_logp, t_logp),
                           "kl/forward": forward_kl(s_logp, t_logp), "loss/entropy": -(s_logp.exp() * s_logp).sum(-1),
                           "s_tok": s_logp.gather(-1, chunk["completion_ids"][:, None]).squeeze(-1)}
        for k, v in token_stats.items():
            stats.setdefault(k, []).append(v)
    loss = PrecomputedGrad.apply(torch.as_tensor(total), h, weight, grad_h.view_as(h), grad_w)
    return loss, {k: torch.cat(v).view(b, C) for k, v in stats.items()}


def token_loss(variant, s_logp, t_logp, b_tok, tokens, args, z=None, z_behav=None):
    """Per-token loss [...] of one variant, from log-probs [..., V]; t_logp is only read through the finite cache.

    b_tok [...]: the behaviour's log-probs of the sampled tokens; rkl-mc: z [..., M], the rollout-time draws
    from b (mc_draws), and z_behav, their behaviour log-probs.
    """
    need = tokens[..., None] if z is None else torch.cat([tokens[..., None], z], -1)
    cache = teacher_cache(t_logp, args.cache_k, need)
    t_tok = cache["extra_vals"][..., 0]
    s_tok = s_logp.gather(-1, tokens[..., None]).squeeze(-1)
    if variant == "fkl":
        return sparse_fkl(s_logp, cache)
    if variant == "rkl-sparse":
        return sparse_rkl(s_logp, cache)
    if variant == "rkl-stale":
        return rkl_sampled_loss(s_tok, b_tok, t_tok)
    if variant == "rkl-tis":
        return rkl_sampled_loss(s_tok, b_tok, t_tok, (s_tok - b_tok).exp().clamp(max=args.tis_cap))
    if variant == "rkl-recompute":
        return rkl_sampled_loss(s_tok, s_tok, t_tok)
    if variant == "rkl-mc":
        return mc_rkl_loss(s_logp, z, cache["extra_vals"][..., 1:], z_behav)
    raise ValueError(f"unknown variant {variant!r}")


def async_opd_loss(s_logp, mb: dict, n_seqs: int, n_tokens: int, args: Args):
    """A chunk's share of J: the variant's per-token loss (token_loss), token-mean over the step's n_tokens.

    s_logp [n, V] (with grad) at n completion positions; mb holds the teacher's log-probs there [n, V] (read
    through the cache) and per-position rows (opd.py's position_rows): the sampled tokens, the mask, the sampler's
    log-probs of the sampled tokens (b's) and, for rkl-mc, the draws [n, M]. Returns (loss, per-token stats).
    """
    tl = token_loss(args.variant, s_logp, mb["teacher"], mb["logprobs"], mb["completion_ids"], args,
                    mb.get("mc_ids"), mb.get("mc_behaviour"))
    return common.masked_sum(tl, mb["mask"]) / n_tokens, {}


def repeat_frac(texts: list[str], n: int = 3) -> float:
    """Fraction of completions containing some character n-gram at least twice (StableOPD's repetition signal)."""
    def rep(t):
        grams = [t[i:i + n] for i in range(len(t) - n + 1)]
        return len(grams) != len(set(grams))
    return float(np.mean([rep(t) for t in texts])) if texts else 0.0


# ---- rollout and update ----
def rollout(sampler, tok, task, args: Args, rng, device, gen=None) -> list[dict]:
    """Sample every prompt with the stale behaviour policy b, the model of `sampler` (G completions each; rewarded
    for the metrics).

    Returns one batch (opd.py's keys). rkl-mc: also M draws per position from b (with `gen`) and b's log-probs
    of them, taken at rollout time as an asynchronous sampler would.
    """
    examples, behaviour = task.sample("train", args.prompts_per_step, rng), sampler.model
    ro = common.generate(sampler, tok, common.encode_prompts(tok, [e.prompt for e in examples]), args.group_size,
                         args.max_new_tokens, args.temperature, args.top_p)
    answers = [e.answer for e in examples for _ in range(args.group_size)]
    rewards = torch.tensor([task.verify(t, a)[0] for t, a in zip(ro.texts, answers)], device=device)
    batch = {k: getattr(ro, k).to(device) for k in
             ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs")}
    batch.update(rewards=rewards, finish_reasons=ro.finish_reasons, texts=ro.texts, source="student")
    if args.variant == "rkl-mc":  # b's full distribution chunk by chunk over positions, never [B, C, V] whole
        (B, C), draws, behav = batch["completion_ids"].shape, [], []
        with torch.no_grad():
            h = completion_hidden(behaviour, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                                  batch["completion_mask"]).reshape(B * C, -1)
            step = common.chunk_positions(behaviour.get_output_embeddings().weight.shape[0])
            for s in range(0, B * C, step):
                behav_logp = chunk_logprobs(behaviour, h[s:s + step], args.temperature)
                draws.append(mc_draws(behav_logp, args.mc_samples, gen))
                behav.append(behav_logp.gather(-1, draws[-1]))
        batch["mc_ids"] = torch.cat(draws).view(B, C, args.mc_samples)
        batch["mc_behaviour"] = torch.cat(behav).view(B, C, args.mc_samples)
    return [batch]


def teacher_hidden(teacher, mb: dict, args: Args) -> torch.Tensor:
    """The teacher's last hidden states [b, C, H_t] at the student's prefixes (x, y_<t) of this part's completions
    (chunked_loss turns each chunk of them into log-probs)."""
    return completion_hidden(teacher, mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["completion_mask"])


def lr_at(step: int, args: Args) -> float:
    """Learning rate of a 1-based step: --lr on llm.lr_factor's schedule (a linear warm-up over --warmup-steps, then
    constant, by default, or cosine)."""
    return args.lr * llm.lr_factor(step - 1, args.steps, args)


def optimizer_step(model, opt, args: Args, step: int) -> float:
    """llm.optimizer_step (clip at --max-grad-norm, NaN guard, step) at the rate lr_at gives this 1-based step,
    handed to it as a flat --lr (llm.optimizer_step knows only --lr times its own schedules); returns the norm."""
    args = dataclasses.replace(args, lr=lr_at(step, args), lr_schedule="constant", warmup_steps=0)
    return llm.optimizer_step(model, opt, args, step - 1, step)


def micro_batches(part: dict, size: int):
    """A part (one sampler's rollouts) in micro-batches of at most `size` sequences: each tensor's rows split, other
    entries (the loss kind, the source, numbers, texts) as they are."""
    for rows in torch.arange(len(part["completion_ids"])).split(size):
        yield {k: v[rows.to(v.device)] if torch.is_tensor(v) else v for k, v in part.items()}


def update(model, opt, parts: list[dict], loss_fn, args: Args, step: int, teacher, ref_model=None) -> dict:
    """One optimiser step on one rollout batch; each part (one sampler's rollouts) in micro-batches of at most
    --micro-batch-size sequences, each micro-batch's loss normalised by counts over the whole step (n_seqs,
    n_tokens), so that they add up to J.

    The teacher's forward runs here (teacher_hidden, no grad): the losses need the full-vocabulary log-probs
    of the student and of the teacher at every completion position, which chunked_loss computes chunk by chunk
    from the two decoders' hidden states. The sampler-vs-trainer log-prob gap is measured on the student's part
    (the only forward on the sampler's weights).
    """
    n_seqs = sum(len(p["completion_ids"]) for p in parts)
    n_tokens = sum(int(p["completion_mask"].sum()) for p in parts)
    stats, gap = {"loss/total": 0.0}, {}
    opt.zero_grad(set_to_none=True)
    for mb in (mb for part in parts for mb in micro_batches(part, args.micro_batch_size)):
        ids = [mb[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]
        mask = mb["completion_mask"].float()
        h = completion_hidden(model, *ids)  # [b, C, H], with grad
        with torch.no_grad():
            t_h = teacher_hidden(teacher, mb, args)
            ref = None if ref_model is None or mb["source"] != "student" else common.token_logprobs(
                ref_model, *ids, args.temperature)
        loss, token_stats = chunked_loss(model, teacher, h, t_h, {**mb, "mask": mask, "ref": ref}, loss_fn,
                                         n_seqs, n_tokens, args)
        loss.backward()  # through the decoder; a NaN here reaches the gradient: optimizer_step stops the run
        stats["loss/total"] += loss.item()
        s_tok = token_stats.pop("s_tok")
        if mb["source"] == "student":
            gap["sum"] = gap.get("sum", 0.0) + common.masked_sum((s_tok - mb["logprobs"]).abs(), mask).item()
            gap["tokens"] = gap.get("tokens", 0.0) + mask.sum().item()
        for k, v in token_stats.items():
            stats[k] = stats.get(k, 0.0) + common.masked_sum(v, mask).item() / n_tokens
    if gap:
        stats["rollout/logprob_mismatch"] = gap["sum"] / max(gap["tokens"], 1.0)
    stats["loss/grad_norm"] = optimizer_step(model, opt, args, step)
    return stats


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    run = llm.Run(args)  # accelerator, threads, seed, the task and its held-out sets, the run folder
    if run.accel.num_processes > 1:
        raise SystemExit("AsyncOPD runs in one process: start it with python, not torchrun or accelerate launch")
    model, tok, _, sampler = llm.load_policy(args, run.accel)  # the student; its sampler is the held-out evaluation's
    teacher, tok_t = common.load_model(args.teacher, run.accel.device, args.dtype)
    check_teacher(tok, tok_t, model, teacher, args.teacher)
    teacher.eval().requires_grad_(False)
    behaviour = common.Sampler(copy.deepcopy(model).eval().requires_grad_(False))  # the stale sampler
    snapshots = collections.deque(maxlen=args.staleness + 1)  # weights after each of the last k+1 updates
    snapshots.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    opt = llm.make_optimizer(model.parameters(), args)
    evaluate = lambda policy, hard=run.hard_task, k=args.pass_k: common.run_eval(  # noqa: E731
        policy, tok, run.task, run.eval_sets, args.max_new_tokens, k, args.temperature, hard)
    teacher_acc = evaluate(common.Sampler(teacher), None, 0)["eval/acc"]
    # the step-0 held-out evaluation, with the teacher's accuracy (--resume is refused in check_args)
    run.start(model, tok, opt, sampler,
              evaluate=lambda: {**evaluate(sampler), **({} if run.history else {"eval/teacher_acc": teacher_acc})})
    for step, rng in run.steps():  # rng: default_rng([seed, step]) (one process: rank 0 adds nothing)
        torch.manual_seed(hash((args.seed, step)) % 2**31)  # each step's draws depend on (seed, step)
        gen = torch.Generator().manual_seed(hash((args.seed, step, 1)) % 2**31)
        behaviour.model.load_state_dict(snapshots[0])  # the oldest kept: k updates behind (fewer at the start)
        with run.timer("gen"):
            parts = rollout(behaviour, tok, run.task, args, rng, run.accel.device, gen)
        with run.timer("train"):
            stats = update(model, opt, parts, async_opd_loss, args, step, teacher)
        snapshots.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        run.log_step(step, parts[0], stats, extra={"rollout/repeat_frac": repeat_frac(parts[0]["texts"])})
    train = [h for h in run.history if "rollout/reward" in h]
    last = train[-10:]
    summary = {"teacher_acc": teacher_acc, "kl_reverse_end": float(np.mean([h["kl/reverse"] for h in last])),
               "kl_forward_end": float(np.mean([h["kl/forward"] for h in last])),
               "truncated_frac_max": max(h["rollout/truncated_frac"] for h in train),
               "length_mean": float(np.mean([h["rollout/length"] for h in train]))}
    print(f"[{args.variant}, k={args.staleness}] teacher held-out accuracy {teacher_acc:.3f}, final KL(s||t) "
          f"{summary['kl_reverse_end']:.3f}")
    return run.finish(f"AsyncOPD {args.variant}, k={args.staleness}", extra=summary, hlines={"teacher": teacher_acc})


if __name__ == "__main__":
    main(tyro.cli(Args))
