"""DRIFT: Decoupled Rollouts and Importance-Weighted Fine-Tuning (reference samples once, then weighted SFT).

Paper: Mu et al., "DRIFT: Decoupled Rollouts and Importance-Weighted Fine-Tuning for Efficient Multi-Turn
Optimization", arXiv:2605.31455.

The KL-regularised RL objective max_pi E[R] - beta KL(pi || pi_ref) has the optimum pi*(y|x) = pi_ref(y|x)
exp(R(x,y) / beta) / Z(x), so fitting pi to pi* is supervised learning on samples of pi_ref weighted by exp(R / beta).
DRIFT samples once from a fixed reference policy, weighs each sample by its return, and runs weighted SFT on that
fixed dataset: no generation during training.

Equations (each implemented by the function named on the right):
  reference samples  y_i,g ~ pi_ref(. | x_i), g = 1..G, N prompts, drawn once before training   reference_rollouts
  importance weight  w_i,g = exp(R_i,g / beta) / sum_(j,h) exp(R_j,h / beta) * N             drift_weights
                     (--normalise prompt: / sum_h exp(R_i,h / beta) over the prompt's own G samples instead, the
                     self-normalised estimate of pi*(y|x) / pi_ref(y|x) / G with Z(x) estimated per prompt)
  limits             beta -> inf: w uniform (plain SFT on the samples); beta -> 0: w uniform on the samples of the
                     highest reward (over the whole set: rejection sampling; per prompt: each prompt's best samples)
  rejection control  w_i,g = 1[R_i,g = 1] (--weighting rejection: keep the verified samples, uniform)  drift_weights
  weighted SFT       J = - sum_i w_i sum_t log pi_theta(y_i,t | x_i, y_i,<t) / sum_i w_i |y_i|   weighted_sft_loss
                     over one optimiser step's batch (all micro-batches and ranks); uniform w gives SFT's token mean
  batches            every step takes the next batch_size samples of a seeded permutation of the dataset (a new
                     permutation each epoch), zero-weight samples dropped                      batch_indices

Parent: none. An offline method: one generation, then an SFT loop; it shares the LLM plumbing (LLMArgs, the Sampler,
the optimiser step, checkpoints, the held-out evaluation) with the RL scripts and no function with any of them.

Deviations from the paper (the abstract fixes none of these):
- Single-turn: the task is the verifiable arithmetic of the tiny world, one response per prompt, the return is the
  verifier's 0/1 reward. The paper's multi-turn trajectories (an environment's feedback between turns) would weigh
  whole trajectories by their return the same way; this file does not roll out an environment.
- The weights are exp(R / beta) self-normalised over the whole dataset by default (the scale is N so that the mean
  weight per prompt is 1; only relative weights matter, the loss divides by sum w |y|). This weighs prompts by their
  Z(x), which leaves the optimum unchanged for a policy that can fit every prompt, and makes beta -> 0 exactly
  rejection sampling. --normalise prompt estimates Z(x) per prompt instead; then a prompt whose G samples all fail
  keeps uniform weights on its failures (pi* = pi_ref where no sample tells them apart) at every beta.
- beta = 0.5 (a verified sample weighs e^2 = 7.4 times a failed one); G = 8 samples for each of N = 512 prompts at
  --temperature 1 from the shipped policy.
- The loss is a weighted token mean (the normaliser sum_i w_i |y_i|), so uniform weights reproduce algos/sft.py's
  loss exactly; a per-sequence normalisation would weigh short responses more.
- Samples drawn by another computation than the trainer (a bf16 sampler copy, vLLM) are data like any other: the
  weights use rewards only, and no importance ratio to the sampler enters the loss.
- Several processes (torchrun) follow the RL scripts' recipe (FSDP2, each rank samples its own prompts, the
  normaliser sum w |y| summed over ranks), unverified here: the tests run one process.
- Resuming regenerates the reference dataset from the initial weights with the same seeds before loading the
  checkpoint (exact on CPU; a GPU's sampling kernels need not repeat bit for bit).

Commands:
  python algos/drift_sft.py                                # tiny-0.6m on 2-digit addition, 2-core CPU, ~1 minute
  python algos/drift_sft.py --weighting rejection          # rejection-sampling SFT on the same samples
  python algos/drift_sft.py --beta 1e9                     # plain SFT on the reference samples
  python algos/drift_sft.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --device cuda --engine vllm \
      --max-new-tokens 512 --prompts 4096 --lr 1e-6 --pass-k 0                  # one GPU
Expected: the default (512 x 8 reference samples, 14.4k generated tokens, 200 steps) raises tiny-0.6m's held-out
greedy accuracy on 2-digit addition from 38.8% to 51.4 ± 5.7% (3 seeds, one thread, 53 ± 11 s each on the busy
shared 2-core machine of the table); GRPO after as many sampled sequences (16 steps of 32 x 8) reaches 47.9 ± 1.7%,
rejection-sampling SFT on the same samples 57.3 ± 1.8%. benchmarks/results/drift_sft.md (rows in
benchmarks/results/drift_sft.csv, `python benchmarks/drift_sft_table.py`).
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
from tqdm import tqdm

import common
from algos import _llm as llm
from algos._llm import LLMArgs


@dataclass
class Args(LLMArgs):
    """DRIFT's own flags and the defaults it changes; the plumbing flags (run, model, task, optimiser, eval) are
    LLMArgs'."""
    # the reference dataset
    prompts: int = 512
    """N: training prompts sampled once from the reference policy (per process)"""
    group_size: int = 8
    """G: samples per prompt"""
    # the weights
    weighting: Literal["drift", "rejection"] = "drift"
    """drift: w proportional to exp(R / beta); rejection: keep only R = 1, uniform (rejection-sampling SFT)"""
    beta: float = 0.5
    """KL coefficient: the temperature of the weights exp(R / beta) (large: plain SFT; small: rejection sampling)"""
    normalise: Literal["all", "prompt"] = "all"
    """self-normalise the weights over the whole dataset, or over each prompt's G samples"""
    # optimisation
    batch_size: int = 64
    """samples per optimiser step (per process)"""
    steps: int = 200
    """optimiser steps over the fixed dataset"""
    eval_every: int = 50
    """optimiser steps between held-out evaluations"""


def check_args(args: Args) -> None:
    """Fail early, naming the flag, instead of deep inside torch."""
    llm.check_plumbing(args)  # the plumbing flags (llm.Run checks them in the scripts that use it)
    if args.prompts < 1 or args.steps < 1 or args.batch_size < 1 or args.max_new_tokens < 1:
        raise SystemExit("--prompts, --steps, --batch-size and --max-new-tokens must be positive")
    if args.group_size < 1:
        raise SystemExit(f"--group-size must be positive, got {args.group_size}")
    if not args.beta > 0:
        raise SystemExit(f"--beta must be > 0 (1e9 gives plain SFT, 1e-6 rejection sampling), got {args.beta}")
    if args.micro_batch_size < 1:
        raise SystemExit("--micro-batch-size must be positive")
    if args.temperature <= 0:
        raise SystemExit("--temperature must be > 0 (the reference samples are drawn at it)")


# ---- the idea: weights from returns, weighted SFT ----
def drift_weights(rewards: torch.Tensor, group_size: int, beta: float, normalise: str = "all",
                  weighting: str = "drift") -> torch.Tensor:
    """Importance weights of the reference samples, rewards [N * G] prompt-major -> weights [N * G].

    drift: w = exp(R / beta) self-normalised (a softmax, so no overflow at small beta), scaled so that the weights of
    one prompt sum to 1 on average ('all') or exactly ('prompt'). rejection: w = 1[R = 1] (R >= 1), uniform."""
    if weighting == "rejection":
        return (rewards >= 1).float()
    if weighting != "drift":
        raise ValueError(f"unknown weighting {weighting!r}")
    z = rewards.double() / beta
    if normalise == "prompt":
        return torch.softmax(z.view(-1, group_size), -1).view(-1).float()
    if normalise == "all":
        return (torch.softmax(z, 0) * (rewards.numel() / group_size)).float()
    raise ValueError(f"unknown normalisation {normalise!r}")


def weighted_sft_loss(logp: torch.Tensor, mask: torch.Tensor, w: torch.Tensor, norm: float) -> torch.Tensor:
    """This micro-batch's share of J = -sum_i w_i sum_t log pi(y_i,t) / sum_i w_i |y_i|; logp, mask [b, C], w [b];
    norm = sum_i w_i |y_i| over the whole optimiser step (all micro-batches and ranks)."""
    return -(w[:, None] * logp * mask).sum() / norm


def batch_indices(n: int, batch_size: int, step: int, seed: int, rank: int = 0) -> np.ndarray:
    """Indices of step `step` (1-based): the next batch_size entries of a seeded permutation of range(n), a new
    permutation each epoch, so a batch depends on (seed, step, rank) only (resume is exact)."""
    start = (step - 1) * batch_size
    out = []
    while len(out) < batch_size:
        epoch, pos = divmod(start + len(out), n)
        perm = np.random.default_rng([seed, epoch, rank]).permutation(n)
        out += perm[pos:pos + batch_size - len(out)].tolist()
    return np.asarray(out)


# ---- the reference dataset ----
def reference_rollouts(sampler, tok, task, args: Args, rng, device) -> dict:
    """G samples for each of N training prompts from the sampler (the fixed reference policy), with rewards; generated
    in calls of about micro_batch_size sequences. Completions right-padded to one width, prompts left-padded."""
    examples = task.sample("train", args.prompts, rng)
    per_call = max(1, args.micro_batch_size // args.group_size)
    parts = [common.generate(sampler, tok, common.encode_prompts(tok, [e.prompt for e in examples[s:s + per_call]]),
                             args.group_size, args.max_new_tokens, args.temperature, args.top_p)
             for s in range(0, len(examples), per_call)]
    ro = common.concat_rollouts(parts, tok.pad_token_id)
    answers = [e.answer for e in examples for _ in range(args.group_size)]
    rewards = torch.tensor([task.verify(t, a)[0] for t, a in zip(ro.texts, answers)])
    data = {k: getattr(ro, k).to(device) for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
    return {**data, "rewards": rewards.to(device), "finish_reasons": ro.finish_reasons}


def dataset_stats(data: dict, w: torch.Tensor, group_size: int) -> dict:
    """What the weights make of the samples: the kept fraction, the effective sample size (sum w)^2 / sum w^2 as a
    fraction of the samples, the verified samples' share of the weight, and the prompts with a verified sample."""
    r = data["rewards"].float()
    return {"data/kept_frac": (w > 0).float().mean().item(),
            "data/ess_frac": (w.sum() ** 2 / (w ** 2).sum().clamp(min=1e-30) / w.numel()).item(),
            "data/verified_weight_frac": ((w * (r >= 1)).sum() / w.sum().clamp(min=1e-30)).item(),
            "data/solved_prompt_frac": (r.view(-1, group_size).max(1).values >= 1).float().mean().item()}


# ---- the update ----
def update(model, opt, data: dict, idx: torch.Tensor, args: Args, step: int, accel, sampler) -> dict:
    """One optimiser step of weighted SFT on the samples idx (micro-batches accumulate). The normaliser
    sum_i w_i |y_i| is counted over the whole step on all ranks, so accumulation and data parallelism leave J
    unchanged. Log-probs at temperature 1 (the policy itself), under the training autocast, chunked over the vocab."""
    mask, w = data["completion_mask"][idx].float(), data["weights"][idx]
    norm = llm.all_ranks_sum({"n": float((w[:, None] * mask).sum())}, accel, accel.device)["n"]
    opt.zero_grad(set_to_none=True)
    total, nll, tokens = 0.0, 0.0, 0.0
    for mb in torch.arange(len(idx)).split(args.micro_batch_size):
        rows = idx[mb]
        logp = common.token_logprobs(model, data["prompt_ids"][rows], data["prompt_mask"][rows],
                                     data["completion_ids"][rows], data["completion_mask"][rows])
        loss = weighted_sft_loss(logp, mask[mb], w[mb], max(norm, 1e-12))
        loss.backward()
        total += loss.item()
        nll, tokens = nll - float((logp.detach() * mask[mb]).sum()), tokens + float(mask[mb].sum())
    grad_norm = llm.optimizer_step(model, opt, args, step - 1, args.steps, sampler)
    tot = llm.all_ranks_sum({"loss": total, "nll": nll, "tokens": tokens}, accel, accel.device)
    return {"loss/weighted_sft": tot["loss"], "loss/nll": tot["nll"] / max(tot["tokens"], 1),
            "loss/grad_norm": grad_norm}


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    from accelerate import Accelerator

    accel = Accelerator(cpu=args.device == "cpu" or not torch.cuda.is_available())
    rank, is_main = accel.process_index, accel.is_main_process
    torch.set_num_threads(args.threads)
    common.set_seed(args.seed)
    task = llm.make_task(args.task, args.digits)
    hard_task = llm.make_task(args.task, args.digits + 1) if args.eval_hard and hasattr(task, "digits") else None
    eval_sets = common.held_out_sets(task, args.eval_examples, hard_task)
    model, tok, _, sampler = llm.load_policy(args, accel)
    opt = llm.make_optimizer(model.parameters(), args)
    tracker = common.Tracker(Path(args.out_dir) / args.exp_name, args, args.track, run_name=args.exp_name) \
        if is_main else None
    t_start, history = time.time(), []
    evaluate = lambda: common.run_eval(sampler, tok, task, eval_sets, args.max_new_tokens, args.pass_k,  # noqa: E731
                                       args.temperature, hard_task)

    def log(metrics: dict, step: int):
        history.append({"step": step, **metrics})
        if tracker is not None:
            tracker.log(metrics, step)

    # the reference dataset: once, from the initial weights (also on resume, before the checkpoint is loaded)
    torch.manual_seed(hash((args.seed, 0, rank)) % 2**31)
    t0 = time.time()
    data = reference_rollouts(sampler, tok, task, args, np.random.default_rng([args.seed, 0, rank]), accel.device)
    gen_s, gen_tokens = time.time() - t0, int(data["completion_mask"].sum())
    weights = drift_weights(data["rewards"], args.group_size, args.beta, args.normalise, args.weighting)
    stats = dataset_stats(data, weights, args.group_size)
    data["weights"], keep = weights, torch.nonzero(weights > 0).view(-1)
    if len(keep) == 0:
        raise SystemExit("no reference sample has a positive weight (rejection sampling kept none): raise --prompts "
                         "or --group-size, or use --weighting drift")
    state = common.load_checkpoint(args.resume, model, opt) if args.resume else {}
    if args.resume:
        sampler.refresh()
        history.extend(state.get("history", []))
    start_step = state.get("step", 0)
    if start_step == 0 and is_main:
        log({**common.rollout_metrics(data["rewards"], data["completion_mask"], data["finish_reasons"],
                                      args.group_size, gen_s), **stats, **evaluate()}, 0)
    bar = tqdm(range(start_step + 1, args.steps + 1), desc=args.weighting, dynamic_ncols=True, disable=not is_main,
               initial=start_step, total=args.steps)
    for step in bar:
        idx = keep[torch.as_tensor(batch_indices(len(keep), args.batch_size, step, args.seed, rank),
                                   device=keep.device)]
        t0 = time.time()
        metrics = {**update(model, opt, data, idx, args, step, accel, sampler), "perf/train_s": time.time() - t0,
                   "perf/lr": opt.param_groups[0]["lr"]}
        if is_main and (step % args.eval_every == 0 or step == args.steps):
            metrics.update(evaluate())
        log(metrics, step)
        if is_main:
            bar.set_postfix(nll=f"{metrics['loss/nll']:.3f}",
                            acc=f"{next(h['eval/acc'] for h in reversed(history) if 'eval/acc' in h):.2f}")
        if args.save_every and step % args.save_every == 0 or step == args.steps:  # every rank: shards
            common.save_checkpoint(Path(args.out_dir) / args.exp_name / "checkpoint", accel.unwrap_model(model), tok,
                                   opt, {"step": step, "history": history})
    if not is_main:
        return {}
    summary = {**common.summarize(history, gen_tokens, gen_s, time.time() - t_start), "reference_samples":
               int(data["rewards"].numel()), **{k.replace("data/", ""): v for k, v in stats.items()}}
    common.save_curve(history, Path(args.out_dir) / args.exp_name / "curve.png",
                      f"DRIFT ({args.weighting}) on {task.name} ({args.model})")
    return tracker.finish(summary)


if __name__ == "__main__":
    main(tyro.cli(Args))
