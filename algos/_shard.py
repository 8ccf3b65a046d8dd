"""What several processes need beyond common.shard: a policy loaded straight into its FSDP2 shards, and the sums over
ranks that make the step-global normalisers. algos/_llm.py uses it (llm.load_policy, llm.step_counts); the scripts
never import it themselves.

Loading (load_sharded), as torchtitan and TRL load a model for FSDP2:
- every rank builds the model on the meta device (no weights; buffers such as rotary tables are real), shards it
  with common.shard and allocates only its own shard;
- rank 0 alone reads the checkpoint, one safetensors file at a time in its stored dtype, and broadcasts it into
  every rank's shard (set_model_state_dict with full_state_dict and broadcast_from_rank0: one tensor at a time);
- the reference of a KL term is the same skeleton sharded and filled from the policy's shards (a local copy, no
  communication, no second read), stored in bf16 when the run computes in bf16;
- the sampler's full copy (the HF engine) is a meta skeleton allocated on the device and filled by a gather of the
  shards (Sampler.refresh); with vLLM there is none.
No rank ever holds the whole fp32 model: at 7B, rank 0 holds one checkpoint file (about 4 GB of bf16) beside its
shard instead of 30.5 GB of fp32 weights and a deep copy per derived model on every rank. LoRA keeps the plain path
(peft wraps a model with weights, then common.shard).
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402


def empty_model(name: str, amp: bool):
    """(model on the meta device, tokenizer, local path or id) of a tiny-* name, a local folder or a Hugging Face id:
    the config's model with no weights (buffers real), its generation config (the EOS ids), the tokenizer as
    common.load_model sets it up, amp_dtype bf16 when `amp`."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    path = common.resolve_model_path(name)
    try:
        tok, config = AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise SystemExit(f"could not load model {name!r} (a local folder, a Hugging Face id or a tiny-* name): {e}")
    tok.padding_side, tok.pad_token = "left", tok.pad_token or tok.eos_token
    with init_empty_weights(include_buffers=False):  # parameters on the meta device, buffers computed as usual
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # tied input and output embeddings (tie_word_embeddings): one parameter, as from_pretrained has
    try:
        model.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: the one from the config stays
        pass
    model.amp_dtype = torch.bfloat16 if amp else None
    return model, tok, path


def materialize(module, device):
    """Allocate a meta module's parameters on `device` (uninitialised: the caller fills them), keeping its buffers'
    values and its tied parameters tied (to_empty would leave the buffers empty and give each module that shares a
    parameter, such as tied input and output embeddings, its own). A sharded module allocates its own shard only."""
    keep = [b.to(device) for b in module.buffers()]
    places = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                places.setdefault(id(p), []).append((m, name))
    module.to_empty(device=device)
    for (m0, n0), *others in places.values():
        for m, name in others:
            if getattr(m, name) is not getattr(m0, n0):
                setattr(m, name, getattr(m0, n0))
    with torch.no_grad():
        for b, k in zip(module.buffers(), keep):
            b.copy_(k)
    return module


def checkpoint_files(path: str) -> list[Path]:
    """The safetensors files of a local folder, or of a Hugging Face id (downloaded to the cache): rank 0 reads them."""
    if not Path(path).is_dir():
        from huggingface_hub import snapshot_download
        path = snapshot_download(path, allow_patterns=["*.safetensors", "*.json"])
    return sorted(Path(path).glob("*.safetensors"))


def broadcast_weights(model, path: str) -> None:
    """Fill a sharded model (allocated, not initialised) from the checkpoint at `path`, read on rank 0 only, one
    safetensors file at a time, each tensor broadcast and cut into every rank's shard (every rank calls this). Rank 0
    first checks that the files hold every parameter (tied ones excepted) and every rank stops with the same message."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    rank0 = torch.distributed.get_rank() == 0
    files, info = (checkpoint_files(path) if rank0 else []), [None]
    if rank0:
        have = set()
        for f in files:
            with safe_open(str(f), "pt") as r:
                have.update(r.keys())
        info = [(len(files), sorted({n for n, _ in model.named_parameters()} - have))]  # tied: named once
    torch.distributed.broadcast_object_list(info, src=0)
    n_files, missing = info[0]
    if not n_files or missing:
        raise SystemExit(f"{path}: several processes load safetensors weights on rank 0, and " +
                         (f"the files lack {missing[:3]}" if n_files else "there are none (convert the checkpoint "
                          "with save_pretrained, or train on one process)"))
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    for i in range(n_files):
        set_model_state_dict(model, load_file(str(files[i])) if rank0 else {}, options=opts)


def load_sharded(name: str, accel, amp: bool, grad_checkpointing: bool, with_ref: bool, engine=None):
    """(policy sharded with FSDP2 in train mode, tokenizer, sharded frozen reference or None, Sampler) with the
    weights read once, on rank 0 (see the header): what llm.load_policy returns, for full fine-tuning with several
    processes. `amp`: bf16 compute (common.shard's MixedPrecisionPolicy), the reference stored in bf16."""
    model, tok, path = empty_model(name, amp)
    model.train()
    if grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = copy.deepcopy(model).eval().requires_grad_(False) if with_ref else None  # a meta skeleton: no memory
    if ref is not None and amp:
        for p in ref.parameters():  # the parameters only: buffers (rotary frequencies) stay fp32
            p.data = p.data.to(torch.bfloat16)
    sampler = common.Sampler(model, engine, sharded=True)  # the HF engine's full copy: a meta skeleton for now
    model = materialize(common.shard(model, accel), accel.device)
    broadcast_weights(model, path)
    if ref is not None:
        ref = materialize(common.shard(ref, accel), accel.device)
        with torch.no_grad():  # the same layout on every rank: each copies its own shard
            for q, p in zip(ref.parameters(), model.parameters()):
                q.to_local().copy_(p.to_local())
    if sampler.full is not None:
        sampler.full = materialize(sampler.full, "cuda" if torch.cuda.is_available() else "cpu")  # as Sampler places it
        sampler.refresh()  # a gather of the shards, as after every optimiser step
    return model, tok, ref, sampler


def all_ranks_sum(values: dict, accel, device=None) -> dict:
    """{name: sum over all ranks} of this rank's floats (every rank calls it; one process returns them as they are)."""
    if accel.num_processes == 1:
        return dict(values)
    keys = sorted(values)
    t = accel.reduce(torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device), "sum")
    return dict(zip(keys, t.tolist()))


def step_counts(completion_mask: torch.Tensor, accel) -> tuple[int, int]:
    """(sequences, tokens) of one optimiser step over all ranks: the step-global normaliser, so that gradient
    accumulation and data parallelism leave the objective unchanged."""
    c = all_ranks_sum({"seqs": completion_mask.shape[0], "tokens": float(completion_mask.sum())}, accel,
                      completion_mask.device)
    return int(c["seqs"]), int(c["tokens"])
