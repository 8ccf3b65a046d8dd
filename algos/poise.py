"""POISE: Policy Optimization with Internal State Value Estimation, a probe on the policy's own states as baseline.

Paper: Choi, Lim et al., "Your Language Model is Its Own Critic: Reinforcement Learning with Value Estimation
from Actor's Internal States", arXiv:2605.07579. GRPO needs many rollouts per prompt for a stable group-mean
baseline, PPO a policy-sized critic. POISE trains a lightweight probe online that predicts the expected verifiable
reward from the policy's hidden states (prompt and trajectory) and token-entropy statistics, and uses it as the
baseline. Trajectory features of rollout i would bias i's own gradient, so i's baseline is predicted from an
independent rollout j of the same prompt (cross-rollout). With two rollouts per prompt, a fixed rollout budget
covers four times as many prompts as GRPO with G = 8. Reported: matches DAPO with less compute.

Parent: algos/grpo.py; changed: Args, Args.adv_std_norm, Args.group_size, Args.prompts_per_step, Args.steps,
  check_args, rollout, main.

Equations (each implemented by the function named on the right):
  features          f_i = [h_T(prompt's last token), mean_t h_T(o_i,<t), mean/max/std of the token entropy
                    H_it, |o_i| / max_new_tokens]: final-layer hidden states of the sampled rollout    probe_features
                    (--probe-features prompt keeps only the prompt's state: no trajectory information)
  probe             v(f) = w . [f, 1], ridge regression fitted online with forgetting: after each batch
                    S <- gamma S + X^T X, u <- gamma u + X^T r, w = (S + lambda I)^-1 u             RidgeProbe
  cross-rollout     b_i = mean_{j != i, same prompt} v(f_j): rollout i's baseline never reads i's own states
  baseline          (--probe-features prompt: b_i = v(f_i), which holds no trajectory information)  cross_rollout_baselines
  advantage         A_i = (r_i - b_i) / std_batch(r - b)  (--no-adv-std-norm: r_i - b_i)               poise_advantages
                    E[(r_i - b_i) grad log pi(o_i)] = grad E[r]: b_i is independent of o_i given the prompt, and
                    the probe is fitted on earlier batches only
  clipped surrogate, k3 KL and --loss-agg aggregation: grpo.py's (grpo_loss or kernel_grpo_loss)

Deviations from the paper:
- The probe is linear, fitted in closed form (ridge regression with forgetting gamma = --probe-decay per batch)
  rather than by SGD: deterministic, no probe learning rate, and its state (S, u) resumes exactly.
- Features come from an extra no-grad forward of the sampled sequences (the paper reuses the policy's forward);
  at this scale it costs a fraction of the sampling time.
- --adv-std-norm divides by the std of r - b over the whole rollout batch (one positive scalar per step, GRPO's
  step size); the direction of the update stays unbiased. --no-adv-std-norm gives the plain r - b.
- The probe's state is D x D with D = 2 * hidden + 4 (260 here); for hidden sizes in the thousands project the
  hidden states first (not implemented).
- grpo.py's other deviations hold (KL off by default, pi_old handling, the truncated importance weight when the
  sampler is not the trainer, FSDP2 with several processes). The probe reads the trainer's states, not the
  sampler copy's.

Commands:
  python algos/poise.py                                         # tiny default: add, 2 rollouts x 128 prompts
  python algos/poise.py --group-size 2 --prompts-per-step 32    # a quarter of GRPO's rollouts per step
  python algos/poise.py --probe-features prompt --group-size 1  # one rollout per prompt, prompt-state probe
  python algos/poise.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --engine vllm --device cuda \
      --max-new-tokens 512 --prompts-per-step 128 --lr 1e-6     # one GPU
  accelerate launch --num_processes 4 algos/poise.py --model ... --device cuda        # several GPUs
Expected: held-out greedy accuracy on 2-digit addition 38.8 -> 63.6 (+24.8 points) in the default run (200 rollout
batches of 128 prompts x 2; 62 s on a shared 2-core machine, benchmarks/results/defaults.md).
After 40 batches with the same generated tokens as GRPO (G = 8 x 32 prompts): 51.5 ± 2.7 vs 46.8 ± 3.9; with a
quarter of them (2 x 32 prompts) 44.4 ± 3.8 (10 seeds, 10-19, the claims table's POISE row; the first 3 seeds read
52.8, 46.8 and 43.0; benchmarks/results/poise_unique.md).
"""
from __future__ import annotations

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
    """POISE's flags: GRPO's, with a probe baseline and its own defaults; the plumbing flags are LLMArgs'."""
    # rollout
    prompts_per_step: int = 128
    """distinct prompts per rollout batch (per process)"""
    group_size: int = 2
    """completions per prompt (n); with full features rollout i's baseline comes from the other n - 1"""
    # objective
    adv_std_norm: bool = True
    """divide r - b by its std over the whole rollout batch (one scalar per step, GRPO's scale); off = r - b"""
    probe_features: Literal["full", "prompt"] = "full"
    """full: prompt and trajectory states + entropy stats (cross-rollout); prompt: the prompt's state only"""
    probe_ridge: float = 1.0
    """lambda: the ridge penalty of the linear probe"""
    probe_decay: float = 0.8
    """gamma: the weight of the earlier batches in the probe's statistics after each batch (0 = this batch only)"""
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
    kernels: bool = False
    """use the Triton kernels (fused log-prob, fused clipped loss) when a GPU is present"""


def check_args(args: Args) -> None:
    """Fail early, naming the flag, instead of deep inside torch."""
    if args.group_size < 1 or args.group_size < 2 and args.probe_features == "full":
        raise SystemExit(f"--group-size must be at least 2 with --probe-features full (rollout i's baseline comes from "
                         f"another rollout of its prompt) and at least 1 with prompt features, got {args.group_size}")
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
    if not (args.probe_ridge > 0 and 0 <= args.probe_decay <= 1):
        raise SystemExit(f"--probe-ridge must be > 0 and --probe-decay in [0, 1], got {args.probe_ridge}, "
                         f"{args.probe_decay}")


# ---- the idea: a value probe on the policy's internal states, cross-rollout baselines ----
@torch.no_grad()
def probe_features(model, batch: dict, max_new_tokens: int, temperature: float = 1.0,
                   prompt_only: bool = False, chunk_mb: float | None = None) -> torch.Tensor:
    """f_i [B, 2H + 4] (or [B, H] with prompt_only) from one forward of the sampled sequences.

    The prompt's last token's final hidden state (left padding puts it at column P - 1), the response's mean final
    hidden state over the positions that predict its tokens, and its token entropies' mean, max and std, and the
    response length over the generation budget max_new_tokens (not over the batch's padded width, which the
    longest rollout sets: f_i reads rollout i alone).
    """
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    head, ents = model.get_output_embeddings(), []
    with common.autocast(model):  # the training autocast; the lm_head + log-softmax over chunks of positions
        hidden = common.decoder_hidden(model, ids, mask, pos)
        P = batch["prompt_ids"].shape[1]
        if prompt_only:
            return hidden[:, P - 1].float()
        h = hidden[:, P - 1:-1]  # [B, C, H]: the states that predict each response token
        flat, step = h.reshape(-1, h.shape[-1]), common.chunk_positions(head.weight.shape[0], chunk_mb)
        for s in range(0, flat.shape[0], step):  # chunk_mb MiB of fp32 logits each: no [B, C, V] tensor
            logp = torch.log_softmax(head(flat[s:s + step]).float() / temperature, -1)
            ents.append(-(logp.exp() * logp).sum(-1))
    hidden, h = hidden.float(), h.float()
    m = batch["completion_mask"].float()
    n = m.sum(1).clamp(min=1)
    ent = torch.cat(ents).view(m.shape)  # [B, C]
    ent_mean = (ent * m).sum(1) / n
    ent_std = (((ent - ent_mean[:, None]) ** 2 * m).sum(1) / n).sqrt()
    stats = torch.stack([ent_mean, (ent * m).max(1).values, ent_std, m.sum(1) / max_new_tokens], 1)
    return torch.cat([hidden[:, P - 1], (h * m[..., None]).sum(1) / n[:, None], stats], 1)


class RidgeProbe:
    """v(f) = w . [f, 1]: linear, fitted online by ridge regression with forgetting (float64 statistics).

    update(X, r): S <- decay * S + X1^T X1, u <- decay * u + X1^T r, w = (S + ridge * I)^-1 u (bias not penalised).
    Before any update it predicts 0 (the first step is REINFORCE without a baseline).
    """

    def __init__(self, dim: int, ridge: float = 1.0, decay: float = 0.8):
        self.ridge, self.decay = ridge, decay
        self.S, self.u, self.w = (torch.zeros(dim + 1, dim + 1, dtype=torch.float64), torch.zeros(dim + 1, dtype=torch.float64),
                                  torch.zeros(dim + 1, dtype=torch.float64))

    @staticmethod
    def _with_bias(X: torch.Tensor) -> torch.Tensor:
        return torch.cat([X.detach().double().cpu(), torch.ones(X.shape[0], 1, dtype=torch.float64)], 1)

    def predict(self, X: torch.Tensor) -> torch.Tensor:
        return (self._with_bias(X) @ self.w).to(X.device, torch.float32)

    def update(self, X: torch.Tensor, r: torch.Tensor, accel=None) -> None:
        X1, r = self._with_bias(X), r.detach().double().cpu()
        S, u = X1.T @ X1, X1.T @ r
        if accel is not None and accel.num_processes > 1:  # every rank fits the same probe on all ranks' rollouts
            S, u = (accel.reduce(t.to(accel.device), "sum").cpu() for t in (S, u))
        self.S, self.u = self.decay * self.S + S, self.decay * self.u + u
        eye = torch.eye(len(self.u), dtype=torch.float64)
        eye[-1, -1] = 0.0
        self.w = torch.linalg.solve(self.S + self.ridge * eye, self.u)

    def save(self, path: Path) -> None:
        """S, u and w in safetensors (next to the policy's checkpoint): a resumed run continues exactly."""
        from safetensors.torch import save_file

        save_file({"S": self.S, "u": self.u, "w": self.w}, path)

    def load(self, path: Path) -> None:
        from safetensors.torch import load_file

        state = load_file(path)
        self.S, self.u, self.w = state["S"], state["u"], state["w"]


def cross_rollout_baselines(values: torch.Tensor, n: int) -> torch.Tensor:
    """b_i = mean of the probe's values v(f_j) over the other rollouts j != i of i's prompt; values [B] -> [B]."""
    v = values.view(-1, n)
    return ((v.sum(1, keepdim=True) - v) / (n - 1)).view(-1)


def poise_advantages(rewards: torch.Tensor, feats: torch.Tensor, probe: RidgeProbe, n: int, prompt_only: bool,
                     std_norm: bool = True, eps: float = 1e-6):
    """A_i = (r_i - b_i) / std(r - b); rewards [B], feats [B, D] group-major -> (A [B], b [B], own values [B])."""
    values = probe.predict(feats)
    base = values if prompt_only else cross_rollout_baselines(values, n)
    adv = rewards - base
    if std_norm and adv.numel() > 1:
        adv = adv / (adv.std() + eps)
    return adv, base, values


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


def kernel_grpo_loss(logp, mb: dict, n_seqs: int, n_tokens: int, args: Args):
    """grpo_loss from the fused Triton kernel (--kernels on a GPU): the same value and gradient.

    The kernel normalises inside the micro-batch (token or sequence mean); rescaling by this micro-batch's
    share of the step's sequences or tokens gives aggregate_loss's step-level normaliser.
    """
    from kernels.clipped_pg_loss import clipped_pg_loss as fused

    if mb.get("is_weight") is not None:  # the kernel has no per-token weight: the reference path takes it
        return grpo_loss(logp, mb, n_seqs, n_tokens, args)
    mask = mb["mask"]
    loss, kst = fused(logp, mb["old"], mb["adv"], mask, args.clip_eps_low, args.clip_eps_high, ref_logp=mb["ref"],
                      beta=args.kl_coef, reduction="seq_mean" if args.loss_agg == "seq-mean" else "token_mean")
    mb_tokens = float(mask.sum())
    scale = {"seq-mean": mask.shape[0] / n_seqs, "token-mean": mb_tokens / max(n_tokens, 1),
             "const": mb_tokens / (n_seqs * agg_const(args))}[args.loss_agg]
    return loss * scale, {"clipfrac": torch.full_like(mask, float(kst["clip_frac"]))}  # micro-batch mean


# ---- rollout and update ----
def rollout(sampler, tok, task, args: Args, rng, device, probe: RidgeProbe | None = None) -> dict:
    """n completions per prompt; rewards; the probe's features and cross-rollout baselines; A_i = r_i - b_i.

    The probe is the one fitted on earlier batches (main fits it on this batch only after this returns); the
    features are the trainer's (sampler.model), whatever copy sampled.
    """
    examples = task.sample("train", args.prompts_per_step, rng)
    ro = common.generate(sampler, tok, common.encode_prompts(tok, [e.prompt for e in examples]), args.group_size,
                         args.max_new_tokens, args.temperature, args.top_p)
    answers = [e.answer for e in examples for _ in range(args.group_size)]
    rewards = torch.tensor([task.verify(t, a)[0] for t, a in zip(ro.texts, answers)], device=device)
    batch = {k: getattr(ro, k).to(device) for k in
             ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs")}
    prompt_only = args.probe_features == "prompt"
    feats = probe_features(sampler.model, batch, args.max_new_tokens, args.temperature, prompt_only)
    adv, base, values = poise_advantages(rewards.float(), feats, probe, args.group_size, prompt_only, args.adv_std_norm)
    var = rewards.float().var().item() if len(rewards) > 1 else 0.0
    batch.update(rewards=rewards, adv=adv, finish_reasons=ro.finish_reasons, features=feats,
                 probe_stats={"probe/r2": 1 - ((rewards - values) ** 2).mean().item() / max(var, 1e-9),
                              "probe/baseline_mse": ((rewards - base) ** 2).mean().item(), "probe/reward_var": var,
                              "probe/no_baseline_mse": (rewards.float() ** 2).mean().item()})
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


# ---- main ----
def probe_summary(history: list[dict], n_steps: int) -> dict:
    """The probe's figures (R^2, baseline MSE, no-baseline MSE) averaged over the second half of this run's steps."""
    late = [h for h in history if "probe/r2" in h][n_steps // 2:]  # the second half of the steps
    return {f"probe_{key}": float(np.mean([h[f"probe/{key}"] for h in late])) if late else float("nan")
            for key in ("r2", "baseline_mse", "no_baseline_mse")}


def main(args: Args) -> dict:
    check_args(args)
    run = llm.Run(args)  # accelerator, threads, seed, the task and its held-out sets, the run folder
    # sharded when several processes run; the sampler decodes (the trainer itself on CPU)
    model, tok, ref_model, sampler = llm.load_policy(args, run.accel, with_ref=args.kl_coef > 0)
    use_kernels = args.kernels and run.accel.device.type == "cuda"
    fused_logprob = None
    if use_kernels:  # Triton: the fused lm_head + log-softmax (the loss kernel is in kernel_grpo_loss)
        from kernels.fused_logprob import fused_linear_logprob as fused_logprob
    loss_fn = kernel_grpo_loss if use_kernels else grpo_loss
    opt = llm.make_optimizer(model.parameters(), args)
    hidden = model.config.hidden_size
    probe = RidgeProbe(hidden if args.probe_features == "prompt" else 2 * hidden + 4, args.probe_ridge, args.probe_decay)
    run.start(model, tok, opt, sampler)  # resume from --resume, then the step-0 held-out evaluation
    if args.resume:  # the probe's statistics are part of the state: resuming stays exact
        probe.load(Path(args.resume) / "probe.safetensors")
    for step, rng in run.steps():  # every random draw of a step depends on (seed, step, rank) only
        with run.timer("gen"):
            batch = rollout(sampler, tok, run.task, args, rng, run.accel.device, probe)
        with run.timer("train"):  # includes the sampler's refresh after each optimiser step
            stats = update(model, opt, batch, loss_fn, args, step, run.accel, sampler, ref_model, fused_logprob)
            probe.update(batch["features"], batch["rewards"].float(), run.accel)  # after the baselines: not its own
        run.log_step(step, batch, stats, extra=batch["probe_stats"])  # evaluation every --eval-every, checkpoints
        if args.save_every and step % args.save_every == 0 or step == args.steps:  # beside log_step's checkpoint
            probe.save(run.run_dir / "checkpoint" / "probe.safetensors")
    return run.finish(f"POISE, {args.group_size} rollouts x {args.prompts_per_step} prompts,",
                      extra=probe_summary(run.history, args.steps - run.start_step))


if __name__ == "__main__":
    main(tyro.cli(Args))
