"""NAT: policy-gradient loss on a random subset of the generated tokens, reweighted to stay unbiased.

Paper: "Not All Tokens Are Needed" (NAT), arXiv:2603.06619: GRPO's per-token loss is computed on a random subset of each
completion's tokens; every kept token is weighted by 1 / P(kept) (the Horvitz-Thompson estimator), so the expected
loss and gradient equal full-token GRPO's. Rollouts, rewards and advantages are unchanged. Claims: matches
full-token GRPO using as few as 50% of the tokens; random prefix cutting saves 18% peak GPU memory and 29% of the
forward+backward time of RL training on an 8B model.

Equations (each implemented by the function named on the right; GRPO's own are as in algos/grpo.py):
  URS (--selector urs)  keep_it ~ Bernoulli(p) on every generated token, pi_it = p          select_tokens
  RPC (--selector rpc)  keep the prefix t <= K_i of completion i (n_i tokens), with
                        K_i = floor(n_i U^(1/q - 1) + V), U, V ~ U(0, 1): at q = 1/2 the cut point is uniform on
                        [0, n_i] and rounded at random; pi_it = P(K_i >= t) =
                        1 - (t^(b+1) - (t-1)^(b+1)) / ((b+1) n_i^b),  b = q / (1 - q),             rpc_inclusion
                        so sum_t pi_it = q n_i exactly (q = --keep-prob, the mean kept fraction)
  HT weight             w_it = keep_it / pi_it  (E[w_it] = 1)                                 select_tokens
  NAT loss              J_NAT = aggregate_loss(w * l), with grpo's step normaliser (N_seq, |o_i|, sum |o_i|) over
                        ALL generated tokens, so E_keep[J_NAT] = J_GRPO and E[grad J_NAT] = grad J_GRPO   nat_loss
                        (l_it is grpo's, with its sampler-trainer weight min(pi_old / pi_sampler, C) when the
                        sampler is not the trainer's computation: truncated_is_weight)
  RPC compute           a micro-batch runs forward and backward only up to its longest kept prefix (the model is
                        causal, so the kept tokens' log-probs do not change); the mini-batch is sorted by kept
                        length first, so that like prefixes share a micro-batch                   update, kept_columns

Parent: algos/grpo.py; changed: Args, Args.kernels, check_args, update, main.

The diff against algos/grpo.py: the two flags, select_tokens / rpc_inclusion / nat_loss / kept_columns /
nat_summary, and in update the token selection, the sort and truncation for RPC, the HT-weighted stats and the
timing of the forward and backward (the sampler-trainer weight is grpo's, cut to the kept columns).
kernel_grpo_loss is gone (the fused loss kernel takes no per-token weights); --kernels still uses the fused
log-prob kernel.

Deviations from the paper:
- The RPC cut distribution (K above) is our choice, stated so that pi_t has a closed form and the mean kept fraction
  is exactly --keep-prob; the paper only fixes pi_t = P(cut >= t). Every position keeps pi_t > 0, so the estimate
  stays unbiased; a single draw per completion serves all ppo_epochs of a rollout batch.
- The saving of RPC here comes from truncating padded micro-batches (no sequence packing): it needs
  --micro-batch-size smaller than the rollout batch, and it is a saving of compute, not of the rollout.
- The loss/* statistics (entropy, clip fraction), rollout/logprob_mismatch and (when the sampler is not the trainer)
  rollout/is_weight_mean and rollout/is_truncated_frac are HT estimates over the kept tokens (unbiased for grpo's
  full-token figures; equal to them with --selector full).
- On CPU peak memory is not measured reliably; nat/positions counts the token positions (prompt + kept prefix
  columns, per sequence) that go through the forward and backward of a rollout batch, which is what compute scales
  with; nat/peak_positions counts those of its widest micro-batch, which is what peak activation memory scales with
  (the micro-batches run one after another).
  perf/forward_s and perf/backward_s are wall-clock (no CUDA synchronisation: CPU figures).
- Everything of GRPO's deviations (algos/grpo.py) applies.

Commands:
  python algos/nat.py                                           # RPC, 50% of tokens, tiny default, 2-core CPU
  python algos/nat.py --selector urs --keep-prob 0.5            # URS
  python algos/nat.py --selector full                           # full-token GRPO (the same loss as grpo.py)
  python algos/nat.py --micro-batch-size 32                     # RPC with its compute saving
  python algos/nat.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --engine vllm --device cuda \
      --max-new-tokens 512 --prompts-per-step 64 --micro-batch-size 16 --lr 1e-6                 # one GPU
  accelerate launch --num_processes 4 algos/nat.py --model ... --device cuda         # several GPUs
Expected: held-out accuracy on 2-digit addition rises on half of the tokens. benchmarks/results/nat.md (20 rollout
batches, micro-batches of 32, 3 seeds): full 35.3 -> 44.1 +- 1.1, RPC 50% -> 45.6 +- 3.9, URS 50% -> 40.9 +- 8.2;
on the claims plan's two fresh runs RPC 50% ends 2.1 and 1.8 points below full (142 seeds: 42.0 vs 44.1,
[-3.0, -1.2]; 182 seeds: 42.3 vs 44.1, [-2.6, -0.9]);
RPC ran 0.82x full's token positions through forward and backward and 0.81x its forward+backward time per seed,
but its widest micro-batch was about as wide as full's (0.97x peak positions): longest kept prefixes go first
(rows in benchmarks/results/nat.csv).
"""
from __future__ import annotations

import sys
import time
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
    """NAT's flags: GRPO's (algos/grpo.py) and the token selector; the plumbing flags are LLMArgs'."""
    # rollout
    prompts_per_step: int = 32
    """distinct prompts per rollout batch (per process)"""
    group_size: int = 8
    """completions per prompt (G)"""
    reward: tuple[str, ...] = ("correct",)
    """reward terms NAME[:WEIGHT]: built-ins correct, format, length, or module:function (TRL's convention: prompts,
    completions, answers in; a float or None per completion out); the total is their weighted sum"""
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
    selector: Literal["rpc", "urs", "full"] = "rpc"
    """NAT token selector: rpc (random prefix cutting), urs (uniform random sampling), full (every token: GRPO)"""
    keep_prob: float = 0.5
    """urs: each token's keep probability; rpc: the mean kept fraction of a completion (ignored by full)"""
    # optimisation
    ppo_epochs: int = 1
    """passes over each rollout batch"""
    minibatches: int = 1
    """optimiser steps per pass; the rollout batch is split into this many"""
    kernels: bool = False
    """use the Triton fused log-prob kernel when a GPU is present (the fused loss kernel takes no per-token weights)"""


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
    if args.engine == "vllm" and not torch.cuda.is_available():
        raise SystemExit("--engine vllm needs a CUDA GPU; use --engine hf on CPU")
    if not 0 < args.keep_prob <= 1:
        raise SystemExit(f"--keep-prob must be in (0, 1], got {args.keep_prob}")


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


# ---- the idea of NAT: a random subset of the tokens, each weighted by 1 / P(kept) ----
def rpc_inclusion(mask, q: float):
    """pi_t = P(K >= t) of random prefix cutting, K = floor(n U^(1/q - 1) + V); mask [B, C] (right-padded) -> [B, C].

    With b = q / (1 - q): pi_t = 1 - (t^(b+1) - (t-1)^(b+1)) / ((b+1) n^b) for t = 1..n (0 on padding), all > 0,
    and sum_t pi_t = q n. q = 1 keeps everything. Computed in log space, since t^(b+1) overflows float64 for q near
    1 on long completions (2048^100 at q = 0.99): t^(b+1) - (t-1)^(b+1) = -t^(b+1) expm1((b+1) log1p(-1/t)), and
    t^(b+1) / n^b = exp((b+1) log t - b log n) <= n for t <= n.
    """
    if q >= 1:
        return mask.double()
    b = q / (1 - q)
    n = mask.sum(1, keepdim=True).double().clamp(min=1)
    t = torch.arange(1, mask.shape[1] + 1, dtype=torch.float64, device=mask.device)
    t = torch.minimum(t, n)  # [B, C]; positions past n are padding (zeroed below), kept finite here
    lead = torch.exp((b + 1) * torch.log(t) - b * torch.log(n))  # t^(b+1) / n^b
    step = -torch.expm1((b + 1) * torch.log1p(-1 / t))  # 1 - ((t-1)/t)^(b+1)
    return ((1 - lead * step / (b + 1)) * mask).clamp(min=0)


def select_tokens(mask, selector: str, keep_prob: float, gen=None):
    """Horvitz-Thompson weights w = keep / P(keep) [B, C] (0 on dropped tokens and padding), for one random draw."""
    mask = mask.float()
    if selector == "full":
        return mask
    u = torch.rand(mask.shape if selector == "urs" else (mask.shape[0], 2), generator=gen, device=mask.device)
    if selector == "urs":
        return (u < keep_prob).float() * mask / keep_prob
    if selector != "rpc":
        raise ValueError(f"unknown selector {selector!r}")
    n = mask.sum(1)
    cut = torch.floor(n * u[:, 0] ** (1 / keep_prob - 1) + u[:, 1])  # K: keep positions t = 1..K
    keep = (torch.arange(mask.shape[1], device=mask.device) < cut[:, None]).float() * mask
    return (keep / rpc_inclusion(mask, keep_prob).clamp(min=1e-12)).float() * keep


def nat_loss(logp, mb: dict, n_seqs: int, n_tokens: int, args: Args):
    """grpo_loss with each token's loss weighted by keep / P(keep) (Horvitz-Thompson); the normaliser is grpo's.

    logp [b, L] covers the first L completion positions (L >= the last kept one); old, ref (or None), ht (the HT
    weights) and is_weight (or None: grpo's sampler-trainer weight) are [b, L]; adv [b]; mask [b, C] is the full
    completion mask, so |o_i|, N_seq and sum |o_i| count every generated token and E_keep[loss] = grpo_loss.
    Returns (loss, per-token stats [b, L]).
    """
    tok_loss, clipped = clipped_pg_loss(logp, mb["old"], mb["adv"], args.clip_eps_low, args.clip_eps_high)
    if mb.get("is_weight") is not None:  # the sampler is not the trainer: truncated importance weight per token
        tok_loss = tok_loss * mb["is_weight"]
    stats = {"clipfrac": clipped}
    if mb["ref"] is not None:
        kl = k3_kl(logp, mb["ref"])
        tok_loss, stats["kl"] = tok_loss + args.kl_coef * kl, kl
    weighted = torch.nn.functional.pad(tok_loss * mb["ht"], (0, mb["mask"].shape[1] - logp.shape[1]))
    return aggregate_loss(weighted, mb["mask"], args.loss_agg, n_seqs, n_tokens, agg_const(args)), stats


def kept_columns(ht) -> int:
    """The longest kept prefix of a micro-batch (ht [b, C]): later columns carry no loss and, the model being
    causal, do not change the log-probs before them, so forward and backward can stop there."""
    cols = (ht > 0).any(0).nonzero()
    return int(cols.max()) + 1 if len(cols) else 1


def nat_summary(history: list[dict]) -> dict:
    """Per rollout batch: mean kept-token fraction and token positions through forward/backward, median times."""
    rows = [h for h in history if "nat/kept_frac" in h]
    return {"kept_frac": float(np.mean([h["nat/kept_frac"] for h in rows])),
            "positions_per_step": float(np.mean([h["nat/positions"] for h in rows])),
            "peak_positions_per_step": float(np.mean([h["nat/peak_positions"] for h in rows])),
            "peak_positions_max": float(np.max([h["nat/peak_positions"] for h in rows])),
            "forward_s_per_step": float(np.median([h["perf/forward_s"] for h in rows])),
            "backward_s_per_step": float(np.median([h["perf/backward_s"] for h in rows]))}


# ---- rollout and update ----
def rollout(sampler, tok, task, args: Args, rng, device) -> dict:
    """Sample G completions for each of prompts_per_step training prompts; reward them; A_i per group."""
    examples = task.sample("train", args.prompts_per_step, rng)
    ro = common.generate(sampler, tok, common.encode_prompts(tok, [e.prompt for e in examples]), args.group_size,
                         args.max_new_tokens, args.temperature, args.top_p)
    per_row = lambda xs: [x for x in xs for _ in range(args.group_size)]  # noqa: E731
    total, terms = llm.Rewards(args.reward)(per_row([e.prompt for e in examples]), ro.texts,
                                            per_row([e.answer for e in examples]), task=task,
                                            completion_lengths=ro.completion_mask.sum(1).tolist(),
                                            max_new_tokens=args.max_new_tokens)
    rewards = torch.tensor(total, device=device)
    batch = {k: getattr(ro, k).to(device) for k in
             ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs")}
    batch.update(rewards=rewards, adv=group_advantages(rewards, args.group_size, args.adv_std_norm),
                 finish_reasons=ro.finish_reasons, reward_terms={  # each term's mean where it applies
                     f"reward/{k}": float(np.mean([v for v in vs if v is not None] or [0.0])) for k, vs in terms.items()})
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
    NAT: one token selection per rollout batch; each micro-batch runs forward and backward over its longest kept
    prefix only (RPC sorts the mini-batch by kept length, so like prefixes share a micro-batch); stats are HT estimates.
    """
    B, mask = batch["completion_ids"].shape[0], batch["completion_mask"]
    micro = lambda idx: idx.split(args.micro_batch_size)  # noqa: E731
    logprobs_of = lambda m, idx, ent=False, cols=None: common.token_logprobs(  # noqa: E731
        m, batch["prompt_ids"][idx], batch["prompt_mask"][idx], batch["completion_ids"][idx, :cols],
        mask[idx, :cols], args.temperature, with_entropy=ent, fused_fn=fused_logprob)
    ht = select_tokens(mask, args.selector, args.keep_prob)  # [B, C] keep / P(keep)
    on_policy = args.ppo_epochs == 1 and args.minibatches == 1  # then pi_old = pi_theta.detach()
    with torch.no_grad():
        old = None if on_policy else torch.cat([logprobs_of(model, i) for i in micro(torch.arange(B))])
        ref = torch.cat([logprobs_of(ref_model, i) for i in micro(torch.arange(B))]) if ref_model else None
    correct = args.sampler_is_cap > 0 and not sampler.is_trainer  # the sampler is another computation
    sums, n_opt, grad_norm = {}, 0, 0.0  # sums: this rank's share of each logged mean, summed over ranks below
    positions, peak, t_fwd, t_bwd = 0, 0, 0.0, 0.0
    total = args.steps * args.ppo_epochs * args.minibatches
    for epoch in range(args.ppo_epochs):
        for mb_idx in (torch.randperm(B) if args.minibatches > 1 else torch.arange(B)).chunk(args.minibatches):
            n_seqs, n_tokens = llm.step_counts(mask[mb_idx], accel)
            if args.selector == "rpc":  # longest kept prefixes first: each micro-batch is cut to its own longest
                mb_idx = mb_idx[(ht[mb_idx] > 0).sum(1).argsort(descending=True, stable=True)]
            opt.zero_grad(set_to_none=True)
            for idx in micro(mb_idx):
                cols = kept_columns(ht[idx])
                t0 = time.perf_counter()
                logp, ent = logprobs_of(model, idx, True, cols)
                mb = {"adv": batch["adv"][idx], "mask": mask[idx].float(), "ht": ht[idx, :cols],
                      "old": logp.detach() if old is None else old[idx, :cols],
                      "ref": None if ref is None else ref[idx, :cols]}
                mb["is_weight"] = truncated_is_weight(mb["old"], batch["logprobs"][idx, :cols], args.sampler_is_cap) \
                    if correct else None
                loss, token_stats = loss_fn(logp, mb, n_seqs, n_tokens, args)
                t1 = time.perf_counter()
                loss.backward()  # a NaN here reaches every rank's gradient: optimizer_step stops them all
                t_fwd, t_bwd = t_fwd + t1 - t0, t_bwd + time.perf_counter() - t1
                width = len(idx) * (batch["prompt_ids"].shape[1] + cols)  # positions through this micro-batch
                positions, peak = positions + width, max(peak, width)
                for k, v in {"pg": loss.item(), **{k: common.masked_sum(v.detach(), mb["ht"]).item() / max(
                        n_tokens, 1) for k, v in {**token_stats, "entropy": ent}.items()}}.items():
                    sums[k] = sums.get(k, 0.0) + v
                if epoch == 0:  # every token once, on the sampler's weights (pi_old): HT sums over the kept ones
                    gap = sampler_gap(mb["old"], batch["logprobs"][idx, :cols], mb["is_weight"], mb["ht"],
                                      args.sampler_is_cap)
                    gap["gap/tokens"] = mb["mask"].sum().item()  # the HT sums estimate those over every token
                    for k, v in gap.items():
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
    kept = float((ht > 0).sum() / mask.sum().clamp(min=1))
    return {**out, "nat/kept_frac": kept, "nat/positions": positions, "nat/peak_positions": peak,
            "perf/forward_s": t_fwd, "perf/backward_s": t_bwd}


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    run = llm.Run(args)  # accelerator, threads, seed, the task and its held-out sets, the run folder
    # sharded when several processes run; the sampler decodes (the trainer itself on CPU)
    model, tok, ref_model, sampler = llm.load_policy(args, run.accel, with_ref=args.kl_coef > 0)
    use_kernels = args.kernels and run.accel.device.type == "cuda"
    fused_logprob = None
    if use_kernels:  # Triton: the fused lm_head + log-softmax (the fused loss kernel takes no per-token weights)
        from kernels.fused_logprob import fused_linear_logprob as fused_logprob
    loss_fn = nat_loss
    opt = llm.make_optimizer(model.parameters(), args)
    run.start(model, tok, opt, sampler)  # resume from --resume, then the step-0 held-out evaluation
    for step, rng in run.steps():  # every random draw of a step depends on (seed, step, rank) only
        with run.timer("gen"):
            batch = rollout(sampler, tok, run.task, args, rng, run.accel.device)
        with run.timer("train"):  # includes the sampler's refresh after each optimiser step
            stats = update(model, opt, batch, loss_fn, args, step, run.accel, sampler, ref_model, fused_logprob)
        run.log_step(step, batch, stats)  # rollout metrics, evaluation every --eval-every, checkpoints
    return run.finish(f"NAT ({args.selector}, p={args.keep_prob})", extra=nat_summary(run.history))


if __name__ == "__main__":
    main(tyro.cli(Args))
