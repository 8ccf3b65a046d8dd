"""OPD: on-policy distillation, and the "dense bridge" from a teacher to a student.

Papers: Agarwal et al., "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes",
arXiv:2306.13649 (OPD with a per-token divergence; GKD); the bridge: "Beyond GRPO and On-Policy Distillation:
An Empirical Sparse-to-Dense Reward Principle for Language-Model Post-Training", arXiv:2605.12483.

The student samples; a frozen teacher scores every generated token; the student minimises a per-token
divergence to the teacher at its own prefixes. At each completion position t with student log-probs s(.)
and teacher log-probs q(.) over the vocabulary (both at the student's prefix x, y_<t):

  exact reverse KL     KL(pi_s || pi_t)_t = sum_v p_s(v) (s(v) - q(v))                  reverse_kl
  sampled reverse KL   r_t = -(s(y_t) - q(y_t)) (a per-token reward, no grad),           sampled_rkl_advantage
                       loss_t = -r_t * s(y_t)  (REINFORCE on one token)                  sampled_rkl_loss
                       E_{y_t ~ pi_s}[s(y_t) - q(y_t)] = KL_t, and the expected gradient is grad KL_t.
  forward KL           KL(pi_t || pi_s)_t = sum_v p_t(v) (q(v) - s(v))                   forward_kl
                       (--loss fkl: at student prefixes; --loss fkl-teacher: on teacher rollouts, i.e. KD)
  GKD                  JSD_beta = beta KL(p_t || m) + (1-beta) KL(p_s || m), m = beta p_t + (1-beta) p_s,
                       on a mix of student (fraction --gkd-student-frac) and teacher rollouts   gen_jsd
  aggregation          token mean over all completion tokens of the step                 opd_loss
                       (each kind per token: token_divergence; who rolls out what: rollout_plan)

--schedule bridge (the bridge paper's "reward-density principle"): stage 1, --bridge-warmup steps of forward
KL on teacher rollouts; stage 2, --steps of OPD (--loss) on student rollouts; stage 3, optional --grpo-steps
of GRPO on the student with the verifier reward (the only stage that uses labels; group_advantages, -A_i log pi
aggregated seq-mean in opd_loss). benchmarks/opd_bridge.py compares, at a fixed budget of labelled
prompts, GRPO on the student vs GRPO on the teacher followed by the bridge.

StableOPD ("Demystifying OPD: Length Inflation and Stabilization Strategies for Large Language Models",
arXiv:2604.08527; truncation collapse): every step logs rollout/length, rollout/truncated_frac and
rollout/repeat_frac (completions with a repeated character 3-gram). The two fixes are flags:
--ref-coef (k3 KL of the student to its initial self on the sampled tokens, the reference-based divergence
constraint) and --mix-teacher-frac (that fraction of each batch's prompts is rolled out by the teacher and
distilled with forward KL: rollout mixture distillation).

Parent: none (its own design). Borrows: algos/grpo.py (group_advantages, k3_kl), exact copies.

What changes from GRPO: the per-token signal is the teacher's log-probs, not a verifier's reward. rollout is
grpo's with a second sampler: the student rolls out its share of the step's prompts and the teacher the rest,
each share one part of the batch (rewarded by the verifier for the metrics and for the bridge's GRPO stage).
`update` is changed because the teacher's forward must happen inside it: the divergences need the
full-vocabulary log-probs of the student and of the teacher at every completion position, where grpo's update
scores only the sampled tokens. They are never held whole ([b, C, V]): chunked_loss runs both decoders once to
their hidden states and then, chunk by chunk over positions (common.LOGPROB_CHUNK_MB MiB of fp32 logits each),
both lm_heads, the divergence and its gradient w.r.t. the chunk's hidden states and the lm_head weight (the design
of Liger-Kernel's fused linear JSD), before one backward through the student's decoder. Each part is split into
micro-batches of at most --micro-batch-size sequences (micro_batches; a micro-batch never mixes the two samplers'
completions, which have their own lengths), with one optimiser step per batch and no pi_old (the losses are
on-policy). The loss_fn fed to it is opd_loss (a chunk's share of J). optimizer_step is llm.optimizer_step at
OPD's learning rate (lr_at). Eval, rollout metrics, summary and curve are common.py's.

Deviations:
- The KL is "local": the per-position divergence at the sampled prefix, with no gradient through the
  choice of future tokens (the sequence-level reverse KL would add a return over later positions). This is
  what Thinking Machines' OPD and AsyncOPD (arXiv:2606.24143) use; the sampled estimator uses per-token
  rewards with discount 0.
- Full-vocabulary log-probs are computed chunk by chunk (chunked_loss), so memory does not grow with
  vocabulary x length; the teacher still runs its full lm_head on every position (a top-k teacher cache, as in
  algos/async_opd.py, would store less).
- StableOPD's abstract names its two fixes but not their exact form; the k3 penalty and the forward-KL
  treatment of mixed-in teacher rollouts are our choices.
- The bridge's GRPO stage is on-policy (one update per batch, ratio 1), the same gradient as algos/grpo.py
  with its defaults.
- The teacher may be any model with the student's tokenizer (vocabularies are checked to be identical).
- One process (no `accelerate launch`) and Hugging Face sampling (--engine vllm is refused); the learning rate
  warms up over --warmup-steps and, with the default --lr-schedule linear, decays linearly toward 10% at the last
  step (lr_at).
- On CUDA the student samples with common.Sampler's bf16 weight copy (and the teacher with its own). The exact
  divergences are per prefix and need no correction for it; the sampled estimators (rkl-sampled, the bridge's
  GRPO stage) take no importance weight for that gap, which is logged as rollout/logprob_mismatch. On CPU the
  sampler is the trainer's own forward.

Commands:
  python algos/opd.py                                     # tiny-5m teacher -> tiny-0.6m student, ~2 min
  python algos/opd.py --loss rkl                          # exact full-vocabulary reverse KL
  python algos/opd.py --loss gkd --gkd-student-frac 0.5   # GKD-style mixture
  python algos/opd.py --schedule bridge --bridge-warmup 30 --grpo-steps 50    # the dense bridge (+ student GRPO)
  python algos/opd.py --teacher runs/grpo/checkpoint      # any teacher sharing the tokenizer
  python algos/opd.py --save-every 25 --resume runs/opd/checkpoint   # continue an interrupted run exactly
Expected: held-out greedy accuracy of tiny-0.6m on 2-digit addition rises from 35.8% by 10+ points toward
the teacher's ~71% (measured: 35.8% -> 53.8% in 129 s on 2 shared cores); benchmarks/results/opd_bridge.md
has the bridge comparison.
"""
from __future__ import annotations

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


@dataclass
class Args(LLMArgs):
    """OPD's own flags; the plumbing flags (run, --model: the student, task, optimiser, eval, checkpoints) are
    LLMArgs'."""
    teacher: str = "tiny-5m"
    """the teacher: any model with the student's tokenizer (a checkpoint folder of algos/grpo.py works)"""
    threads: int = 1
    """torch CPU threads (1 is faster than 2 on a shared 2-core machine)"""
    # objective and schedule
    loss: Literal["rkl", "rkl-sampled", "fkl", "fkl-teacher", "gkd"] = "rkl"
    """per-token divergence of the OPD stage (see the header)"""
    schedule: Literal["opd", "bridge"] = "opd"
    """opd: --steps of --loss; bridge: forward-KL warm-up on teacher rollouts, OPD, then optional GRPO"""
    bridge_warmup: int = 30
    """bridge stage 1: steps of forward KL on teacher rollouts"""
    grpo_steps: int = 0
    """bridge stage 3: steps of GRPO on the student (labelled prompts)"""
    gkd_student_frac: float = 0.5
    """GKD: fraction of each batch's prompts rolled out by the student (the rest by the teacher)"""
    gkd_beta: float = 0.5
    """GKD: the generalised JSD's interpolation beta, in (0, 1)"""
    ref_coef: float = 0.0
    """StableOPD fix 1: weight of the k3 KL to the initial student (0 = off)"""
    mix_teacher_frac: float = 0.0
    """StableOPD fix 2: fraction of prompts rolled out by the teacher and distilled with forward KL"""
    # rollout and optimisation
    steps: int = 150
    """OPD steps (rollout batch + one optimiser step each)"""
    prompts_per_step: int = 32
    """distinct prompts per batch"""
    group_size: int = 4
    """completions per prompt (GRPO needs >= 2)"""
    grpo_lr: float = 1e-4
    """AdamW learning rate of the bridge's GRPO stage (constant; --lr is the distillation stages': 5e-4 overshoots
    on the tiny student)"""
    lr_schedule: Literal["linear", "constant", "cosine"] = "linear"
    """after warm-up: linear (the distillation lr times 1 - 0.9 (step - 1) / total steps, from the first step on:
    10% at the last step), constant, or cosine decay to 10% over all steps"""
    warmup_steps: int = 10
    """linear learning-rate warm-up (Adam's first steps are sign-like and overshoot at full lr)"""
    # eval
    pass_k: int = 0
    """k of pass@k (on the first 100 held-out prompts; 0 = off)"""


def check_args(args: Args) -> None:
    """Fail early, naming the flag, instead of deep inside torch."""
    if args.steps < 0 or args.bridge_warmup < 0 or args.grpo_steps < 0:
        raise SystemExit("--steps, --bridge-warmup and --grpo-steps must be >= 0")
    if total_steps(args) < 1:
        raise SystemExit("nothing to train: --steps (and the bridge stages) add up to 0")
    if args.prompts_per_step < 1 or args.group_size < 1 or args.max_new_tokens < 1:
        raise SystemExit("--prompts-per-step, --group-size and --max-new-tokens must be positive")
    if args.schedule == "bridge" and args.grpo_steps and args.group_size < 2:
        raise SystemExit(f"--grpo-steps needs --group-size >= 2 for a group baseline, got {args.group_size}")
    if args.schedule == "opd" and args.grpo_steps:
        raise SystemExit("--grpo-steps only applies with --schedule bridge")
    if not 0 < args.gkd_beta < 1:
        raise SystemExit(f"--gkd-beta must be in (0, 1), got {args.gkd_beta}")
    if not 0 <= args.gkd_student_frac <= 1 or not 0 <= args.mix_teacher_frac < 1:
        raise SystemExit("--gkd-student-frac must be in [0, 1] and --mix-teacher-frac in [0, 1)")
    if args.temperature <= 0:
        raise SystemExit("--temperature must be > 0")
    if args.ref_coef < 0:
        raise SystemExit("--ref-coef must be >= 0")
    if args.micro_batch_size < 1:
        raise SystemExit("--micro-batch-size must be positive")
    if args.engine == "vllm":
        raise SystemExit("--engine vllm: OPD samples the student and the teacher with Hugging Face generate (no "
                         "vLLM engine is wired in); use --engine hf")


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


# ---- the idea: per-token divergences ----
def reverse_kl(s_logp: torch.Tensor, t_logp: torch.Tensor) -> torch.Tensor:
    """KL(pi_s || pi_t) per position: sum_v p_s (s - q); inputs [..., V] log-probs -> [...]."""
    return (s_logp.exp() * (s_logp - t_logp)).sum(-1)


def forward_kl(s_logp: torch.Tensor, t_logp: torch.Tensor) -> torch.Tensor:
    """KL(pi_t || pi_s) per position: sum_v p_t (q - s)."""
    return (t_logp.exp() * (t_logp - s_logp)).sum(-1)


def gen_jsd(s_logp: torch.Tensor, t_logp: torch.Tensor, beta: float) -> torch.Tensor:
    """GKD's generalised JSD: beta KL(p_t || m) + (1 - beta) KL(p_s || m), m = beta p_t + (1 - beta) p_s."""
    m = torch.logsumexp(torch.stack([t_logp + np.log(beta), s_logp + np.log(1 - beta)]), 0)
    return beta * (t_logp.exp() * (t_logp - m)).sum(-1) + (1 - beta) * (s_logp.exp() * (s_logp - m)).sum(-1)


def sampled_rkl_advantage(s_tok: torch.Tensor, t_tok: torch.Tensor) -> torch.Tensor:
    """Per-token reward r_t = -(log pi_s(y_t) - log pi_t(y_t)) at the sampled tokens (no gradient)."""
    return -(s_tok - t_tok).detach()


def sampled_rkl_loss(s_tok: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """REINFORCE on each token with its own reward: -r_t log pi_s(y_t); expected gradient = grad KL_t."""
    return -adv * s_tok


def k3_kl(logp, ref_logp):
    """Schulman's k3 estimator of KL(pi_theta || pi_ref): exp(ref - logp) - (ref - logp) - 1 >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def group_advantages(rewards: torch.Tensor, group_size: int, std_norm: bool = True, eps: float = 1e-6):
    """A_i = (r_i - mean_g r) / (std_g r + eps); rewards [B] group-major -> advantages [B]."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(1, keepdim=True)
    if std_norm:
        adv = adv / (r.std(1, keepdim=True) + eps)
    return adv.view(-1)


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


def token_divergence(kind: str, s_logp, t_logp, tokens, beta: float = 0.5):
    """Per-token loss [B, C] for one divergence kind, given [B, C, V] log-probs and the sampled tokens [B, C]."""
    if kind == "rkl":
        return reverse_kl(s_logp, t_logp)
    if kind in ("fkl", "fkl-teacher"):
        return forward_kl(s_logp, t_logp)
    if kind == "gkd":
        return gen_jsd(s_logp, t_logp, beta)
    if kind == "rkl-sampled":
        s_tok = s_logp.gather(-1, tokens[..., None]).squeeze(-1)
        t_tok = t_logp.gather(-1, tokens[..., None]).squeeze(-1)
        return sampled_rkl_loss(s_tok, sampled_rkl_advantage(s_tok, t_tok))
    raise ValueError(f"unknown divergence {kind!r}")


def opd_loss(s_logp, mb: dict, n_seqs: int, n_tokens: int, args: Args):
    """A chunk's share of J. s_logp [n, V] (with grad): the student's log-probs at n completion positions of one
    part; mb holds the teacher's log-probs there [n, V], per-position rows [n] (position_rows: the sampled tokens,
    the mask, ref (the initial student's log-prob of the token, or None), the sequence's adv and seq_len) and the
    part's loss kind.

    Distillation: the per-token divergence (+ ref_coef * k3 KL to the initial student on the student's
    rollouts), token-mean over the step's n_tokens. The bridge's GRPO stage: -A_i log pi(y_t), seq-mean (each
    token weighted 1 / (|o_i| n_seqs): GRPO at ratio 1, the same gradient as grpo_loss). Returns (loss, per-token
    stats).
    """
    tokens, mask = mb["completion_ids"], mb["mask"]
    s_tok = s_logp.gather(-1, tokens[..., None]).squeeze(-1)
    if mb["kind"] == "grpo":
        return common.masked_sum(-(mb["adv"] * s_tok) / mb["seq_len"].clamp(min=1), mask) / n_seqs, {}
    tok_loss, stats = token_divergence(mb["kind"], s_logp, mb["teacher"], tokens, args.gkd_beta), {}
    if mb["ref"] is not None:
        rk = k3_kl(s_tok, mb["ref"])
        tok_loss, stats["kl/ref"] = tok_loss + args.ref_coef * rk, rk
    return common.masked_sum(tok_loss, mask) / n_tokens, stats


def repeat_frac(texts: list[str], n: int = 3) -> float:
    """Fraction of completions containing some character n-gram at least twice (StableOPD's repetition signal)."""
    def rep(t):
        grams = [t[i:i + n] for i in range(len(t) - n + 1)]
        return len(grams) != len(set(grams))
    return float(np.mean([rep(t) for t in texts])) if texts else 0.0


# ---- rollout and update ----
def total_steps(args: Args) -> int:
    """Optimiser steps of the whole run: --steps, plus the bridge's warm-up and GRPO stages."""
    return args.steps + (args.bridge_warmup + args.grpo_steps if args.schedule == "bridge" else 0)


def stage_of(step: int, args: Args) -> str:
    """'warmup' (FKL on teacher rollouts), 'opd' or 'grpo' for a 1-based step."""
    if args.schedule == "opd":
        return "opd"
    if step <= args.bridge_warmup:
        return "warmup"
    return "opd" if step <= args.bridge_warmup + args.steps else "grpo"


def rollout_plan(stage: str, n: int, args: Args) -> tuple[int, str | None, str | None]:
    """How many of the step's n prompts the student rolls out (the rest: the teacher), and each part's loss kind."""
    if stage == "warmup" or (stage == "opd" and args.loss == "fkl-teacher"):
        return 0, None, "fkl-teacher"
    if stage == "opd" and args.loss == "gkd":
        return round(args.gkd_student_frac * n), "gkd", "gkd"
    if stage == "opd":  # StableOPD's rollout mixture: a share of teacher rollouts, distilled with forward KL
        return n - round(args.mix_teacher_frac * n), args.loss, "fkl-teacher"
    return n, "grpo", None


def rollout(sampler, tok, task, args: Args, rng, device, teacher=None, stage: str = "opd") -> list[dict]:
    """Sample the step's prompts: the student's sampler rolls out its share (G completions each), the teacher's
    sampler the rest.

    Returns one batch per sampler that rolled out (the student's first), each with grpo's keys (rewards from
    the verifier; A_i per group only for the GRPO stage) plus the texts, the loss kind and the source.
    """
    examples = task.sample("train", args.prompts_per_step, rng)
    n_student, s_kind, t_kind = rollout_plan(stage, len(examples), args)
    parts = []
    for source, policy, exs, kind in (("student", sampler, examples[:n_student], s_kind),
                                      ("teacher", teacher, examples[n_student:], t_kind)):
        if not exs:
            continue
        ro = common.generate(policy, tok, common.encode_prompts(tok, [e.prompt for e in exs]), args.group_size,
                             args.max_new_tokens, args.temperature, args.top_p)
        answers = [e.answer for e in exs for _ in range(args.group_size)]
        rewards = torch.tensor([task.verify(t, a)[0] for t, a in zip(ro.texts, answers)], device=device)
        batch = {k: getattr(ro, k).to(device) for k in
                 ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs")}
        batch.update(rewards=rewards, adv=group_advantages(rewards, args.group_size) if kind == "grpo" else None,
                     finish_reasons=ro.finish_reasons, texts=ro.texts, kind=kind, source=source)
        parts.append(batch)
    return parts


def teacher_hidden(teacher, mb: dict, args: Args) -> torch.Tensor:
    """The teacher's last hidden states [b, C, H_t] at the student's prefixes (x, y_<t) of this part's completions
    (chunked_loss turns each chunk of them into log-probs)."""
    return completion_hidden(teacher, mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["completion_mask"])


def lr_at(step: int, args: Args) -> float:
    """Learning rate of a 1-based step: --lr times a linear warm-up over --warmup-steps and, with --lr-schedule
    linear, a linear decay from 1 toward 0.1 at the last step (constant or cosine: llm.lr_factor's schedule); the
    bridge's GRPO stage runs at a constant --grpo-lr."""
    if stage_of(step, args) == "grpo":
        return args.grpo_lr
    if args.lr_schedule != "linear":
        return args.lr * llm.lr_factor(step - 1, total_steps(args), args)
    return args.lr * min(1.0, step / max(args.warmup_steps, 1)) * (1 - 0.9 * (step - 1) / total_steps(args))


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
def opd_summary(history: list[dict], teacher_eval: dict, labelled_prompts: int) -> dict:
    """The summary's OPD figures: the teacher's accuracy, the final KLs, the student's lengths and truncation (the
    collapse signals), and the labelled prompts the run used."""
    train = [h for h in history if "rollout/reward" in h]
    student_rows = [h for h in train if h["rollout/source_student"]] or train
    out = {"teacher_acc": teacher_eval["eval/acc"],
           "kl_reverse_end": train[-1]["kl/reverse"], "kl_forward_end": train[-1]["kl/forward"],
           "truncated_frac_max": max(h["rollout/truncated_frac"] for h in student_rows),
           "length_mean": float(np.mean([h["rollout/length"] for h in student_rows])),
           "labelled_prompts": labelled_prompts}
    if "eval/acc_hard" in teacher_eval:
        out["teacher_acc_hard"] = teacher_eval["eval/acc_hard"]
    return out


def main(args: Args) -> dict:
    check_args(args)
    run = llm.Run(args, total=total_steps(args))  # accelerator, threads, seed, task, held-out sets; all stages' steps
    if run.accel.num_processes > 1:
        raise SystemExit("OPD runs in one process: start it with python, not torchrun or accelerate launch")
    model, tok, ref_model, sampler = llm.load_policy(args, run.accel, with_ref=args.ref_coef > 0)  # the student
    teacher, tok_t = common.load_model(args.teacher, run.accel.device, args.dtype)
    check_teacher(tok, tok_t, model, teacher, args.teacher)
    teacher_sampler = common.Sampler(teacher.eval().requires_grad_(False))  # frozen: nothing to refresh
    opt = llm.make_optimizer(model.parameters(), args)
    evaluate = lambda policy, k=args.pass_k: common.run_eval(  # noqa: E731
        policy, tok, run.task, run.eval_sets, args.max_new_tokens, k, args.temperature, run.hard_task)

    def evaluate_student() -> dict:  # at step 0, after the teacher's evaluation (once per run), with its accuracy
        if run.history:
            return evaluate(sampler)
        run.counters["teacher_eval"] = evaluate(teacher_sampler, 0)
        return {**evaluate(sampler), "eval/teacher_acc": run.counters["teacher_eval"]["eval/acc"]}

    # resume (the labelled-prompt count and the teacher's evaluation too), then the step-0 held-out evaluation
    run.start(model, tok, opt, sampler, evaluate=evaluate_student,
              counters={"labelled_prompts": 0, "teacher_eval": None})
    run.counters["teacher_eval"] = run.counters["teacher_eval"] or evaluate(teacher_sampler, 0)  # an older checkpoint
    for step, rng in run.steps():  # rng: default_rng([seed, step]) (one process: rank 0 adds nothing)
        torch.manual_seed(hash((args.seed, step)) % 2**31)  # each step's draws depend on (seed, step): exact resume
        stage = stage_of(step, args)
        with run.timer("gen"):
            parts = rollout(sampler, tok, run.task, args, rng, run.accel.device, teacher_sampler, stage)
        with run.timer("train"):
            stats = update(model, opt, parts, opd_loss, args, step, teacher, ref_model)
        run.gen_tokens += sum(int(p["completion_mask"].sum()) for p in parts[1:])  # log_step counts parts[0]'s
        run.counters["labelled_prompts"] += args.prompts_per_step if stage == "grpo" else 0
        own = parts[0]  # the rollouts of the policy being trained where it sampled, else the teacher's
        run.log_step(step, own, stats, extra={"stage": {"warmup": 0, "opd": 1, "grpo": 2}[stage],
                                              "rollout/source_student": float(own["source"] == "student"),
                                              "rollout/repeat_frac": repeat_frac(own["texts"])})
    teacher_eval = run.counters["teacher_eval"]
    print(f"teacher held-out greedy accuracy {teacher_eval['eval/acc']:.3f}")
    return run.finish(f"OPD {args.loss}/{args.schedule}", hlines={"teacher": teacher_eval["eval/acc"]},
                      extra=opd_summary(run.history, teacher_eval, run.counters["labelled_prompts"]))


if __name__ == "__main__":
    main(tyro.cli(Args))
