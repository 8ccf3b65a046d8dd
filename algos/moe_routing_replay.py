"""MoE routing replay: R3 and PR2 against the train-inference routing mismatch of a mixture-of-experts policy.

Papers: Ma et al., "Stabilizing MoE Reinforcement Learning by Aligning Training and Inference Routers",
arXiv:2510.11370 (Rollout Routing Replay, R3); Dong et al., "PR2: Predictive Routing Replay for MoE-Based LLM
Reinforcement Learning", arXiv:2606.00395 (PR2); truncated importance sampling (TIS) of Yao et al., "Your
Efficient RL Framework Secretly Brings You Off-Policy RL Training" (blog, 2025), R3's comparison.

Parent: algos/grpo.py; changed: Args, Args.dtype, Args.eval_every, Args.lr, Args.minibatches, Args.model,
  Args.resume, Args.sampler_is_cap, Args.steps, Args.threads, check_args, rollout, update, main.

The mismatch. A router picks the top-k experts of softmax(s), s = W_r h. The rollout engine (MoERolloutEngine) is
a separate copy of the policy at rollout precision (--rollout-dtype bf16: the whole copy in bf16, as a bf16 inference
engine) whose routers add Gaussian noise of std --router-noise to their logits (a controlled stand-in for the kernel
and batch nondeterminism that makes real engines route differently, even between identical passes); it records the
expert ids of every token it feeds (prompt and response). The trainer is the fp32 policy. A token whose route differs
between the two gets a different probability: pi_old(y_t) != mu(y_t) even at the same weights. Where the noise acts
decides what a replay can remove (--router-noise-on):
  select (default)  the noise only picks the engine's experts, their gate weights come from the noise-free logits:
                    the engine differs from the trainer in the choice of experts and bf16 rounding only, so
                    replaying the choice removes the injected mismatch entirely; R3's KL drop is built in here
  logits            the engine's router logits themselves are noisy: the experts and their gate weights both, so a
                    replay of the choice leaves the gate weights' mismatch (the trainer's gates are its own)
  --router-noise 0  bf16 numerics only: the routes differ only where bf16 rounding flips a top-k choice
Routing (class Routing: a forward hook on every router module of the transformers model, of a class in
CHECKED_ROUTERS only (Qwen3-MoE, whose class the shipped tiny-moe uses, Qwen2-MoE, Mixtral, OLMoE: softmax top-k
gates, checked against each class in the tests), and on its first call the router's own gate weights are checked
to equal gate_weights of its own choice (check_gates; a router whose gates are not, e.g. sigmoid gates, stops the run
with a message): the router's own forward runs, then its output (logits, gate weights, expert ids) is replaced)
  own route        I = top-k(s)                                              (--replay none, and the trainer's eval)
  rollout route    I_mu = top-k(s_mu + eps),  eps ~ N(0, noise^2)            (MoERolloutEngine, recorded)
                   (logits: s_mu <- s_mu + eps, and the engine's gates are softmax(s_mu + eps) over I_mu)
  R3 (--replay r3) the trainer's forwards (pi_old, pi_theta, pi_ref) use I_mu, the recorded ids of the same token;
                   gate weights from the trainer's own logits over the replayed set, as the R3 paper does:
                   g_i = softmax(s)_i / sum_{j in I_mu} softmax(s)_j  for i in I_mu                   gate_weights
                   so the policy gradient reaches the router through g, and nothing flows through I_mu (integers)
  PR2 (--replay pr2) each router has an evolution predictor P_l (RouterDrift; not part of the policy): the rollout
                   routes by the predicted logits, I_mu = top-k(s_mu + c P_l(h) + eps), c = --pr2-scale, and the
                   trainer replays I_mu as in R3. The predictor is grounded in what moves s = W_r h, the optimiser:
                   P_l(h) = g_l D_l h, D_l = -K lr (m_hat / (sqrt(v_hat) + eps) + wd W_r), where the policy's AdamW
                   moments would move W_r over the batch's K = ppo_epochs * minibatches steps    adam_forecast
                   and g_l >= 0 the least-squares gain over the batches so far of that forecast against the router
                   change the updates really caused on the batch's tokens (delta = s_after - s_before):
                   g_l = max(0, sum <D_l h, delta> / sum ||D_l h||^2)                            fit_drift, pr2_fit
                   Judged out of sample, against R3's implicit forecast of no change, on the logit change it explains
                   (1 - MSE / MSE(no change)) and on the share of top-k routes it gets right   topk_agreement
Load balancing (every arm): + aux_coef * E sum_e f_e P_e per layer (Switch Transformer), f_e the share of routed
slots sent to expert e (the routes actually used; no gradient), P_e the mean router probability (the gradient
path), averaged over layers, on real tokens                                              load_balancing_loss
TIS (--replay none --sampler-is-cap 2, R3's comparison; grpo.py's sampler correction, applied whenever the cap is
> 0 and the engine is not the trainer's computation): each token's clipped surrogate is weighted by
w_t = min(pi_old(y_t) / mu(y_t), C), C = --sampler-is-cap                          truncated_is_weight, grpo_loss
The rest is GRPO (group advantage, PPO-clip, aggregation), copied unchanged from algos/grpo.py.
Diagnostics (mismatch_metrics, route_disagreement; on the rollout's response tokens, pi_old scored before any
update): train-inference KL(mu || pi_old) by the k3 estimator mean(r - 1 - log r), r = pi_old / mu; the variance
of r (the importance-ratio variance); mean |log r|; routing disagreement, the share of (token, layer) pairs whose
rollout expert set differs from the trainer router's own top-k before the update (routing/disagree) and at the
last optimiser step of the batch (routing/stale: how stale the replayed routes are by then).

Deviations:
- R3 records routes inside the inference engine (SGLang / vLLM); here the engine is a Hugging Face copy of the
  policy (common.generate with the dynamic cache), so --engine vllm is refused. The rollout's own mismatch is
  bf16 numerics plus injected router noise, not a real engine's kernels.
- grpo.py corrects for a sampler that is not the trainer by default (--sampler-is-cap 2); here the engine never is
  (that mismatch is what the arms compare), so the cap defaults to 0: the none, R3 and PR2 arms train on the
  mismatched rollouts uncorrected, and TIS is the arm with the cap set.
- PR2's abstract leaves open the predictor's form and input, its training target and horizon, how the prediction
  enters the routing (added to the logits here, scaled by --pr2-scale, for the choice only: the trainer's replayed
  gates are its own), and whether the predicted routes are also used at the rollout's later tokens (here at every
  token the engine feeds). Here P_l is the optimiser's own forecast with one fitted gain per router, not a learned
  network: the coming gradients are unknown, so their momentum is what can be forecast; a linear map of the router
  input fitted by Adam to the last batch's change explained less than forecasting no change (-0.45). Its target
  needs one more no-grad forward of --pr2-rows sequences before and after the update. The forecast is not saved in
  the checkpoint (a resumed run refits its gain from zero).
- The load-balancing loss counts f_e on the routes used (the replayed ones under R3 / PR2) and averages the
  per-layer losses (transformers' load_balancing_loss_func pools the counts over layers first).
- pi_ref (when --kl-coef > 0) is scored on the same routes as pi_theta.
- Single process: accelerate launch and FSDP2 are not wired here (the route buffers are per process).
- Default --minibatches 4 (four optimiser steps per rollout batch, as gspo.py), so routes can go stale within a
  batch; grpo.py's default is one on-policy step.

Commands:
  python algos/moe_routing_replay.py                                 # tiny-moe, bf16 + noisy routers, R3
  python algos/moe_routing_replay.py --replay none                   # the mismatch left alone
  python algos/moe_routing_replay.py --replay pr2                    # predictive routing replay
  python algos/moe_routing_replay.py --replay none --sampler-is-cap 2   # truncated importance sampling instead
  python algos/moe_routing_replay.py --router-noise-on logits       # noisy router logits: selection and gates
  python algos/moe_routing_replay.py --router-noise 0                # bf16 numerics only
  python algos/moe_routing_replay.py --rollout-dtype fp32 --router-noise 0   # no mismatch: R3 is exact
  python algos/moe_routing_replay.py --model allenai/OLMoE-1B-7B-0924-Instruct --task gsm8k --device cuda \
      --max-new-tokens 512 --lr 1e-6 --micro-batch-size 8 --threads 8   # a real MoE checkpoint (unverified here)
Expected: the default (R3) lifts held-out greedy accuracy on 2-digit addition from 45.4% to 59.5 ± 2.5% in 100 rollout
batches (about 60-100 s on one thread of 2 cores; 4 seeds, 3 for the other arms). What R3 removes depends on the mismatch:
train-inference KL(mu || pi_old) per token, R3 vs no replay, 3.3e-4 vs 4.8e-2 with the noise on the engine's choice
only (the default; by construction: a replay of the choice removes exactly the injected mismatch), 7.0e-2 vs 1.5e-1
with the noise on the engine's router logits (the gates still differ; 4 seeds), 3.3e-4 vs 6.2e-4 with bf16 numerics
only (8 seeds).
TIS leaves the KL at 4.5e-2 and ends at 61.3 ± 9.0%. Without router noise PR2's optimiser forecast explains 3% of the
router-logit change over a rollout batch (out of sample) and gets 98.31% of the top-k routes right, as does
forecasting no change, and its replayed routes are stale at the batch's last step in 1.50 ± 0.04% of (token, layer)
pairs (4 seeds) against R3's 1.49 ± 0.07% (its seeds 0-3), and 1.42 ± 0.13% against 1.49 ± 0.14% over the paired
seeds 100-106: no less stale; accuracy with router noise 62.2 ± 4.6% (PR2) vs 61.7 ± 4.3% (R3) over seeds 100-147
(seeds 10-19 read 59.7 vs 60.9, the first seeds 62.3 vs 59.5). benchmarks/results/
moe_routing_replay.md (benchmarks/moe_routing_replay_table.py) and the claims table in benchmarks/README.md.
"""
from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import tyro
from tqdm import tqdm

import common
from algos import _llm as llm
from algos._llm import LLMArgs


@dataclass
class Args(LLMArgs):
    """The routing-replay flags with GRPO's; the plumbing flags are LLMArgs' (no --engine vllm: see check_args)."""
    # plumbing defaults
    model: str = "tiny-moe"
    """a mixture-of-experts causal LM: tiny-moe (shipped), a Hugging Face id or a local path (Qwen3-MoE, Mixtral...)"""
    threads: int = 1
    """torch CPU threads"""
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """trainer compute dtype: auto = bf16 autocast on CUDA (fp32 weights, optimiser, log-softmax and losses), fp32 on CPU"""
    steps: int = 100
    """rollout batches (each followed by ppo_epochs * minibatches optimiser steps)"""
    lr: float = 3e-4
    """peak learning rate (AdamW)"""
    eval_every: int = 10
    """rollout batches between held-out evaluations"""
    resume: str = ""
    """checkpoint folder to resume from (exact: same metrics as an uninterrupted run; the PR2 predictors restart)"""
    # rollout engine and its mismatch
    rollout_dtype: Literal["bf16", "fp32"] = "bf16"
    """precision of the rollout engine's copy of the policy (bf16: the whole copy; fp32: the trainer's numerics)"""
    router_noise: float = 0.5
    """std of the Gaussian noise added to every router logit in the rollout engine (0 = none: bf16 numerics only)"""
    router_noise_on: Literal["select", "logits"] = "select"
    """select: the noise only picks the engine's experts, their gate weights come from the noise-free logits (a pure
    routing mismatch); logits: the engine's router logits themselves are perturbed (the experts and their gate
    weights), so replaying the routes leaves the gate weights' mismatch in place"""
    prompts_per_step: int = 32
    """distinct prompts per rollout batch (per process)"""
    group_size: int = 8
    """completions per prompt (G)"""
    # routing replay and corrections
    replay: Literal["none", "r3", "pr2"] = "r3"
    """none: the trainer routes by its own router; r3: it replays the rollout's routes; pr2: the rollout routes by
    the predicted router, the trainer replays those routes"""
    sampler_is_cap: float = 0.0
    """cap C of the truncated importance weight min(pi_old / mu, C) per token (TIS, R3's comparison), applied when the
    rollout engine is not the trainer's computation; 0 = off (the default: the replay arms are measured alone)"""
    aux_coef: float = 0.01
    """weight of the load-balancing loss (tiny-moe was trained with 0.01)"""
    pr2_scale: float = 1.0
    """PR2: the predicted router change added to the rollout's router logits is scaled by this"""
    pr2_rows: int = 64
    """PR2: sequences of each rollout batch whose router change is measured (two extra no-grad forwards)"""
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
    ppo_epochs: int = 1
    """passes over each rollout batch"""
    minibatches: int = 4
    """optimiser steps per pass; the rollout batch is split into this many"""


def check_args(args: Args) -> None:
    """Fail early, naming the flag, instead of deep inside torch."""
    llm.check_plumbing(args)  # the plumbing flags (llm.Run checks them in the scripts that use it)
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
    if args.router_noise < 0 or args.aux_coef < 0:
        raise SystemExit("--router-noise and --aux-coef must be >= 0")
    if args.sampler_is_cap < 0:
        raise SystemExit("--sampler-is-cap must be >= 0 (0 = no truncated importance weight)")
    if args.engine == "vllm":
        raise SystemExit("--engine vllm: the rollout engine here is MoERolloutEngine, a Hugging Face copy of the policy "
                         "that records every token's routes (vLLM does not expose them)")
    if args.replay == "pr2" and (args.pr2_rows < 1 or args.pr2_scale < 0):
        raise SystemExit("--replay pr2 needs --pr2-rows >= 1 and --pr2-scale >= 0")
    if args.router_noise_on == "logits" and args.router_noise == 0:
        raise SystemExit("--router-noise-on logits needs --router-noise > 0 (with 0 there is no noise to place)")


# ---- the idea (GRPO's equations, unchanged) ----
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


# ---- the idea: routes recorded, perturbed, replayed and predicted ----
# Router classes whose forward this file has been checked to reproduce: softmax over the experts, top-k, the top-k
# renormalised when norm_topk_prob (Mixtral: always), returned as (logits [N, E], gate weights [N, k], ids [N, k]).
# tests/test_moe_routing_replay.py builds a small model of each and checks R3's recomputed gate against its own output.
# Others (sigmoid gates as Lfm2-MoE, expert biases as DeepSeek-V3, scaling factors) would be replayed wrongly.
CHECKED_ROUTERS = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "MixtralTopKRouter", "OlmoeTopKRouter")


def find_routers(model) -> list:
    """The top-k routers of a transformers mixture-of-experts model, in layer order: modules of a class in
    CHECKED_ROUTERS (Qwen3-MoE and the shipped tiny-moe, Qwen2-MoE, Mixtral, OLMoE), whose forward maps h [N, H] to
    (logits [N, E], gate weights [N, k], expert ids [N, k]). Any other *TopKRouter class is refused by name."""
    found = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    if not found:
        raise SystemExit(f"{type(model).__name__} has no *TopKRouter modules: --model must be a mixture-of-experts "
                         "model of transformers (tiny-moe, Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE)")
    unchecked = sorted({type(m).__name__ for m in found} - set(CHECKED_ROUTERS))
    if unchecked:
        raise SystemExit(f"{type(model).__name__}: router class {', '.join(unchecked)} is not one whose gate rule R3's "
                         f"replay reproduces (checked: {', '.join(CHECKED_ROUTERS)}; softmax top-k gates). A router "
                         "with sigmoid gates, expert biases or a scaling factor would be replayed with wrong gate "
                         "weights: add it to CHECKED_ROUTERS only with a gate_weights rule its output matches")
    return found


def gate_weights(logits, ids, normalise: bool):
    """R3's replayed gate: g_i = softmax(s)_i for i in the given expert set (renormalised over the set when the router
    normalises its top-k), from this forward's logits s; gradient reaches s, none reaches the ids. [N, E], [N, k]."""
    g = torch.softmax(logits, -1, dtype=torch.float).gather(-1, ids)
    if normalise:
        g = g / g.sum(-1, keepdim=True)
    return g.to(logits.dtype)


def check_gates(router, logits, gates, ids, normalise: bool) -> None:
    """The router's own gate weights must be gate_weights of its own logits over its own ids (to the rounding of
    the logits' dtype); otherwise recomputing them over replayed ids would change the model, so stop."""
    ref = gate_weights(logits.detach(), ids, normalise).float()
    tol = 1e-5 if logits.dtype == torch.float32 else 1e-2  # bf16 / fp16 gates: a few units of 2^-8
    if gates.shape != ref.shape or not torch.allclose(gates.detach().float(), ref, atol=tol, rtol=tol):
        err = (gates.detach().float() - ref).abs().max().item() if gates.shape == ref.shape else float("nan")
        raise SystemExit(f"{type(router).__name__}: its gate weights are not softmax(logits) over its top-k "
                         f"{'renormalised ' if normalise else ''}(max difference {err:.3g}, gate shape "
                         f"{tuple(gates.shape)}): routing replay would recompute them wrongly for this router")


def load_balancing_loss(logits, ids, mask, n_experts: int):
    """Switch Transformer's auxiliary loss for one layer, E sum_e f_e P_e on the rows where mask is 1: f_e = routed
    slots sent to e per token (no gradient), P_e = mean router probability of e (gradient). [N, E], [N, k], [N]."""
    m = mask.reshape(-1).to(torch.float32)
    f = torch.zeros(n_experts, device=logits.device).scatter_add(0, ids.reshape(-1),
                                                                   m.repeat_interleave(ids.shape[-1]))
    p = torch.softmax(logits, -1, dtype=torch.float)
    return n_experts * ((f / m.sum().clamp(min=1)) * ((p * m[:, None]).sum(0) / m.sum().clamp(min=1))).sum()


class Routing:
    """Forward hooks on every router of one model. Each call: the router's own forward runs (its gates checked against
    gate_weights on the first call, check_gates); the ids become top-k(s + c P_l(h) + noise) when the predictor or the
    noise is on (else the router's own), then the replayed ids where `replay` holds a record (>= 0); gate weights are
    recomputed over the final ids unless they are the router's own. With noise_on == "logits" the noisy logits
    replace the router's logits (ids and gate weights both from them). `record` collects the ids of every call (the
    rollout engine); `keep` keeps the last call's logits, ids, own ids and inputs per layer (aux loss, disagreement,
    PR2's targets)."""

    def __init__(self, model, noise: float = 0.0, predictors=None, pr2_scale: float = 1.0, noise_on: str = "select"):
        self.routers = find_routers(model)
        self.k, self.n_experts = self.routers[0].top_k, self.routers[0].weight.shape[0]
        self.normalise = getattr(self.routers[0], "norm_topk_prob", True)  # Mixtral always renormalises
        self.noise, self.predictors, self.pr2_scale, self.noise_on = noise, predictors, pr2_scale, noise_on
        self.replay, self.mask, self.recorded, self.rows, self.keep = None, None, None, 0, False
        self.kept = [None] * len(self.routers)
        self.checked = [False] * len(self.routers)
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(partial(self._hook, layer))

    def _hook(self, layer, module, inputs, output):
        logits, gates, own = output
        if not self.checked[layer]:
            check_gates(module, logits, gates, own, self.normalise)
            self.checked[layer] = True
        h = inputs[0].reshape(logits.shape[0], -1)
        ids, noisy = own, None
        if self.noise > 0 or self.predictors is not None:
            s = logits.detach().float()
            if self.noise > 0 and self.noise_on == "logits":  # the engine's logits themselves: ids and gates
                noisy = (s + self.noise * torch.randn_like(s)).to(logits.dtype)
                s = noisy.float()
            if self.predictors is not None:
                s = s + self.pr2_scale * self.predictors[layer](h.detach().float())
            if self.noise > 0 and self.noise_on == "select":  # the choice only; gates from the clean logits
                s = s + self.noise * torch.randn_like(s)
            ids = s.topk(self.k, -1).indices
        if self.replay is not None:
            rec = self.replay[layer]
            if rec.numel() != ids.numel():
                raise ValueError(f"replayed routes of layer {layer} hold {rec.numel() // self.k} token routes "
                                 f"(shape {tuple(rec.shape)}) for a forward of {ids.shape[0]} tokens")
            rec = rec.reshape(-1, self.k).to(ids.device)
            ids = torch.where(rec >= 0, rec, ids)
        if self.recorded is not None:
            self.recorded[layer].append(ids.reshape(self.rows, -1, self.k))
        if self.keep:
            self.kept[layer] = (logits, ids, own, h.detach())
        if noisy is not None:
            return noisy, gate_weights(noisy, ids, self.normalise), ids
        return output if ids is own else (logits, gate_weights(logits, ids, self.normalise), ids)

    def set(self, replay=None, mask=None, keep: bool = False):
        """Routes to replay ([L, b, T, k], -1 = free) and the real-token mask [b, T] of the next forward."""
        if replay is not None:
            L, k = len(self.routers), self.k
            if replay.dim() != 4 or replay.shape[0] != L or replay.shape[3] != k or \
                    (mask is not None and tuple(replay.shape[1:3]) != tuple(mask.shape)):
                raise ValueError(f"routes to replay must have shape [layers={L}, b, T, top_k={k}] matching the "
                                 f"mask [b, T]; got {tuple(replay.shape)} and mask "
                                 f"{None if mask is None else tuple(mask.shape)}")
            if replay.dtype.is_floating_point or replay.max() >= self.n_experts:
                raise ValueError(f"routes to replay must be integer expert ids below {self.n_experts} (-1 = free)")
        self.replay, self.mask, self.keep = replay, mask, keep

    def aux_loss(self):
        """The load-balancing loss of the last kept forward, averaged over layers."""
        return torch.stack([load_balancing_loss(lg, ids, self.mask, self.n_experts)
                            for lg, ids, _, _ in self.kept]).mean()


class MoERolloutEngine:
    """The inference engine: a copy of the policy at rollout precision whose routers add noise (and, with PR2, the
    predicted router change) and record the expert ids of every token they route."""

    def __init__(self, model, dtype: str, noise: float, predictors=None, pr2_scale: float = 1.0,
                 noise_on: str = "select"):
        self.model = copy.deepcopy(model).to(torch.bfloat16 if dtype == "bf16" else torch.float32).eval()
        self.model.requires_grad_(False)
        self.model.amp_dtype = None  # the copy's own dtype is its precision: no autocast
        self.routing = Routing(self.model, noise, predictors, pr2_scale, noise_on)
        # the trainer's own computation only in fp32, without noise or forecast, the trainer not under autocast
        self._same = dtype == "fp32" and noise == 0 and predictors is None and getattr(model, "amp_dtype", None) is None

    @property
    def is_trainer(self) -> bool:
        """True when the engine samples what the trainer computes (as common.Sampler.is_trainer): no correction."""
        return self._same

    def generate(self, policy, tok, prompts, group_size, max_new_tokens, temperature, top_p):
        """Sample with the engine's copy refreshed from the policy; returns (Rollout, routes [L, B, P + C, k]) with the
        route of every position the engine fed (prompt and response; the last response token, never fed, gets -1)."""
        torch._foreach_copy_(list(self.model.parameters()), list(policy.parameters()))
        r = self.routing
        r.rows, r.recorded = len(prompts) * group_size, [[] for _ in r.routers]
        try:
            ro = common.generate(self.model, tok, prompts, group_size, max_new_tokens, temperature, top_p)
        finally:
            recorded, r.recorded = r.recorded, None
        width = ro.prompt_ids.shape[1] + ro.completion_ids.shape[1]
        routes = torch.stack([torch.cat(calls, 1) for calls in recorded])[:, :, :width]
        return ro, torch.nn.functional.pad(routes, (0, 0, 0, width - routes.shape[2]), value=-1)


def mismatch_metrics(old, mu, mask) -> dict:
    """Train-inference mismatch on the sampled response tokens, r = pi_old / mu: KL(mu || pi_old) by the k3 estimator
    E_mu[r - 1 - log r], the variance of r, mean and max |log r|."""
    log_r = (old - mu) * mask
    r = torch.exp(log_r)
    mean_r = common.masked_mean(r, mask)
    return {"mismatch/kl_k3": common.masked_mean(r - 1 - log_r, mask).item(),
            "mismatch/ratio_var": common.masked_mean((r - mean_r) ** 2, mask).item(),
            "mismatch/logratio_abs": common.masked_mean(log_r.abs(), mask).item(),
            "mismatch/logratio_max": log_r.abs().max().item()}


def route_disagreement(kept, routes, mask) -> tuple[float, float]:
    """(number, count) of (token, layer) pairs, over the positions where mask is 1, whose expert set in `routes`
    [L, b, T, k] differs from the trainer router's own top-k of the kept forward."""
    own = torch.stack([o.reshape(routes.shape[1:]) for _, _, o, _ in kept])
    diff = (own.sort(-1).values != routes.sort(-1).values).any(-1).float()
    return float((diff * mask).sum()), float(mask.sum()) * len(kept)


class RouterDrift(torch.nn.Module):
    """PR2's evolution predictor of one router, grounded in what moves its logits s = W h: the optimiser. D is where
    the policy optimiser's current AdamW moments would move W over the coming batch's steps (adam_forecast), g a gain
    fitted on the batches so far (how much of that forecast the real change bears out): P(h) = g D h. D = 0, g = 0
    at the start, so PR2 starts as R3."""

    def __init__(self, n_experts: int, hidden: int):
        super().__init__()
        self.register_buffer("D", torch.zeros(n_experts, hidden))
        self.register_buffer("gain", torch.zeros(()))
        self.register_buffer("num", torch.zeros((), dtype=torch.float64))  # running sums of the gain's least squares
        self.register_buffer("den", torch.zeros((), dtype=torch.float64))

    def forward(self, h):  # [N, H] -> the forecast change of the logits [N, E]
        return self.gain * (h @ self.D.T)


def adam_forecast(opt, weight, steps: int):
    """The change of `weight` that `steps` more AdamW steps at the optimiser's current moments and learning rate would
    make: -steps * lr * (m_hat / (sqrt(v_hat) + eps) + wd * W), m_hat, v_hat the bias-corrected moments (zero before
    the first step). The coming gradients are unknown: this is their momentum's share."""
    st = opt.state.get(weight, {})
    if "exp_avg" not in st:
        return torch.zeros_like(weight, dtype=torch.float32)
    group = next(g for g in opt.param_groups if any(q is weight for q in g["params"]))
    (b1, b2), t = group["betas"], float(st["step"])
    m, v = st["exp_avg"] / (1 - b1 ** t), st["exp_avg_sq"] / (1 - b2 ** t)
    return (-steps * group["lr"] * (m / (v.sqrt() + group["eps"]) + group["weight_decay"] * weight.detach())).float()


def fit_drift(predictors, h, delta, forecasts) -> list[float]:
    """After a batch's updates, per router: the gain refitted by least squares over all batches so far,
    g = max(0, sum <D h, delta> / sum ||D h||^2) (h [N, H] the router inputs before the updates, delta [N, E] the
    logit change they caused, D the forecast this batch's rollout used), then D = the next batch's forecast
    (adam_forecast). Returns the gains."""
    gains = []
    for p, x, d, nxt in zip(predictors, h, delta, forecasts):
        base = x @ p.D.T
        p.num += (base * d).sum().double()
        p.den += (base * base).sum().double()
        p.gain.fill_(max(0.0, float(p.num / p.den)) if p.den > 0 else 0.0)
        p.D.copy_(nxt)
        gains.append(float(p.gain))
    return gains


def topk_agreement(s_from, s_to, k: int) -> float:
    """Share of rows whose top-k expert set under s_from [N, E] equals the one under s_to."""
    a, b = s_from.topk(k, -1).indices.sort(-1).values, s_to.topk(k, -1).indices.sort(-1).values
    return float((a == b).all(-1).float().mean())


# ---- rollout and update ----
def scored(model, routing: Routing, batch: dict, idx, args: Args, with_entropy: bool = False, keep: bool = False):
    """token_logprobs of rows idx, the routers replaying the rollout's routes under --replay r3 / pr2. The replay stays
    set until routing.set() (a checkpointed layer recomputes its forward in the backward, on the same routes)."""
    replay = batch["routes"][:, idx] if args.replay != "none" else None
    routing.set(replay, torch.cat([batch["prompt_mask"][idx], batch["completion_mask"][idx]], 1), keep)
    return common.token_logprobs(model, batch["prompt_ids"][idx], batch["prompt_mask"][idx],
                                 batch["completion_ids"][idx], batch["completion_mask"][idx], args.temperature,
                                 with_entropy=with_entropy, share_prompts=False)  # the routes cover whole rows


def rollout(model, tok, task, args: Args, rng, device, engine=None) -> dict:
    """Sample G completions for each of prompts_per_step training prompts with the rollout engine (routes recorded);
    reward them; A_i per group."""
    examples = task.sample("train", args.prompts_per_step, rng)
    ro, routes = engine.generate(model, tok, common.encode_prompts(tok, [e.prompt for e in examples]),
                                 args.group_size, args.max_new_tokens, args.temperature, args.top_p)
    answers = [e.answer for e in examples for _ in range(args.group_size)]
    rewards = torch.tensor([task.verify(t, a)[0] for t, a in zip(ro.texts, answers)], device=device)
    batch = {k: getattr(ro, k).to(device) for k in
             ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs")}
    P, C = batch["prompt_ids"].shape[1], batch["completion_ids"].shape[1]
    scoring = torch.zeros(len(rewards), P + C, device=device)  # the positions whose state predicts a response token
    scoring[:, P - 1:P + C - 1] = batch["completion_mask"].float()
    batch.update(rewards=rewards, adv=group_advantages(rewards, args.group_size, args.adv_std_norm),
                 finish_reasons=ro.finish_reasons, routes=routes.to(device), scoring=scoring)
    return batch


def update(model, opt, batch: dict, routing: Routing, args: Args, step: int, accel, engine, ref_model=None) -> dict:
    """GRPO's update (ppo_epochs x minibatches optimiser steps, micro-batches accumulating gradients) with every forward
    under `routing` (the rollout's routes replayed under r3 / pr2), the load-balancing loss added, grpo.py's truncated
    importance weight (TIS) when --sampler-is-cap > 0 and the rollout engine is not the trainer's computation, and
    the mismatch diagnostics measured on pi_old before any update."""
    B = batch["completion_ids"].shape[0]
    micro = lambda idx: idx.split(args.micro_batch_size)  # noqa: E731
    on_policy = args.ppo_epochs == 1 and args.minibatches == 1  # then pi_old = pi_theta.detach()
    disagree = [0.0, 0.0]
    with torch.no_grad():  # pi_old on the routes of this arm, and the trainer router's own choice beside them
        olds = []
        for i in micro(torch.arange(B)):
            olds.append(scored(model, routing, batch, i, args, keep=True))
            n, c = route_disagreement(routing.kept, batch["routes"][:, i], batch["scoring"][i])
            disagree = [disagree[0] + n, disagree[1] + c]
        old = torch.cat(olds)
        ref = torch.cat([scored(ref_model, ref_model.routing, batch, i, args) for i in micro(torch.arange(B))]) \
            if ref_model else None
    routing.set()
    correct = args.sampler_is_cap > 0 and not engine.is_trainer  # the rollout engine is another computation
    stats = {"pg": 0.0, "aux": 0.0, "entropy": 0.0, "grad_norm": 0.0}
    stale, n_opt, last = [0.0, 0.0], 0, args.ppo_epochs * args.minibatches - 1
    total = args.steps * args.ppo_epochs * args.minibatches
    for _ in range(args.ppo_epochs):
        for mb_idx in (torch.randperm(B) if args.minibatches > 1 else torch.arange(B)).chunk(args.minibatches):
            n_seqs, n_tokens = llm.step_counts(batch["completion_mask"][mb_idx], accel)
            opt.zero_grad(set_to_none=True)
            for idx in micro(mb_idx):
                logp, ent = scored(model, routing, batch, idx, args, with_entropy=True, keep=True)
                aux = routing.aux_loss()
                mb = {"adv": batch["adv"][idx], "mask": batch["completion_mask"][idx].float(),
                      "old": logp.detach() if on_policy else old[idx], "ref": None if ref is None else ref[idx]}
                mb["is_weight"] = truncated_is_weight(old[idx], batch["logprobs"][idx], args.sampler_is_cap) \
                    if correct else None
                loss, token_stats = grpo_loss(logp, mb, n_seqs, n_tokens, args)
                (loss + args.aux_coef * aux * len(idx) / n_seqs).backward()
                stats["pg"] += loss.item()
                stats["aux"] += aux.item() * len(idx) / n_seqs
                for k, v in {**token_stats, "entropy": ent}.items():
                    stats[k] = stats.get(k, 0.0) + common.masked_sum(v.detach(), mb["mask"]).item() / max(n_tokens, 1)
                if n_opt == last:  # how stale the rollout's routes are at the batch's last optimiser step
                    n, c = route_disagreement(routing.kept, batch["routes"][:, idx], batch["scoring"][idx])
                    stale = [stale[0] + n, stale[1] + c]
            routing.set()
            opt_step = (step - 1) * args.ppo_epochs * args.minibatches + n_opt  # derived: resume-safe
            # one process, no vLLM: the engine copies the weights at each rollout, the eval sampler at each call
            stats["grad_norm"] += llm.optimizer_step(model, opt, args, opt_step, total)
            n_opt += 1
    routing.set()  # evaluation routes freely
    mask = batch["completion_mask"].float()
    out = {**{f"loss/{k}": v / n_opt for k, v in stats.items()}, **mismatch_metrics(old, batch["logprobs"], mask),
           "rollout/logprob_mismatch": common.masked_mean((old - batch["logprobs"]).abs(), mask).item(),
           "routing/disagree": disagree[0] / max(disagree[1], 1), "routing/stale": stale[0] / max(stale[1], 1)}
    if correct:  # as grpo.py logs its correction
        w = truncated_is_weight(old, batch["logprobs"], args.sampler_is_cap)
        out.update({"rollout/is_weight_mean": common.masked_mean(w, mask).item(),
                    "rollout/is_truncated_frac": common.masked_mean((w >= args.sampler_is_cap).float(), mask).item()})
    return out


def router_snapshot(model, routing: Routing, batch: dict, rows, args: Args) -> tuple[list, list]:
    """Per layer, the router inputs h [N, H] and logits s [N, E] of the real tokens of `rows` (no gradient)."""
    with torch.no_grad():
        scored(model, routing, batch, rows, args, keep=True)
    m = routing.mask.reshape(-1).bool()
    routing.set()
    return [h[m].float() for _, _, _, h in routing.kept], [lg[m].float() for lg, _, _, _ in routing.kept]


def make_predictors(model, args: Args, device):
    """PR2's forecasters, one RouterDrift per router (zero: PR2 starts as R3); None unless --replay pr2."""
    if args.replay != "pr2":
        return None
    n_experts, hidden = find_routers(model)[0].weight.shape
    return torch.nn.ModuleList(RouterDrift(n_experts, hidden) for _ in find_routers(model)).to(device)


def pr2_fit(predictors, opt, model, routing: Routing, batch: dict, rows, before: tuple, args: Args) -> dict:
    """After an update: the router logits' change on `rows` since `before` (router_snapshot), how well the forecast
    the rollout used predicted it (out of sample), then the forecasters refitted for the next batch (fit_drift, with
    the optimiser's forecast over its ppo_epochs * minibatches steps). pr2/explained is 1 - MSE(forecast) /
    MSE(no change), R3's implicit forecast; pr2/agree and pr2/agree_r3 are the shares of (token, layer) routes whose
    top-k under the forecast s + c P(h), and under the unchanged s, equal the top-k after the updates."""
    after = router_snapshot(model, routing, batch, rows, args)
    delta = [a - b for a, b in zip(after[1], before[1])]
    with torch.no_grad():
        forecast = [args.pr2_scale * p(x) for p, x in zip(predictors, before[0])]
    err = sum(((f - d) ** 2).mean().item() for f, d in zip(forecast, delta))
    change = sum((d ** 2).mean().item() for d in delta)  # the error of R3's forecast: no change
    agree = np.mean([topk_agreement(s + f, s2, routing.k) for s, f, s2 in zip(before[1], forecast, after[1])])
    agree_r3 = np.mean([topk_agreement(s, s2, routing.k) for s, s2 in zip(before[1], after[1])])
    steps = args.ppo_epochs * args.minibatches
    gains = fit_drift(predictors, before[0], delta, [adam_forecast(opt, r.weight, steps) for r in routing.routers])
    return {"pr2/forecast_mse": err, "pr2/change_ms": change, "pr2/explained": 1 - err / max(change, 1e-12),
            "pr2/agree": float(agree), "pr2/agree_r3": float(agree_r3), "pr2/gain": float(np.mean(gains))}


# ---- main ----
def run_figures(history: list) -> dict:
    """The run's mismatch figures, means over its rollout batches: kl_k3, ratio_var, logratio_abs, disagree, stale;
    under PR2 also pr2_explained, pr2_agree, pr2_agree_r3 and pr2_gain (the forecast against R3's, out of sample)."""
    train = [h for h in history if "mismatch/kl_k3" in h]
    keys = ["mismatch/kl_k3", "mismatch/ratio_var", "mismatch/logratio_abs", "routing/disagree", "routing/stale"]
    keys += [k for k in ("pr2/explained", "pr2/agree", "pr2/agree_r3", "pr2/gain") if train and k in train[0]]
    return {(k.split("/")[1] if k.startswith(("mismatch", "routing")) else k.replace("/", "_")):
            float(np.mean([h[k] for h in train])) for k in keys}


def main(args: Args) -> dict:
    check_args(args)
    from accelerate import Accelerator

    accel = Accelerator(cpu=args.device == "cpu" or not torch.cuda.is_available())
    if accel.num_processes > 1:
        raise SystemExit("moe_routing_replay.py runs in one process (its route buffers are per process)")
    torch.set_num_threads(args.threads)
    common.set_seed(args.seed)
    task = llm.make_task(args.task, args.digits)
    hard_task = llm.make_task(args.task, args.digits + 1) if args.eval_hard and hasattr(task, "digits") else None
    eval_sets = common.held_out_sets(task, args.eval_examples, hard_task)
    # the sampler only evaluates (the trainer itself on CPU); rollouts come from the MoE engine
    model, tok, ref_model, sampler = llm.load_policy(args, accel, with_ref=args.kl_coef > 0)
    predictors = make_predictors(model, args, accel.device)
    engine = MoERolloutEngine(model, args.rollout_dtype, args.router_noise, predictors, args.pr2_scale,
                              args.router_noise_on)
    if ref_model is not None:
        ref_model.routing = Routing(ref_model)
    routing = Routing(model)  # after the copies: their hooks are their own
    opt = llm.make_optimizer(model.parameters(), args)

    run_dir = Path(args.out_dir) / args.exp_name
    state = common.load_checkpoint(args.resume, model, opt) if args.resume else {}
    start_step, history = state.get("step", 0), state.get("history", [])
    gen_tokens, gen_time = state.get("gen_tokens", 0), state.get("gen_time", 0.0)
    tracker = common.Tracker(run_dir, args, args.track, run_name=args.exp_name)
    timer, t_start = common.Timer(), time.time() - state.get("wall_s", 0.0)
    evaluate = lambda: common.run_eval(sampler, tok, task, eval_sets, args.max_new_tokens, args.pass_k,  # noqa: E731
                                       args.temperature, hard_task)

    def log(metrics: dict, step: int):
        history.append({"step": step, **metrics})
        tracker.log(metrics, step)

    if start_step == 0:
        log(evaluate(), 0)
    bar = tqdm(range(start_step + 1, args.steps + 1), desc="moe-replay", dynamic_ncols=True, initial=start_step,
               total=args.steps)
    for step in bar:
        # Every random draw of this step depends on (seed, step) only: resuming is exact.
        torch.manual_seed(hash((args.seed, step, 0)) % 2**31)
        rng = np.random.default_rng([args.seed, step, 0])
        with timer("gen"):
            batch = rollout(model, tok, task, args, rng, accel.device, engine)
        rows = torch.arange(min(args.pr2_rows, len(batch["rewards"]))) if predictors is not None else None
        before = router_snapshot(model, routing, batch, rows, args) if predictors is not None else None
        with timer("train"):
            stats = update(model, opt, batch, routing, args, step, accel, engine, ref_model)
        if predictors is not None:
            with timer("pr2"):
                stats.update(pr2_fit(predictors, opt, model, routing, batch, rows, before, args))
        t = timer.pop()
        gen_tokens, gen_time = gen_tokens + int(batch["completion_mask"].sum()), gen_time + t["gen"]
        metrics = {**common.rollout_metrics(batch["rewards"], batch["completion_mask"], batch["finish_reasons"],
                                            args.group_size, t["gen"]), **stats, "perf/lr": opt.param_groups[0]["lr"],
                   **{f"perf/{k}_s": v for k, v in t.items()}}
        if step % args.eval_every == 0 or step == args.steps:
            metrics.update(evaluate())
        log(metrics, step)
        bar.set_postfix(reward=f"{metrics['rollout/reward']:.2f}", kl=f"{metrics['mismatch/kl_k3']:.1e}",
                        acc=f"{next(h['eval/acc'] for h in reversed(history) if 'eval/acc' in h):.2f}")
        if args.save_every and step % args.save_every == 0 or step == args.steps:
            common.save_checkpoint(run_dir / "checkpoint", model, tok, opt,
                                   {"step": step, "history": history, "wall_s": time.time() - t_start,
                                    "gen_tokens": gen_tokens, "gen_time": gen_time})
    summary = common.summarize(history, gen_tokens, gen_time, time.time() - t_start)
    summary.update(run_figures(history))
    print(f"train-inference KL {summary['kl_k3']:.2e}, ratio variance {summary['ratio_var']:.2e}, routes: "
          f"{100 * summary['disagree']:.1f}% differ from the trainer's, {100 * summary['stale']:.1f}% at the last step")
    common.save_curve(history, run_dir / "curve.png", f"MoE routing replay ({args.replay}) on {task.name}")
    return tracker.finish(summary)


if __name__ == "__main__":
    main(tyro.cli(Args))
