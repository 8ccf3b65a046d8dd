"""Memory plan: the per-GPU bytes of one GRPO step of algos/grpo.py, computed from a model's config.json alone.

    python benchmarks/memory_plan.py                  # writes benchmarks/results/memory_plan.{csv,md}
    python benchmarks/memory_plan.py --model benchmarks/configs/Qwen2.5-7B --gpus 8 --micro 4 --ckpt   # one line
    python benchmarks/memory_plan.py --measure-step 8     # measure one GRPO step of SmolLM2-135M on CPU (LoRA rank 8)

For every model in benchmarks/configs/ (config.json only, no weights) x 1, 2 and 8 GPUs x gradient checkpointing
off / on, it finds the largest --micro-batch-size whose step fits in an 80 GB and in a 141 GB GPU and prints the
command to run it. Nothing here needs a GPU or torch: it is arithmetic over the config, and
tests/test_memory_plan.py checks each term against a real model on CPU (parameter count, AdamW state, the bytes
autograd saves, and the CPU allocator's peak).

What one step holds, per GPU (P parameters, N GPUs; "sharded" means FSDP2 over N > 1 processes, common.shard):
  persistent  fp32 weights 4P, fp32 gradients 4P (kept between steps: update() zeroes them with set_to_none at the
              start of the next step, so they are alive during the next rollout), AdamW's exp_avg and exp_avg_sq 8P
              (its 'step' counters are 0-d CPU tensors), all divided by N when sharded (FSDP2 pads dim 0 of each
              tensor to a multiple of N: counted per tensor); the bf16 sampler copy 2P, full on every rank (the
              static-cache decode copy of one process, or the gathered copy of a sharded run), only under bf16.
  rollout     the static KV cache of the rollout batch, 2 (K, V) x layers x kv_heads x head_dim x 2 bytes x
              sequences x (prompt width padded to 32 + new tokens), plus the prefill's per-layer transient
              (3 intermediate-wide + 4 hidden-wide + 2 query-wide bf16 vectors per prompt token) or the decode
              step's [sequences x vocab] logits (bf16, an fp32 copy, the recorder's two log-softmaxes, the
              sampling probabilities: 18 bytes x vocab per sequence), whichever is larger; sharded, before it,
              the gather of the sampler copy (one fp32 tensor at a time: 4 x the largest parameter tensor).
              transformers 5.24 builds a fresh StaticCache per generate call, so the KV cache is gone in training.
  eval        rank 0 evaluates with the same sampler: greedy on 256 prompts, pass@k on 100 prompts x k in one
              generate call (800 sequences at k = 8): the KV cache of those.
  training    one micro-batch forward + backward (below), plus, sharded, FSDP2's gathered units.
  optimiser   AdamW's foreach step allocates one fp32 temporary the size of the (local) parameters (sqrt of
              exp_avg_sq), 4P / N.
The peak is the largest of the four phases.

---- The activation model (one micro-batch of M sequences, L = prompt + new tokens, T = M L tokens) ----
Notation: h hidden, I intermediate, nq / nkv attention / key-value heads, d head dim, q = nq d, V vocabulary,
a = bytes of an activation (2 under bf16 autocast, the GPU default; 4 in fp32, the CPU path), r = 4 (the residual
stream is fp32 in both: the embedding output is fp32 because the weights are, and fp32 + bf16 stays fp32).
Autograd saves, per token per decoder layer (Llama / Qwen2 in transformers 5.24; each term was read off the saved-
tensor hooks of a real layer, tests/test_memory_plan.py checks the total to the byte on CPU):
    4 r h   the layer input x and x * rsqrt(var) of input_layernorm; the mid-layer residual and its normalised copy
            (RMSNorm computes in fp32: pow and the first mul save x, the weight mul saves the normalised tensor)
  + 5 a h   under autocast: the bf16 casts of the inputs of q, k, v, gate and up (autocast caches casts of
            parameters only, so each linear casts its activation input again);  in fp32 instead 2 r h (the two
            norm outputs, shared by the linears that read them)
  + 4 a q   RoPE'd q, k and v repeated to nq heads (a padding mask disables SDPA's GQA path, so repeat_kv copies),
            the attention output (SDPA's saved output is the o_proj input: the transpose-contiguous is a no-op on
            its [B, L, nq, d] layout)
  + 4 a I   gate_proj output (SiLU input), SiLU output, up_proj output, their product (down_proj input)
  + 8       the two rsqrt(var + eps), fp32
  attention SDPA (memory-efficient kernel with a mask, CPU flash kernel): + 4 nq (fp32 log-sum-exp) + a L (the
            boolean mask converted to an additive bias in the query dtype, per call, saved as attn_bias)
            eager, instead of those two: + 4 nq L (the fp32 softmax) + a nq L (its bf16 cast, saved by the PV
            matmul; absent in fp32): quadratic in the length.
  Per token, once for the model: cos and sin (2 r d), the final norm's input and normalised copy (2 r h + 4), the
  input ids (8), and the completion positions' hidden states kept for the chunked log-prob (r h per new token).
  Under autocast with SDPA a layer saves 26 h + 8 q + 8 I + 4 nq + 2 L + 8 bytes per token: for Qwen2.5-7B at
  L = 640, 274,808 bytes (eager: 380,936), 7.3 MiB per token over its 28 layers.
With gradient checkpointing (HF, non-reentrant, per decoder layer) only each layer's input is kept, r h per token
per layer (14,336 bytes for Qwen2.5-7B, 19x less; plus the boolean mask, L bytes per token, once); in the backward
one layer is recomputed (its full set above) at a time.
The backward's transient: while a layer is differentiated, the gradients alive beside its saved tensors are about
one intermediate-wide activation gradient (each MLP node frees its saved input as it makes the gradient that
replaces it) and two fp32 residual gradients, (a I + 2 r h) T; eager attention holds the gradients of the softmax's
output and input, 2 (4 + a) nq L + 2 r h per token (a only under autocast), if larger. With checkpointing, the
recomputed layer's saved tensors (less its input, already kept) come on top.
Measured on CPU (tests/test_memory_plan.py, a 4-layer Llama, 8 x 96 tokens): the plan's forward + backward peak is
0.92-1.16x the allocator's, fp32 and bf16 autocast, SDPA and eager, with and without checkpointing; the test allows
1.25x either way.
Weights under autocast: autocast caches the bf16 cast of every fp32 weight for the whole `with autocast` block and
the matmuls save it for the backward, so without checkpointing a bf16 copy of every linear weight (2 bytes per
parameter, never sharded: FSDP2 all-gathers fp32 and autocast casts the gathered weight) is alive from the forward
to the backward; with checkpointing all of them are cached until the forward's end, then one layer's at a time.
FSDP2 (common.shard: one unit per decoder layer, the root holding embeddings, final norm and lm_head) computes in
bf16 by MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) with autocast off: two layer units in flight
(current + prefetched) and the root for the whole forward and backward, gathered in bf16 (2 bytes per parameter), no
autocast cache, plus in the backward the root's unsharded gradients until the end and one layer's before its
reduce-scatter (bf16, and its fp32 copy). `--fsdp-gather fp32` models the previous code, autocast over FSDP2:
fp32 gathers (4 bytes) and autocast's cached bf16 casts of the gathered weights. The KL reference of a sharded
bf16 run is stored in bf16 (algos/_shard.py: 2 bytes per parameter, sharded), of one GPU an fp32 copy.
benchmarks/memory_plan_scaleout.py adds what this table leaves out for 7B on 8 GPUs (vLLM's share and sleep mode,
the reference's root while it scores, communication buffers, host memory per rank): a section of the .md.
The chunked log-prob path (common.token_logprobs, chunks of about --logprob-chunk-mb MiB of fp32 logits, each
recomputed in the backward): forward, 3 chunk-sized fp32 buffers alive (log-softmax, its exp, their product for the
entropy); backward, 4 (the recomputed log-softmax, the gradient of the log-probs, of the logits, of logits / T),
plus the lm_head weight's gradient per chunk: under autocast its bf16 cast, its bf16 gradient and the fp32 copy
accumulated into .grad (8 V h bytes), in fp32 the fp32 gradient (4 V h). Setup(logprob_path="legacy") models
the previous path (4096 positions per chunk, every chunk's graph kept: 4 V + a h bytes saved per new token, and 3
chunk-sized buffers in the backward, which recomputes nothing), which is what benchmarks/bench_gpu_step.py measured
on the H200; the plan is checked against those peaks below the table.

Result (benchmarks/results/memory_plan.md): Qwen2.5-7B at 512 new tokens fits on 8 GPUs of 80 GB with checkpointing
(micro-batch up to 77, peak 63.0 GiB at 64) or without (micro-batch 7, 54.0 GiB at 4), with the pass@k eval off: its one
generate call of 800 sequences needs 27 GiB of KV cache and 15 GiB of prefill at 7B. With a KL reference at micro-batch
32: 50.6 GiB with --engine hf, 64.1 GiB with --engine vllm (44.2 GiB with --vllm-sleep): memory_plan_scaleout.py.

LoRA (--lora-rank r, peft adapters on every attention and MLP projection; Setup(lora=r)): each adapted layer of
shape out x in adds A (r x in) and B (out x in) in fp32, Pa = r x layers x (2h + q + 2 kv + q + h + 3 (h + I)) in
all; gradients and AdamW state exist for those only (4 Pa + 8 Pa instead of 12 P; FSDP2 splits dim 0 of A and B
like any tensor), the optimiser's temporary is 4 Pa, and the reference of a KL term costs nothing: it is the policy
itself with its adapters disabled (common.AdaptersOff), where full fine-tuning keeps a 4P copy. The sampler's bf16
copy is a plain model with the adapters merged (2P, as without LoRA). Autograd saves, per token, relative to full
fine-tuning (checked to the byte on CPU by tests/test_llm.py, fp32 and autocast, SDPA and eager): per layer - 2 r h
(RMSNorm's normalised copies: its weight is frozen, so only its output is kept) + 7 r a (each adapter's A output,
the input of B) + a q under autocast with SDPA (peft casts the o_proj adapter's bf16 input to fp32 and autocast
casts it back: a copy SDPA's saved output no longer shares), and once - (2 r h + 12) (the final norm's normalised
copy, the embedding output, which needs no gradient, one rsqrt and the input ids). The frozen lm_head keeps its
bf16 cast for the backward but gets no gradient (2 V h per chunk instead of 8 V h under autocast; none in fp32),
and FSDP2 reduces no base gradient. Autocast caches the casts of weights that require a gradient only: the frozen
weights are cast at each use, so under checkpointing the forward holds one cast at a time, not all of them.
Against the CPU allocator (the shapes of tests/test_memory_plan.py's peak test, rank 16) the LoRA plan's forward +
backward peak was 0.89-1.09x the measured one (fp32 and autocast, SDPA and eager, checkpointing off and on).
Measured (--measure-step 0 / 8, benchmarks/results/lora_memory.csv): one GRPO update step of SmolLM2-135M on CPU in
fp32 with a KL term, full fine-tuning against LoRA rank 8, with the plan beside it in
benchmarks/results/memory_plan.md.

Deviations, assumptions: the KV cache and logits of vLLM are not modelled (--engine hf); prompts are all of the
stated length and every completion runs to the budget (the worst case); allocator fragmentation, the CUDA context,
cuBLAS workspaces, NCCL buffers and the compiled decode step's CUDA-graph pool are outside the plan: the table
reserves 10% of the card plus 2 GiB for them. Peaks are for a steady-state step (AdamW state allocated).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import platform
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "benchmarks" / "configs"
RESULTS = ROOT / "benchmarks" / "results"
GiB = 2 ** 30
MODELS = {"Qwen2.5-0.5B": "Qwen/Qwen2.5-0.5B", "Qwen2.5-1.5B": "Qwen/Qwen2.5-1.5B", "Qwen2.5-7B": "Qwen/Qwen2.5-7B",
          "Llama-3.1-8B": "meta-llama/Llama-3.1-8B"}
CARDS = {"80GB": 79.2, "141GB": 139.8}  # GiB torch reports on an H100 80GB / H200 141GB
HEADROOM = (0.10, 2.0)  # reserved: 10% of the card (allocator fragmentation) + 2 GiB (CUDA context, cuBLAS, NCCL)
COMMAND = "python benchmarks/memory_plan.py"


# ---- the model's shape and parameters ----
@dataclass(frozen=True)
class Shape:
    name: str
    vocab: int
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool  # Qwen2: q, k, v carry a bias
    attn_bias: bool  # Llama's attention_bias: q, k, v and o
    mlp_bias: bool
    max_pos: int

    @classmethod
    def from_config(cls, cfg: dict, name: str = "") -> "Shape":
        kind = cfg.get("model_type", "llama")
        if kind not in ("llama", "qwen2"):
            raise SystemExit(f"{name or 'config'}: model_type {kind!r}: the plan knows Llama and Qwen2 decoders only")
        h, nq = cfg["hidden_size"], cfg["num_attention_heads"]
        return cls(name=name, vocab=cfg["vocab_size"], hidden=h, inter=cfg["intermediate_size"],
                   layers=cfg["num_hidden_layers"], heads=nq, kv_heads=cfg.get("num_key_value_heads", nq),
                   head_dim=cfg.get("head_dim") or h // nq, tied=bool(cfg.get("tie_word_embeddings", False)),
                   qkv_bias=kind == "qwen2", attn_bias=kind == "llama" and bool(cfg.get("attention_bias")),
                   mlp_bias=kind == "llama" and bool(cfg.get("mlp_bias")),
                   max_pos=cfg.get("max_position_embeddings", 0))

    @classmethod
    def load(cls, path: str | Path) -> "Shape":
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise SystemExit(f"no config.json at {path}")
        return cls.from_config(json.loads(file.read_text()), path.name if path.is_dir() else path.parent.name)


def layer_param_shapes(s: Shape) -> list[tuple[int, ...]]:
    """The parameter tensors of one decoder layer, in the order the model registers them."""
    h, q, kv, i = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim, s.inter
    out = []
    for rows, cols, bias in ((q, h, s.qkv_bias or s.attn_bias), (kv, h, s.qkv_bias or s.attn_bias),
                             (kv, h, s.qkv_bias or s.attn_bias), (h, q, s.attn_bias)):
        out += [(rows, cols)] + [(rows,)] * bias
    for rows, cols in ((i, h), (i, h), (h, i)):
        out += [(rows, cols)] + [(rows,)] * s.mlp_bias
    return out + [(h,), (h,)]  # input_layernorm, post_attention_layernorm


def param_shapes(s: Shape) -> list[tuple[int, ...]]:
    """Every parameter tensor of the CausalLM (a tied lm_head is the embedding, counted once)."""
    return [(s.vocab, s.hidden)] + layer_param_shapes(s) * s.layers + [(s.hidden,)] + \
        ([] if s.tied else [(s.vocab, s.hidden)])


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def n_params(s: Shape) -> int:
    return sum(map(numel, param_shapes(s)))


def shard_numel(shape: tuple[int, ...], n: int) -> int:
    """Elements of one rank's FSDP2 shard: dim 0 split in ceil(dim0 / n) rows (the last rank's padded)."""
    return numel(shape) if n == 1 else -(-shape[0] // n) * numel(shape[1:])


def lora_param_shapes(s: Shape, rank: int) -> list[tuple[int, ...]]:
    """The LoRA adapters (A: rank x in, B: out x rank) of every attention and MLP projection of every layer, in the
    order peft registers them (q, k, v, o, gate, up, down)."""
    h, q, kv, i = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim, s.inter
    linears = ((q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i))
    return [shape for out, inp in linears for shape in ((rank, inp), (out, rank))] * s.layers if rank else []


def adamw_state_bytes(s: Shape, gpus: int = 1, with_step: bool = True, lora: int = 0) -> int:
    """torch.optim.AdamW's state: exp_avg and exp_avg_sq in fp32 per trained parameter (all of them, or the LoRA
    adapters of rank `lora` only), and a 0-d fp32 'step' per tensor (on the CPU unless capturable or fused)."""
    shapes = lora_param_shapes(s, lora) if lora else param_shapes(s)
    return 8 * sum(shard_numel(p, gpus) for p in shapes) + 4 * len(shapes) * with_step


# ---- activations ----
def layer_saved_bytes(s: Shape, L: int, bf16: bool, attn: str = "sdpa", lora: int = 0) -> float:
    """Bytes autograd saves per token in one decoder layer (see the header for each term; `lora`: the rank)."""
    a, r, h, q, nq = (2 if bf16 else 4), 4, s.hidden, s.heads * s.head_dim, s.heads
    b = 4 * r * h + (5 * a * h if bf16 else 2 * r * h) + 4 * a * q + 4 * a * s.inter + 8
    if lora:  # frozen norms keep no normalised copy; each adapter's A output; o_proj's re-cast input (autocast, SDPA)
        b += -2 * r * h + 7 * lora * a + (a * q if bf16 and attn == "sdpa" else 0)
    if attn == "sdpa":
        return b + 4 * nq + a * L
    if attn == "eager":
        return b + (4 + (a if bf16 else 0)) * nq * L
    raise ValueError(f"attention {attn!r}: sdpa or eager")


def model_saved_bytes(s: Shape, bf16: bool, lora: int = 0) -> float:
    """Bytes saved per token once for the model: cos and sin, the final norm, the input ids (LoRA: see the header)."""
    return 2 * 4 * s.head_dim + 2 * 4 * s.hidden + 4 + 8 - (2 * 4 * s.hidden + 12 if lora else 0)


def layer_backward_bytes(s: Shape, L: int, bf16: bool, attn: str = "sdpa") -> float:
    """Per token: the gradients alive beside the saved tensors while one layer is differentiated."""
    a = 2 if bf16 else 4
    mlp = a * s.inter + 2 * 4 * s.hidden
    return max(mlp, 2 * (4 + (a if bf16 else 0)) * s.heads * L + 2 * 4 * s.hidden) if attn == "eager" else mlp


def decoder_activation_bytes(s: Shape, M: int, L: int, bf16: bool, ckpt: bool, attn: str = "sdpa",
                             lora: int = 0) -> dict:
    """The decoder's share of a forward + backward on M sequences of L tokens: what is saved at the end of the
    forward ('saved'), and the extra alive at the worst moment of the forward and of the backward."""
    T = M * L
    per_layer = layer_saved_bytes(s, L, bf16, attn, lora) * T
    if ckpt:
        saved = (s.layers * 4 * s.hidden + model_saved_bytes(s, bf16, lora) + L) * T
        recomputed = per_layer - 4 * s.hidden * T  # its input is the checkpoint's saved input, counted above
        return {"saved": saved, "fwd_extra": per_layer,
                "bwd_extra": recomputed + layer_backward_bytes(s, L, bf16, attn) * T}
    saved = s.layers * per_layer + model_saved_bytes(s, bf16, lora) * T
    return {"saved": saved, "fwd_extra": 0.0, "bwd_extra": layer_backward_bytes(s, L, bf16, attn) * T}


# ---- one GRPO step ----
@dataclass(frozen=True)
class Setup:
    gpus: int = 1
    micro: int = 8  # --micro-batch-size
    prompt: int = 128  # prompt tokens (all prompts this long)
    new: int = 512  # --max-new-tokens (every completion runs to it)
    prompts_per_step: int = 32  # per process
    group: int = 8
    ckpt: bool = False
    bf16: bool = True  # bf16 autocast with fp32 weights (the CUDA default); False = the fp32 CPU path
    attn: str = "sdpa"
    chunk_mb: float = 256.0  # --logprob-chunk-mb
    logprob_path: str = "recompute"  # or "legacy": 4096 positions per chunk, every chunk's graph kept
    fsdp_gather: str = "bf16"  # FSDP2 gathers: bf16 (common.shard's MixedPrecisionPolicy) or fp32 (the previous code)
    kl: bool = False  # a reference model (--kl-coef > 0): an fp32 copy, sharded like the policy (none under LoRA)
    pass_k: int = 8  # eval pass@k on 100 prompts (0 = off)
    lora: int = 0  # --lora-rank: adapters on every attention and MLP projection (0 = full fine-tuning)


def plan(s: Shape, u: Setup) -> dict:
    """Per-GPU bytes of each term and each phase of one steady-state GRPO step; 'peak' is the largest phase."""
    shapes, N = param_shapes(s), u.gpus
    P, P_local = n_params(s), sum(shard_numel(p, N) for p in shapes)
    trained = sum(shard_numel(p, N) for p in lora_param_shapes(s, u.lora)) if u.lora else P_local  # LoRA: adapters
    layer = sum(numel(p) for p in layer_param_shapes(s))
    lin = layer - 2 * s.hidden  # what autocast casts for a layer: its linear weights and biases, not the norms
    root = P - layer * s.layers
    kv_bytes, a = (2, 2) if u.bf16 else (4, 4)
    t = {"weights": 4 * P_local + (4 * trained if u.lora else 0), "grads": 4 * trained,
         "adamw": adamw_state_bytes(s, N, with_step=False, lora=u.lora), "sampler_bf16": 2 * P if u.bf16 else 0,
         "ref_model": (2 if u.bf16 and N > 1 else 4) * P_local if u.kl and not u.lora else 0}  # LoRA: adapters off
    persistent = sum(t.values())
    # rollout and eval: KV cache + the larger of the prefill and decode transients
    width = -(-u.prompt // 32) * 32
    kv_tok = 2 * s.layers * s.kv_heads * s.head_dim * kv_bytes

    def generation(seqs: int) -> tuple[float, float]:
        prefill = seqs * width * kv_bytes * (3 * s.inter + 4 * s.hidden + 2 * s.heads * s.head_dim)
        decode = seqs * s.vocab * (kv_bytes + 16)
        return kv_tok * seqs * (width + u.new), max(prefill, decode)

    B = u.prompts_per_step * u.group
    t["kv_cache"], gen_transient = generation(B)
    gather = 4 * max(map(numel, shapes)) if N > 1 else 0
    rollout = persistent + max(gather, t["kv_cache"] + gen_transient)
    eval_seqs = max(256, 100 * u.pass_k)  # greedy in batches of 256; pass@k on 100 prompts in one call
    t["eval_kv_cache"], eval_transient = generation(eval_seqs)
    evaluation = persistent + t["eval_kv_cache"] + eval_transient
    # training: one micro-batch forward + backward
    L, Tc = u.prompt + u.new, u.micro * u.new
    act = decoder_activation_bytes(s, u.micro, L, u.bf16, u.ckpt, u.attn, u.lora)
    if u.logprob_path == "legacy":  # the log-softmax of every chunk is saved (in keep): the backward recomputes none
        chunk, bufs_bwd = min(4096, Tc) * 4 * s.vocab, 3
        keep = Tc * (4 * s.vocab + a * s.hidden + 4 * s.hidden)
    else:
        chunk, bufs_bwd = min(max(1, int(u.chunk_mb * 2 ** 20) // (4 * s.vocab)), Tc) * 4 * s.vocab, 4
        keep = Tc * 4 * s.hidden
    casts = u.bf16 and (N == 1 or u.fsdp_gather == "fp32")  # autocast caches bf16 casts of fp32 weights
    Vh = s.vocab * s.hidden
    # the lm_head's weight in the log-prob chunks: its bf16 cast (cached through the forward's chunk loop), and per
    # chunk in the backward the cast, its bf16 gradient and the fp32 copy added to .grad (fp32: the fp32 gradient;
    # gathered in bf16 by FSDP2: its bf16 gradient, the unsharded accumulation being counted with FSDP2's buffers)
    head_fwd = 2 * Vh if casts else 0
    head_grad = 8 * Vh if casts else (2 if u.bf16 else 4) * Vh
    if u.lora:  # a frozen lm_head: its bf16 cast for the input's gradient, no weight gradient
        head_grad = 2 * Vh if casts else 0
    casts_fwd = 2 * lin * s.layers if casts and not (u.lora and u.ckpt) else 0  # frozen weights: not cached
    casts_bwd = (2 * lin if u.ckpt else 2 * lin * s.layers) if casts else 0
    if N > 1:
        g = 4 if u.fsdp_gather == "fp32" else 2
        fsdp_fwd = g * (root + 2 * layer)
        # the lm_head's (or tied embedding's) unsharded gradient until the root's reduce-scatter at the end, one
        # layer's unsharded gradient before its reduce-scatter (and its fp32 copy when gathered in bf16)
        fsdp_bwd = fsdp_fwd + g * (s.vocab * s.hidden + s.hidden) + g * layer + (4 * layer if g == 2 else 0)
        fsdp_bwd = fsdp_fwd if u.lora else fsdp_bwd  # LoRA: no unsharded base gradients (the adapters' are small)
    else:
        fsdp_fwd = fsdp_bwd = 0
    t["activations"] = act["saved"]
    t["logprob_kept"] = keep
    t["logprob_chunk"] = chunk
    t["autocast_weights"] = casts_bwd
    t["autocast_weights_fwd"] = casts_fwd
    t["fsdp_gathered"] = fsdp_bwd
    fwd = persistent + act["saved"] + keep + casts_fwd + fsdp_fwd + max(act["fwd_extra"], head_fwd + 3 * chunk)
    bwd = persistent + act["saved"] + keep + casts_bwd + fsdp_bwd + max(act["bwd_extra"],
                                                                          bufs_bwd * chunk + head_grad)
    training = max(fwd, bwd)
    t["train_extra"] = training - persistent  # what one micro-batch's forward + backward adds to the persistent
    optimiser = persistent + 4 * trained
    phases = {"rollout": rollout, "eval": evaluation, "training": training, "optimiser": optimiser}
    return {**t, "params": P, **{f"phase_{k}": v for k, v in phases.items()},
            "peak": max(phases.values()), "peak_phase": max(phases, key=phases.get)}


def budget(card: str) -> float:
    frac, fixed = HEADROOM
    return (CARDS[card] * (1 - frac) - fixed) * GiB


def max_micro(s: Shape, u: Setup, card: str) -> int:
    """The largest micro-batch (up to the rollout batch) whose step fits the card's budget; 0 if none."""
    lo, hi = 0, u.prompts_per_step * u.group  # the peak grows with the micro-batch: bisect
    while lo < hi:
        m = (lo + hi + 1) // 2
        lo, hi = (m, hi) if plan(s, replace(u, micro=m))["peak"] <= budget(card) else (lo, m - 1)
    return lo


def command(model: str, u: Setup) -> str:
    """The command line of algos/grpo.py for this setup (micro-batch: the largest power of two that fits)."""
    launch = f"torchrun --nproc_per_node {u.gpus} algos/grpo.py" if u.gpus > 1 else "python algos/grpo.py"
    flags = [f"--model {model}", "--task gsm8k", "--device cuda", f"--max-new-tokens {u.new}",
             f"--prompts-per-step {u.prompts_per_step}", f"--group-size {u.group}", f"--micro-batch-size {u.micro}",
             "--lr 1e-6"]
    if u.ckpt:
        flags.append("--grad-checkpointing")
    if u.pass_k != 8:
        flags.append(f"--pass-k {u.pass_k}")
    if u.lora:
        flags.append(f"--lora-rank {u.lora}")
    return " ".join([launch] + flags)


# ---- the table ----
def gb(x: float) -> str:
    return f"{x / GiB:.1f}"


def pow2(m: int) -> int:
    """The largest power of two <= m (a micro-batch that divides the rollout batch of 256)."""
    return 2 ** int(math.log2(m))


def fit(s: Shape, u: Setup, card: str) -> dict:
    """The card's answer for a setup: pass@k eval kept if its generate call fits, else --pass-k 0; the largest
    micro-batch that fits, and the plan at the command's micro-batch (the largest power of two below it)."""
    if plan(s, replace(u, micro=1))["phase_eval"] > budget(card):
        u = replace(u, pass_k=0)
    m = max_micro(s, u, card)
    u = replace(u, micro=pow2(m) if m else 1)
    return {"max_micro": m, "setup": u, "plan": plan(s, u)}


def rows(base: Setup, gpus=(1, 2, 8)) -> list[dict]:
    out = []
    for name, hub in MODELS.items():
        s = Shape.load(CONFIGS / name)
        for n in gpus:
            for ckpt in (False, True):
                u = replace(base, gpus=n, ckpt=ckpt)
                out.append({"model": name, "hub": hub, "shape": s, "setup": u, "plan": plan(s, u),
                            **{card: fit(s, u, card) for card in CARDS}})
    return out


def render(rs: list[dict], base: Setup) -> str:
    frac, fixed = HEADROOM
    lines = [
        f"`{COMMAND}`: per-GPU memory of one steady-state GRPO step of `algos/grpo.py` (`--engine hf`, bf16 autocast "
        f"with fp32 weights and AdamW, SDPA attention), computed from `benchmarks/configs/<model>/config.json` alone. "
        f"Rollout batch {base.prompts_per_step} prompts x {base.group} completions per GPU, prompts of "
        f"{base.prompt} tokens (a GSM8K question in a chat template), {base.new} new tokens (every completion runs to "
        f"the budget), log-prob chunks of {base.chunk_mb:.0f} MiB recomputed in the backward. Sharded = FSDP2 "
        "(`common.shard`) over the GPUs, computing in bf16 by MixedPrecisionPolicy (bf16 gathers, fp32 gradient "
        "reduction). A configuration fits when "
        f"every phase (rollout, training, optimiser step, and rank 0's held-out eval) peaks below "
        f"{100 - 100 * frac:.0f}% of the card minus {fixed:.0f} GiB ({CARDS['80GB']:.1f} / {CARDS['141GB']:.1f} GiB "
        f"cards: {gb(budget('80GB'))} / {gb(budget('141GB'))} GiB usable); the rest is left for allocator "
        "fragmentation, the CUDA context, cuBLAS and NCCL buffers (and covers the plan's error against the measured "
        "peaks at the end). Where the pass@8 eval (100 prompts x 8 in one generate call) does not fit, the command "
        "turns it off (`--pass-k 0`). Every term's derivation is in the script's header; "
        "tests/test_memory_plan.py checks them on CPU.",
        "",
        "| model | params | GPUs | ckpt | weights + grads + AdamW | sampler bf16 | rollout KV | pass@8 eval KV | "
        "80 GB: max micro | peak GiB at micro (phase) | 141 GB: max micro | peak GiB at micro (phase) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rs:
        p, u = r["plan"], r["setup"]
        state = p["weights"] + p["grads"] + p["adamw"]
        cells = []
        for card in CARDS:
            f = r[card]
            note = "" if f["setup"].pass_k else ", pass@k off"
            cells += [str(f["max_micro"]) if f["max_micro"] else "-",
                      f"{gb(f['plan']['peak'])} at {f['setup'].micro} ({f['plan']['peak_phase']}{note})"
                      if f["max_micro"] else "-"]
        lines.append(f"| {r['model']} | {p['params'] / 1e9:.2f}B | {u.gpus} | {'on' if u.ckpt else 'off'} | "
                     f"{gb(state)} | {gb(p['sampler_bf16'])} | {gb(p['kv_cache'])} | {gb(p['eval_kv_cache'])} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Max micro: the largest `--micro-batch-size` (up to the rollout batch of 256) that fits; the command "
              "uses the largest power of two below it, and the peak is given at that micro-batch. '-': not even one "
              "sequence fits.", ""]
    for card in CARDS:
        lines += [f"Commands for {card} GPUs:", ""]
        for r in rs:
            f = r[card]
            if f["max_micro"]:
                u = f["setup"]
                lines.append(f"- {r['model']}, {u.gpus} GPU{'s' * (u.gpus > 1)}, "
                             f"checkpointing {'on' if u.ckpt else 'off'}"
                             f" ({gb(f['plan']['peak'])} GiB): `{command(r['hub'], u)}`")
        lines.append("")
    from benchmarks.memory_plan_scaleout import lines as scaleout
    lines += [*lora_table(base), "", *measured_table(), "", *breakdown(rs), "", *checks(), "", *scaleout()]
    return "\n".join(lines) + "\n"


def lora_table(base: Setup, rank: int = 16) -> list[str]:
    """Full fine-tuning against LoRA of rank `rank`, checkpointing on, with a KL term (--kl-coef > 0), no pass@k."""
    out = [f"LoRA (`--lora-rank {rank}`, adapters on every attention and MLP projection) against full fine-tuning, "
           "checkpointing on, with a KL term (`--kl-coef > 0`), the pass@k eval off (`--pass-k 0`): the reference is "
           "a copy of the policy (fp32 on one GPU, sharded in bf16 on several) under full fine-tuning, and the policy "
           "itself with its adapters disabled under LoRA (no copy). "
           "Gradients and AdamW state exist for the adapters only; the bf16 sampler copy (the adapters merged) and "
           "the activations stay about the same, so the gain is in the persistent state.", "",
           "| model | GPUs | adapters | weights + grads + AdamW + reference: full / LoRA GiB | 80 GB max micro: "
           "full / LoRA | 80 GB peak GiB at micro 8: full / LoRA |", "|---|---|---|---|---|---|"]
    for name in MODELS:
        s = Shape.load(CONFIGS / name)
        for n in (1, 8):
            u = replace(base, gpus=n, ckpt=True, kl=True, micro=8, pass_k=0)
            full, lora = plan(s, u), plan(s, replace(u, lora=rank))
            state = lambda p: gb(p["weights"] + p["grads"] + p["adamw"] + p["ref_model"])  # noqa: E731
            micro = [max_micro(s, v, "80GB") or "-" for v in (u, replace(u, lora=rank))]
            out.append(f"| {name} | {n} | {sum(map(numel, lora_param_shapes(s, rank))) / 1e6:.1f}M | {state(full)} / "
                       f"{state(lora)} | {micro[0]} / {micro[1]} | {gb(full['peak'])} / {gb(lora['peak'])} |")
    return out


def breakdown(rs: list[dict]) -> list[str]:
    """Every term for Qwen2.5-7B on 8 GPUs (the configuration the plan exists for)."""
    r = next(r for r in rs if r["model"] == "Qwen2.5-7B" and r["setup"].gpus == 8 and r["setup"].ckpt)
    s, u, p = r["shape"], r["80GB"]["setup"], r["80GB"]["plan"]
    old = plan(s, replace(u, fsdp_gather="fp32"))
    keys = ["weights", "grads", "adamw", "sampler_bf16", "kv_cache", "eval_kv_cache", "activations",
            "logprob_kept", "logprob_chunk", "autocast_weights", "fsdp_gathered"]
    out = [f"Qwen2.5-7B on 8 GPUs of 80 GB, checkpointing on, micro-batch {u.micro}, pass@k {u.pass_k or 'off'}: "
           + ", ".join(f"{k} {gb(p[k])}" for k in keys) + " GiB; phases: "
           + ", ".join(f"{k[6:]} {gb(v)}" for k, v in p.items() if k.startswith("phase_"))
           + f" GiB. Peak {gb(p['peak'])} GiB of {gb(budget('80GB'))} usable. Under the previous code (autocast "
           f"over FSDP2, fp32 gathers, the bf16 casts cached: {gb(old['autocast_weights_fwd'])} GiB until the "
           f"forward's end) the training phase was {gb(old['phase_training'])} GiB."]
    return out


def checks() -> list[str]:
    """The plan against the peaks bench_gpu_step.py measured on an H200 (previous log-prob path, one GPU)."""
    from benchmarks.bench_gpu_step import MICRO, PROMPTS, GROUP, SHAPES

    measured, commits = {}, set()
    path = RESULTS / "gpu_step.csv"
    if path.exists():
        for row in csv.DictReader(open(path)):
            if row["metric"] == "peak_GB" and row["config"].endswith(" ours"):
                commits.add(row["commit"])
                measured[row["config"].split()[0], int(row["config"].split()[1].split("=")[1])] = float(row["value"])
    out = [f"Check against measured peaks, taken at an older commit ({', '.join(sorted(commits))}; not re-measured on "
           "the current code, no GPU since) (`benchmarks/bench_gpu_step.py`, one H200, random-weight SmolLM2 shapes, "
           f"{PROMPTS} prompts x {GROUP}, micro-batch {MICRO}, prompts of about 40 tokens, the previous log-prob path: "
           "4096 positions per chunk with every chunk's graph kept, no checkpointing; "
           "`torch.cuda.max_memory_allocated`, which leaves out fragmentation and the CUDA context):", "",
           "| shape | new tokens | plan GiB (phase) | measured GiB | plan / measured |", "|---|---|---|---|---|"]
    gaps = []
    for (shape, new), value in sorted(measured.items()):
        if shape not in SHAPES:
            continue
        cfg = {**SHAPES[shape], "vocab_size": 49152, "tie_word_embeddings": True, "model_type": "llama"}
        p = plan(Shape.from_config(cfg, shape), Setup(micro=MICRO, prompt=40, new=new, prompts_per_step=PROMPTS,
                                                      group=GROUP, logprob_path="legacy", pass_k=0))
        out.append(f"| {shape} | {new} | {gb(p['peak'])} ({p['peak_phase']}) | {value:.1f} | "
                   f"{p['peak'] / GiB / value:.2f} |")
        gaps.append(value - p["peak"] / GiB)
    if gaps:
        out += ["", f"The plan falls {min(gaps):.1f}-{max(gaps):.1f} GiB short of both measured peaks. At that "
                "commit the "
                "entropy statistic kept the previous micro-batch's [positions x vocab] graph alive (2 x 8,192 x 49,152 "
                "x 4 B = 3.0 GiB at these shapes), which the plan never modelled and the code no longer does: these "
                "rows calibrate nothing now. They stay as the record of that commit until a GPU re-measures the "
                "current path; no measurement of the sharded path, of checkpointing or of vLLM exists. The CPU "
                "calibration of the activations (tests/test_memory_plan.py) is current."]
    return out


MEASURED = dict(model="smollm2-135m", task="words", max_new_tokens=32, prompts_per_step=2, group_size=4,
                micro_batch_size=4, kl_coef=0.05, temperature=0.7, lr=1e-5, threads=2)  # one small CPU step


def allocator_peak(fn) -> int:
    """Peak bytes the CPU allocator holds during fn() beyond what it held before: every allocation torch's profiler
    records (profile_memory), and the frees of those allocations, summed in time order. Exact bytes asked of the
    allocator: no fragmentation, no Python objects. A free of memory allocated before fn() is left out: the garbage
    collector may release an earlier object's tensors at any moment, which would otherwise lower the count."""
    import gc

    import torch
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []

    def walk(nodes):
        for n in nodes:
            if n.tag == torch._C._profiler._EventType.Allocation:
                events.append((n.start_time_ns, n.extra_fields.ptr, n.extra_fields.alloc_size))
            walk(n.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    live, cur, peak = set(), 0, 0
    for _, ptr, size in sorted(events, key=lambda e: e[0]):
        if size > 0:
            live.add(ptr)
        elif ptr in live:
            live.discard(ptr)
        else:
            continue
        cur += size
        peak = max(peak, cur)
    return peak


def measure_step(rank: int) -> dict:
    """One steady-state GRPO update step of algos/grpo.py (the second: gradients and AdamW state exist) on
    SmolLM2-135M on CPU (fp32), full fine-tuning (rank 0) or LoRA: the bytes of weights, gradients, AdamW state and
    reference, and the CPU allocator's peak during the update above what it held before (allocator_peak). Appends
    them to benchmarks/results/lora_memory.csv."""
    import numpy as np
    import torch

    import common
    from algos import _llm as llm
    from algos import grpo
    from benchmarks._results import append_rows

    args = grpo.Args(**MEASURED, lora_rank=rank)
    accel = type("OneProcess", (), {"num_processes": 1, "process_index": 0, "device": torch.device("cpu")})()
    torch.set_num_threads(args.threads)
    common.set_seed(0)
    model, tok, ref, sampler = llm.load_policy(args, accel, with_ref=True)
    opt, task = llm.make_optimizer(model.parameters(), args), llm.make_task(args.task)
    for step in (1, 2):
        torch.manual_seed(step)
        batch = grpo.rollout(sampler, tok, task, args, np.random.default_rng(step), "cpu")
        if step == 1:  # allocates the gradients and AdamW state
            grpo.update(model, opt, batch, grpo.grpo_loss, args, step, accel, sampler, ref)
            continue
        peak = allocator_peak(lambda: grpo.update(model, opt, batch, grpo.grpo_loss, args, step, accel, sampler, ref))

    size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    out = {"weights": size(model.parameters()), "grads": size(p.grad for p in model.parameters() if p.grad is not None),
           "adamw": size(t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)),
           "ref_model": 0 if isinstance(ref, common.AdaptersOff) else size(ref.parameters()), "update_peak": peak,
           "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
           "prompt": batch["prompt_ids"].shape[1]}
    out["state"] = out["weights"] + out["grads"] + out["adamw"] + out["ref_model"]
    append_rows("lora_memory.csv", "lora_memory", "benchmarks/memory_plan.py", f"smollm2-135m lora_rank={rank}", 0,
                out, f"{COMMAND} --measure-step {rank}")
    return out


def measured_table() -> list[str]:
    """The measured steps (--measure-step) beside the plan's training and optimiser phases for the same setup."""
    from benchmarks._results import by_config_seed

    by, _ = by_config_seed("lora_memory.csv")
    if not by:
        return []
    s = Shape.load(ROOT / ".cache" / "smollm2-135m") if (ROOT / ".cache" / "smollm2-135m").exists() else None
    out = ["Measured on CPU (`--measure-step 0` and `--measure-step 8`): one steady-state GRPO update step of "
           f"SmolLM2-135M in fp32, {MEASURED['prompts_per_step']} prompts x {MEASURED['group_size']} completions of "
           f"{MEASURED['max_new_tokens']} new tokens, micro-batch {MEASURED['micro_batch_size']}, with a KL term. "
           "State: weights, gradients, AdamW state and reference, counted tensor by tensor; the update's peak: the CPU "
           "allocator's, above the state (torch's profiler). Plan: the same setup's training and optimiser phases.",
           "", "| run | trainable params | state MiB | update peak above state MiB | total MiB | plan MiB |",
           "|---|---|---|---|---|---|"]
    for config, seeds in sorted(by.items()):
        m, rank = seeds["0"], int(config.split("=")[1])
        planned = "-"
        if s is not None:
            p = plan(s, Setup(micro=MEASURED["micro_batch_size"], prompt=int(m["prompt"]),
                              new=MEASURED["max_new_tokens"], prompts_per_step=MEASURED["prompts_per_step"],
                              group=MEASURED["group_size"], bf16=False, kl=True, pass_k=0, lora=rank))
            planned = f"{max(p['phase_training'], p['phase_optimiser']) / 2 ** 20:.0f}"
        out.append(f"| {'LoRA rank ' + str(rank) if rank else 'full fine-tuning'} | {m['trainable'] / 1e6:.2f}M | "
                   f"{m['state'] / 2 ** 20:.0f} | {m['update_peak'] / 2 ** 20:.0f} | "
                   f"{(m['state'] + m['update_peak']) / 2 ** 20:.0f} | {planned} |")
    return out


def write_csv(rs: list[dict]) -> None:
    """One row per (model, GPUs, checkpointing, metric), in the long format of benchmarks/_results.py; deterministic
    figures, so the file is rewritten, not appended to."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip() or "unknown"
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    with open(RESULTS / "memory_plan.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["bench", "script", "config", "seed", "metric", "value", "command", "commit", "hardware",
                    "versions", "timestamp"])
        for r in rs:
            for card in CARDS:
                u, p = r[card]["setup"], r[card]["plan"]
                config = (f"{r['model']} gpus={u.gpus} ckpt={int(u.ckpt)} micro={u.micro} prompt={u.prompt} "
                          f"new={u.new} pass_k={u.pass_k} card={card}")
                metrics = {**{k: v for k, v in p.items() if isinstance(v, (int, float))},
                           "max_micro": r[card]["max_micro"]}
                for k, v in metrics.items():
                    w.writerow(["memory_plan", "benchmarks/memory_plan.py", config, 0, k, v, COMMAND, commit,
                                "none (computed from config.json)", f"python {platform.python_version()}", stamp])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a folder with config.json (or the file): print one setup's terms and exit")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--micro", type=int, default=8, help="--micro-batch-size")
    ap.add_argument("--ckpt", action="store_true", help="--grad-checkpointing")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--prompts-per-step", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    ap.add_argument("--logprob-chunk-mb", type=float, default=256.0)
    ap.add_argument("--fsdp-gather", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--pass-k", type=int, default=8)
    ap.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank (0 = full fine-tuning)")
    ap.add_argument("--kl", action="store_true", help="a reference model (--kl-coef > 0)")
    ap.add_argument("--measure-step", type=int, metavar="RANK", help="measure one GRPO step of SmolLM2-135M on CPU "
                    "(full fine-tuning for 0, else LoRA of this rank) into results/lora_memory.csv, and exit")
    args = ap.parse_args()
    if args.measure_step is not None:
        print(json.dumps(measure_step(args.measure_step)))
        return 0
    base = Setup(gpus=args.gpus, micro=args.micro, prompt=args.prompt_tokens, new=args.new_tokens,
                 prompts_per_step=args.prompts_per_step, group=args.group_size, ckpt=args.ckpt, attn=args.attn,
                 chunk_mb=args.logprob_chunk_mb, fsdp_gather=args.fsdp_gather, pass_k=args.pass_k, lora=args.lora_rank,
                 kl=args.kl)
    if args.model:
        s = Shape.load(args.model)
        p = plan(s, base)
        for k, v in p.items():
            print(f"{k:22s} {gb(v) + ' GiB' if isinstance(v, (int, float)) and k != 'params' else v}")
        for card in CARDS:
            print(f"max micro-batch on {card}: {max_micro(s, base, card)}")
        return 0
    rs = rows(base)
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_csv(rs)
    (RESULTS / "memory_plan.md").write_text(render(rs, base))
    print((RESULTS / "memory_plan.md").read_text())
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
