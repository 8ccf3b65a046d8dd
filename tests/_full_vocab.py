"""What the distillation tests compare the chunked losses with: the previous full-tensor computation, which held
the [B, C, V] log-probs of the student (with its graph) and of the teacher whole, and the chunked `update` of
algos/opd.py (shared by async_opd.py and self_opd.py) run with chunks of a few positions."""
import numpy as np
import torch

import common
from algos import _llm as llm


def full_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature=1.0):
    """Full-vocabulary log-probs at every completion position, [B, C, V], from one decoder pass (as before)."""
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
    logits = model.get_output_embeddings()(hidden[:, prompt_ids.shape[1] - 1:-1]).float() / temperature
    return torch.log_softmax(logits, -1)


def tiny_rollout(n_prompts=4, group=2, seed=0, max_new_tokens=8):
    """tiny-0.6m (student), tiny-5m (teacher) and one student rollout batch on `add` (opd.py's batch keys)."""
    student, tok = common.load_model("tiny-0.6m")
    teacher, _ = common.load_model("tiny-5m")
    task = llm.make_task("add")
    exs = task.sample("train", n_prompts, np.random.default_rng(seed))
    torch.manual_seed(seed)
    ro = common.generate(student, tok, common.encode_prompts(tok, [e.prompt for e in exs]), group, max_new_tokens)
    batch = {k: getattr(ro, k) for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs")}
    assert batch["completion_mask"].sum(1).min() < batch["completion_mask"].shape[1]  # ragged: padding is covered
    return student, teacher, tok, task, exs, batch


def chunked_step(monkeypatch, module, student, teacher, parts, loss_fn, args, ref_model=None, positions=3):
    """(stats, gradient) of module.update with chunks of `positions` positions (the optimiser step replaced by
    reading the gradient)."""
    vocab = student.get_output_embeddings().weight.shape[0]
    monkeypatch.setattr(common, "LOGPROB_CHUNK_MB", positions * 4 * vocab / 2**20)
    assert common.chunk_positions(vocab) == positions
    grads = []

    def keep_gradient(model, *a):
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        return 0.0

    monkeypatch.setattr(module, "optimizer_step", keep_gradient)
    student.zero_grad(set_to_none=True)
    stats = module.update(student, torch.optim.SGD(student.parameters(), lr=0.0), parts, loss_fn, args, 1, teacher,
                          ref_model)
    return stats, grads[0]


def full_gradient(student, loss):
    """The gradient of the previous computation's loss, flattened as chunked_step's."""
    student.zero_grad(set_to_none=True)
    loss.backward()
    g = torch.cat([p.grad.flatten() for p in student.parameters()])
    student.zero_grad(set_to_none=True)
    return g


def assert_close(new, old, what, tol=1e-5):
    new, old = torch.as_tensor(new, dtype=torch.float64), torch.as_tensor(old, dtype=torch.float64)
    err = (new - old).abs().max().item()
    scale = max(1.0, old.abs().max().item())
    assert err <= tol * scale, f"{what}: chunked differs from the full-tensor computation by {err:.3g}"
