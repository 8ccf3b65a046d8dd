"""Two processes (tests/_sharded_update.py's reshard job, or launched by itself): the reference of a bf16 run, loaded
into its shards by algos/_shard.load_sharded, scores a batch under no_grad, and afterwards every parameter is back to
its shard (a DTensor) and stored in bf16: no backward follows to reshard the root's gathered embeddings, final norm
and lm_head, so common.token_logprobs must (the root's reshard()). Rank 0 writes OUT: "sharded bf16", or the names of
the gathered parameters and the dtypes found."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402
from algos import _shard  # noqa: E402


class StandIn:
    """An engine that never runs: no sampler copy to build."""


def main(out: str) -> None:
    from accelerate import Accelerator
    from torch.distributed.tensor import DTensor

    accel = Accelerator(cpu=True)
    torch.set_num_threads(1)
    ref = _shard.load_sharded("tiny-0.6m", accel, True, False, True, StandIn())[2]
    ids, mask = common.left_pad([[1, 12, 40, 13], [1, 9, 14]], 0)
    with torch.no_grad():
        common.token_logprobs(ref, ids, mask, torch.tensor([[7, 8], [9, 2]]), torch.ones(2, 2, dtype=torch.long))
    gathered = [n for n, p in ref.named_parameters() if not isinstance(p, DTensor)]
    dtypes = sorted({str(p.dtype) for p in ref.parameters()})
    if accel.is_main_process:
        found = " bf16" if dtypes == ["torch.bfloat16"] else f" {dtypes}"
        Path(out).write_text((" ".join(gathered) or "sharded") + found)


if __name__ == "__main__":
    main(sys.argv[1])
