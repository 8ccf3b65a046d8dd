"""Token log-probs and one backward of the tiny policy on a fixed batch, in three precisions (launched by
tests/test_shard.py):

    python tests/_sharded_mp.py OUT                                  # one process: fp32, and bf16 autocast
    accelerate launch --multi_gpu --num_processes 2 ... tests/_sharded_mp.py OUT   # two ranks: FSDP2 bf16 policy

The two-rank run shards the policy with --dtype bf16 (common.shard: MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32), no autocast) and each rank scores half of the batch. Rank 0 writes OUT/<mode>.safetensors with
the log-probs of the whole batch ("lp"), the gradient of every parameter (gathered) and, for the sharded run, what a
linear layer saw in the forward ("seen": 1 when its weight was bf16) and the dtypes of the stored parameters, their
gradients and the log-probs (1 when fp32).
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402


def batch():
    g = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(3, 99, (int(n),), generator=g).tolist() for n in (4, 6, 5, 7, 3, 6, 4, 5)]
    ids, mask = common.left_pad(prompts, 0)
    comp = torch.randint(3, 99, (8, 10), generator=g)
    cmask = (torch.arange(10)[None] < torch.tensor([10, 7, 9, 4, 10, 8, 6, 10])[:, None]).long()
    adv = torch.randn(8, generator=g)
    return ids, mask, comp, cmask, adv


def score(model, rows):
    ids, mask, comp, cmask, adv = (t[rows] for t in batch())
    lp = common.token_logprobs(model, ids, mask, comp, cmask, share_prompts=False)
    (-(lp * adv[:, None]).sum() / 8).backward()  # the whole batch's normaliser: gradients summed over ranks
    return lp.detach()


def grads(model):
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).float()
            for n, p in model.named_parameters()}


def main(out: str) -> None:
    from accelerate import Accelerator
    from safetensors.torch import save_file

    accel = Accelerator(cpu=True)
    torch.set_num_threads(1)
    Path(out).mkdir(parents=True, exist_ok=True)
    if accel.num_processes == 1:
        for mode, dtype in (("fp32", "fp32"), ("autocast", "bf16")):
            model = common.load_model("tiny-0.6m", "cpu", dtype)[0].train()
            save_file({"lp": score(model, slice(None)), **grads(model)}, f"{out}/{mode}.safetensors")
        return
    model = common.shard(common.load_model("tiny-0.6m", "cpu", "bf16")[0].train(), accel)
    seen = []
    linear = model.model.layers[0].self_attn.q_proj
    linear.register_forward_hook(lambda m, a, o: seen.append(float(m.weight.dtype == torch.bfloat16)))
    half = 8 // accel.num_processes
    lp = score(model, slice(accel.process_index * half, (accel.process_index + 1) * half))
    parts = [None] * accel.num_processes
    torch.distributed.all_gather_object(parts, lp)
    fp32 = [p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters()] + [
        lp.dtype == torch.float32]
    g = grads(model)
    if accel.is_main_process:
        save_file({"lp": torch.cat(parts), "seen": torch.tensor(seen), "fp32": torch.tensor(fp32).float(), **g},
                  f"{out}/sharded.safetensors")


if __name__ == "__main__":
    main(sys.argv[1])
