"""algos/sft.py: the prompt is masked out, the loss equals a naive loop, and a short run learns."""
from dataclasses import replace

import numpy as np
import pytest
import torch

import common
from algos import sft


def test_char_tokenizer_roundtrip():
    tok = sft.build_char_tokenizer()
    ids = tok("12+34=")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 7
    assert tok.decode(ids, skip_special_tokens=True) == "12+34="
    assert common.encode_prompts(tok, ["1+1="]) == [tok("1+1=")["input_ids"]]
    assert tok.get_vocab() == common.load_model("tiny-0.6m")[1].get_vocab()  # the shipped models' tokenizer


def test_build_batch_masks_prompt_and_keeps_eos():
    tok = sft.build_char_tokenizer()
    exs = [common.Example("1+2=", "3", "3"), common.Example("10+20:", "30", "0+0=0;1+2=3;=30")]
    ids, attn, loss_mask = sft.build_batch(tok, exs)
    for i, e in enumerate(exs):
        n_p = len(tok(e.prompt)["input_ids"])
        target = ids[i][loss_mask[i] == 1].tolist()
        assert target == tok(e.solution, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert loss_mask[i, :n_p].sum() == 0 and attn[i].sum() == n_p + len(target)


def test_sft_loss_against_loop():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11)
    ids = torch.randint(0, 11, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0]])
    terms = [torch.log_softmax(logits[b, t - 1], -1)[ids[b, t]] for b in range(2) for t in range(1, 6) if mask[b, t]]
    assert torch.allclose(sft.sft_loss(logits, ids, mask), -torch.stack(terms).mean(), atol=1e-6)


def test_new_model_sizes():
    small, tok = sft.new_model("new-small", 0)
    large, _ = sft.new_model("new-large", 0)
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert 0.5e6 < n(small) < 1e6 and 3e6 < n(large) < 8e6 and small.config.vocab_size == len(tok)


def test_sft_learns(tmp_path):
    s = sft.main(sft.Args(steps=60, eval_every=60, eval_examples=300, out_dir=str(tmp_path)))
    # stated margin: 60 supervised steps on add raise tiny-0.6m's held-out accuracy by 5+ points
    assert s["eval_acc_end"] >= s["eval_acc_start"] + 0.05, s


def test_sft_learns_sums_and_reports_pass_k(tmp_path):
    s = sft.main(sft.Args(model="tiny-sums", tasks=["sums"], digits=1, steps=30, eval_every=30, eval_examples=200,
                          max_new_tokens=40, pass_k=4, out_dir=str(tmp_path)))
    # stated margin: 30 supervised steps on the default sums task raise tiny-sums' held-out accuracy by 15+ points
    assert s["eval_acc_end"] >= s["eval_acc_start"] + 0.15, s
    assert s["final_sums5d1_pass@4"] > s["eval_acc_start"], s


def test_tiny_sums_half_solves_the_default_sums_task():
    model, tok = common.load_model("tiny-sums")
    task = common.make_task("sums", 1)  # 5 one-digit operands, as in the model card
    torch.manual_seed(0)
    res = common.evaluate(model, tok, task, task.sample("test", 200, np.random.default_rng(12345)), 40, pass_k=8)
    # the card's figures (300 prompts): 49% greedy, 89% pass@8; RL needs both the misses and the room
    assert 0.3 <= res["acc"] <= 0.6 and res["pass@8"] >= res["acc"] + 0.25, res


def test_sft_from_scratch_saves_loadable_model(tmp_path):
    out = tmp_path / "m"
    sft.main(sft.Args(model="new-small", steps=3, eval_every=3, eval_examples=10, out_dir=str(tmp_path),
                      save_to=str(out)))
    model, tok = common.load_model(str(out))
    assert model.config.num_hidden_layers == 3 and tok.eos_token == "<eos>"


@pytest.mark.parametrize("change,msg", [({"steps": 0}, "positive"), ({"tasks": []}, "at least one"),
                                        ({"tasks": ["nope"]}, "unknown task")])
def test_bad_input(tmp_path, change, msg):
    with pytest.raises(SystemExit, match=msg):
        sft.main(replace(sft.Args(out_dir=str(tmp_path)), **change))
