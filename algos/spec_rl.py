"""SPEC-RL: GRPO whose rollouts are speculative, with the previous epoch's rollouts as drafts.

Papers: Liu et al., "SPEC-RL: Accelerating On-Policy Reinforcement Learning via Speculative Rollouts",
arXiv:2509.23232 (the previous epoch's rollout of the same prompt is the draft); Iso et al., "Accelerating RL
Post-Training Rollouts via System-Integrated Speculative Decoding", arXiv:2604.26779 (lossless speculation in
RL rollouts); Kim, Lee, Oh et al., "EfficientRollout: System-Aware Self-Speculative Decoding for RL Rollouts",
arXiv:2606.18967 (a quantised self-drafter; acceptance-aware draft length); Qin et al., "Seer: Online Context
Learning for Fast Synchronous LLM Reinforcement Learning", arXiv:2511.14617 (drafts from sibling responses).

Parent: algos/grpo.py; changed: Args, Args.eval_every, Args.steps, check_args, rollout, main.

The update is grpo.py's (update, grpo_loss); rollout changes: prompts come from a fixed pool revisited every
epoch, and spec_decode.py's sampler (spec_generate of algos/_speculative.py, which both scripts import)
samples each group with a drafter. Speculative sampling is lossless: the rollouts have the policy's own
distribution, the behaviour log-probs are the target's processed log-probs, and the update stays on-policy
(ratio 1).

Equations (each implemented by the function named on the right; * = in algos/_speculative.py):
  accept draft x_j       u_j < min(1, p_j(x_j) / q_j(x_j))                                     accept_prob*
  reject at j            emit y ~ norm(max(0, p_j - q_j)); all accepted: bonus y ~ p_gamma       verify*
  SPEC-RL                draft = the previous epoch's completion o'_i of the same prompt (row i of its group),
                         q_j = pi_old(. | x, o'_<j), stored when o'_i was sampled; the longest accepted prefix is
                         kept and sampling continues from the first rejection                     PrevDrafter
  sibling n-gram (Seer)  draft = majority continuation of the longest matching suffix in the group's other
                         responses and the previous epoch's responses; q one-hot              NgramDrafter*
  self-draft             q from an int8 (per-row absmax) copy of the current policy, re-made every step
                         (EfficientRollout)                                                  fake_int8_copy
  frozen draft           q from a frozen model (default: the initial policy)                  ModelDrafter*
  group advantage, clipped surrogate, aggregation: as algos/grpo.py            group_advantages, grpo_loss
  reused fraction        accepted draft tokens / generated tokens                                SpecStats*
  tokens per target call E[n] = (1 - alpha^(gamma+1)) / (1 - alpha)                 tokens_per_call_theory*
  the rollout loop       draft, verify, append, for every row of the batch in lock-step        spec_generate*

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
- No vLLM engine, no resume (the previous-epoch drafts are not checkpointed; --engine vllm and --resume are refused),
  no Triton kernels: the rollout engine is the speculative sampler (HF model, KV cache with rollback). Its target is
  the sampler's copy of the policy (common.Sampler: the trainer itself on CPU, a bf16 copy on one GPU, a gathered
  full copy when sharded); when that copy is not the trainer's computation, grpo.py's update weights each token by
  min(pi_old / pi_sampler, --sampler-is-cap), the speculative sampler being lossless with respect to that copy.
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
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import tyro

import common
from algos import _llm as llm
from algos._llm import LLMArgs
from algos._speculative import ModelDrafter, NgramDrafter, SpecStats, spec_generate, to_rollout


@dataclass
class Args(LLMArgs):
    """GRPO's flags with SPEC-RL's: the drafter and the fixed prompt pool; the plumbing flags are LLMArgs'."""
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
    """training prompts in the fixed pool (drawn from --seed and the rank), revisited every epoch"""
    prompts_per_step: int = 32
    """distinct prompts per rollout batch (per process)"""
    group_size: int = 8
    """completions per prompt (G)"""
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
    steps: int = 200
    """rollout batches (each followed by ppo_epochs * minibatches optimiser steps)"""
    ppo_epochs: int = 1
    """passes over each rollout batch"""
    minibatches: int = 1
    """optimiser steps per pass; the rollout batch is split into this many"""
    # eval
    eval_every: int = 40
    """rollout batches between held-out evaluations"""


def check_args(args: Args) -> None:
    """Fail early, naming the flag, instead of deep inside torch."""
    if args.group_size < 2:
        raise SystemExit(f"--group-size must be at least 2 for a group baseline, got {args.group_size}")
    if args.prompts_per_step < 1 or args.steps < 1 or args.max_new_tokens < 1:
        raise SystemExit("--prompts-per-step, --steps and --max-new-tokens must be positive")
    if args.minibatches < 1 or args.ppo_epochs < 1:  # before the modulo below (llm.check_plumbing: --kl-coef)
        raise SystemExit("--minibatches and --ppo-epochs must be positive")
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
    if args.engine != "hf":
        raise SystemExit("--engine: the speculative sampler (algos/_speculative.py on the Hugging Face model) is the "
                         "rollout engine here; there is no vLLM path")
    if args.resume:
        raise SystemExit("--resume: not supported (the previous epoch's drafts are not checkpointed)")


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


# ---- SPEC-RL's drafter, the int8 self-drafter, and the rollout engine that holds them ----
# (the sampler itself, spec_generate with ModelDrafter and NgramDrafter, is algos/_speculative.py's)
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
def rollout(sampler, tok, task, args: Args, step: int, device, spec: Speculator) -> dict:
    """Sample G completions for each of prompts_per_step pool prompts speculatively; reward them; A_i per group.

    The drafter sees what it may: SPEC-RL the group's rollout of the last epoch (with the q it was sampled
    from), the n-gram drafter that rollout and the siblings, the self-drafter an int8 copy of the policy. The target
    is the sampler's copy (the trainer itself on CPU; a bf16 copy on one GPU, a gathered full copy when sharded).
    """
    epoch, idx = spec.batch_of(step)
    examples, prompts = [spec.pool[i] for i in idx], [spec.pool_prompts[i] for i in idx]
    d, prev, G = spec.drafter, [spec.memory.get(i) for i in idx], args.group_size
    target = sampler.module()
    if args.drafter == "self":
        d.model = fake_int8_copy(target)
    if args.drafter.startswith("prev"):
        d.prior, d.plen = {g: m for g, m in enumerate(prev) if m}, [len(p) for p in prompts for _ in range(G)]
    if args.drafter in ("ngram", "prev+ngram"):
        ngram = d.then if args.drafter == "prev+ngram" else d  # n-grams also from last epoch's rollouts
        ngram.extra = {g: [prompts[g] + t for t, _ in m] for g, m in enumerate(prev) if m}
    target.eval()
    comp, lps, st, probs = spec_generate(target, prompts, G, args.max_new_tokens, tok.pad_token_id, tok.eos_token_id,
                                         d, spec.gamma, args.temperature, args.top_p, False, args.adaptive_gamma,
                                         keep_probs=args.drafter.startswith("prev"))
    sampler.model.train()  # the trainer (which is the target on CPU)
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


def sampler_gap(old_logp, sampler_logp, is_weight, mask, cap: float) -> dict:
    """This micro-batch's sums for rollout/logprob_mismatch (|log pi_old - log pi_sampler| per token, on the sampler's
    weights) and, when the correction is on, the mean importance weight and the fraction truncated at C."""
    out = {"gap/sum": common.masked_sum((old_logp - sampler_logp).abs(), mask).item(), "gap/tokens": mask.sum().item()}
    if is_weight is not None:
        out.update({"gap/is_w": common.masked_sum(is_weight, mask).item(),
                    "gap/is_cut": common.masked_sum((is_weight >= cap).float(), mask).item()})
    return out


def update(model, opt, batch: dict, loss_fn, args: Args, step: int, accel, sampler, ref_model=None,
           fused_logprob=None) -> dict:
    """ppo_epochs x minibatches optimiser steps on one rollout batch (micro-batches accumulate gradients).

    pi_old (and pi_ref) are scored before any update; the loss of each micro-batch is normalised by counts
    over its whole mini-batch on all ranks, so accumulation and data parallelism leave J unchanged. The logged
    statistics are sums over all ranks divided by global counts: every rank returns the same values.
    """
    B, mask = batch["completion_ids"].shape[0], batch["completion_mask"]
    micro = lambda idx: idx.split(args.micro_batch_size)  # noqa: E731
    logprobs_of = lambda m, idx, ent=False: common.token_logprobs(  # noqa: E731
        m, batch["prompt_ids"][idx], batch["prompt_mask"][idx], batch["completion_ids"][idx], mask[idx],
        args.temperature, with_entropy=ent, fused_fn=fused_logprob)
    on_policy = args.ppo_epochs == 1 and args.minibatches == 1  # then pi_old = pi_theta.detach()
    with torch.no_grad():
        old = None if on_policy else torch.cat([logprobs_of(model, i) for i in micro(torch.arange(B))])
        ref = torch.cat([logprobs_of(ref_model, i) for i in micro(torch.arange(B))]) if ref_model else None
    correct = args.sampler_is_cap > 0 and not sampler.is_trainer  # the sampler is another computation
    sums, n_opt, grad_norm = {}, 0, 0.0  # sums: this rank's share of each logged mean, summed over ranks below
    total = args.steps * args.ppo_epochs * args.minibatches
    for epoch in range(args.ppo_epochs):
        for mb_idx in (torch.randperm(B) if args.minibatches > 1 else torch.arange(B)).chunk(args.minibatches):
            n_seqs, n_tokens = llm.step_counts(mask[mb_idx], accel)
            opt.zero_grad(set_to_none=True)
            for idx in micro(mb_idx):
                logp, ent = logprobs_of(model, idx, True)
                mb = {"adv": batch["adv"][idx], "mask": mask[idx].float(),
                      "old": logp.detach() if old is None else old[idx], "ref": None if ref is None else ref[idx]}
                mb["is_weight"] = truncated_is_weight(mb["old"], batch["logprobs"][idx], args.sampler_is_cap) \
                    if correct else None
                loss, token_stats = loss_fn(logp, mb, n_seqs, n_tokens, args)
                loss.backward()  # a NaN here reaches every rank's gradient: optimizer_step stops them all
                for k, v in {"pg": loss.item(), **{k: common.masked_sum(v.detach(), mb["mask"]).item() / max(
                        n_tokens, 1) for k, v in {**token_stats, "entropy": ent}.items()}}.items():
                    sums[k] = sums.get(k, 0.0) + v
                if epoch == 0:  # every token once, on the sampler's weights (pi_old)
                    for k, v in sampler_gap(mb["old"], batch["logprobs"][idx], mb["is_weight"], mb["mask"],
                                            args.sampler_is_cap).items():
                        sums[k] = sums.get(k, 0.0) + v
            opt_step = (step - 1) * args.ppo_epochs * args.minibatches + n_opt  # derived: resume-safe
            grad_norm += llm.optimizer_step(model, opt, args, opt_step, total, sampler)
            n_opt += 1
    tot = llm.all_ranks_sum(sums, accel, mask.device)
    out = {**{f"loss/{k}": v / n_opt for k, v in tot.items() if not k.startswith("gap/")},
           "loss/grad_norm": grad_norm / n_opt, "rollout/logprob_mismatch": tot["gap/sum"] / max(tot["gap/tokens"], 1)}
    if correct:
        out.update({"rollout/is_weight_mean": tot["gap/is_w"] / max(tot["gap/tokens"], 1),
                    "rollout/is_truncated_frac": tot["gap/is_cut"] / max(tot["gap/tokens"], 1)})
    return out


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
    run = llm.Run(args)  # accelerator, threads, seed, the task and its held-out sets, the run folder
    # sharded when several processes run; the sampler's copy is the speculative sampler's target
    model, tok, ref_model, sampler = llm.load_policy(args, run.accel, with_ref=args.kl_coef > 0)
    spec = Speculator(args, sampler.module(), tok, run.task, run.accel.device, run.rank)  # the rollout engine
    opt = llm.make_optimizer(model.parameters(), args)
    run.start(model, tok, opt, sampler)  # the step-0 held-out evaluation (--resume is refused in check_args)
    for step, _ in run.steps():  # every random draw of a step depends on (seed, step, rank) only
        with run.timer("gen"):
            batch = rollout(sampler, tok, run.task, args, step, run.accel.device, spec)
        with run.timer("train"):  # includes the sampler's refresh after each optimiser step
            stats = update(model, opt, batch, grpo_loss, args, step, run.accel, sampler, ref_model)
        run.log_step(step, batch, stats, extra=batch["spec_metrics"])  # evaluation every --eval-every, checkpoints
    if run.is_main:
        save_drift(run.history, run.run_dir / "drift.png", f"drafter {args.drafter}: acceptance as the policy trains")
    return run.finish(f"GRPO with {args.drafter} drafts", extra={**spec.summary(run.history), "gen_s": run.gen_time})


if __name__ == "__main__":
    main(tyro.cli(Args))
