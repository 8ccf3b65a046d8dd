"""AsyncOPD: on-policy distillation from stale rollouts, with a finite teacher-score cache.

Paper: "AsyncOPD: How Stale Can On-Policy Distillation Be?", arXiv:2606.24143.

Parent: algos/opd.py (the losses are copied from there). Asynchronous OPD samples rollouts with a student
snapshot that is --staleness k optimiser steps old (simulated exactly: the sampler loads the weights of k
updates ago), and the teacher's scores are not full-vocabulary logits but a finite cache per position.

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
                 rollout time, their teacher scores cached; at learner time
                 loss = 1/M sum_m w_m (s(z_m) - q(z_m)).detach() s(z_m),  w_m = pi_theta(z_m)/b(z_m)  mc_rkl_loss
                 Unbiased per prefix ("MC correctability"): at a given prefix, E_{z~b}[w (s - q) grad s] is the
                 exact gradient of the local KL(pi_theta || pi_t) there, however stale b is. It is not unbiased
                 for the on-policy objective: the prefixes themselves were sampled by the stale b, so a batch
                 weights each prefix by its probability under b, not under pi_theta (nothing here reweights
                 whole prefixes): a bias that is 0 at staleness 0 and grows as b drifts from pi_theta.
  rkl-sparse     reverse KL on the cached top-k support: KL(p~_s || p~_t) with both renormalised over
                 the k cached ids (biased when k < V; exact at k = V)                     sparse_rkl

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
are logged every step.

Deviations:
- Staleness is simulated in one process (a snapshot k updates old samples); no throughput claim.
- KL is local (per position at the sampled prefix), as in algos/opd.py.
- The paper's exact cache layout and estimator normalisations are not in the abstract; the ones here are
  the plainest choices (renormalised top-k; importance-weighted M-sample average).
- The teacher's scores for the sampled tokens are always kept (a real cache stores them with the rollout).

Commands:
  python algos/async_opd.py                                            # rkl-mc (M = 4), k = 2, ~3 min
  python algos/async_opd.py --variant rkl-stale --staleness 8
  python algos/async_opd.py --variant fkl --staleness 8 --cache-k 8
  python algos/async_opd.py --variant rkl-mc --mc-samples 4 --staleness 2
Expected: held-out greedy accuracy of tiny-0.6m on 2-digit addition rises from 35% toward the teacher's
~72%; in 40 steps fkl keeps ~44% at every staleness, rkl-stale collapses (47% at k = 0, 2% at k = 2),
rkl-mc keeps 49% at k = 2 (results: benchmarks/results/async_opd.md).
"""
from __future__ import annotations

import collections
import copy
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

VARIANTS = ("fkl", "rkl-stale", "rkl-tis", "rkl-recompute", "rkl-mc", "rkl-sparse")


@dataclass
class Args:
    exp_name: str = "async_opd"
    """name of the run (the output folder is out_dir/exp_name)"""
    seed: int = 0
    """random seed"""
    track: bool = False
    """log to Weights & Biases as well"""
    out_dir: str = "runs"
    """where metrics.jsonl, summary.json and the curve go"""
    model: str = "tiny-0.6m"
    """the student"""
    teacher: str = "tiny-5m"
    """the teacher (same tokenizer as the student)"""
    task: str = "add"
    """add, addsteps, jsonl:PATH or gsm8k"""
    digits: int = 2
    """operand digits of the arithmetic tasks"""
    device: str = "auto"
    """auto, cpu or cuda"""
    threads: int = 1
    """torch CPU threads"""
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
    max_new_tokens: int = 8
    """generation budget per completion"""
    temperature: float = 1.0
    """sampling temperature"""
    lr: float = 1e-4
    """AdamW learning rate"""
    warmup_steps: int = 10
    """linear learning-rate warm-up (Adam's first steps are sign-like and overshoot at full lr)"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""
    eval_every: int = 30
    """steps between held-out evaluations"""
    eval_examples: int = 500
    """held-out prompts"""
    eval_hard: bool = False
    """also evaluate one digit harder (out of distribution)"""


def check_args(args: Args) -> None:
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


def check_teacher(tok_s, tok_t, student, teacher, name: str) -> None:
    vs, vt = tok_s.get_vocab(), tok_t.get_vocab()
    if vs != vt:
        raise SystemExit(f"--teacher {name}: its tokenizer differs from the student's ({len(vt)} vs {len(vs)} "
                         "tokens); OPD needs one shared vocabulary")
    ns, nt = student.get_output_embeddings().weight.shape[0], teacher.get_output_embeddings().weight.shape[0]
    if ns != nt:
        raise SystemExit(f"--teacher {name}: output layer has {nt} logits, the student's has {ns}")


# ---- divergences (copied from algos/opd.py) ----
def reverse_kl(s_logp, t_logp):
    """KL(pi_s || pi_t) per position over the last axis."""
    return (s_logp.exp() * (s_logp - t_logp)).sum(-1)


def forward_kl(s_logp, t_logp):
    """KL(pi_t || pi_s) per position over the last axis."""
    return (t_logp.exp() * (t_logp - s_logp)).sum(-1)


def completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature=1.0):
    """Full-vocabulary log-probs at every completion position, [B, C, V]."""
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
    logits = model.get_output_embeddings()(hidden[:, prompt_ids.shape[1] - 1:-1]).float() / temperature
    return torch.log_softmax(logits, -1)


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

    s_logits [N, V] (student), t_logp [N, V] (teacher). For each estimator, with g_bar the mean of `draws`
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
        gs = []
        for _ in range(draws):
            z = torch.multinomial(p, M, replacement=True, generator=gen)
            c = teacher_cache(t_logp, 1, z)
            b = torch.log_softmax(s_logits, -1).gather(-1, z)
            gs.append(grad_of(lambda s: mc_rkl_loss(s, z, c["extra_vals"], b)))
        gs = torch.stack(gs)
        mean = gs.mean(0)
        bias = (mean - exact).pow(2).sum(-1).mean().item() / scale
        var = (gs - mean).pow(2).sum(-1).mean().item() / scale
        rows.append({"estimator": f"{M}-sample MC", "k": 0, "M": M, "draws": draws, "rel_bias": bias,
                     "rel_var": var, "rel_bias_net": bias - var / max(draws - 1, 1)})
    return rows


def repeat_frac(texts: list[str], n: int = 3) -> float:
    """Fraction of completions containing some character n-gram at least twice (StableOPD's repetition signal)."""
    def rep(t):
        grams = [t[i:i + n] for i in range(len(t) - n + 1)]
        return len(grams) != len(set(grams))
    return float(np.mean([rep(t) for t in texts])) if texts else 0.0


def run_eval(model, tok, task, hard_task, eval_sets, args) -> dict:
    out = {"eval/acc": common.evaluate(model, tok, task, eval_sets["main"], args.max_new_tokens)["acc"]}
    if hard_task is not None:
        out["eval/acc_hard"] = common.evaluate(model, tok, hard_task, eval_sets["hard"], args.max_new_tokens + 2)["acc"]
    return out


def token_loss(variant, s_logp, t_logp, b_tok, tokens, args, gen=None, behav_logp=None):
    """Per-token loss [B, C] of one variant; t_logp is only read through the finite cache."""
    need = tokens[..., None]
    z = None
    if variant == "rkl-mc":
        z = torch.multinomial(behav_logp.exp().reshape(-1, behav_logp.shape[-1]), args.mc_samples,
                              replacement=True, generator=gen).view(*tokens.shape, args.mc_samples)
        need = torch.cat([need, z], -1)
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
        return mc_rkl_loss(s_logp, z, cache["extra_vals"][..., 1:], behav_logp.gather(-1, z))
    raise ValueError(f"unknown variant {variant!r}")


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    torch.set_num_threads(args.threads)
    common.set_seed(args.seed)
    device = common.get_device(args.device)
    task = common.make_task(args.task, args.digits)
    hard_task = common.make_task(args.task, args.digits + 1) if args.eval_hard and hasattr(task, "digits") else None
    model, tok = common.load_model(args.model, device)
    teacher, tok_t = common.load_model(args.teacher, device)
    check_teacher(tok, tok_t, model, teacher, args.teacher)
    teacher.eval().requires_grad_(False)
    behaviour = copy.deepcopy(model).eval().requires_grad_(False)  # the stale sampler
    snapshots = collections.deque(maxlen=args.staleness + 1)  # weights after each of the last k+1 updates
    snapshots.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    run_dir = Path(args.out_dir) / args.exp_name
    eval_rng = np.random.default_rng(12345)
    eval_sets = {"main": task.sample("test", args.eval_examples, eval_rng)}
    if hard_task is not None:
        eval_sets["hard"] = hard_task.sample("test", min(args.eval_examples, 300), eval_rng)
    tracker = common.Tracker(run_dir, args, args.track, run_name=args.exp_name)
    t_start, gen_tokens, gen_time, history = time.time(), 0, 0.0, []
    timer = common.Timer()

    def log(metrics, step):
        history.append({"step": step, **metrics})
        tracker.log(metrics, step)

    teacher_acc = run_eval(teacher, tok, task, None, eval_sets, args)["eval/acc"]
    log({**run_eval(model, tok, task, hard_task, eval_sets, args), "eval/teacher_acc": teacher_acc}, 0)
    for step in tqdm(range(1, args.steps + 1), desc=f"async_opd[{args.variant},k={args.staleness}]", dynamic_ncols=True):
        torch.manual_seed(hash((args.seed, step)) % 2**31)
        rng = np.random.default_rng([args.seed, step])
        gen = torch.Generator().manual_seed(hash((args.seed, step, 1)) % 2**31)
        behaviour.load_state_dict(snapshots[0])  # the oldest kept: k updates behind (fewer at the start)
        examples = task.sample("train", args.prompts_per_step, rng)
        with timer("gen"):
            ro = common.generate(behaviour, tok, common.encode_prompts(tok, [e.prompt for e in examples]),
                                 args.group_size, args.max_new_tokens, args.temperature)
        b = {k: getattr(ro, k).to(device) for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
        m = b["completion_mask"].float()
        gen_tokens += int(m.sum())
        gen_time += timer.totals.get("gen", 0.0)
        with timer("train"):
            with torch.no_grad():  # rollout-time quantities: the teacher's scores and the behaviour policy's
                t_logp = completion_logprobs(teacher, **b, temperature=args.temperature)
                behav_logp = completion_logprobs(behaviour, **b, temperature=args.temperature) \
                    if args.variant == "rkl-mc" else None
            b_tok = ro.logprobs.to(device)
            s_logp = completion_logprobs(model, **b, temperature=args.temperature)
            tl = token_loss(args.variant, s_logp, t_logp, b_tok, b["completion_ids"], args, gen, behav_logp)
            loss = common.masked_mean(tl, m)
            if not torch.isfinite(loss):
                raise SystemExit(f"non-finite loss at step {step}; lower --lr")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm))
            for g in opt.param_groups:
                g["lr"] = args.lr * min(1.0, step / max(args.warmup_steps, 1))
            opt.step()
        snapshots.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        t = timer.pop()
        with torch.no_grad():
            s_tok = s_logp.gather(-1, b["completion_ids"][..., None]).squeeze(-1)
            metrics = {
                "rollout/reward": float(np.mean([task.verify(tx, e.answer)[0] for tx, e in
                                                 zip(ro.texts, [e for e in examples for _ in range(args.group_size)])])),
                "rollout/length": m.sum(1).mean().item(),
                "rollout/truncated_frac": float(np.mean([f == "length" for f in ro.finish_reasons])),
                "rollout/repeat_frac": repeat_frac(ro.texts),
                "rollout/staleness_logratio": common.masked_mean((s_tok - b_tok).abs(), m).item(),
                "kl/reverse": common.masked_mean(reverse_kl(s_logp, t_logp), m).item(),
                "kl/forward": common.masked_mean(forward_kl(s_logp, t_logp), m).item(),
                "loss/total": loss.item(), "loss/grad_norm": grad_norm,
                "perf/gen_s": t.get("gen", 0.0), "perf/train_s": t.get("train", 0.0),
            }
        if step % args.eval_every == 0 or step == args.steps:
            metrics.update(run_eval(model, tok, task, hard_task, eval_sets, args))
        log(metrics, step)

    evals = [h for h in history if "eval/acc" in h]
    train = [h for h in history if "rollout/reward" in h]
    last = train[-10:]
    summary = {
        "eval_acc_start": evals[0]["eval/acc"], "eval_acc_end": evals[-1]["eval/acc"],
        "eval_acc_best": max(h["eval/acc"] for h in evals), "teacher_acc": teacher_acc,
        "train_reward_first": train[0]["rollout/reward"], "train_reward_last": train[-1]["rollout/reward"],
        "gen_tokens": gen_tokens, "tokens_per_s": gen_tokens / max(gen_time, 1e-9), "wall_s": time.time() - t_start,
        "kl_reverse_end": float(np.mean([h["kl/reverse"] for h in last])),
        "kl_forward_end": float(np.mean([h["kl/forward"] for h in last])),
        "truncated_frac_max": max(h["rollout/truncated_frac"] for h in train),
        "length_mean": float(np.mean([h["rollout/length"] for h in train])),
    }
    if "eval/acc_hard" in evals[-1]:
        summary["eval_acc_hard_start"], summary["eval_acc_hard_end"] = evals[0]["eval/acc_hard"], evals[-1]["eval/acc_hard"]
    print(f"[{args.variant}, k={args.staleness}] student held-out accuracy {summary['eval_acc_start']:.3f} -> "
          f"{summary['eval_acc_end']:.3f} (teacher {teacher_acc:.3f}), final KL(s||t) {summary['kl_reverse_end']:.3f}")
    return tracker.finish(summary)


if __name__ == "__main__":
    main(tyro.cli(Args))
