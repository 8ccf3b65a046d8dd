"""benchmarks/memory_plan.py against real models on CPU: parameter counts by numel, AdamW's state after a step, the
bytes autograd saves (to the byte), and the CPU allocator's peak over a forward + backward of the log-prob path."""
import inspect
import json

import pytest
import torch

import common
from benchmarks import memory_plan as mp

TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def tiny_model(kind: str, attn: str = "sdpa", **over):
    """A small Llama (GQA, biases on attention and MLP) or Qwen2 (q/k/v biases, tied embeddings), fp32, train mode."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        cfg = LlamaConfig(**{**TINY, "attention_bias": True, "mlp_bias": True, **over}, attn_implementation=attn)
        model = LlamaForCausalLM(cfg)
    else:
        cfg = Qwen2Config(**{**TINY, "tie_word_embeddings": True, **over}, attn_implementation=attn)
        model = Qwen2ForCausalLM(cfg)
    return model.train(), mp.Shape.from_config(json.loads(cfg.to_json_string()))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_parameter_shapes_and_count_match_the_model(kind):
    model, shape = tiny_model(kind)
    assert mp.param_shapes(shape) == [tuple(p.shape) for p in model.parameters()]
    assert mp.n_params(shape) == sum(p.numel() for p in model.parameters())
    plain, shape = tiny_model(kind, attention_bias=False, mlp_bias=False) if kind == "llama" else (model, shape)
    assert mp.n_params(shape) == sum(p.numel() for p in plain.parameters())


def test_shipped_configs_count_like_the_models_they_describe():
    """Each shipped config.json, built by transformers on the meta device (no memory), has the plan's parameters;
    the counts are the published ones (0.49B, 1.54B, 7.62B, 8.03B)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    published = {"Qwen2.5-0.5B": 0.49e9, "Qwen2.5-1.5B": 1.54e9, "Qwen2.5-7B": 7.62e9, "Llama-3.1-8B": 8.03e9}
    for name in mp.MODELS:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(mp.CONFIGS / name))
        shape = mp.Shape.load(mp.CONFIGS / name)
        assert mp.n_params(shape) == sum(p.numel() for p in model.parameters()), name
        assert abs(mp.n_params(shape) - published[name]) < 0.006e9, name


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_adamw_state_bytes_equal_torch_after_one_step(kind):
    model, shape = tiny_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.randint(0, 512, (2, 8))).logits.float().pow(2).mean().backward()
    opt.step()
    state = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
    assert mp.adamw_state_bytes(shape) == sum(t.numel() * t.element_size() for t in state)


def test_shards_follow_fsdp2_row_split():
    """FSDP2 splits dim 0 as torch.chunk does; the plan counts rank 0's (the largest) shard."""
    for shape in [(151936, 896), (7, 3), (5,)]:
        for n in (2, 8):
            assert mp.shard_numel(shape, n) == torch.empty(shape, device="meta").chunk(n)[0].numel()


def saved_bytes(model, ids, mask, bf16: bool) -> tuple[int, int]:
    """(activation bytes, weight-cast bytes) autograd saves in the decoder's forward: unique storages seen by the
    saved-tensor hooks, parameters left out, bf16 copies of parameters counted apart (autocast's weight casts)."""
    seen, params = {}, {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() > 0}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = (st.nbytes(), tuple(t.shape), t.dtype)
        return t

    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        model.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=pos)
    act = casts = 0
    for ptr, (n, shp, dt) in seen.items():
        if ptr in params:
            continue
        if dt == torch.bfloat16 and (shp in shapes or shp[::-1] in shapes):  # addmm saves weight.t()
            casts += n
        else:
            act += n
    return act, casts


@pytest.mark.parametrize("kind,attn,bf16", [("llama", "sdpa", False), ("llama", "sdpa", True),
                                            ("llama", "eager", False), ("llama", "eager", True),
                                            ("qwen2", "sdpa", True)])
def test_saved_activations_match_the_model_to_the_byte(kind, attn, bf16):
    """The header's per-layer terms, summed, are exactly what autograd keeps (left padding: a mask, as in GRPO);
    under autocast every linear weight of the decoder is also kept as a bf16 copy."""
    model, shape = tiny_model(kind, attn)
    M, L = 6, 40
    ids, mask = torch.randint(0, 512, (M, L)), torch.ones(M, L, dtype=torch.long)
    mask[:3, :7] = 0
    act, casts = saved_bytes(model, ids, mask, bf16)
    want = (shape.layers * mp.layer_saved_bytes(shape, L, bf16, attn) + mp.model_saved_bytes(shape, bf16)) * M * L
    assert act == want
    layer_weights = sum(mp.numel(p) for p in mp.layer_param_shapes(shape) if len(p) == 2)
    assert casts == (2 * shape.layers * layer_weights if bf16 else 0)


def test_allocator_peak_ignores_frees_of_memory_allocated_before():
    """A tensor from before the window freed inside it (as the garbage collector may do at any moment) must not lower
    the peak: only what fn() itself allocates counts."""
    old = [torch.ones(1 << 20)]  # 4 MiB allocated before the window

    def fn():
        old.clear()  # frees the 4 MiB inside the window
        new = torch.ones(1 << 18)  # 1 MiB
        del new

    assert mp.allocator_peak(fn) == 4 * (1 << 18)


# The plan models the backward's transient gradients as two intermediate-wide and two residual-wide vectors per
# token and the log-prob chunks as 3 (forward) / 4 (backward) chunk-sized buffers: estimates of what autograd holds
# at its worst moment, not a count. On these shapes they are a fifth to a third of the peak, so the plan is asked
# to be within 25% of the measured peak; the saved tensors themselves are checked to the byte above.
FACTOR = 1.25


@pytest.mark.parametrize("attn,ckpt,bf16", [("sdpa", False, False), ("sdpa", True, False), ("eager", False, False),
                                            ("sdpa", False, True), ("sdpa", True, True)])
def test_activation_peak_within_a_factor_of_the_cpu_allocator(attn, ckpt, bf16):
    """One micro-batch of the training forward + backward through common.token_logprobs, with gradients already
    allocated (as at a steady-state step): the allocator's peak against the plan's. fp32 is the CPU path; bf16 runs
    CPU autocast, which casts and caches like CUDA's (the GPU path), so the weight-cast terms are measured too."""
    model, shape = tiny_model("llama", attn, vocab_size=4096)
    model.amp_dtype = torch.bfloat16 if bf16 else None  # what common.load_model sets: common.autocast reads it
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    M, P, C, chunk_mb = 8, 24, 72, 0.25  # 16 positions per chunk of fp32 logits: 36 chunks
    prompt, comp = torch.randint(0, 4096, (M, P)), torch.randint(0, 4096, (M, C))
    pmask, cmask = torch.ones(M, P, dtype=torch.long), torch.ones(M, C, dtype=torch.long)

    # common.token_logprobs sizes its chunks in MiB and recomputes each in the backward; the plan also models the
    # previous path (chunks of 4096 positions, every chunk's graph kept), which this checks while that is common's
    recompute = "chunk_mb" in inspect.signature(common.token_logprobs).parameters
    kw = {"chunk_mb": chunk_mb} if recompute else {}

    def step():
        lp, ent = common.token_logprobs(model, prompt, pmask, comp, cmask, with_entropy=True, **kw)
        (-lp.sum() / (M * C)).backward()

    step()  # gradients exist from here on, as between two steps of a run
    measured = mp.allocator_peak(step)
    setup = mp.Setup(gpus=1, micro=M, prompt=P, new=C, ckpt=ckpt, bf16=bf16, attn=attn, chunk_mb=chunk_mb,
                     logprob_path="recompute" if recompute else "legacy")
    planned = mp.plan(shape, setup)["train_extra"]
    assert measured / FACTOR <= planned <= measured * FACTOR, (planned, measured)
