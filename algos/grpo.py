"""GRPO: Group Relative Policy Optimization, the baseline most RL post-training papers build on.

Paper: Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
arXiv:2402.03300 (GRPO), with the loss-aggregation variants of DAPO (arXiv:2503.14476), Dr. GRPO
(Liu et al., "Understanding R1-Zero-Like Training", arXiv:2503.20783) and AsyncWebRL (papers/ A-56).

Equations (each implemented by the function named on the right):
  group advantage   A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)       group_advantages
                    (Dr. GRPO: --no-adv-std-norm drops the division by the std)
  ratio             rho_it = pi_theta(o_it | q, o_i,<t) / pi_old(o_it | q, o_i,<t)
  clipped surrogate l_it = -min(rho_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) A_i)   clipped_pg_loss
  k3 KL to ref      kl_it = pi_ref/pi_theta - log(pi_ref/pi_theta) - 1              k3_kl
  aggregation (--loss-agg), over the G*N sequences of one optimiser step:                 aggregate_loss
    seq-mean   (GRPO)      J = 1/N_seq  sum_i 1/|o_i| sum_t l_it
    token-mean (DAPO)      J = 1/sum_i |o_i|  sum_i sum_t l_it
    const      (Dr. GRPO, and A-56's constant 1/k)   J = 1/(N_seq * k) sum_i sum_t l_it,  k = --agg-const
  The normaliser (N_seq, sum |o_i|) is counted once per optimiser step across all micro-batches (and all
  ranks), so gradient accumulation does not change the objective.

Deviations from the paper:
- KL to the reference is off by default (kl_coef = 0), as in DAPO and Dr. GRPO; GRPO used 0.04.
- The reward is a rule-based verifier (exact answer), not a reward model; no format reward.
- The std in the advantage is the unbiased sample std (as TRL); the paper does not say which.
- pi_old: with one PPO epoch and one mini-batch the update is on-policy and pi_old = pi_theta.detach()
  (ratio 1, the same gradient as REINFORCE with a group baseline); otherwise pi_old is recomputed by the
  trainer before the first update, as in PPO. The sampler's own log-probs are only used for the
  rollout/logprob_mismatch metric (what vLLM or low-precision sampling would silently change).
- Multi-GPU uses `accelerate launch` with an explicit gradient all-reduce (sum, with the normaliser
  counted globally) instead of DDP wrapping, so the chunked log-prob path can call the decoder directly.

Commands:
  python algos/grpo.py                                          # tiny default, 2-core CPU, ~2 minutes
  python algos/grpo.py --loss-agg const --no-adv-std-norm       # Dr. GRPO
  python algos/grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --engine vllm --device cuda \
      --max-new-tokens 512 --prompts-per-step 64 --lr 1e-6 --kl-coef 0.0          # one GPU
  accelerate launch --num_processes 4 algos/grpo.py --model ... --device cuda         # several GPUs
  accelerate launch --cpu --num_processes 2 algos/grpo.py --threads 1                 # same code on CPU
Expected: held-out greedy accuracy on 2-digit addition rises by 15+ points in under 3 minutes on 2 cores;
see benchmarks/results/grpo.md (rows in benchmarks/results/foundation.csv).
"""
from __future__ import annotations

import copy
import math
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
    # bookkeeping
    exp_name: str = "grpo"
    """name of the run (the output folder is out_dir/exp_name)"""
    seed: int = 0
    """random seed: prompts and sampling of step s depend only on (seed, s, rank), which makes resume exact"""
    track: bool = False
    """log to Weights & Biases as well (WANDB_MODE=offline works without network)"""
    out_dir: str = "runs"
    """where metrics.jsonl, summary.json, the curve and checkpoints go"""
    # model and task
    model: str = "tiny-0.6m"
    """tiny-0.6m, tiny-5m, smollm2-135m, a Hugging Face id or a local path"""
    task: str = "add"
    """add, addsteps, jsonl:PATH (prompt/answer records) or gsm8k"""
    digits: int = 2
    """operand digits of the arithmetic tasks (training and the main held-out eval)"""
    device: str = "auto"
    """auto (CUDA if present), cpu or cuda"""
    threads: int = 2
    """torch CPU threads per process"""
    # rollout
    engine: Literal["hf", "vllm"] = "hf"
    """rollout engine: Hugging Face generate (CPU or GPU) or vLLM (GPU)"""
    vllm_gpu_memory: float = 0.3
    """fraction of GPU memory vLLM may take (the trainer shares the GPU)"""
    prompts_per_step: int = 32
    """distinct prompts per rollout batch (per process)"""
    group_size: int = 8
    """completions per prompt (G)"""
    max_new_tokens: int = 8
    """generation budget per completion"""
    temperature: float = 1.0
    """sampling temperature (the trainer scores with the same temperature)"""
    top_p: float = 1.0
    """nucleus sampling threshold"""
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
    """seq-mean (GRPO), token-mean (DAPO), const (Dr. GRPO / A-56: divide by --agg-const per sequence)"""
    agg_const: int = 0
    """the constant k of --loss-agg const (0 = max_new_tokens)"""
    # optimisation
    steps: int = 400
    """rollout batches (each followed by ppo_epochs * minibatches optimiser steps)"""
    ppo_epochs: int = 1
    """passes over each rollout batch"""
    minibatches: int = 1
    """optimiser steps per pass; the rollout batch is split into this many"""
    micro_batch_size: int = 256
    """sequences per forward/backward (gradient accumulation inside a mini-batch)"""
    lr: float = 1e-4
    """peak learning rate (AdamW); 1e-3 collapses the tiny policy, real LLMs want about 1e-6"""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """after warm-up: constant, or cosine decay to 10% over all optimiser steps"""
    warmup_steps: int = 0
    """linear warm-up (optimiser steps)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm"""
    kernels: bool = False
    """use the Triton kernels (fused log-prob, fused clipped loss) when a GPU is present"""
    # eval and checkpoints
    eval_every: int = 25
    """rollout batches between held-out evaluations"""
    eval_examples: int = 500
    """held-out prompts for greedy accuracy"""
    pass_k: int = 8
    """k of pass@k (on the first 100 held-out prompts; 0 = off)"""
    eval_hard: bool = True
    """also evaluate one digit harder than training (out of distribution)"""
    save_every: int = 0
    """rollout batches between checkpoints (0 = only at the end)"""
    resume: str = ""
    """checkpoint folder to resume from (exact: same metrics as an uninterrupted run)"""


def check_args(args: Args) -> None:
    """Fail early, naming the flag, instead of deep inside torch."""
    if args.group_size < 2:
        raise SystemExit(f"--group-size must be at least 2 for a group baseline, got {args.group_size}")
    if args.prompts_per_step < 1 or args.steps < 1 or args.max_new_tokens < 1:
        raise SystemExit("--prompts-per-step, --steps and --max-new-tokens must be positive")
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


# ---- helpers of the loop ----
def lr_factor(step: int, total: int, args: Args) -> float:
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    if args.lr_schedule == "constant":
        return 1.0
    progress = (step - args.warmup_steps) / max(1, total - args.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def pick_kernels(args: Args, device):
    """(fused log-prob fn, fused loss fn) from kernels/ on a GPU when --kernels is set, else (None, None)."""
    if args.kernels and device.type == "cuda":
        from kernels.clipped_pg_loss import clipped_pg_loss as fused_loss
        from kernels.fused_logprob import fused_linear_logprob

        return fused_linear_logprob, fused_loss
    return None, None


def kernel_loss_share(fused_loss, logp, old, adv, mask, ref, args: Args, n_seqs: int, n_tokens: int, const: int):
    """The same micro-batch share as aggregate_loss(clipped_pg_loss + kl), from the fused kernel.

    The kernel normalises inside the micro-batch (token or sequence mean); rescaling by this micro-batch's
    share of the step's sequences or tokens gives the step-level normaliser of aggregate_loss.
    """
    reduction = "seq_mean" if args.loss_agg == "seq-mean" else "token_mean"
    loss, stats = fused_loss(logp, old, adv, mask, args.clip_eps_low, args.clip_eps_high, ref_logp=ref,
                             beta=args.kl_coef, reduction=reduction)
    mb_seqs, mb_tokens = mask.shape[0], float(mask.sum())
    scale = {"seq-mean": mb_seqs / n_seqs, "token-mean": mb_tokens / max(n_tokens, 1),
             "const": mb_tokens / (n_seqs * const)}[args.loss_agg]
    return loss * scale, stats


def run_eval(model, tok, task, hard_task, eval_sets, args, engine=None) -> dict:
    out = {}
    res = common.evaluate(model, tok, task, eval_sets["main"], args.max_new_tokens, engine=engine)
    out["eval/acc"] = res["acc"]
    if args.pass_k:
        res = common.evaluate(model, tok, task, eval_sets["main"][:100], args.max_new_tokens, pass_k=args.pass_k,
                              temperature=args.temperature, engine=engine)
        out[f"eval/pass@{args.pass_k}"] = res[f"pass@{args.pass_k}"]
    if hard_task is not None:
        res = common.evaluate(model, tok, hard_task, eval_sets["hard"], args.max_new_tokens + 2, engine=engine)
        out["eval/acc_hard"] = res["acc"]
    return out


def save_curve(history: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [h["step"] for h in history if "rollout/reward" in h]
    ax.plot(steps, [h["rollout/reward"] for h in history if "rollout/reward" in h], alpha=0.5, label="train reward")
    ev = [h for h in history if "eval/acc" in h]
    ax.plot([h["step"] for h in ev], [h["eval/acc"] for h in ev], "o-", label="held-out greedy acc")
    if ev and "eval/acc_hard" in ev[0]:
        ax.plot([h["step"] for h in ev], [h["eval/acc_hard"] for h in ev], "s--", label="harder (OOD) acc")
    ax.set(xlabel="rollout batch", ylabel="accuracy / reward", ylim=(0, 1), title=title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- main ----
def main(args: Args) -> dict:
    check_args(args)
    from accelerate import Accelerator

    accel = Accelerator(cpu=args.device == "cpu" or not torch.cuda.is_available())
    rank, world = accel.process_index, accel.num_processes
    torch.set_num_threads(args.threads)
    common.set_seed(args.seed)
    device = accel.device
    task = common.make_task(args.task, args.digits)
    hard_task = common.make_task(args.task, args.digits + 1) if args.eval_hard and hasattr(task, "digits") else None
    model, tok = common.load_model(args.model, device)
    model.train()
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if args.kl_coef > 0 else None
    engine = None
    if args.engine == "vllm":
        engine = common.VLLMEngine(common.resolve_model_path(args.model), args.vllm_gpu_memory, seed=args.seed + rank)
    fused_logprob, fused_loss = pick_kernels(args, device)
    agg_const = args.agg_const or args.max_new_tokens

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    total_opt_steps = args.steps * args.ppo_epochs * args.minibatches
    run_dir = Path(args.out_dir) / args.exp_name
    eval_rng = np.random.default_rng(12345)  # the same held-out prompts in every script
    eval_sets = {"main": task.sample("test", args.eval_examples, eval_rng)}
    if hard_task is not None:
        eval_sets["hard"] = hard_task.sample("test", min(args.eval_examples, 300), eval_rng)

    start_step, history, state = 0, [], {}
    if args.resume:
        state = common.load_checkpoint(args.resume, model, opt)
        start_step, history = state["step"], state["history"]
        if engine is not None:
            engine.sync_weights(model)
    tracker = common.Tracker(run_dir, args, args.track and accel.is_main_process, run_name=args.exp_name) \
        if accel.is_main_process else None
    timer = common.Timer()
    t_start = time.time() - state.get("wall_s", 0.0)
    gen_tokens = state.get("gen_tokens", 0)
    gen_time = state.get("gen_time", 0.0)

    def log(metrics: dict, step: int):
        history.append({"step": step, **metrics})
        if tracker is not None:
            tracker.log(metrics, step)

    if start_step == 0 and accel.is_main_process:
        log(run_eval(model, tok, task, hard_task, eval_sets, args, engine), 0)

    bar = tqdm(range(start_step + 1, args.steps + 1), desc="grpo", dynamic_ncols=True, disable=not accel.is_main_process,
               initial=start_step, total=args.steps)
    for step in bar:
        # Every random draw of this step depends on (seed, step, rank) only: resuming is exact.
        torch.manual_seed(hash((args.seed, step, rank)) % 2**31)
        rng = np.random.default_rng([args.seed, step, rank])

        # ---- rollout ----
        examples = task.sample("train", args.prompts_per_step, rng)
        with timer("gen"):
            ro = common.generate(model, tok, common.encode_prompts(tok, [e.prompt for e in examples]), args.group_size,
                                 args.max_new_tokens, args.temperature, args.top_p, engine=engine)
        answers = [e.answer for e in examples for _ in range(args.group_size)]
        rewards = torch.tensor([task.verify(t, a)[0] for t, a in zip(ro.texts, answers)], device=device)
        adv = group_advantages(rewards, args.group_size, args.adv_std_norm)
        lengths = ro.completion_mask.sum(1).float()
        gen_tokens += int(lengths.sum())
        gen_time += timer.totals["gen"]
        batch = {k: getattr(ro, k).to(device) for k in
                 ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs")}
        batch["adv"] = adv

        def logprobs_of(m, idx, with_entropy=False):
            return common.token_logprobs(m, batch["prompt_ids"][idx], batch["prompt_mask"][idx],
                                         batch["completion_ids"][idx], batch["completion_mask"][idx],
                                         args.temperature, with_entropy=with_entropy, fused_fn=fused_logprob)

        # ---- pi_old and pi_ref (no grad) ----
        B = len(ro.texts)
        on_policy = args.ppo_epochs == 1 and args.minibatches == 1
        with timer("train"), torch.no_grad():
            micro = [torch.arange(s, min(s + args.micro_batch_size, B)) for s in range(0, B, args.micro_batch_size)]
            batch["old"] = None if on_policy else torch.cat([logprobs_of(model, i) for i in micro])
            batch["ref"] = torch.cat([logprobs_of(ref_model, i) for i in micro]) if ref_model is not None else None
        # Sampler-vs-trainer log-prob gap on the same weights (before any update of this batch).
        mismatch = None if on_policy else common.masked_mean((batch["old"] - batch["logprobs"]).abs(),
                                                             batch["completion_mask"].float()).item()

        # ---- update ----
        stats = {"pg": 0.0, "kl": 0.0, "clipfrac": 0.0, "entropy": 0.0, "mismatch": 0.0, "grad_norm": 0.0}
        n_upd = 0
        with timer("train"):
            for _epoch in range(args.ppo_epochs):
                perm = torch.randperm(B) if args.minibatches > 1 else torch.arange(B)
                for mb in perm.chunk(args.minibatches):
                    mask_mb = batch["completion_mask"][mb]
                    counts = torch.tensor([len(mb), int(mask_mb.sum())], device=device, dtype=torch.float64)
                    if world > 1:
                        counts = accel.reduce(counts, "sum")
                    n_seqs, n_tokens = int(counts[0]), int(counts[1])
                    opt.zero_grad(set_to_none=True)
                    for idx in mb.split(args.micro_batch_size):
                        logp, ent = logprobs_of(model, idx, with_entropy=True)
                        m = batch["completion_mask"][idx].float()
                        old = logp.detach() if batch["old"] is None else batch["old"][idx]
                        ref = batch["ref"][idx] if batch["ref"] is not None else None
                        if fused_loss is not None:
                            loss, kst = kernel_loss_share(fused_loss, logp, old, batch["adv"][idx], m, ref, args,
                                                          n_seqs, n_tokens, agg_const)
                            clipped = torch.full_like(m, float(kst["clip_frac"]))  # stats: micro-batch mean
                        else:
                            tok_loss, clipped = clipped_pg_loss(logp, old, batch["adv"][idx], args.clip_eps_low,
                                                                args.clip_eps_high)
                            if ref is not None:
                                kl = k3_kl(logp, ref)
                                tok_loss = tok_loss + args.kl_coef * kl
                                stats["kl"] += common.masked_sum(kl.detach(), m).item() / n_tokens
                            loss = aggregate_loss(tok_loss, m, args.loss_agg, n_seqs, n_tokens, agg_const)
                        if not torch.isfinite(loss):
                            raise SystemExit(f"non-finite loss at step {step}; the last checkpoint in {run_dir} "
                                             "is intact. Lower --lr or check the rewards.")
                        loss.backward()
                        stats["pg"] += loss.item()
                        stats["clipfrac"] += common.masked_sum(clipped, m).item() / n_tokens
                        stats["entropy"] += common.masked_sum(ent.detach(), m).item() / n_tokens
                        if on_policy:  # one update: this forward still has the sampler's weights
                            stats["mismatch"] += common.masked_sum((logp.detach() - batch["logprobs"][idx]).abs(),
                                                                   m).item() / n_tokens
                    if world > 1:  # the loss was normalised by global counts, so summed gradients are exact
                        for p in model.parameters():
                            if p.grad is not None:
                                p.grad = accel.reduce(p.grad, "sum")
                    stats["grad_norm"] += float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm))
                    opt_step = (step - 1) * args.ppo_epochs * args.minibatches + n_upd  # derived: resume-safe
                    for group in opt.param_groups:
                        group["lr"] = args.lr * lr_factor(opt_step, total_opt_steps, args)
                    opt.step()
                    n_upd += 1
        if engine is not None:
            with timer("sync"):
                engine.sync_weights(model)

        t = timer.pop()
        groups = rewards.view(-1, args.group_size)
        metrics = {
            "rollout/reward": rewards.mean().item(),
            "rollout/length": lengths.mean().item(),
            "rollout/truncated_frac": float(np.mean([f == "length" for f in ro.finish_reasons])),
            "rollout/zero_var_group_frac": (groups.std(1) == 0).float().mean().item(),
            "rollout/tokens_per_s": lengths.sum().item() / max(t.get("gen", 1e-9), 1e-9),
            "rollout/logprob_mismatch": stats["mismatch"] if on_policy else mismatch,
            "loss/pg": stats["pg"] / n_upd, "loss/kl": stats["kl"] / n_upd,
            "loss/clipfrac": stats["clipfrac"] / n_upd, "loss/entropy": stats["entropy"] / n_upd,
            "loss/grad_norm": stats["grad_norm"] / n_upd, "perf/lr": opt.param_groups[0]["lr"],
            "perf/gen_s": t.get("gen", 0.0), "perf/train_s": t.get("train", 0.0), "perf/sync_s": t.get("sync", 0.0),
        }
        if accel.is_main_process and (step % args.eval_every == 0 or step == args.steps):
            metrics.update(run_eval(model, tok, task, hard_task, eval_sets, args, engine))
        log(metrics, step)
        bar.set_postfix(reward=f"{metrics['rollout/reward']:.2f}",
                        acc=f"{[h for h in history if 'eval/acc' in h][-1]['eval/acc']:.2f}" if accel.is_main_process else "")
        if accel.is_main_process and (args.save_every and step % args.save_every == 0 or step == args.steps):
            common.save_checkpoint(run_dir / "checkpoint", accel.unwrap_model(model), tok, opt,
                                   {"step": step, "history": history, "wall_s": time.time() - t_start,
                                    "gen_tokens": gen_tokens, "gen_time": gen_time})

    if not accel.is_main_process:
        return {}
    evals = [h for h in history if "eval/acc" in h]
    train = [h for h in history if "rollout/reward" in h]
    summary = {
        "eval_acc_start": evals[0]["eval/acc"], "eval_acc_end": evals[-1]["eval/acc"],
        "eval_acc_best": max(h["eval/acc"] for h in evals),
        "train_reward_first": train[0]["rollout/reward"], "train_reward_last": train[-1]["rollout/reward"],
        "gen_tokens": gen_tokens, "tokens_per_s": gen_tokens / max(gen_time, 1e-9), "wall_s": time.time() - t_start,
        "logprob_mismatch": float(np.mean([h["rollout/logprob_mismatch"] for h in train])),
        "zero_var_group_frac": float(np.mean([h["rollout/zero_var_group_frac"] for h in train])),
    }
    for key in ("acc_hard", f"pass@{args.pass_k}"):
        if f"eval/{key}" in evals[-1]:
            summary[f"eval_{key}_start"], summary[f"eval_{key}_end"] = evals[0][f"eval/{key}"], evals[-1][f"eval/{key}"]
    save_curve(history, run_dir / "curve.png", f"GRPO on {task.name} ({args.model})")
    print(f"held-out greedy accuracy {summary['eval_acc_start']:.3f} -> {summary['eval_acc_end']:.3f} "
          f"(+{100 * (summary['eval_acc_end'] - summary['eval_acc_start']):.1f} points) in {summary['wall_s']:.0f}s; "
          f"{summary['tokens_per_s']:.0f} generated tokens/s")
    return tracker.finish(summary)


if __name__ == "__main__":
    main(tyro.cli(Args))
