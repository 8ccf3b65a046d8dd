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
  Each mode's loss and aggregation (token-mean for opsd and pw-opsd, seq-mean for trace and grpo):
  self_opd_loss.

Logged every step: student entropy (loss/entropy) and response length on rollouts (TRACE's leakage
symptoms), the truncated fraction and repetition (StableOPD's collapse signals); held-out accuracy, and
out-of-distribution accuracy one digit harder, at every evaluation.

Parent: none (its own design). Borrows: algos/opd.py (reverse_kl, forward_kl, group_advantages, completion_hidden,
  chunk_logprobs, position_rows, PrecomputedGrad, chunked_loss, repeat_frac, optimizer_step, micro_batches,
  update), exact copies.

What changes from OPD: the teacher is the student's own weights, shown x* instead of x: teacher_hidden reads
the completions after the privileged prompt that rollout builds next to each rollout (the sampler never sees
it). The loss_fn fed to opd.py's `update` is self_opd_loss, a chunk's share of J (opd.py's chunked_loss computes
both views' log-probs chunk by chunk over positions). rollout samples every prompt with the student and always
rewards it (trace and grpo use A_i; trace also gets its span marks and this step's KL-channel weight; pw-opsd's
position weights are computed there, from whole sequences); lr_at is llm.lr_factor's schedule (constant by
default).

Deviations:
- The privileged teacher is the current weights (not a frozen copy), as in OPSD; no gradient through it.
- PW-OPSD's exact clipping of the forward-KL target is not in the abstract: we cap each token's loss weight.
- Spans are marked programmatically (carries), not by an annotator or the model (TRACE's online variant).
- The branch-viability diagnostic / AUROC of PW-OPSD is not implemented.
- TRACE's GRPO term is on-policy (ratio 1), seq-mean, as algos/grpo.py with its defaults. On CUDA the student
  samples with common.Sampler's bf16 weight copy, and the GRPO terms (trace, grpo) take no importance weight for
  that gap (logged as rollout/logprob_mismatch); on CPU the sampler is the trainer's own forward.
- One process, Hugging Face sampling (--engine vllm is refused).

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

import dataclasses
import re
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
    """Self-OPD's own flags; the plumbing flags (run, --model: the student and, shown privileged context, the
    teacher, task, optimiser, eval, checkpoints) are LLMArgs'."""
    threads: int = 1
    """torch CPU threads (1 is faster than 2 on a shared 2-core machine)"""
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
    lr: float = 2e-4
    """peak learning rate (AdamW)"""
    pass_k: int = 0
    """k of pass@k (on the first 100 held-out prompts; 0 = off)"""


def check_args(args: Args) -> None:
    """Fail early, naming the flag, instead of deep inside torch."""
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
    if args.micro_batch_size < 1:
        raise SystemExit("--micro-batch-size must be positive")
    if args.engine == "vllm":
        raise SystemExit("--engine vllm: the student samples with Hugging Face generate here (no vLLM engine is wired "
                         "in); use --engine hf")


# ---- privileged context ----
def privileged_prompt(ex: llm.Example, task, mode: str) -> str:
    """The teacher's prompt: x plus the worked solution (or the answer). Never shown to the student."""
    if getattr(task, "kind", None) == "add" and mode == "solution":
        a, b = (int(v) for v in ex.prompt.rstrip("=").split("+"))
        pad = llm.addition_scratchpad(a, b)
        return f"{a}+{b}:" + pad[:pad.rindex("=") + 1]  # the scratchpad-reading format the model knows
    ctx = ex.answer if mode == "answer" or not ex.solution else ex.solution
    if getattr(task, "kind", None) == "add":
        return f"{ex.prompt}{ctx}\n{ex.prompt}"  # the answer shown once, then asked again
    return f"Reference {'answer' if mode == 'answer' else 'solution'}: {ctx}\n\n{ex.prompt}"


# ---- the idea: per-token weights and losses ----
def reverse_kl(s_logp: torch.Tensor, t_logp: torch.Tensor) -> torch.Tensor:
    """KL(pi_s || pi_t) per position: sum_v p_s (s - q); inputs [..., V] log-probs -> [...]."""
    return (s_logp.exp() * (s_logp - t_logp)).sum(-1)


def forward_kl(s_logp: torch.Tensor, t_logp: torch.Tensor) -> torch.Tensor:
    """KL(pi_t || pi_s) per position: sum_v p_t (q - s)."""
    return (t_logp.exp() * (t_logp - s_logp)).sum(-1)


def clipped_fkl(s_logp, t_logp, clip: float):
    """c_t f_t with c_t = min(1, clip / f_t) held constant: the value is min(f_t, clip), the gradient capped."""
    f = forward_kl(s_logp, t_logp)
    return (clip / f.detach().clamp(min=1e-12)).clamp(max=1.0) * f


def position_weights(mask: torch.Tensor) -> torch.Tensor:
    """w_t = 2 (t + 1) / (|y| + 1) on the completion tokens (mean 1 per sequence), 0 on padding."""
    pos = torch.arange(1, mask.shape[1] + 1, device=mask.device, dtype=torch.float32)[None]
    length = mask.sum(1, keepdim=True).float()
    return 2 * pos / (length + 1) * mask


def group_advantages(rewards: torch.Tensor, group_size: int, std_norm: bool = True, eps: float = 1e-6):
    """A_i = (r_i - mean_g r) / (std_g r + eps); rewards [B] group-major -> advantages [B]."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(1, keepdim=True)
    if std_norm:
        adv = adv / (r.std(1, keepdim=True) + eps)
    return adv.view(-1)


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
    """Per-token TRACE loss [...]: GRPO (-A s(y)) off the spans, lambda FKL on key, lambda RKL on error; adv is the
    advantage of each token's sequence (per position, as s_tok)."""
    spans = torch.clamp(key + (err if error_rkl else 0), max=1) * cmask
    pg = -(adv * s_tok) * (1 - spans)
    kl = forward_kl(s_logp, t_logp) * key + (reverse_kl(s_logp, t_logp) * err if error_rkl else 0)
    return pg + kl_weight * kl * cmask


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


def self_opd_loss(s_logp, mb: dict, n_seqs: int, n_tokens: int, args: Args):
    """A chunk's share of J for --mode. s_logp [n, V] (with grad) at n completion positions; mb holds the
    teacher's log-probs at x* there [n, V] and per-position rows [n] (opd.py's position_rows): the sampled tokens,
    the mask, pos_weight (position_weights), the sequence's seq_len and, for trace and grpo, adv (trace: key, err
    and the step's kl_weight).

    opsd, pw-opsd: token-mean over the step's n_tokens; trace, grpo: seq-mean (each token weighted
    1 / (|y_i| n_seqs), algos/grpo.py's seq-mean). Returns (loss, per-token stats).
    """
    mask, t_logp = mb["mask"], mb["teacher"]
    if args.mode in ("opsd", "pw-opsd"):
        tl = clipped_fkl(s_logp, t_logp, args.kl_clip)
        if args.mode == "pw-opsd":
            tl = tl * mb["pos_weight"]
        return common.masked_sum(tl, mask) / n_tokens, {}
    s_tok = s_logp.gather(-1, mb["completion_ids"][..., None]).squeeze(-1)
    seq_mean = mask / (mb["seq_len"].clamp(min=1) * n_seqs)
    if args.mode == "grpo":
        return (-(mb["adv"] * s_tok) * seq_mean).sum(), {}
    tl = trace_loss(s_logp, t_logp, s_tok, mb["adv"], mask, mb["key"], mb["err"], mb["kl_weight"], args.error_rkl)
    return (tl * seq_mean).sum(), {"trace/key_frac": mb["key"], "trace/err_frac": mb["err"]}


def repeat_frac(texts: list[str], n: int = 3) -> float:
    """Fraction of completions containing some character n-gram at least twice (StableOPD's repetition signal)."""
    def rep(t):
        grams = [t[i:i + n] for i in range(len(t) - n + 1)]
        return len(grams) != len(set(grams))
    return float(np.mean([rep(t) for t in texts])) if texts else 0.0


@torch.no_grad()
def privileged_eval(policy, tok, task, examples, args) -> float:
    """Greedy accuracy of the teacher view: the same model (or its sampler) given the privileged prompt."""
    exs = [llm.Example(privileged_prompt(e, task, args.privileged), e.answer, e.solution) for e in examples]
    return common.evaluate(policy, tok, task, exs, args.max_new_tokens)["acc"]


# ---- rollout and update ----
def rollout(sampler, tok, task, args: Args, rng, device, step: int = 1) -> list[dict]:
    """Sample G completions per prompt from the plain prompt x; reward them (A_i per group for trace, grpo).

    Returns one batch (opd.py's keys) that also carries the teacher's view, x* (privileged_prompt, left-padded;
    never given to the sampler), and for trace the span marks and this step's KL-channel weight.
    """
    examples = task.sample("train", args.prompts_per_step, rng)
    ro = common.generate(sampler, tok, common.encode_prompts(tok, [e.prompt for e in examples]), args.group_size,
                         args.max_new_tokens, args.temperature, args.top_p)
    rep = [e for e in examples for _ in range(args.group_size)]
    rewards = torch.tensor([task.verify(t, e.answer)[0] for t, e in zip(ro.texts, rep)], device=device)
    batch = {k: getattr(ro, k).to(device) for k in
             ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs")}
    x_star, x_star_mask = common.left_pad(common.encode_prompts(
        tok, [privileged_prompt(e, task, args.privileged) for e in rep]), tok.pad_token_id)
    batch.update(rewards=rewards, finish_reasons=ro.finish_reasons, texts=ro.texts, source="student",
                 privileged_ids=x_star.to(device), privileged_mask=x_star_mask.to(device),
                 pos_weight=position_weights(batch["completion_mask"].float()))
    if args.mode in ("trace", "grpo"):
        batch["adv"] = group_advantages(rewards, args.group_size)
    if args.mode == "trace":
        m = batch["completion_mask"].float()
        key, err = critical_masks(task, rep, ro.texts, rewards.tolist(), m.shape[1])
        batch.update(key=key.to(device) * m, err=error_mask(err.to(device), args.error_span, m),
                     kl_weight=kl_channel_weight(step, args))
    return [batch]


def teacher_hidden(teacher, mb: dict, args: Args) -> torch.Tensor:
    """The teacher's last hidden states [b, C, H]: the same weights, reading the completions after x* (x*, y_<t)."""
    return completion_hidden(teacher, mb["privileged_ids"], mb["privileged_mask"], mb["completion_ids"],
                             mb["completion_mask"])


def lr_at(step: int, args: Args) -> float:
    """Learning rate of a 1-based step: --lr on llm.lr_factor's schedule (constant by default, no warm-up)."""
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
def self_opd_summary(history: list[dict], privileged_start: float, privileged_end: float) -> dict:
    """The summary's self-OPD figures: the privileged view's accuracy, and the entropy, length and truncation of the
    first and last rollouts (TRACE's leakage and StableOPD's collapse symptoms)."""
    train = [h for h in history if "rollout/reward" in h]
    return {"privileged_acc_start": privileged_start, "privileged_acc_end": privileged_end,
            "entropy_first": float(np.mean([h["loss/entropy"] for h in train[:5]])),
            "entropy_last": float(np.mean([h["loss/entropy"] for h in train[-5:]])),
            "length_first": float(np.mean([h["rollout/length"] for h in train[:5]])),
            "length_last": float(np.mean([h["rollout/length"] for h in train[-5:]])),
            "truncated_frac_max": max(h["rollout/truncated_frac"] for h in train)}


def main(args: Args) -> dict:
    check_args(args)
    run = llm.Run(args)  # accelerator, threads, seed, the task and its held-out sets, the run folder
    if run.accel.num_processes > 1:
        raise SystemExit("self_opd runs in one process: start it with python, not torchrun or accelerate launch")
    if args.mode == "trace" and getattr(run.task, "kind", None) not in ("add", "addsteps"):
        raise SystemExit("--mode trace marks critical spans programmatically: only the arithmetic tasks "
                         "(add, addsteps) have span marks")
    model, tok, _, sampler = llm.load_policy(args, run.accel)  # the student, and the teacher when shown x*
    opt = llm.make_optimizer(model.parameters(), args)
    privileged = lambda: privileged_eval(sampler, tok, run.task, run.eval_sets["main"][:200], args)  # noqa: E731

    def evaluate() -> dict:  # at step 0 after the privileged view's accuracy (checkpointed), logged beside it
        first = not run.history
        if first:
            run.counters["privileged_acc_start"] = privileged()
        out = common.run_eval(sampler, tok, run.task, run.eval_sets, args.max_new_tokens, args.pass_k,
                              args.temperature, run.hard_task)
        return {**out, "eval/privileged_acc": run.counters["privileged_acc_start"]} if first else out

    # resume (the privileged view's starting accuracy too), then the step-0 held-out evaluation
    run.start(model, tok, opt, sampler, evaluate=evaluate, counters={"privileged_acc_start": None})
    for step, rng in run.steps():  # rng: default_rng([seed, step]) (one process: rank 0 adds nothing)
        torch.manual_seed(hash((args.seed, step)) % 2**31)  # each step's draws depend on (seed, step): exact resume
        with run.timer("gen"):
            parts = rollout(sampler, tok, run.task, args, rng, run.accel.device, step)
        with run.timer("train"):
            stats = update(model, opt, parts, self_opd_loss, args, step, model)  # the teacher: the same weights
        b = parts[0]
        run.log_step(step, b, stats, extra={"rollout/repeat_frac": repeat_frac(b["texts"]),
                                            **({"trace/kl_weight": b["kl_weight"]} if args.mode == "trace" else {})})
    teacher_acc0 = run.counters["privileged_acc_start"]
    summary = self_opd_summary(run.history, teacher_acc0, privileged())
    print(f"[{args.mode}] privileged view {teacher_acc0:.3f} -> {summary['privileged_acc_end']:.3f}; entropy "
          f"{summary['entropy_first']:.3f} -> {summary['entropy_last']:.3f}")
    return run.finish(f"self-OPD {args.mode}", extra=summary, hlines={"teacher (privileged view)": teacher_acc0})


if __name__ == "__main__":
    main(tyro.cli(Args))
