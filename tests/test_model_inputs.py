"""What a real model and a real dataset bring before the first step: stop ids from a ChatML template whose end of turn
is not EOS (a base model used with the chat template), over-long dataset prompts dropped when the run starts on the
HF and the vLLM limits alike, and a clear error for a model folder that does not exist."""
import copy
import json

import pytest
import torch

import common
from algos import _llm as llm
from algos import grpo


def chatml(tok):
    """The tiny tokenizer with a ChatML template (Qwen2.5's): turns end with <|im_end|>, EOS is <|endoftext|>."""
    tok = copy.deepcopy(tok)
    tok.add_special_tokens({"eos_token": "<|endoftext|>",
                            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok


def test_stop_ids_include_chatml_end_of_turn_with_a_base_models_eos():
    """A base model's generation config names only <|endoftext|> (Qwen2.5-7B: 151643); its chat template closes the
    assistant's turn with <|im_end|>: the sampler (HF and vLLM: common.eos_ids) stops on both, and the completion mask
    ends at whichever comes first."""
    model, tiny = common.load_model("tiny-0.6m")
    tok = chatml(tiny)
    eos, im_end = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")
    assert eos == tok.eos_token_id and im_end != eos
    base = type("Base", (), {"generation_config": type("GC", (), {"eos_token_id": eos})()})()
    assert common.eos_ids(tok, base) == sorted({eos, im_end})
    ids = torch.tensor([[5, 6, im_end, 7, eos], [5, eos, 6, im_end, 7]])
    assert common._completion_mask(ids, common.eos_ids(tok, base)).tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
    tok.chat_template = None  # no template: the EOS ids alone
    assert common.eos_ids(tok, base) == [eos]


def test_a_missing_model_folder_is_a_clear_error(tmp_path):
    for name in (str(tmp_path / "nope"), "./nope", "runs/grpo/checkpoint"):
        with pytest.raises(SystemExit, match="no such folder"):
            common.load_model(name)
    with pytest.raises(SystemExit, match="could not load model 'not a valid id!'"):
        common.load_model("not a valid id!")


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_over_long_dataset_prompts_leave_the_task_when_the_run_starts(tmp_path, capsys, engine):
    """A JSONL task with prompts of three lengths: the run drops, when it starts, every prompt whose tokens and the
    completion budget exceed the context (the model's 128 positions with HF; --vllm-max-model-len 40 with vLLM, the
    smaller), says how many, and keeps the rest; nothing fails later in the run."""
    rows = [{"prompt": "1+2=" * k, "answer": "3"} for _ in range(10) for k in (1, 9, 40)]  # 5, 37 and 161 tokens
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")  # held out: the first 3, one of each length
    args = grpo.Args(task=f"jsonl:{path}", engine=engine, vllm_max_model_len=40, max_new_tokens=8, eval_examples=4,
                     pass_k=0, eval_hard=False, out_dir=str(tmp_path), threads=1, device="cpu")
    run = llm.Run(args)
    model, tok = common.load_model("tiny-0.6m")
    run.start(model, tok, torch.optim.SGD(model.parameters(), lr=0.0), common.Sampler(model))
    limit = (128 if engine == "hf" else 40) - 8
    lengths = {len(ids) for ids in common.encode_prompts(tok, [e.prompt for e in run.task.train + run.task.test])}
    assert max(lengths) <= limit and min(lengths) == 5
    kept_long = 37 in lengths
    assert kept_long == (engine == "hf")
    dropped = {"train": 9, "test": 1} if engine == "hf" else {"train": 18, "test": 2}
    assert f"dropped prompts longer than {limit} tokens: {dropped}" in capsys.readouterr().out
