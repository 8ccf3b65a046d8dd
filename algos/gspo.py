"""GSPO: Group Sequence Policy Optimization (GRPO with a sequence-level importance ratio).

Paper: Zheng et al., "Group Sequence Policy Optimization", arXiv:2507.18071.
Parent: algos/grpo.py (`diff algos/grpo.py algos/gspo.py` shows the ratio, the clip and little else).

Equations (each implemented by the function named on the right):
  group advantage   A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)       group_advantages
  sequence ratio    s_i = (pi_theta(o_i | q) / pi_old(o_i | q))^(1/|o_i|)
                        = exp( 1/|o_i| sum_t (log pi_theta(o_it|.) - log pi_old(o_it|.)) )  sequence_ratio
  sequence clip     l_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)         gspo_loss
  objective         J = 1/N_seq sum_i l_i (every sequence weighs the same; the length normalisation lives
                    inside s_i), N_seq counted once per optimiser step across micro-batches and ranks
  k3 KL to ref      (optional, per token, token-mean over the step, added to J)          k3_kl

Why it differs from GRPO only off-policy: with one epoch and one mini-batch pi_old = pi_theta.detach(),
s_i = 1 and grad l_i = -A_i/|o_i| sum_t grad log pi(o_it): exactly GRPO with --loss-agg seq-mean. The
sequence ratio and clip matter when a rollout batch is reused, so the default here takes 4 optimiser steps
per rollout batch (--minibatches 4), as the paper does.

Deviations from the paper:
- Clip ranges: the paper uses eps_low = 3e-4, eps_high = 4e-4 on Qwen3 models with responses of thousands
  of tokens, where the 1/|o_i| mean averages the per-token drift down; on 2-4-token answers it averages
  little, so the default here is wider, 0.02 / 0.02 (loss/clipfrac reports the clipped share of sequences).
- The optional KL is a per-token k3 term (as algos/grpo.py), not part of the paper's objective.
- Everything else as algos/grpo.py (exact verifier reward, unbiased std, accelerate for several processes).

Commands:
  python algos/gspo.py                                          # tiny default, 2-core CPU, ~3 minutes
  python algos/gspo.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k --engine vllm --device cuda \
      --max-new-tokens 512 --prompts-per-step 64 --lr 1e-6 --clip-eps-low 3e-4 --clip-eps-high 4e-4   # one GPU
  accelerate launch --num_processes 4 algos/gspo.py --model ... --device cuda         # several GPUs
Expected: held-out greedy accuracy on 2-digit addition +11.0 +- 2.2 points after 40 rollout batches (3 seeds,
benchmarks/results/grpo_family.md, rows in benchmarks/results/grpo_family.csv); the default runs 400.
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
    exp_name: str = "gspo"
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
    clip_eps_low: float = 0.02
    """lower clip range of the sequence ratio: s_i >= 1 - eps_low"""
    clip_eps_high: float = 0.02
    """upper clip range of the sequence ratio: s_i <= 1 + eps_high"""
    kl_coef: float = 0.0
    """weight of the k3 KL to the frozen initial policy (0 = no reference model)"""
    # optimisation
    steps: int = 400
    """rollout batches (each followed by ppo_epochs * minibatches optimiser steps)"""
    ppo_epochs: int = 1
    """passes over each rollout batch"""
    minibatches: int = 4
    """optimiser steps per pass; the rollout batch is split into this many (1 with 1 epoch = GRPO)"""
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
    """use the fused log-prob Triton kernel when a GPU is present"""
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


# ---- the idea: advantage, sequence ratio, sequence clip, KL ----
def group_advantages(rewards: torch.Tensor, group_size: int, std_norm: bool = True, eps: float = 1e-6):
    """A_i = (r_i - mean_g r) / (std_g r + eps); rewards [B] group-major -> advantages [B]."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(1, keepdim=True)
    if std_norm:
        adv = adv / (r.std(1, keepdim=True) + eps)
    return adv.view(-1)


def sequence_ratio(logp, old_logp, mask):
    """s_i = exp(mean_t (logp_it - old_it)) over the response's own tokens; [B, C] -> [B]."""
    return torch.exp(common.masked_sum(logp - old_logp, mask, 1) / mask.sum(1).clamp(min=1))


def gspo_loss(logp, old_logp, adv, mask, eps_low: float, eps_high: float):
    """Per-sequence GSPO loss -min(s A, clip(s, 1-eps_low, 1+eps_high) A); logp [B, C], adv [B].

    Returns (loss [B], clipped [B] as float: where the clipped branch was the active one).
    """
    s = sequence_ratio(logp, old_logp, mask)
    unclipped, clipped = s * adv, s.clamp(1 - eps_low, 1 + eps_high) * adv
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).float()


def k3_kl(logp, ref_logp):
    """Schulman's k3 estimator of KL(pi_theta || pi_ref): exp(ref - logp) - (ref - logp) - 1 >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


# ---- helpers of the loop ----
def lr_factor(step: int, total: int, args: Args) -> float:
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    if args.lr_schedule == "constant":
        return 1.0
    progress = (step - args.warmup_steps) / max(1, total - args.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def pick_kernels(args: Args, device):
    """The fused log-prob kernel from kernels/ on a GPU when --kernels is set (the loss is per sequence here)."""
    if args.kernels and device.type == "cuda":
        from kernels.fused_logprob import fused_linear_logprob

        return fused_linear_logprob
    return None


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
    fused_logprob = pick_kernels(args, device)

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

    bar = tqdm(range(start_step + 1, args.steps + 1), desc="gspo", dynamic_ncols=True, disable=not accel.is_main_process,
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
                        seq_loss, clipped = gspo_loss(logp, old, batch["adv"][idx], m, args.clip_eps_low,
                                                      args.clip_eps_high)
                        loss = seq_loss.sum() / n_seqs
                        if ref is not None:
                            kl = k3_kl(logp, ref)
                            loss = loss + args.kl_coef * common.masked_sum(kl, m) / n_tokens
                            stats["kl"] += common.masked_sum(kl.detach(), m).item() / n_tokens
                        if not torch.isfinite(loss):
                            raise SystemExit(f"non-finite loss at step {step}; the last checkpoint in {run_dir} "
                                             "is intact. Lower --lr or check the rewards.")
                        loss.backward()
                        stats["pg"] += loss.item()
                        stats["clipfrac"] += clipped.sum().item() / n_seqs  # fraction of sequences clipped
                        stats["entropy"] += common.masked_sum(ent.detach(), m).item() / n_tokens
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
            "rollout/logprob_mismatch": stats["mismatch"] / args.ppo_epochs,
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
    save_curve(history, run_dir / "curve.png", f"GSPO on {task.name} ({args.model})")
    print(f"held-out greedy accuracy {summary['eval_acc_start']:.3f} -> {summary['eval_acc_end']:.3f} "
          f"(+{100 * (summary['eval_acc_end'] - summary['eval_acc_start']):.1f} points) in {summary['wall_s']:.0f}s; "
          f"{summary['tokens_per_s']:.0f} generated tokens/s")
    return tracker.finish(summary)


if __name__ == "__main__":
    main(tyro.cli(Args))
