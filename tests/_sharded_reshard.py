"""Two processes (launched by tests/test_sharding.py): a sharded reference scores a batch under no_grad, and
afterwards every parameter is back to its shard (a DTensor): no backward follows to reshard the root's gathered
embeddings, final norm and lm_head, so common.token_logprobs must. Rank 0 writes OUT ("sharded" or the names of the
gathered parameters)."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402


def main(out: str) -> None:
    from accelerate import Accelerator
    from torch.distributed.tensor import DTensor

    accel = Accelerator(cpu=True)
    torch.set_num_threads(1)
    ref = common.shard(common.load_model("tiny-0.6m", "cpu")[0].eval().requires_grad_(False), accel)
    ids, mask = common.left_pad([[1, 12, 40, 13], [1, 9, 14]], 0)
    with torch.no_grad():
        common.token_logprobs(ref, ids, mask, torch.tensor([[7, 8], [9, 2]]), torch.ones(2, 2, dtype=torch.long))
    gathered = [n for n, p in ref.named_parameters() if not isinstance(p, DTensor)]
    if accel.is_main_process:
        Path(out).write_text(" ".join(gathered) or "sharded")


if __name__ == "__main__":
    main(sys.argv[1])
