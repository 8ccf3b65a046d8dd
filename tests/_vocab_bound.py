"""Test helper: the largest tensor a call creates whose last dimension is the vocabulary (a block of logits,
log-probs or probabilities), parameters and their views excluded. A path that never holds more than one chunk of
[positions x vocab] shows at most chunk x vocab elements; one that builds [rows x length x vocab] shows all of it."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LargestVocabTensor(TorchDispatchMode):
    def __init__(self, model):
        super().__init__()
        self.vocab = model.get_output_embeddings().weight.shape[0]
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab and t.is_floating_point() \
                    and t.untyped_storage().data_ptr() not in self.params:
                self.numel = max(self.numel, t.numel())
        return out


def chunk_mb(model, positions: int) -> float:
    """The chunk budget (MiB of fp32 logits) that holds `positions` positions of this model's vocabulary."""
    return positions * 4 * model.get_output_embeddings().weight.shape[0] / 2**20
