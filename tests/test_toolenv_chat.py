"""algos/_toolenv.py with a chat model: the template's system, user, tool and assistant turns as token ids, JSON tool
calls (a malformed one answered, never raised), token budgets, and the multi-turn scripts end to end on a tiny random
chat model built here (a character tokenizer with ChatML's special tokens and template, a one-layer Llama)."""
import json

import numpy as np
import pytest
import torch

import common
from algos import _toolenv, echo, hgpo, multiturn_grpo as mt
from algos._toolenv import ERROR_OBS, LookupEnv

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A folder that common.load_model loads: every printable character a token, <|im_start|> and <|im_end|> special
    tokens (<|im_end|> ends a turn and is EOS), the ChatML template, a random one-layer Llama."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + [chr(c) for c in range(32, 127)] + ["\n"])}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tok.add_special_tokens(specials)
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<|im_end|>", pad_token="<pad>",
                                   unk_token="<unk>", padding_side="left",
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHATML
    folder = tmp_path_factory.mktemp("tiny_chat")
    fast.save_pretrained(folder)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=vocab["<|im_end|>"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = vocab["<|im_end|>"]
    model.save_pretrained(folder)
    return folder


@pytest.fixture()
def tok(chat_model):
    return common.load_model(str(chat_model))[1]


class Replies:
    """In place of common.generate: turn k's reply to every context is replies[k] (with the end-of-turn token unless
    it is cut by the budget); the contexts it was given are recorded."""

    def __init__(self, tok, replies):
        self.tok, self.replies, self.calls = tok, replies, []

    def __call__(self, policy, tok, prompts, group_size=1, max_new_tokens=32, temperature=1.0, top_p=1.0,
                 greedy=False):
        text = self.replies[len(self.calls)]
        self.calls.append([list(p) for p in prompts])
        ids = (tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])[:max_new_tokens]
        stopped = ids[-1] == tok.eos_token_id
        shown = tok.decode(ids, skip_special_tokens=True)
        n = len(prompts)
        return common.Rollout(*common.left_pad(prompts, tok.pad_token_id), torch.tensor([ids] * n),
                              torch.ones(n, len(ids), dtype=torch.long), torch.full((n, len(ids)), -0.5),
                              ["stop" if stopped else "length"] * n, [shown] * n)


def test_tool_calls_parse_and_malformed_ones_are_answered_not_raised():
    for action in ("#b", "!13"):
        assert _toolenv.parse_tool_call("I will call " + _toolenv.tool_call(action)) == (action, None)
    assert _toolenv.parse_tool_call('<tool_call>{"name": "answer", "arguments": {"value": "7"}}</tool_call>') == \
        ("!7", None)
    for text, why in [("#b", "no <tool_call>"), ("<tool_call>{name: lookup}</tool_call>", "not JSON"),
                      ('<tool_call>["lookup"]</tool_call>', "an object"),
                      ('<tool_call>{"name": "lookup"}</tool_call>', "an object"),
                      ('<tool_call>{"name": "search", "arguments": {"key": "b"}}</tool_call>', "unknown tool"),
                      ('<tool_call>{"name": "answer", "arguments": {"value": true}}</tool_call>', "bad arguments"),
                      ('<tool_call>{"name": "lookup", "arguments": {"key": 3}}</tool_call>', "bad arguments")]:
        action, error = _toolenv.parse_tool_call(text)
        assert action == "" and why in error, text
    env = LookupEnv()
    env.reset(5)
    assert env.step("")[0] == ERROR_OBS  # what a malformed call sends to the environment


def test_chat_turns_are_the_templates_conversation(tok, monkeypatch):
    """After a lookup, a malformed reply and another lookup (the turn limit, 3, ends the episode), the context is
    exactly the template's rendering of the conversation: system (protocol and tool schemas), user (the prompt), then
    assistant / tool turns, the next assistant turn opened after each; the replies (with their end-of-turn token) are
    the action tokens, everything the template adds is observation tokens."""
    env = LookupEnv(max_turns=3)
    prompt_text = env.reset(11)
    q = env.query
    replies = [_toolenv.tool_call(f"#{q[0]}"), "the answer is 9", _toolenv.tool_call(f"#{q[1]}")]
    fake = Replies(tok, replies)
    monkeypatch.setattr(common, "generate", fake)
    prompts = _toolenv.encode_prompts(tok, [prompt_text])
    ep = _toolenv.play(None, tok, [env], prompts, 200)[0]
    assert ep.actions == [f"#{q[0]}", "", f"#{q[1]}"] and ep.replies == replies and ep.reward == 0.0
    assert ep.observations == [f"={env.store[q[0]]};", f"{ERROR_OBS} no <tool_call>...</tool_call> in the reply",
                               "end;"]
    messages = [{"role": "system", "content": _toolenv.SYSTEM_PROMPT}, {"role": "user", "content": prompt_text}]
    for k, (reply, obs) in enumerate(zip(replies, ep.observations)):
        assert fake.calls[k][0] == list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                                return_dict=False))
        messages += [{"role": "assistant", "content": reply}, {"role": "tool", "content": obs}]
    full = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tok.decode(prompts[0] + ep.ids) == full
    acts = tok.decode([i for i, k in zip(ep.ids, ep.kind) if k == 1])
    assert acts == "<|im_end|>".join(replies) + "<|im_end|>"
    assert json.dumps(_toolenv.TOOLS) in tok.decode(prompts[0])


def test_token_budgets_cut_observations_and_end_episodes(tok, monkeypatch):
    """max_obs_tokens cuts a tool response (`=V;` -> `=V`, counted); max_context_tokens ends the episode with the
    limit's observation and reward (counted); a reply cut by its own budget gets the end-of-turn token before the
    tool turn (as observation tokens)."""
    env = LookupEnv(max_obs_tokens=2)
    env.reset(11)
    call = _toolenv.tool_call(f"#{env.query[0]}")
    monkeypatch.setattr(common, "generate", Replies(tok, [call, _toolenv.tool_call(f"!{env.answer}")]))
    ep = _toolenv.play(None, tok, [env], _toolenv.encode_prompts(tok, [env.transcript]), 200)[0]
    assert ep.reward == 1.0 and ep.obs_truncated == 1
    assert f"tool\n={env.store[env.query[0]]}<|im_end|>" in tok.decode(ep.ids)
    prompts = _toolenv.encode_prompts(tok, [LookupEnv().reset(11)])
    env = LookupEnv(max_context_tokens=len(prompts[0]) + len(tok(call)["input_ids"]) + 10)
    env.reset(11)
    monkeypatch.setattr(common, "generate", Replies(tok, [call]))
    ep = _toolenv.play(None, tok, [env], prompts, 200)[0]
    assert ep.context_limited and ep.env.done and ep.reward == 0.0 and ep.observations == ["end;"]
    env = LookupEnv(max_turns=1)
    env.reset(11)
    monkeypatch.setattr(common, "generate", Replies(tok, [call]))
    ep = _toolenv.play(None, tok, [env], prompts, 10)[0]
    assert ep.truncated == 1 and ep.kind[10] == 2 and ep.ids[10] == tok.eos_token_id


def test_the_character_world_has_the_trivial_template():
    """The shipped tiny-toolenv has no chat template: prompts, actions and observations are its raw tokens."""
    tok = common.load_model("tiny-toolenv")[1]
    assert not _toolenv.chat_mode(tok)
    assert _toolenv.encode_prompts(tok, ["b+d+a?"]) == common.encode_prompts(tok, ["b+d+a?"])
    assert _toolenv.observation_ids(tok, "=4;", False) == (tok("=4;", add_special_tokens=False)["input_ids"], False)
    assert _toolenv.env_action(tok, "#b") == ("#b", None)


@pytest.mark.parametrize("mod", [mt, echo, hgpo], ids=["multiturn_grpo", "echo", "hgpo"])
def test_scripts_run_a_chat_model_end_to_end(chat_model, mod, tmp_path):
    """One rollout batch and update of each multi-turn script on the tiny random chat model: chat-template turns, tool
    calls (the random replies are malformed, so every turn is answered with the error), token budgets, finite losses;
    the observation tokens carry the template's turns and stay out of the policy loss, and the behaviour log-probs
    recorded turn by turn equal the trainer's on every action token (1e-4, fp32)."""
    args = mod.Args(model=str(chat_model), steps=1, prompts_per_step=2, group_size=2, max_new_tokens=12,
                    eval_every=1, eval_examples=2, env_ce_examples=2, max_context_tokens=1200, max_obs_tokens=40,
                    threads=1, device="cpu", out_dir=str(tmp_path))
    s = mod.main(args)
    assert np.isfinite(s["train_reward_last"]) and s["gen_tokens"] > 0
    model, tok = common.load_model(str(chat_model))
    batch = mod.rollout(model, tok, mod.make_env(args), args, np.random.default_rng(0), torch.device("cpu"))
    obs_text = tok.decode(batch["completion_ids"][batch["obs_mask"].bool()].tolist())
    assert "<|im_start|>tool" in obs_text and "<|im_start|>assistant" in obs_text and "err;" in obs_text
    assert (batch["action_mask"] * batch["obs_mask"]).sum() == 0
    with torch.no_grad():  # what the sampler saw turn by turn is what the trainer scores (chat turns included)
        lp = common.token_logprobs(model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                                   batch["completion_mask"], args.temperature)
    assert (lp - batch["logprobs"])[batch["action_mask"].bool()].abs().max() < 1e-4


def test_calculator_tool_calls_parse_and_malformed_ones_are_answered():
    env = _toolenv.CalculatorEnv()
    for action in ("#(56+-33)-84", "!-61", "!3.5"):
        assert env.parse_tool_call("so " + env.tool_call(action)) == (action, None)
    assert env.parse_tool_call('<tool_call>{"name": "calculator", "arguments": {"expression": "( 2 + 3 ) * 4"}}'
                               '</tool_call>') == ("#(2+3)*4", None)
    assert env.parse_tool_call('<tool_call>{"name": "answer", "arguments": {"value": -7}}</tool_call>') == ("!-7", None)
    for text, why in [("the answer is 3", "no <tool_call>"), ("<tool_call>{calculator}</tool_call>", "not JSON"),
                      ('<tool_call>{"name": "calculator"}</tool_call>', "an object"),
                      ('<tool_call>{"name": "lookup", "arguments": {"key": "b"}}</tool_call>', "unknown tool"),
                      ('<tool_call>{"name": "calculator", "arguments": {"expression": 3}}</tool_call>', "bad arguments"),
                      ('<tool_call>{"name": "answer", "arguments": {"value": "three"}}</tool_call>', "bad arguments"),
                      ('<tool_call>{"name": "answer", "arguments": {"value": true}}</tool_call>', "bad arguments")]:
        action, error = env.parse_tool_call(text)
        assert action == "" and why in error, text
    assert json.dumps(_toolenv.CALC_TOOLS) in env.system_prompt and env.system_prompt != _toolenv.SYSTEM_PROMPT


def test_calculator_env_plays_through_the_chat_template(tok, monkeypatch):
    """A malformed reply, then the expert's calculator call and answer as JSON tool calls: the error observation says
    what is wrong, the calculator's value comes back as a tool turn, the answer earns reward 1, and the context is the
    template's rendering of the conversation under the calculator's system prompt."""
    env = _toolenv.CalculatorEnv()
    question = env.reset(11)
    replies = ['<tool_call>{"name": "calculator", "arguments": {"expression": "2 ** 99"}}</tool_call>',
               "I think it is 4", env.tool_call("#" + env.expression), env.tool_call(f"!{env.answer}")]
    fake = Replies(tok, replies)
    monkeypatch.setattr(common, "generate", fake)
    prompts = _toolenv.encode_prompts(tok, [question], env.system_prompt)
    ep = _toolenv.play(None, tok, [env], prompts, 200)[0]
    assert ep.actions == ["#2**99", "", "#" + env.expression, f"!{env.answer}"] and ep.reward == 1.0
    assert ep.observations == [ERROR_OBS, f"{ERROR_OBS} no <tool_call>...</tool_call> in the reply",
                               f"={env.answer};", ""]
    messages = [{"role": "system", "content": _toolenv.CALC_SYSTEM_PROMPT}, {"role": "user", "content": question}]
    for reply, obs in zip(replies[:3], ep.observations):
        messages += [{"role": "assistant", "content": reply}, {"role": "tool", "content": obs}]
    text = tok.decode(prompts[0] + ep.ids)
    assert text == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) + replies[3] + \
        "<|im_end|>"


def test_multiturn_grpo_runs_the_calculator_env_on_a_chat_model(chat_model, tmp_path):
    """--env calc end to end on the tiny random chat model: one rollout batch and update, the held-out evaluation;
    the rollouts' contexts carry the calculator's system prompt; the lookup's own flags are refused."""
    args = mt.Args(model=str(chat_model), env="calc", steps=1, prompts_per_step=2, group_size=2, max_new_tokens=12,
                   eval_every=1, eval_examples=2, env_ce_examples=2, max_context_tokens=1500, max_obs_tokens=40,
                   threads=1, device="cpu", out_dir=str(tmp_path))
    s = mt.main(args)
    assert np.isfinite(s["train_reward_last"]) and s["gen_tokens"] > 0
    model, tok = common.load_model(str(chat_model))
    env = mt.make_env(args)
    assert isinstance(env, _toolenv.CalculatorEnv)
    batch = mt.rollout(model, tok, env, args, np.random.default_rng(0), torch.device("cpu"))
    assert "calculator" in tok.decode(batch["prompt_ids"][0][batch["prompt_mask"][0].bool()].tolist())
    assert (batch["action_mask"] * batch["obs_mask"]).sum() == 0 and batch["obs_mask"].sum() > 0
    with pytest.raises(SystemExit, match="--n-keys"):
        mt.check_args(mt.Args(env="calc", n_keys=5))
