"""A script's `update` for a few optimiser steps on one fixed global batch: in one process, or split over the ranks
of a two-process launch where common.shard wraps the policy (and reference / critic) with FSDP2. One process runs
several jobs in turn (a process start costs more than a job's steps), each into OUT/JOB:

    python tests/_sharded_update.py OUT grpo ppo grpo-lora             # one process, the whole batch
    accelerate launch --multi_gpu --num_processes 2 ... tests/_sharded_update.py OUT grpo ppo   # each rank half of it

    grpo, ppo             the script's update
    grpo-lora             LoRA adapters (peft before FSDP2)
    grpo-variant          token-mean, 2 epochs x 2 mini-batches, gradient checkpointing
    grpo-variant-average  the same with the bug planted: gradients averaged over ranks (FSDP2's default)
    reshard               tests/_sharded_reshard.py (a sharded bf16 reference scored under no_grad)

Rank 0 writes OUT/JOB/stats.json (the logged statistics of every step) and OUT/JOB/params.safetensors (the full
parameters after the steps); every rank writes its part of OUT/JOB/checkpoint (common.save_checkpoint: shards when
sharded). tests/test_sharding.py compares the two: same losses, same parameters, and exports both checkpoints.
With LoRA the reference is the policy with its adapters disabled (common.AdaptersOff) and the adapters' B starts
non-zero (seeded), so that policy and reference differ from the first step.
The optimiser is plain SGD without clipping, so a parameter moves by exactly lr x its gradient: a gradient averaged
over ranks instead of summed moves it half as far (AdamW and clipping to a norm would both hide a constant factor).
Several mini-batches: each rank splits its rows in order, and one process takes the same global mini-batches (the
union of the ranks' m-th parts) by a fixed order in place of torch.randperm (put back after the job, as is the
planted bug).
"""
import copy
import importlib
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
from algos import _llm as llm  # noqa: E402


RANKS = 2  # the two-process launch: one process orders its rows as the ranks split them
LR = 0.002  # SGD: every policy moves by 1e-3 or more (grad norms 1-9), far above fp32 rounding; 0.02 diverges


def global_minibatch_order(B: int, minibatches: int, ranks: int) -> torch.Tensor:
    """One process's row order whose m-th chunk holds the rows that the ranks' m-th chunks hold together (each rank has
    B / ranks consecutive rows, split in order)."""
    n = B // ranks
    parts = [torch.arange(n).chunk(minibatches)[m] + r * n for m in range(minibatches) for r in range(ranks)]
    return torch.cat(parts)


def main(script: str, out: str, lora: bool = False, steps: int = 3, variant: bool = False, average: bool = False) -> None:
    from accelerate import Accelerator
    from safetensors.torch import save_file

    mod = importlib.import_module(f"algos.{script}")
    accel = Accelerator(cpu=True)
    torch.set_num_threads(1)
    args = replace(mod.Args(), device="cpu", prompts_per_step=4, group_size=4, max_new_tokens=8, micro_batch_size=3,
                   kl_coef=0.05, lr=LR, max_grad_norm=1e9, lora_rank=4 if lora else 0)  # no clipping
    if variant:  # token-mean, 2 epochs x 2 mini-batches (pi_old scored apart), gradient checkpointing
        args = replace(args, loss_agg="token-mean", ppo_epochs=2, minibatches=2, grad_checkpointing=True)
    if average:  # the planted bug: FSDP2's default, gradients averaged over ranks instead of summed
        from torch.distributed.fsdp import FSDPModule
        FSDPModule.set_gradient_divide_factor = lambda self, factor: None  # put back by run_jobs
    common.set_seed(0)
    model, tok = common.load_model("tiny-0.6m", "cpu")
    model.train()
    if args.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        model = llm.add_lora(model, args)
        with torch.no_grad():  # B = 0 would make the policy the reference at the first step
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    # the global batch: sampled once from the initial weights, the same on every rank
    torch.manual_seed(0)
    batch = mod.rollout(common.Sampler(model), tok, llm.make_task("add", 2), args, np.random.default_rng(0), "cpu")
    per_rank = batch["completion_ids"].shape[0] // accel.num_processes  # whole groups: B / ranks is a multiple of G
    rows = slice(accel.process_index * per_rank, (accel.process_index + 1) * per_rank)
    batch = {k: v if isinstance(v, dict) else v[rows] for k, v in batch.items()}  # reward_terms: logged means
    if args.minibatches > 1:  # the same global mini-batches in one process as on the ranks (see the header)
        B, one = batch["completion_ids"].shape[0], accel.num_processes == 1
        order = global_minibatch_order(B, args.minibatches, RANKS) if one else torch.arange(B)
        torch.randperm = lambda n, *a, **k: order.clone()  # noqa: E731 (this process only)
    ref = common.AdaptersOff(model) if lora else copy.deepcopy(model).eval().requires_grad_(False)
    sampler = (llm.LoRASampler if lora else common.Sampler)(model, sharded=accel.num_processes > 1)  # before sharding
    extra = {}
    if script == "ppo":
        extra["critic"] = common.shard(mod.Critic(model).train(), accel)
        groups = [{"params": list(common.shard(model, accel).parameters())},
                  {"params": list(extra["critic"].parameters())}]
        opt, loss_fn = torch.optim.SGD(groups, lr=args.lr), mod.ppo_loss
    else:
        model = common.shard(model, accel)
        opt, loss_fn = torch.optim.SGD(model.parameters(), lr=args.lr), mod.grpo_loss
    ref = ref if lora else common.shard(ref, accel)  # AdaptersOff: the policy itself, sharded above
    init = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}
    history = [mod.update(model, opt, batch, loss_fn, args, step, accel, sampler, ref, **extra)
               for step in range(1, steps + 1)]
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in [*model.named_parameters(), *((f"critic.{n}", p) for n, p in
                                                      (extra["critic"].named_parameters() if extra else []))]}
    common.save_checkpoint(Path(out) / "checkpoint", model, tok, opt, {"step": steps}, extra or None)  # every rank
    if accel.is_main_process:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "stats.json").write_text(json.dumps(history))
        save_file({k: v.contiguous() for k, v in full.items()}, str(Path(out, "params.safetensors")))
        save_file({k: v.contiguous() for k, v in init.items()}, str(Path(out, "init.safetensors")))  # the policy's


JOBS = ("grpo", "ppo", "grpo-lora", "grpo-variant", "grpo-variant-average", "reshard")


def run_jobs(out: str, jobs: list) -> None:
    """Each job in turn into OUT/JOB, with what a job patches (torch.randperm, FSDP2's divide factor) put back."""
    from torch.distributed.fsdp import FSDPModule

    unknown = [j for j in jobs if j not in JOBS]
    if unknown or not jobs:
        raise SystemExit(f"jobs {unknown or '(none)'}: choose from {JOBS}")
    Path(out).mkdir(parents=True, exist_ok=True)
    randperm, divide = torch.randperm, FSDPModule.set_gradient_divide_factor
    for job in jobs:
        try:
            if job == "reshard":
                import _sharded_reshard  # tests/, this script's folder

                _sharded_reshard.main(str(Path(out) / "reshard.txt"))
            else:
                script, *flags = job.split("-")
                main(script, str(Path(out) / job), lora="lora" in flags, variant="variant" in flags,
                     average="average" in flags)
        finally:
            torch.randperm, FSDPModule.set_gradient_divide_factor = randperm, divide


if __name__ == "__main__":
    run_jobs(sys.argv[1], sys.argv[2:])
