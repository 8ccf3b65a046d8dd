"""Two processes (launched by tests/test_shard.py): a model loaded into its FSDP2 shards by algos/_shard.load_sharded,
each rank's host memory measured, then what was loaded checked.

    accelerate launch --multi_gpu --num_processes 2 ... tests/_sharded_load.py FOLDER OUT

FOLDER holds a random Llama (tens of MB of fp32 weights, in several safetensors files; the test makes it). Each rank
measures the growth of its peak resident memory (VmHWM, reset through /proc/self/clear_refs; without that, the
lifetime peak ru_maxrss, an upper bound) over three loads, one after the other, after one unmeasured load (the
modules it imports, the process group's first collectives: paid once per process, not per model):
- "policy": the policy alone (a stand-in engine, as with vLLM: no sampler copy);
- "with_ref": the policy and a reference (bf16 compute: the reference stored in bf16);
- "old": the previous way, every rank reading the whole fp32 model, deep-copying it for the reference, sharding both.
Then (not measured) the policy, its reference and the HF sampler's gathered full copy are compared with the files:
equal weights, and the copy's logits equal those of from_pretrained (its buffers, the rotary tables, were kept).
Rank 0 writes OUT: {"full_mb": fp32 bytes of the model, "ranks": [{"policy": MB, "with_ref": MB, "old": MB}, ...]}.
"""
import copy
import gc
import json
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
from algos import _shard  # noqa: E402


class StandIn:
    """An engine that never runs: the Sampler keeps no full copy, as with --engine vllm."""


def _status(key: str) -> float:
    """A /proc/self/status field in MB (0 where there is no /proc)."""
    try:
        line = next(x for x in open("/proc/self/status") if x.startswith(key + ":"))
    except (OSError, StopIteration):
        return 0.0
    return int(line.split()[1]) / 1024


def measure(load) -> float:
    """MB by which this process's peak resident memory rose above its resident memory before `load()`."""
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak, to the current VmRSS
        peak = lambda: _status("VmHWM")  # noqa: E731
    except OSError:
        peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # noqa: E731 (Linux: kB)
    before = _status("VmRSS")
    out = load()
    grown = peak() - before
    del out
    gc.collect()
    return grown


def old_way(folder, accel):
    model = common.load_model(folder, "cpu", "bf16")[0]
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    return common.shard(model, accel), common.shard(ref, accel)


def main(folder: str, out: str) -> None:
    from accelerate import Accelerator
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    accel = Accelerator(cpu=True)
    torch.set_num_threads(1)
    measure(lambda: _shard.load_sharded(folder, accel, True, False, False, StandIn()))  # once: imports, process groups
    mine = {"policy": measure(lambda: _shard.load_sharded(folder, accel, True, False, False, StandIn())),
            "with_ref": measure(lambda: _shard.load_sharded(folder, accel, True, False, True, StandIn())),
            "old": measure(lambda: old_way(folder, accel))}
    ranks = [None] * accel.num_processes
    torch.distributed.all_gather_object(ranks, mine)

    model, _, ref, sampler = _shard.load_sharded(folder, accel, True, False, True)  # the HF engine: a full copy
    files = {k: v for f in sorted(Path(folder).glob("*.safetensors")) for k, v in load_file(f).items()}
    copied = dict(sampler.full.named_parameters())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.dtype == torch.float32 and torch.equal(p.full_tensor(), files[name]), name
        assert q.dtype == torch.bfloat16 and torch.equal(q.full_tensor(), files[name].bfloat16()), name
        assert torch.equal(copied[name], files[name]), name
    ids = torch.tensor([[1, 5, 9, 200, 7], [3, 3, 8, 1, 0]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(ids).logits
        assert torch.allclose(sampler.full(ids).logits, want, atol=1e-5)
    if accel.is_main_process:
        full_mb = sum(v.numel() for v in files.values()) * 4 / 2**20
        Path(out).write_text(json.dumps({"full_mb": full_mb, "ranks": ranks}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
