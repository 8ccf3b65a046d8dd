"""The scale-out plan: Qwen2.5-7B on 8 GPUs of 80 GB with --engine hf and with --engine vllm, every term of the code as
it is now, per GPU and per rank's host memory (a section of benchmarks/results/memory_plan.md).

    python benchmarks/memory_plan_scaleout.py     # prints the section; benchmarks/memory_plan.py writes it into the .md

The trainer's terms come from benchmarks/memory_plan.plan (its header derives each one) with the setup of the code:
FSDP2 with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) (common.shard: bf16 gathers, no autocast), a KL
reference sharded and stored in bf16 (algos/_shard.py), gradient checkpointing. On top of them:
  reference root   FSDP2 reshards no root after a forward without backward; common.token_logprobs calls reshard()
                   after scoring, so the reference's gathered root (embeddings, final norm, lm_head; 2 bytes per
                   parameter) exists only while it scores, in the rollout phase, and not in training (before: 4 bytes
                   per parameter, all run long).
  vLLM             --engine vllm: no sampler copy (common.Sampler keeps none when an engine samples); vLLM takes
                   --vllm-gpu-memory of the card (its bf16 weights, 2P, and a KV-cache pool that gets the rest of the
                   share; it schedules the sequences through the pool, so the rollout fits whatever the batch).
                   Without sleep mode the share stays taken in training; with --vllm-sleep (level 1: weights to host
                   memory, KV cache freed) only a residue stays (the CUDA graphs, the allocator's pool and context of
                   the engine: VLLM_RESIDUE, an assumption, unmeasured here). A weight sync streams one parameter at a
                   time: one full parameter in bf16 (the largest, the embedding) alive beside the engine's weights.
  communication    NCCL's own buffers (COMM_BUFFERS: channels x buffer size x 2 directions, about 0.5 GiB for the
                   default 4 MiB and up to 32 channels with NVLink, an assumption, unmeasured here) beside FSDP2's
                   gathered units and unsharded gradients (in the plan's fsdp_gathered).
  host memory      per rank, at load: the previous path held the whole fp32 model and a deep copy per derived model
                   (sampler before its bf16 cast, reference) on every rank; now rank 0 holds one checkpoint file at
                   a time (HF's shards are at most 5 GB) plus one tensor being broadcast, the others one tensor; with
                   --vllm-sleep, the engine's bf16 weights wait in host memory during training (2P per rank).
Phases: rollout (generation), scoring (pi_old and the reference score the batch under no_grad), weight_sync (vLLM only),
training (one micro-batch forward and backward), optimiser (AdamW's step); the peak is the largest.
Deviations, assumptions: the activation model is memory_plan's under autocast (an fp32 residual stream); with the
policy the residual stream between layers is bf16, so the plan's activations are an upper bound. VLLM_RESIDUE and
COMM_BUFFERS are assumptions (no GPU measured them here) and sit inside the 2 GiB the table reserves.
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import memory_plan as mp  # noqa: E402

GiB = 2**30
VLLM_RESIDUE = 2.0 * GiB  # what a sleeping engine keeps on the GPU (assumed)
COMM_BUFFERS = 0.5 * GiB  # NCCL's own buffers (assumed)
HF_FILE = 5e9  # the largest safetensors file of a Hugging Face checkpoint (save_pretrained's default shard size)
SETUP = mp.Setup(gpus=8, micro=32, ckpt=True, kl=True, pass_k=0, fsdp_gather="bf16")
VLLM_SHARE = 0.35  # --vllm-gpu-memory: bf16 weights 14.2 GiB + the rollout's KV cache 8.8 GiB + working space


def terms(s: mp.Shape, u: mp.Setup, engine: str, sleep: bool, card: str = "80GB") -> dict:
    """Per-GPU bytes of each term and phase of one steady-state step of algos/grpo.py with the code's setup."""
    p = mp.plan(s, u)
    P = p["params"]
    layer = sum(mp.numel(x) for x in mp.layer_param_shapes(s))
    t = {k: p[k] for k in ("weights", "grads", "adamw", "ref_model", "activations", "logprob_kept",
                           "logprob_chunk", "fsdp_gathered")}
    t["ref_root_scoring"] = 2 * (P - layer * s.layers)  # gathered while the reference scores, then resharded
    t["ref_root_training"] = 0
    t["comm_buffers"] = C = COMM_BUFFERS
    state = p["phase_optimiser"] - p["weights"]  # weights, gradients, AdamW, sampler copy, reference (no temporary)
    scoring = t["ref_root_scoring"] + 2 * 2 * layer + 3 * p["logprob_chunk"]  # + two bf16 layer units, a chunk
    if engine == "hf":
        t["sampler_bf16"], t["kv_cache"] = p["sampler_bf16"], p["kv_cache"]
        phases = {"rollout": p["phase_rollout"] + C, "scoring": state + scoring + C,
                  "training": p["phase_training"] + C, "optimiser": p["phase_optimiser"] + C}
    else:
        share = VLLM_SHARE * mp.CARDS[card] * GiB
        idle = VLLM_RESIDUE if sleep else share  # the engine between its generate calls
        t["sampler_bf16"], t["vllm_share"], t["vllm_in_training"] = 0, share, idle
        t["weight_sync"] = 2 * max(map(mp.numel, mp.param_shapes(s)))  # one gathered parameter in bf16
        own = state - p["sampler_bf16"] + C
        phases = {"rollout": own + share, "scoring": own + idle + scoring,
                  "training": p["phase_training"] - p["sampler_bf16"] + C + idle,
                  "optimiser": p["phase_optimiser"] - p["sampler_bf16"] + C + idle,
                  "weight_sync": own + (VLLM_RESIDUE + 2 * P if sleep else share) + t["weight_sync"]}
    return {**t, **{f"phase_{k}": v for k, v in phases.items()}, "peak": max(phases.values()),
            "peak_phase": max(phases, key=phases.get), "params": P}


def host_terms(s: mp.Shape, sleep: bool) -> dict:
    """Per-rank host bytes at load (previous path and now) and during training (vLLM asleep)."""
    P, largest = mp.n_params(s), max(map(mp.numel, mp.param_shapes(s)))
    return {"previous_load": 3 * 4 * P,  # the fp32 model, the sampler's deep copy before its cast, the reference's
            "rank0_load": min(HF_FILE, 2 * P) + 2 * largest,  # one bf16 file of the checkpoint + one broadcast tensor
            "rank_load": 2 * largest,
            "training": 2 * P if sleep else 0}


def lines(s: mp.Shape | None = None) -> list[str]:
    """The markdown section: both engines side by side, term by term, the commands, host memory per rank."""
    s = s or mp.Shape.load(mp.CONFIGS / "Qwen2.5-7B")
    cols = {"--engine hf": terms(s, SETUP, "hf", False), "--engine vllm": terms(s, SETUP, "vllm", False),
            "--engine vllm --vllm-sleep": terms(s, SETUP, "vllm", True)}
    keys = ["weights", "grads", "adamw", "ref_model", "ref_root_scoring", "ref_root_training", "sampler_bf16",
            "kv_cache", "vllm_share", "vllm_in_training", "weight_sync", "activations", "logprob_kept",
            "logprob_chunk", "fsdp_gathered", "comm_buffers"]
    phases = ["phase_rollout", "phase_scoring", "phase_weight_sync", "phase_training", "phase_optimiser", "peak"]
    usable = mp.budget("80GB")
    out = ["## Scale-out: Qwen2.5-7B on 8 GPUs of 80 GB, the code as it is now",
           "", "`python benchmarks/memory_plan_scaleout.py` (its header derives the terms beyond the table above): "
           f"micro-batch {SETUP.micro}, checkpointing on, a KL reference, pass@k off, FSDP2 with "
           "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), the reference sharded in bf16 and resharded "
           f"after scoring; vLLM with `--vllm-gpu-memory {VLLM_SHARE}`. GiB per GPU; usable {gb(usable)} GiB.", "",
           "| term | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for k in keys + phases:
        out.append(f"| {k.replace('phase_', 'phase: ')} | " + " | ".join(
            gb(c[k]) if k in c else "-" for c in cols.values()) + " |")
    out.append("| fits | " + " | ".join("yes" if c["peak"] <= usable else "no" for c in cols.values()) + " |")
    base = ("torchrun --nproc_per_node 8 algos/grpo.py --model Qwen/Qwen2.5-7B --task gsm8k --device cuda "
            f"--max-new-tokens {SETUP.new} --prompts-per-step {SETUP.prompts_per_step} --group-size {SETUP.group} "
            f"--micro-batch-size {SETUP.micro} --lr 1e-6 --grad-checkpointing --kl-coef 0.001 --pass-k 0")
    out += ["", "Commands:", "", f"- `--engine hf` ({gb(cols['--engine hf']['peak'])} GiB): `{base}`",
            f"- `--engine vllm` ({gb(cols['--engine vllm']['peak'])} GiB): `{base} --engine vllm "
            f"--vllm-gpu-memory {VLLM_SHARE} --vllm-max-model-len {SETUP.prompt + SETUP.new}`",
            f"- `--engine vllm --vllm-sleep` ({gb(cols['--engine vllm --vllm-sleep']['peak'])} GiB): the same with "
            "`--vllm-sleep`", ""]
    h, hs = host_terms(s, False), host_terms(s, True)
    out += ["Host memory per rank (GiB): loading by the previous path (every rank: the fp32 model, the sampler's "
            f"deep copy before its bf16 cast, the reference's copy) {gb(h['previous_load'])}, "
            f"{gb(8 * h['previous_load'])} for the node; now (algos/_shard.py) rank 0 {gb(h['rank0_load'])} (one "
            f"checkpoint file of at most 5 GB and one tensor being broadcast), the other ranks {gb(h['rank_load'])} "
            f"(that tensor); in training, with `--vllm-sleep`, the sleeping engine's weights {gb(hs['training'])} "
            "per rank. Measured on two CPU processes (tests/test_shard.py): each rank's peak stays below one fp32 "
            "copy of the model it loads."]
    return out


def gb(x) -> str:
    return mp.gb(x)


if __name__ == "__main__":
    print("\n".join(lines()))
