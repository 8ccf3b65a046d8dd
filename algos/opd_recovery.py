"""OPD recovery: recover a structurally pruned model by on-policy distillation from the unpruned one, with a
short-to-long rollout budget and StableOPD's two stabilisers as flags.

Papers: short-to-long OPD, for recovering structurally pruned LLMs (its abstract
names the method only by the unexpanded LaTeX macro "\\shortopd", and no code for it was found); StableOPD:
"Demystifying OPD: Length Inflation and Stabilization Strategies for Large Language Models", arXiv:2604.08527.
OPD itself: algos/opd.py.

The student is the teacher (--teacher, default tiny-5m) with a fraction of its attention heads and/or MLP channels
removed (prune_plan, prune_), i.e. --model == --teacher, pruned until it degrades and loops. It is trained with
algos/opd.py's per-token divergence (--loss) on its own rollouts. The recovery's additions:

  pruning              head h of layer l: columns [h d, (h+1) d) of o_proj zeroed (and rows of q, k, v);    prune_
                       MLP channel c: column c of down_proj (and row c of gate, up) zeroed; gradient masks
                       keep them zero (AdamW then never moves them). --prune-select norm: the lowest-norm
                       heads (o_proj block) / channels (down_proj column) of each layer; random: uniform.
  teacher-confirmed    a truncated completion y_1..y_L ends in a loop when its tail is k >= --repeat-min
  repetition           consecutive copies of one n-gram (n <= --repeat-max-n); the loop is confirmed when the
                       teacher's mean probability of the tail after the first copy, at the student's prefixes,
                       is >= --repeat-confirm. Effective length = L - (k-1) n (the first copy survives), else L.
                                                                                       repetitive_suffix
  budget (short-to-long)  B_1 = --budget-start; B_{s+1} = min(--max-new-tokens, max(B_s, ceil(--budget-growth *
                       q_0.9(effective lengths of step s's student rollouts))))    next_budget
                       (--schedule fixed: B_s = --max-new-tokens, the long horizon)
  StableOPD fix 1      + --stable-kl * k3(pi_theta || pi_init) on the student's tokens, pi_init the pruned
                       student before training (reference-based divergence constraint)  opd_loss, k3_kl
  StableOPD fix 2      --mix-frac of each batch's prompts rolled out by --mix-source (the teacher, or the frozen
                       initial student: the reference) and distilled with forward KL toward the teacher at those
                       prefixes (rollout mixture distillation)              rollout_plan, main

Every step logs rollout/budget, rollout/effective_length, rollout/confirmed_repeat_frac (of the student's
completions), rollout/repeat_frac (opd.py's character 3-gram signal) and kl/reverse, kl/forward (the teacher KL
at the student's prefixes); the summary adds the rollout tokens spent (gen_tokens) and the final figures.

Parent: algos/opd.py; changed: Args, Args.model, Args.task, Args.max_new_tokens, Args.schedule, Args.steps,
Args.lr, check_args, opd_loss, stage_of, rollout_plan, main. With --prune-frac 0, --schedule fixed,
--stable-kl 0, --mix-frac 0 and opd.py's --model, --task, --max-new-tokens, --steps and --lr it computes what
algos/opd.py computes (tests/test_opd_recovery.py checks the metrics step by step). The bridge schedule and its
GRPO stage are left out (their flags with them); --ref-coef and --mix-teacher-frac are --stable-kl and --mix-frac.

Deviations from the papers:
- Pruning zeroes weights (masked, kept zero) instead of slicing them out: the same function, no speed-up.
- The short-to-long paper's abstract gives no formula: the 0.9 quantile, the growth factor, the monotone budget
  and "repetition only counts on truncated completions" are our choices; the effective length sets the next
  budget only, the loss still covers every generated token.
- "Teacher-confirmed" is read as: the teacher at the student's prefixes also predicts the loop's tokens with mean
  probability >= --repeat-confirm (a loop the teacher would continue carries no corrective signal).
- StableOPD's abstract names its two fixes but not their form: the k3 penalty to the initial student, and forward
  KL on the mixed-in rollouts, are our choices (as in algos/opd.py's --ref-coef / --mix-teacher-frac).
- Everything else as algos/opd.py (one process, Hugging Face sampling, the learning-rate schedule, chunked losses).

Commands:
  python algos/opd_recovery.py                                     # 50% of heads pruned, short-to-long
  python algos/opd_recovery.py --schedule fixed                    # the fixed long horizon
  python algos/opd_recovery.py --stable-kl 0.1 --mix-frac 0.25     # StableOPD's two fixes
  python algos/opd_recovery.py --prune-target channels --prune-frac 0.7
Expected (the default: half of tiny-5m's heads pruned, addsteps, 40 steps; measured with --eval-examples 200
--eval-every 20 --no-eval-hard, seeds 0 and 1): greedy accuracy
0% -> 39.5% (seed 0) and 56.5% (seed 1), the teacher 98%; the mean reverse KL to the teacher over the first vs
the last 3 steps 2.98 -> 0.30 (seed 0) and 3.21 -> 0.22 (seed 1); the budget grows from 8 to 32 (seed 0) and 38
(seed 1). On 2 cores shared with other jobs (load average ~10) seed 0 took 1529 s and seed 1 1129 s; on an idle
core it has not been timed. Benchmark (benchmarks/results/opd_recovery.md, 30 steps, 3 seeds): fixed horizon 31.5 +- 9.6%,
short-to-long 31.0 +- 5.4% from 3% fewer rollout tokens, fixed + StableOPD's two fixes 39.2 +- 3.1% (underpowered):
the pruned student's answers are 15-19 tokens, so the 48-token horizon rarely truncates and there is little to save.
"""
from __future__ import annotations

import copy
import dataclasses
import math
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
    """The recovery's flags; the plumbing flags (run, --model: the student before pruning, task, optimiser, eval,
    checkpoints) are LLMArgs'."""
    model: str = "tiny-5m"
    """the student before pruning (the default prunes the teacher itself)"""
    task: str = "addsteps"
    """training and held-out task (addsteps: a digit-by-digit scratchpad, ~16 tokens for 2 digits)"""
    max_new_tokens: int = 48
    """the long horizon: the fixed schedule's budget, short-to-long's cap, and the evaluation's limit"""
    teacher: str = "tiny-5m"
    """the teacher: any model with the student's tokenizer (a checkpoint folder of algos/grpo.py works)"""
    threads: int = 1
    """torch CPU threads (1 is faster than 2 on a shared 2-core machine)"""
    # pruning
    prune_frac: float = 0.5
    """fraction of each layer's heads (and/or MLP channels) removed from the student (0 = no pruning)"""
    prune_target: Literal["heads", "channels", "both"] = "heads"
    """what is pruned: attention heads, MLP channels, or both"""
    prune_select: Literal["norm", "random"] = "norm"
    """which ones: the lowest-norm per layer (o_proj head block, down_proj column), or uniformly at random (--seed)"""
    # rollout budget and repetition
    schedule: Literal["fixed", "short-to-long"] = "short-to-long"
    """rollout budget: fixed (--max-new-tokens every step) or short-to-long (next_budget from effective lengths)"""
    budget_start: int = 8
    """short-to-long: the first step's max new tokens"""
    budget_growth: float = 1.5
    """short-to-long: next budget = growth x the 0.9 quantile of the effective lengths (never shrinking)"""
    repeat_max_n: int = 4
    """longest n-gram the repetition detector tries"""
    repeat_min: int = 3
    """consecutive copies of the n-gram at the end that make a loop"""
    repeat_confirm: float = 0.5
    """a loop counts only when the teacher's mean probability of its repeated tokens is at least this"""
    # objective
    loss: Literal["rkl", "rkl-sampled", "fkl", "fkl-teacher", "gkd"] = "rkl"
    """per-token divergence of the OPD stage (see the header)"""
    gkd_student_frac: float = 0.5
    """GKD: fraction of each batch's prompts rolled out by the student (the rest by the teacher)"""
    gkd_beta: float = 0.5
    """GKD: the generalised JSD's interpolation beta, in (0, 1)"""
    stable_kl: float = 0.0
    """StableOPD fix 1: weight of the k3 KL to the initial (pruned) student on the student's tokens (0 = off)"""
    mix_frac: float = 0.0
    """StableOPD fix 2: fraction of prompts rolled out by --mix-source and distilled with forward KL (0 = off)"""
    mix_source: Literal["teacher", "reference"] = "teacher"
    """StableOPD fix 2: who rolls out the mixed-in share: the teacher, or the frozen initial student"""
    # rollout and optimisation
    steps: int = 40
    """OPD steps (rollout batch + one optimiser step each)"""
    prompts_per_step: int = 32
    """distinct prompts per batch"""
    group_size: int = 4
    """completions per prompt (GRPO needs >= 2)"""
    lr: float = 3e-4
    """AdamW learning rate (warm-up, then the --lr-schedule decay)"""
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
    if args.steps < 1:
        raise SystemExit("nothing to train: --steps must be >= 1")
    if args.prompts_per_step < 1 or args.group_size < 1 or args.max_new_tokens < 1:
        raise SystemExit("--prompts-per-step, --group-size and --max-new-tokens must be positive")
    if not 0 <= args.prune_frac < 1:
        raise SystemExit(f"--prune-frac must be in [0, 1) (1 would remove every head or channel), "
                         f"got {args.prune_frac}")
    if not 1 <= args.budget_start <= args.max_new_tokens:
        raise SystemExit(f"--budget-start must be in [1, --max-new-tokens={args.max_new_tokens}], "
                         f"got {args.budget_start}")
    if args.budget_growth < 1:
        raise SystemExit(f"--budget-growth must be >= 1 (the budget never shrinks), got {args.budget_growth}")
    if args.repeat_max_n < 1 or args.repeat_min < 2 or not 0 <= args.repeat_confirm <= 1:
        raise SystemExit("--repeat-max-n must be >= 1, --repeat-min >= 2 and --repeat-confirm in [0, 1]")
    if not 0 < args.gkd_beta < 1:
        raise SystemExit(f"--gkd-beta must be in (0, 1), got {args.gkd_beta}")
    if not 0 <= args.gkd_student_frac <= 1 or not 0 <= args.mix_frac < 1:
        raise SystemExit("--gkd-student-frac must be in [0, 1] and --mix-frac in [0, 1)")
    if args.mix_frac and args.loss in ("gkd", "fkl-teacher"):
        raise SystemExit(f"--mix-frac mixes rollouts into the student's batch; --loss {args.loss} has its own mixture")
    if args.temperature <= 0:
        raise SystemExit("--temperature must be > 0")
    if args.stable_kl < 0:
        raise SystemExit("--stable-kl must be >= 0")
    if args.micro_batch_size < 1:
        raise SystemExit("--micro-batch-size must be positive")
    if args.prune_frac and args.lora_rank:
        raise SystemExit("--prune-frac with --lora-rank: the pruned weights are masked in the full model; "
                         "use --lora-rank 0")
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

    Distillation: the per-token divergence (+ stable_kl * k3 KL to the initial student on the student's
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
        tok_loss, stats["kl/ref"] = tok_loss + args.stable_kl * rk, rk
    return common.masked_sum(tok_loss, mask) / n_tokens, stats


def repeat_frac(texts: list[str], n: int = 3) -> float:
    """Fraction of completions containing some character n-gram at least twice (StableOPD's repetition signal)."""
    def rep(t):
        grams = [t[i:i + n] for i in range(len(t) - n + 1)]
        return len(grams) != len(set(grams))
    return float(np.mean([rep(t) for t in texts])) if texts else 0.0


# ---- the recovery: pruning, teacher-confirmed repetition, the rollout budget ----
def head_dim(model) -> int:
    """Per-head width of the attention projections."""
    cfg = model.config
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def prune_plan(model, args: Args) -> dict:
    """{'heads': {layer: [head, ...]}, 'channels': {layer: [channel, ...]}}: round(--prune-frac x count) of each
    layer's heads and/or MLP channels, the lowest-norm ones (heads: the o_proj column block; channels: the
    down_proj column) or uniform draws (numpy generator seeded with --seed)."""
    gen, plan, hd = np.random.default_rng(args.seed), {"heads": {}, "channels": {}}, head_dim(model)

    def pick(norms: torch.Tensor) -> list[int]:
        k = round(args.prune_frac * len(norms))
        if args.prune_select == "random":
            return sorted(int(i) for i in gen.choice(len(norms), k, replace=False))
        return sorted(int(i) for i in torch.argsort(norms, stable=True)[:k])

    for i, layer in enumerate(model.model.layers):
        if args.prune_target in ("heads", "both"):
            w = layer.self_attn.o_proj.weight.detach().float()
            plan["heads"][i] = pick(w.view(w.shape[0], -1, hd).norm(dim=(0, 2)))
        if args.prune_target in ("channels", "both"):
            plan["channels"][i] = pick(layer.mlp.down_proj.weight.detach().float().norm(dim=0))
    return plan


def prune_(model, plan: dict) -> int:
    """Remove the plan's heads and channels in place: head h zeroes o_proj's input columns [h d, (h+1) d) (its
    output) and q_proj's rows; channel c zeroes down_proj's column c and the rows c of gate_proj and up_proj. A
    gradient hook multiplies each touched weight's gradient by its mask, so training keeps them zero (AdamW's
    moments stay zero there, and decay of a zero is zero). Returns the number of weights removed."""
    masks, hd, layers = {}, head_dim(model), model.model.layers

    def mask(w: torch.Tensor) -> torch.Tensor:
        return masks.setdefault(id(w), (w, torch.ones_like(w)))[1]

    for i, heads in plan["heads"].items():
        attn = layers[i].self_attn
        for h in heads:
            mask(attn.o_proj.weight)[:, h * hd:(h + 1) * hd] = 0
            mask(attn.q_proj.weight)[h * hd:(h + 1) * hd] = 0
    for i, channels in plan["channels"].items():
        mlp = layers[i].mlp
        for c in channels:
            mask(mlp.down_proj.weight)[:, c] = 0
            mask(mlp.gate_proj.weight)[c] = 0
            mask(mlp.up_proj.weight)[c] = 0
    removed = 0
    with torch.no_grad():
        for w, m in masks.values():
            w.mul_(m)
            w.register_hook(lambda g, m=m: g * m)
            removed += int((m == 0).sum())
    return removed


def repetitive_suffix(tokens: list[int], teacher_p: list[float], args: Args) -> tuple[int, bool]:
    """(effective length, confirmed) of one truncated completion: its tail is k >= --repeat-min consecutive copies
    of one n-gram (n <= --repeat-max-n; of all such tails the longest, ties to the smaller n), and the loop is
    confirmed when the teacher's mean probability of the tokens after the first copy (teacher_p: per token, at the
    student's prefixes) is >= --repeat-confirm. Confirmed: L - (k - 1) n; otherwise L."""
    L, cut = len(tokens), len(tokens)
    for n in range(1, args.repeat_max_n + 1):
        k = 1
        while (k + 1) * n <= L and tokens[L - (k + 1) * n:L - k * n] == tokens[L - n:]:
            k += 1
        if k >= args.repeat_min and L - (k - 1) * n < cut:
            cut = L - (k - 1) * n
    if cut == L or float(np.mean(teacher_p[cut:])) < args.repeat_confirm:
        return L, False
    return cut, True


@torch.no_grad()
def effective_lengths(teacher, part: dict, args: Args) -> tuple[list[int], list[bool]]:
    """Each completion's effective length and whether it ends in a teacher-confirmed loop: the teacher scores the
    sampled tokens at the student's prefixes; only truncated completions (finish reason 'length') are examined."""
    ids = [part[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]
    t_p = common.token_logprobs(teacher, *ids, args.temperature).exp()
    lengths, out = part["completion_mask"].sum(1).tolist(), ([], [])
    for i, (L, reason) in enumerate(zip(lengths, part["finish_reasons"])):
        eff, conf = int(L), False
        if reason == "length":
            eff, conf = repetitive_suffix(part["completion_ids"][i, :int(L)].tolist(), t_p[i, :int(L)].tolist(), args)
        out[0].append(eff)
        out[1].append(conf)
    return out


def next_budget(budget: int, eff_lengths: list[int], args: Args) -> int:
    """The next step's max new tokens: fixed, --max-new-tokens; short-to-long, min(--max-new-tokens, max(budget,
    ceil(--budget-growth x q_0.9(effective lengths)))): it grows as the policy's usable length grows."""
    if args.schedule == "fixed":
        return args.max_new_tokens
    want = math.ceil(args.budget_growth * float(np.quantile(eff_lengths, 0.9)) - 1e-9)
    return int(min(args.max_new_tokens, max(budget, want)))


# ---- rollout and update ----
def total_steps(args: Args) -> int:
    """Optimiser steps of the whole run: --steps, plus the bridge's warm-up and GRPO stages."""
    return args.steps + (args.bridge_warmup + args.grpo_steps if args.schedule == "bridge" else 0)


def stage_of(step: int, args: Args) -> str:
    """Every step is an OPD step (no bridge stages)."""
    return "opd"


def rollout_plan(stage: str, n: int, args: Args) -> tuple[int, str | None, str | None]:
    """How many of the step's n prompts the student rolls out (the rest: the teacher), and each part's loss kind."""
    if stage == "warmup" or (stage == "opd" and args.loss == "fkl-teacher"):
        return 0, None, "fkl-teacher"
    if stage == "opd" and args.loss == "gkd":
        return round(args.gkd_student_frac * n), "gkd", "gkd"
    if stage == "opd":  # StableOPD's rollout mixture: a share of --mix-source rollouts, distilled with forward KL
        return n - round(args.mix_frac * n), args.loss, "fkl-teacher"
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


def load_student(args: Args, run):
    """(student, tokenizer, reference or None, sampler, weights removed): the policy loaded as opd.py does, then
    pruned (prune_plan, prune_); the reference (the initial, pruned student, frozen) when --stable-kl or a
    reference mixture needs it."""
    model, tok, _, sampler = llm.load_policy(args, run.accel)
    removed = prune_(model, prune_plan(model, args)) if args.prune_frac else 0
    sampler.refresh()
    need_ref = args.stable_kl > 0 or (args.mix_frac > 0 and args.mix_source == "reference")
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if need_ref else None
    return model, tok, ref_model, sampler, removed


def recovery_stats(teacher, parts: list[dict], args: Args, budget: int) -> tuple[dict, int]:
    """The step's repetition and budget figures (on the student's rollouts, when it rolled out) and the next
    budget."""
    own = parts[0]
    if own["source"] == "student":
        eff, conf = effective_lengths(teacher, own, args)
    else:
        eff, conf = own["completion_mask"].sum(1).tolist(), [False] * len(own["texts"])
    return {"rollout/budget": budget, "rollout/effective_length": float(np.mean(eff)),
            "rollout/confirmed_repeat_frac": float(np.mean(conf)),
            "rollout/repeat_frac": repeat_frac(own["texts"])}, next_budget(budget, eff, args)


def main(args: Args) -> dict:
    check_args(args)
    run = llm.Run(args, total=total_steps(args))  # accelerator, threads, seed, task, held-out sets
    if run.accel.num_processes > 1:
        raise SystemExit("OPD runs in one process: start it with python, not torchrun or accelerate launch")
    model, tok, ref_model, sampler, removed = load_student(args, run)
    teacher, tok_t = common.load_model(args.teacher, run.accel.device, args.dtype)
    check_teacher(tok, tok_t, model, teacher, args.teacher)
    teacher_sampler = common.Sampler(teacher.eval().requires_grad_(False))  # frozen: nothing to refresh
    mixer = common.Sampler(ref_model) if args.mix_frac and args.mix_source == "reference" else teacher_sampler
    opt = llm.make_optimizer(model.parameters(), args)
    evaluate = lambda policy, k=args.pass_k: common.run_eval(  # noqa: E731
        policy, tok, run.task, run.eval_sets, args.max_new_tokens, k, args.temperature, run.hard_task)

    def evaluate_student() -> dict:  # at step 0, after the teacher's evaluation (once per run), with its accuracy
        if run.history:
            return evaluate(sampler)
        run.counters["teacher_eval"] = evaluate(teacher_sampler, 0)
        return {**evaluate(sampler), "eval/teacher_acc": run.counters["teacher_eval"]["eval/acc"]}

    first = args.max_new_tokens if args.schedule == "fixed" else args.budget_start
    run.start(model, tok, opt, sampler, evaluate=evaluate_student,
              counters={"labelled_prompts": 0, "teacher_eval": None, "budget": first})
    run.counters["teacher_eval"] = run.counters["teacher_eval"] or evaluate(teacher_sampler, 0)
    for step, rng in run.steps():
        torch.manual_seed(hash((args.seed, step)) % 2**31)  # each step's draws depend on (seed, step): exact resume
        stage, budget = stage_of(step, args), run.counters["budget"]
        with run.timer("gen"):
            parts = rollout(sampler, tok, run.task, dataclasses.replace(args, max_new_tokens=budget), rng,
                            run.accel.device, mixer, stage)
        for p in parts[1:] if args.mix_frac else []:
            p["source"] = args.mix_source  # the mixture's share: the teacher's or the reference's
        rec, run.counters["budget"] = recovery_stats(teacher, parts, args, budget)
        with run.timer("train"):
            stats = update(model, opt, parts, opd_loss, args, step, teacher, ref_model if args.stable_kl else None)
        run.gen_tokens += sum(int(p["completion_mask"].sum()) for p in parts[1:])  # log_step counts parts[0]'s
        own = parts[0]
        run.log_step(step, own, stats, extra={"stage": 1, **rec,
                                              "rollout/source_student": float(own["source"] == "student")})
    teacher_eval = run.counters["teacher_eval"]
    print(f"teacher held-out greedy accuracy {teacher_eval['eval/acc']:.3f}; {removed} weights pruned")
    train = [h for h in run.history if "rollout/reward" in h]
    kl = [h["kl/reverse"] for h in train]
    extra = {**opd_summary(run.history, teacher_eval, 0), "pruned_weights": removed,
             "kl_reverse_first3": float(np.mean(kl[:3])), "kl_reverse_last3": float(np.mean(kl[-3:])),
             "budget_end": train[-1]["rollout/budget"],
             "confirmed_repeat_frac_first3": float(np.mean([h["rollout/confirmed_repeat_frac"] for h in train[:3]])),
             "confirmed_repeat_frac_last3": float(np.mean([h["rollout/confirmed_repeat_frac"] for h in train[-3:]]))}
    return run.finish(f"OPD recovery {args.loss}/{args.schedule}", hlines={"teacher": teacher_eval["eval/acc"]},
                      extra=extra)


if __name__ == "__main__":
    main(tyro.cli(Args))
