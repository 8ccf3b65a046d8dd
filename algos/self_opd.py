"""Self-OPD: the policy is its own teacher when its prompt also shows privileged context.

Papers: "When Are Teacher Tokens Reliable? Position-Weighted On-Policy Self-Distillation for Reasoning"
(PW-OPSD), arXiv:2605.21606; "TRACE: Distilling Where It Matters via Token-Routed Self On-Policy Alignment",
arXiv:2605.10194.

OPSD: the student samples y ~ pi_theta(. | x); the teacher is the same weights (no gradient) given the
privileged prompt x* (x plus the worked solution or the answer), scoring the same tokens. On the tiny world
the privileged context of `add` ("47+85=") is the worked scratchpad the model already knows how to read
("47+85:7+5=12;4+8+1=13;="), so the teacher is strong (~98%) while the student answers directly (~36%).

Per completion token t of rollout i (s = student log-probs at x, q = teacher log-probs at x*):

  clipped FKL  f_it = sum_v p_t(v) (q(v) - s(v)),   weighted by c_it = min(1, --kl-clip / f_it) (no grad):
               each token's pull is capped, so a few far-off tokens cannot dominate.      clipped_fkl
  opsd         L = token-mean_it c_it f_it                                    (all-token baseline)
  pw-opsd      L = token-mean_it w_it c_it f_it,  w_it = 2 (t+1) / (|y_i| + 1)  (PW-OPSD: increasing in the
               position, mean 1 over each sequence)                          position_weights
  trace        (TRACE) GRPO on all tokens outside the critical spans, plus a KL channel on the spans:
               forward KL on key spans of correct rollouts, reverse KL on the error span of wrong ones;
               the KL channel's weight lambda(step) is --kl-coef for --kl-warmup steps, then decays
               linearly to 0 over --kl-decay steps.                           critical_masks, trace_loss
               Key spans (programmatic): answer digits that receive a carry (and the "+1" carry terms of a
               scratchpad, in columns that really receive one). Error span: the first --error-span tokens
               from the first wrong character.
  grpo         plain on-policy GRPO with the verifier reward (the reference for the table).

Logged every step: student entropy and response length on rollouts (TRACE's leakage symptoms), the
truncated fraction and repetition (StableOPD's collapse signals); held-out accuracy, and out-of-distribution
accuracy one digit harder, at every evaluation.

Deviations:
- The privileged teacher is the current weights (not a frozen copy), as in OPSD; no gradient through it.
- PW-OPSD's exact clipping of the forward-KL target is not in the abstract: we cap each token's loss weight.
- Spans are marked programmatically (carries), not by an annotator or the model (TRACE's online variant).
- The branch-viability diagnostic / AUROC of PW-OPSD is not implemented.
- TRACE's GRPO term is on-policy (ratio 1), seq-mean, as algos/grpo.py with its defaults.

Commands:
  python algos/self_opd.py                           # PW-OPSD on add, tiny-0.6m, ~2 min on 2 cores
  python algos/self_opd.py --mode opsd               # all-token OPSD
  python algos/self_opd.py --mode trace              # TRACE span routing (GRPO elsewhere)
  python algos/self_opd.py --mode grpo               # the GRPO reference
  python algos/self_opd.py --privileged answer       # show the answer instead of the worked solution
Expected: held-out greedy accuracy on 2-digit addition rises from ~36% by 20+ points in 100 steps
(the scratchpad-reading teacher is far stronger than the direct-answer student).
"""
from __future__ import annotations

import re
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


@dataclass
class Args:
    exp_name: str = "self_opd"
    """name of the run (the output folder is out_dir/exp_name)"""
    seed: int = 0
    """random seed"""
    track: bool = False
    """log to Weights & Biases as well"""
    out_dir: str = "runs"
    """where metrics.jsonl, summary.json and the curve go"""
    model: str = "tiny-0.6m"
    """the policy (student and, with privileged context, teacher)"""
    task: str = "add"
    """add, addsteps, jsonl:PATH (records with a 'solution') or gsm8k"""
    digits: int = 2
    """operand digits of the arithmetic tasks"""
    device: str = "auto"
    """auto, cpu or cuda"""
    threads: int = 1
    """torch CPU threads"""
    mode: Literal["opsd", "pw-opsd", "trace", "grpo"] = "pw-opsd"
    """all-token OPSD, position-weighted OPSD (PW-OPSD), critical-span routing (TRACE) or plain GRPO"""
    privileged: Literal["solution", "answer"] = "solution"
    """what the teacher's prompt adds: the worked solution or only the final answer"""
    kl_clip: float = 2.0
    """cap of each token's forward-KL weight (c = min(1, kl_clip / KL_t))"""
    kl_coef: float = 1.0
    """trace: weight of the KL channel during its warm-up"""
    kl_warmup: int = 30
    """trace: steps at full KL weight"""
    kl_decay: int = 30
    """trace: steps of linear decay of the KL weight to 0 after the warm-up"""
    error_rkl: bool = True
    """trace: reverse KL on the error span of wrong rollouts"""
    error_span: int = 2
    """trace: tokens in an error span (from the first wrong character)"""
    steps: int = 100
    """optimiser steps (one rollout batch each)"""
    prompts_per_step: int = 32
    """prompts per batch"""
    group_size: int = 4
    """completions per prompt (trace and grpo need >= 2)"""
    max_new_tokens: int = 8
    """generation budget per completion"""
    temperature: float = 1.0
    """sampling temperature"""
    lr: float = 2e-4
    """AdamW learning rate"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""
    eval_every: int = 25
    """steps between held-out evaluations"""
    eval_examples: int = 500
    """held-out prompts"""
    eval_hard: bool = True
    """also evaluate one digit harder (out of distribution)"""


def check_args(args: Args) -> None:
    if args.steps < 1 or args.prompts_per_step < 1 or args.max_new_tokens < 1:
        raise SystemExit("--steps, --prompts-per-step and --max-new-tokens must be positive")
    if args.mode in ("trace", "grpo") and args.group_size < 2:
        raise SystemExit(f"--mode {args.mode} needs --group-size >= 2 for a group baseline, got {args.group_size}")
    if args.group_size < 1:
        raise SystemExit("--group-size must be positive")
    if args.kl_clip <= 0:
        raise SystemExit("--kl-clip must be > 0")
    if args.temperature <= 0:
        raise SystemExit("--temperature must be > 0")
    if args.error_span < 1 or args.kl_warmup < 0 or args.kl_decay < 0:
        raise SystemExit("--error-span must be >= 1; --kl-warmup and --kl-decay >= 0")


# ---- privileged context ----
def privileged_prompt(ex: common.Example, task, mode: str) -> str:
    """The teacher's prompt: x plus the worked solution (or the answer). Never shown to the student."""
    if getattr(task, "kind", None) == "add" and mode == "solution":
        a, b = (int(v) for v in ex.prompt.rstrip("=").split("+"))
        pad = common.addition_scratchpad(a, b)
        return f"{a}+{b}:" + pad[:pad.rindex("=") + 1]  # the scratchpad-reading format the model knows
    ctx = ex.answer if mode == "answer" or not ex.solution else ex.solution
    if getattr(task, "kind", None) == "add":
        return f"{ex.prompt}{ctx}\n{ex.prompt}"  # the answer shown once, then asked again
    return f"Reference {'answer' if mode == 'answer' else 'solution'}: {ctx}\n\n{ex.prompt}"


# ---- the idea: per-token weights and losses ----
def forward_kl(s_logp, t_logp):
    """KL(pi_t || pi_s) per position over the last axis."""
    return (t_logp.exp() * (t_logp - s_logp)).sum(-1)


def reverse_kl(s_logp, t_logp):
    """KL(pi_s || pi_t) per position over the last axis."""
    return (s_logp.exp() * (s_logp - t_logp)).sum(-1)


def clipped_fkl(s_logp, t_logp, clip: float):
    """c_t f_t with c_t = min(1, clip / f_t) held constant: the value is min(f_t, clip), the gradient capped."""
    f = forward_kl(s_logp, t_logp)
    return (clip / f.detach().clamp(min=1e-12)).clamp(max=1.0) * f


def position_weights(mask: torch.Tensor) -> torch.Tensor:
    """w_t = 2 (t + 1) / (|y| + 1) on the completion tokens (mean 1 per sequence), 0 on padding."""
    pos = torch.arange(1, mask.shape[1] + 1, device=mask.device, dtype=torch.float32)[None]
    length = mask.sum(1, keepdim=True).float()
    return 2 * pos / (length + 1) * mask


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    r = rewards.view(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).view(-1)


def receives_carry(a: int, b: int, i: int) -> bool:
    """Whether column i (0 = units) of a + b receives a carry from the columns to its right."""
    return i > 0 and a % 10 ** i + b % 10 ** i >= 10 ** i


def carry_in_digits(a: int, b: int) -> set[int]:
    """Indices (from the left) of the digits of a + b that receive a carry (incl. a leading carry digit)."""
    s = str(a + b)
    return {len(s) - 1 - i for i in range(1, len(s)) if receives_carry(a, b, i)}


SCRATCH_STEP = re.compile(r"(?:^|(?<=;))\d\+\d(\+1)?=\d+")  # one column of the scratchpad: x+y[+1]=s


def critical_masks(task, examples, texts: list[str], correct: list[float], C: int):
    """(key [B, C], err [B, C]) token masks for a character-level tokenizer (one character = one token).

    key: on correct rollouts, the answer digits that receive a carry, and the "+1" carry terms of a
    scratchpad: the third term of a column step "x+y+1=s" whose column really receives a carry (an operand 1,
    as in "3+1=4", or a "+1" written where no carry comes in, is not marked). err: on wrong rollouts,
    --error-span tokens from the first character that differs from the reference (the answer for add, the
    worked solution for addsteps); at EOS if the response is a prefix.
    """
    B = len(texts)
    key, err = torch.zeros(B, C), torch.zeros(B, C)
    for i, (ex, t, ok) in enumerate(zip(examples, texts, correct)):
        a, b = (int(v) for v in ex.prompt[:-1].split("+"))
        if ok:
            start = t.rindex("=") + 1 if "=" in t else 0
            for j in carry_in_digits(a, b):
                if start + j < C:
                    key[i, start + j] = 1
            for col, m in enumerate(SCRATCH_STEP.finditer(t)):  # step col adds column col (units first)
                if m.group(1) and receives_carry(a, b, col) and m.end(1) - 1 < C:
                    key[i, m.end(1) - 1] = 1  # the "1" of a third term "+1" where a carry really comes in
        else:
            ref = ex.answer if task.kind == "add" else ex.solution
            first = next((j for j in range(min(len(t), len(ref))) if t[j] != ref[j]), min(len(t), len(ref)))
            if first < C:
                err[i, first] = 1
    return key, err


def error_mask(err_start: torch.Tensor, span: int, cmask: torch.Tensor) -> torch.Tensor:
    """Extend the first-wrong-token marks of `critical_masks` to `span` tokens, inside the completion."""
    out = err_start.clone()
    for d in range(1, span):
        out[:, d:] = torch.maximum(out[:, d:], err_start[:, :-d])
    return out * cmask


def kl_channel_weight(step: int, args: Args) -> float:
    """trace: kl_coef for kl_warmup steps, then linear decay to 0 over kl_decay steps."""
    if step <= args.kl_warmup:
        return args.kl_coef
    if args.kl_decay == 0:
        return 0.0
    return args.kl_coef * max(0.0, 1 - (step - args.kl_warmup) / args.kl_decay)


def trace_loss(s_logp, t_logp, s_tok, adv, cmask, key, err, kl_weight: float, error_rkl: bool):
    """Per-token TRACE loss [B, C]: GRPO (-A s(y)) off the spans, lambda FKL on key, lambda RKL on error."""
    spans = torch.clamp(key + (err if error_rkl else 0), max=1) * cmask
    pg = -(adv[:, None] * s_tok) * (1 - spans)
    kl = forward_kl(s_logp, t_logp) * key + (reverse_kl(s_logp, t_logp) * err if error_rkl else 0)
    return pg + kl_weight * kl * cmask


def completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature=1.0):
    """Full-vocabulary log-probs at every completion position, [B, C, V]."""
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
    logits = model.get_output_embeddings()(hidden[:, prompt_ids.shape[1] - 1:-1]).float() / temperature
    return torch.log_softmax(logits, -1)


def repeat_frac(texts: list[str], n: int = 3) -> float:
    def rep(t):
        grams = [t[i:i + n] for i in range(len(t) - n + 1)]
        return len(grams) != len(set(grams))
    return float(np.mean([rep(t) for t in texts])) if texts else 0.0


def run_eval(model, tok, task, hard_task, eval_sets, args) -> dict:
    out = {"eval/acc": common.evaluate(model, tok, task, eval_sets["main"], args.max_new_tokens)["acc"]}
    if hard_task is not None:
        out["eval/acc_hard"] = common.evaluate(model, tok, hard_task, eval_sets["hard"], args.max_new_tokens + 2)["acc"]
    return out


@torch.no_grad()
def privileged_eval(model, tok, task, examples, args) -> float:
    """Greedy accuracy of the teacher view: the same model given the privileged prompt."""
    exs = [common.Example(privileged_prompt(e, task, args.privileged), e.answer, e.solution) for e in examples]
    return common.evaluate(model, tok, task, exs, args.max_new_tokens)["acc"]


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    torch.set_num_threads(args.threads)
    common.set_seed(args.seed)
    device = common.get_device(args.device)
    task = common.make_task(args.task, args.digits)
    if args.mode == "trace" and getattr(task, "kind", None) not in ("add", "addsteps"):
        raise SystemExit("--mode trace marks critical spans programmatically: only the arithmetic tasks "
                         "(add, addsteps) have span marks")
    hard_task = common.make_task(args.task, args.digits + 1) if args.eval_hard and hasattr(task, "digits") else None
    model, tok = common.load_model(args.model, device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    run_dir = Path(args.out_dir) / args.exp_name
    eval_rng = np.random.default_rng(12345)
    eval_sets = {"main": task.sample("test", args.eval_examples, eval_rng)}
    if hard_task is not None:
        eval_sets["hard"] = hard_task.sample("test", min(args.eval_examples, 300), eval_rng)
    tracker = common.Tracker(run_dir, args, args.track, run_name=args.exp_name)
    t_start, gen_tokens, gen_time, history = time.time(), 0, 0.0, []
    timer = common.Timer()
    G = args.group_size

    def log(metrics, step):
        history.append({"step": step, **metrics})
        tracker.log(metrics, step)

    teacher_acc0 = privileged_eval(model, tok, task, eval_sets["main"][:200], args)
    log({**run_eval(model, tok, task, hard_task, eval_sets, args), "eval/privileged_acc": teacher_acc0}, 0)
    for step in tqdm(range(1, args.steps + 1), desc=f"self_opd[{args.mode}]", dynamic_ncols=True):
        torch.manual_seed(hash((args.seed, step)) % 2**31)
        rng = np.random.default_rng([args.seed, step])
        examples = task.sample("train", args.prompts_per_step, rng)
        rep = [e for e in examples for _ in range(G)]
        with timer("gen"):
            ro = common.generate(model, tok, common.encode_prompts(tok, [e.prompt for e in examples]), G,
                                 args.max_new_tokens, args.temperature)
        cm = ro.completion_mask.to(device)
        m = cm.float()
        comp = ro.completion_ids.to(device)
        gen_tokens += int(m.sum())
        gen_time += timer.totals.get("gen", 0.0)
        rewards = torch.tensor([task.verify(t, e.answer)[0] for t, e in zip(ro.texts, rep)], device=device)
        with timer("train"):
            # the student's forward pass sees only x (the rollout's own prompt ids)
            s_logp = completion_logprobs(model, ro.prompt_ids.to(device), ro.prompt_mask.to(device), comp, cm,
                                         args.temperature)
            s_tok = s_logp.gather(-1, comp[..., None]).squeeze(-1)
            with torch.no_grad():  # the teacher: the same weights, prompt x* (x + privileged context)
                t_ids, t_mask = common.left_pad(common.encode_prompts(
                    tok, [privileged_prompt(e, task, args.privileged) for e in rep]), tok.pad_token_id)
                t_logp = completion_logprobs(model, t_ids.to(device), t_mask.to(device), comp, cm, args.temperature)
            extra = {}
            if args.mode in ("opsd", "pw-opsd"):
                tl = clipped_fkl(s_logp, t_logp, args.kl_clip)
                if args.mode == "pw-opsd":
                    tl = tl * position_weights(m)
                loss = common.masked_mean(tl, m)
            else:
                adv = group_advantages(rewards, G)
                if args.mode == "grpo":
                    loss = ((-(adv[:, None] * s_tok) * m).sum(1) / m.sum(1).clamp(min=1)).mean()
                else:
                    key, err0 = critical_masks(task, rep, ro.texts, rewards.tolist(), comp.shape[1])
                    key, err = key.to(device) * m, error_mask(err0.to(device), args.error_span, m)
                    lam = kl_channel_weight(step, args)
                    tl = trace_loss(s_logp, t_logp, s_tok, adv, m, key, err, lam, args.error_rkl)
                    loss = ((tl * m).sum(1) / m.sum(1).clamp(min=1)).mean()
                    extra = {"trace/kl_weight": lam, "trace/key_frac": (key.sum() / m.sum()).item(),
                             "trace/err_frac": (err.sum() / m.sum()).item()}
            if not torch.isfinite(loss):
                raise SystemExit(f"non-finite loss at step {step}; lower --lr")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm))
            opt.step()
        t = timer.pop()
        with torch.no_grad():
            ent = -(s_logp.exp() * s_logp).sum(-1)
            metrics = {
                "rollout/reward": rewards.mean().item(), "rollout/length": m.sum(1).mean().item(),
                "rollout/truncated_frac": float(np.mean([f == "length" for f in ro.finish_reasons])),
                "rollout/repeat_frac": repeat_frac(ro.texts),
                "rollout/entropy": common.masked_mean(ent, m).item(),
                "kl/forward": common.masked_mean(forward_kl(s_logp, t_logp), m).item(),
                "loss/total": loss.item(), "loss/grad_norm": grad_norm,
                "perf/gen_s": t.get("gen", 0.0), "perf/train_s": t.get("train", 0.0), **extra,
            }
        if step % args.eval_every == 0 or step == args.steps:
            metrics.update(run_eval(model, tok, task, hard_task, eval_sets, args))
        log(metrics, step)

    evals = [h for h in history if "eval/acc" in h]
    train = [h for h in history if "rollout/reward" in h]
    summary = {
        "eval_acc_start": evals[0]["eval/acc"], "eval_acc_end": evals[-1]["eval/acc"],
        "eval_acc_best": max(h["eval/acc"] for h in evals), "privileged_acc_start": teacher_acc0,
        "privileged_acc_end": privileged_eval(model, tok, task, eval_sets["main"][:200], args),
        "train_reward_first": train[0]["rollout/reward"], "train_reward_last": train[-1]["rollout/reward"],
        "gen_tokens": gen_tokens, "tokens_per_s": gen_tokens / max(gen_time, 1e-9), "wall_s": time.time() - t_start,
        "entropy_first": float(np.mean([h["rollout/entropy"] for h in train[:5]])),
        "entropy_last": float(np.mean([h["rollout/entropy"] for h in train[-5:]])),
        "length_first": float(np.mean([h["rollout/length"] for h in train[:5]])),
        "length_last": float(np.mean([h["rollout/length"] for h in train[-5:]])),
        "truncated_frac_max": max(h["rollout/truncated_frac"] for h in train),
    }
    if "eval/acc_hard" in evals[-1]:
        summary["eval_acc_hard_start"], summary["eval_acc_hard_end"] = evals[0]["eval/acc_hard"], evals[-1]["eval/acc_hard"]
    print(f"[{args.mode}] held-out greedy accuracy {summary['eval_acc_start']:.3f} -> {summary['eval_acc_end']:.3f}; "
          f"privileged view {teacher_acc0:.3f} -> {summary['privileged_acc_end']:.3f}; entropy "
          f"{summary['entropy_first']:.3f} -> {summary['entropy_last']:.3f} in {summary['wall_s']:.0f}s")
    return tracker.finish(summary)


if __name__ == "__main__":
    main(tyro.cli(Args))
