"""algos/_shard.py: a policy loaded straight into its FSDP2 shards, the weights read once on rank 0. Two gloo processes
measure each rank's host memory against one full fp32 copy of the model, and check what was loaded; the pieces that
need no process group are tested in this one (bf16 by MixedPrecisionPolicy: tests/test_shard_precision.py)."""
import json
import os
import sys

import pytest
import torch

import common
from algos import _shard
from test_sharding import LAUNCH, run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def random_llama(folder, layers=6, hidden=512) -> int:
    """A random Llama with the tiny tokenizer, saved in safetensors files of at most 4 MB; returns its fp32 bytes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder, max_shard_size="4MB")
    common.load_model("tiny-0.6m")[1].save_pretrained(folder)
    return sum(p.numel() for p in model.parameters()) * 4


def test_sharded_load_holds_less_than_one_fp32_copy_per_rank(tmp_path):
    """Two ranks load a random Llama of 79 MiB of fp32 weights (6 layers of width 512, 30 files): the policy alone, then
    with a bf16 reference. Each rank's peak host memory grows by less than one full fp32 copy (a rank holds half the
    weights; rank 0 also one file of the checkpoint at a time; the bf16 reference is a quarter more), while the previous
    way (every rank reading the whole model and deep-copying it for the reference) grows by about two copies: the
    same measurement fails on it. The harness also checks the loaded weights, the reference's bf16 rounding of them and
    the sampler's gathered copy (equal logits to from_pretrained's)."""
    full = random_llama(tmp_path / "model") / 2**20
    env_mmap = {"MALLOC_MMAP_THRESHOLD_": "65536"}  # large blocks go back to the system when freed, between loads
    os.environ.update(env_mmap)
    try:
        run([*LAUNCH, os.path.join("tests", "_sharded_load.py"), str(tmp_path / "model"), str(tmp_path / "out.json")])
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_")
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["full_mb"] == pytest.approx(full)
    print(json.dumps(out))
    for rank in out["ranks"]:
        assert rank["policy"] < 0.8 * full, (rank, full)
        assert rank["with_ref"] < full, (rank, full)
        assert rank["old"] > 1.5 * full, (rank, full)


def test_empty_model_has_no_weights_but_real_buffers_and_the_generation_config():
    model, tok, path = _shard.empty_model("tiny-0.6m", amp=False)
    real, _ = common.load_model("tiny-0.6m")
    assert all(p.is_meta for p in model.parameters()) and tok.padding_side == "left" and tok.pad_token is not None
    assert model.amp_dtype is None and _shard.empty_model("tiny-0.6m", amp=True)[0].amp_dtype == torch.bfloat16
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as from_pretrained gives it
    for (n, b), (m, c) in zip(model.named_buffers(), real.named_buffers(), strict=True):
        assert n == m and not b.is_meta and torch.equal(b, c), n
    assert model.generation_config.eos_token_id == real.generation_config.eos_token_id


def test_materialize_allocates_parameters_and_keeps_buffers():
    model = _shard.empty_model("tiny-0.6m", amp=False)[0]
    buffers = [b.clone() for b in model.buffers()]
    _shard.materialize(model, "cpu")
    assert not any(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), buffers, strict=True))


def test_sampler_of_a_meta_model_keeps_it_empty_until_filled():
    """common.Sampler of a model with no weights (sharded: it holds a full copy): the copy stays on the meta device for
    algos/_shard.py to allocate and fill; a model with weights is copied as before."""
    meta = _shard.empty_model("tiny-0.6m", amp=False)[0]
    copy = common.Sampler(meta, sharded=True).full
    assert all(p.is_meta for p in copy.parameters())
    _shard.materialize(copy, "cpu")  # as load_sharded does, then refresh() fills it: every parameter, tied ones once
    assert len(list(copy.parameters())) == len(list(meta.parameters()))
    real = common.load_model("tiny-0.6m")[0]
    full = common.Sampler(real, sharded=True).full
    assert all(torch.equal(p, q) for p, q in zip(full.parameters(), real.parameters()))


def test_checkpoint_files_of_a_folder():
    assert [f.name for f in _shard.checkpoint_files(common.resolve_model_path("tiny-0.6m"))] == ["model.safetensors"]


class _One:
    num_processes = 1


def test_one_process_sums_and_counts_are_its_own():
    assert _shard.all_ranks_sum({"a": 2.0, "b": 3}, _One()) == {"a": 2.0, "b": 3}
    assert _shard.step_counts(torch.tensor([[1, 1, 0], [1, 0, 0]]), _One()) == (2, 3)


def test_load_sharded_refuses_a_checkpoint_without_safetensors_weights(tmp_path):
    """Rank 0 finds no safetensors file: every rank stops with the same clear message (one process group of one)."""
    common.load_model("tiny-0.6m")[1].save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text((common.MODELS_DIR / "tiny-0.6m" / "config.json").read_text())
    script = ("import sys, torch; sys.path.insert(0, '.'); from algos import _shard\n"
              "torch.distributed.init_process_group('gloo', init_method='tcp://127.0.0.1:29731', "
              "rank=0, world_size=1)\n"
              "m = _shard.materialize(_shard.empty_model(sys.argv[1], False)[0], 'cpu')\n"
              "_shard.broadcast_weights(m, sys.argv[1])\n")
    import subprocess
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and "load safetensors weights on rank 0" in out.stderr and "Traceback" not in out.stderr
