"""A small multi-turn text environment that ships with the repository: a key-value store the policy must query.

Each episode hides a store of `n_keys` letter keys holding `digits`-digit values and asks for the sum of `n_query`
of them. The prompt names the keys only (`b+d+a?`); the values reach the policy through the environment's answers,
so it has to act, read what the environment says, and act again:

    b+d+a?  #b  =4;  #d  =7;  #a  =2;  !13        (prompt, then action / observation turns, then the answer)

Actions (one per turn, each ended by EOS in token space):
    #k    look key k up              -> observation `=V;` (the value)
    !N  or  !X+Y=N                   -> the episode ends; reward 1 if N is the sum, else 0 (X+Y= is an optional
                                        scratchpad, not checked; the expert answers `!N`)
    anything else, or a key that is not in the store -> the error observation `err;` (never an exception)
Limits, each ending the episode with reward LIMIT_REWARD = 0 and the observation `end;`:
    the turn limit   `max_turns` actions without an answer
    the context limit the transcript (prompt + actions + observations, in characters) would pass `max_context`
    token budgets    (play's, 0 = none) the context in tokens would pass `max_context_tokens`; an observation longer
                     than `max_obs_tokens` tokens is cut instead (the episode goes on); both counted per episode

Chat models: with a tokenizer that has a chat template, an episode is a conversation. The first context is the
template's system turn (the protocol and the tool schemas, TOOLS) and user turn (the prompt) with the assistant turn
opened; an action is the hermes-style tool call in the reply, `<tool_call>{"name": "lookup", "arguments": {"key":
"b"}}</tool_call>` for `#b` and `{"name": "answer", "arguments": {"value": 13}}` for `!13` (parse_tool_call); a
malformed call is answered `err;` and what is wrong with it, never an exception. Each observation is rendered through
the template as a tool turn (a user turn where the template has no tool role) followed by the opened assistant turn,
and appended as token ids (tool_turn, observation_ids): the policy loss never sees them. A tokenizer without a
template (the shipped character world) plays raw text: the trivial template, and the same tokens as before.

`reset(seed)` is deterministic in the seed. Splits (`split=`): "episode" (the default) holds an episode out when a
hash of it (store and query) is 0 mod 10, so training never plays a held-out episode, but the same visible prompt
(`b+d+a?`) occurs in both with other values; "prompt" hashes the visible prompt alone (0 -> test, 1 -> validation,
the rest training), so no held-out or validation prompt is ever seen in training. The state is the transcript, so
exact stepwise values are defined for any policy, and `expert_action` gives the shortest solution (the SFT traces).

Shared by algos/sft.py (traces, per-turn accuracy of the shipped `tiny-toolenv`), algos/multiturn_grpo.py,
algos/echo.py and algos/hgpo.py: the environment, the turn-by-turn episode runner `play` (batched generation through
`common.generate`, observation tokens appended to each context), the chat-template turns, and the held-out evaluation.
"""
from __future__ import annotations

import copy
import hashlib
import json
import re
import string
from dataclasses import dataclass, field

import numpy as np
import torch

import common
from algos import _llm as llm

LIMIT_REWARD = 0.0  # reward of an episode ended by the turn or the context limit (and of a wrong answer)
ERROR_OBS = "err;"
END_OBS = "end;"


class LookupEnv:
    """gymnasium-like: `reset(seed) -> observation` (the prompt), `step(action_text) -> (observation, reward, done)`."""

    def __init__(self, n_keys: int = 4, digits: int = 1, max_turns: int = 5, max_context: int = 40, n_query: int = 3,
                 split: str = "episode", max_context_tokens: int = 0, max_obs_tokens: int = 0):
        if not 2 <= n_query <= n_keys <= 26 or not 1 <= digits <= 4 or max_turns < 1 or max_context < 8:
            raise ValueError(f"LookupEnv needs 2 <= n_query <= n_keys <= 26, 1 <= digits <= 4, max_turns >= 1, "
                             f"max_context >= 8; got {n_query}, {n_keys}, {digits}, {max_turns}, {max_context}")
        if split not in ("episode", "prompt"):
            raise ValueError(f"LookupEnv split must be 'episode' or 'prompt', got {split!r}")
        if max_context_tokens < 0 or max_obs_tokens < 0:
            raise ValueError("LookupEnv token budgets must be >= 0 (0 = none)")
        # token budgets, applied by play(): the whole context (prompt, actions, observations) and one tool response
        self.max_context_tokens, self.max_obs_tokens = max_context_tokens, max_obs_tokens
        self.n_keys, self.digits, self.max_turns, self.max_context = n_keys, digits, max_turns, max_context
        self.n_query, self.name, self.split = n_query, f"lookup{n_query}of{n_keys}d{digits}", split
        self.done, self.transcript = True, ""

    @staticmethod
    def episode(seed: int, n_keys: int = 4, digits: int = 1, n_query: int = 3) -> tuple[dict, tuple]:
        """(store, queried keys) of episode `seed`: a pure function of its arguments."""
        rng = np.random.default_rng([7919, int(seed)])
        keys = rng.choice(list(string.ascii_lowercase[:8 if n_keys <= 8 else 26]), n_keys, replace=False)
        values = rng.integers(0, 10 ** digits, size=n_keys)
        store = {str(k): int(v) for k, v in zip(keys, values)}
        return store, tuple(str(k) for k in rng.choice(keys, n_query, replace=False))

    def split_of(self, seed: int) -> str:
        """'train', 'val' or 'test'. split='episode': test when a hash of the episode (store and query) is 0 mod 10,
        else train (no validation split). split='prompt': the hash of the visible prompt (the queried keys) alone,
        0 -> test, 1 -> val, else train, so no held-out or validation prompt ever occurs in training."""
        store, query = self.episode(seed, self.n_keys, self.digits, self.n_query)
        if self.split == "prompt":
            return {0: "test", 1: "val"}.get(int(hashlib.md5("+".join(query).encode()).hexdigest(), 16) % 10, "train")
        return "test" if int(hashlib.md5(repr((sorted(store.items()), query)).encode()).hexdigest(), 16) % 10 == 0 \
            else "train"

    def is_held_out(self, seed: int) -> bool:
        return self.split_of(seed) == "test"

    def seeds(self, split: str, n: int, rng: np.random.Generator) -> list[int]:
        """n episode seeds of 'train', 'val' (split='prompt' only) or 'test' drawn with `rng`."""
        if split == "val" and self.split != "prompt":
            raise ValueError("the validation split needs the prompt-keyed split (--env-split prompt)")
        out = []
        while len(out) < n:
            s = int(rng.integers(0, 2**31 - 1))
            if self.split_of(s) == split:
                out.append(s)
        return out

    def reset(self, seed: int) -> str:
        self.seed = int(seed)
        self.store, self.query = self.episode(seed, self.n_keys, self.digits, self.n_query)
        self.answer = sum(self.store[k] for k in self.query)
        self.turns, self.done, self.reward = 0, False, 0.0
        self.transcript = "+".join(self.query) + "?"
        return self.transcript

    def step(self, action: str) -> tuple[str, float, bool]:
        if self.done:
            raise RuntimeError("step() after the episode ended: call reset(seed)")
        self.turns += 1
        self.transcript += action
        a = action.strip()
        obs, reward, done = ERROR_OBS, 0.0, False
        if re.fullmatch(r"#[a-z]", a) and a[1] in self.store:
            obs = f"={self.store[a[1]]};"
        elif re.fullmatch(r"!(\d{1,6}\+\d{1,6}=)?\d{1,6}", a):
            obs, reward, done = "", float(int(a.rsplit("=", 1)[-1].lstrip("!")) == self.answer), True
        if not done and (self.turns >= self.max_turns or len(self.transcript) + len(obs) > self.max_context):
            obs, reward, done = END_OBS, LIMIT_REWARD, True
        self.transcript += obs
        self.done, self.reward = done, reward
        return obs, reward, done

    def stop_at_limit(self, obs: str) -> tuple[str, float, bool]:
        """End the episode at a limit counted outside the environment (play's context token budget), after a step
        that answered `obs`: that answer becomes the limit's observation and reward, as at the turn limit."""
        self.transcript = self.transcript[:len(self.transcript) - len(obs)] + END_OBS
        self.done, self.reward = True, LIMIT_REWARD
        return END_OBS, LIMIT_REWARD, True

    def expert_action(self) -> str:
        """The shortest solution's next action: look up the queried keys in order, then answer their sum `!N`."""
        for k in self.query:
            if f"#{k}" not in self.transcript:
                return f"#{k}"
        return f"!{self.answer}"

    def clone(self) -> "LookupEnv":
        return copy.deepcopy(self)


# ---- SFT traces ----
@dataclass
class TraceExample(llm.Example):
    """An expert episode for algos/sft.py: `turns` = [(action, observation), ...]; only actions are trained on."""
    turns: list = field(default_factory=list)
    seed: int = 0


class TraceTask:
    """The environment as an SFT task (`python algos/sft.py --tasks toolenv`): expert traces, held-out evaluation."""

    def __init__(self, env: LookupEnv | None = None, max_action_tokens: int = 6):
        self.env, self.max_action_tokens = env or LookupEnv(), max_action_tokens
        self.name, self.kind = "toolenv", "toolenv"

    def trace(self, seed: int) -> TraceExample:
        env = self.env.clone()
        prompt, turns = env.reset(seed), []
        while not env.done:
            a = env.expert_action()
            obs, _, _ = env.step(a)
            turns.append((a, obs))
        return TraceExample(prompt=prompt, answer=str(env.answer), solution=env.transcript[len(prompt):],
                            turns=turns, seed=seed)

    def sample(self, split: str, n: int, rng: np.random.Generator) -> list[TraceExample]:
        return [self.trace(s) for s in self.env.seeds(split, n, rng)]

    def evaluate(self, model, tok, examples: list, max_new_tokens: int = 0, pass_k: int = 0) -> dict:
        """Greedy episode success, and per-turn accuracy (the greedy action equals the expert's, given the expert's
        history) for every turn index."""
        res = evaluate(model, tok, self.env, [e.seed for e in examples], self.max_action_tokens)
        return {"acc": res["success"], **{k: v for k, v in res.items() if k != "success"}}


# ---- chat-template turns and JSON tool calls ----
TOOLS = [
    {"type": "function", "function": {"name": "lookup", "description": "Read the value stored under a key.",
                                      "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                                                     "required": ["key"]}}},
    {"type": "function", "function": {"name": "answer", "description": "Give the final answer and end the episode.",
                                      "parameters": {"type": "object", "properties": {"value": {"type": "integer"}},
                                                     "required": ["value"]}}},
]
SYSTEM_PROMPT = ("A store hides a value under each key. The user names keys joined by '+'; read each one with the "
                 "lookup tool, then call answer with the sum of their values. Call exactly one tool per turn, as "
                 "<tool_call>{\"name\": <tool name>, \"arguments\": <JSON object>}</tool_call>. Tools: "
                 + json.dumps(TOOLS))


def chat_mode(tok) -> bool:
    """A tokenizer with a chat template plays in chat turns and tool calls; one without (the shipped character world,
    whose template is the trivial one) plays raw text actions (`#b`, `!13`) and observations."""
    return bool(getattr(tok, "chat_template", None))


def encode_prompts(tok, texts: list[str]) -> list[list[int]]:
    """Each episode's first context: the prompt's tokens (no chat template), or the chat template's system turn (the
    protocol and the tool schemas) and user turn (the prompt) with the assistant turn opened."""
    if not chat_mode(tok):
        return common.encode_prompts(tok, texts)
    return [list(tok.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": t}],
                                         add_generation_prompt=True, tokenize=True, return_dict=False)) for t in texts]


def tool_call(action: str) -> str:
    """The hermes-style tool call of an environment action (`#b` -> lookup b, `!13` -> answer 13)."""
    call = {"name": "lookup", "arguments": {"key": action[1:]}} if action.startswith("#") else \
        {"name": "answer", "arguments": {"value": int(action.rsplit("=", 1)[-1].lstrip("!"))}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def parse_tool_call(text: str) -> tuple[str, str | None]:
    """(the environment's action, None) from the first `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` of a
    reply, or ("", what is wrong) for a malformed call: never an exception."""
    m = re.search(r"<tool_call>(.*?)</tool_call>", text, re.S)
    if m is None:
        return "", "no <tool_call>...</tool_call> in the reply"
    try:
        call = json.loads(m.group(1))
    except json.JSONDecodeError as e:
        return "", f"the tool call is not JSON ({e.msg})"
    args = call.get("arguments") if isinstance(call, dict) else None
    if not isinstance(args, dict):
        return "", "a tool call is an object with a name and an arguments object"
    if call.get("name") == "lookup" and isinstance(args.get("key"), str):
        return "#" + args["key"], None
    value = args.get("value")
    if call.get("name") == "answer" and (isinstance(value, int) and not isinstance(value, bool) or
                                         isinstance(value, str) and value.isdigit()):
        return f"!{int(value)}", None
    return "", f"unknown tool {call.get('name')!r} or bad arguments (lookup takes a key, answer an integer value)"


def _turn_end(tok) -> tuple[str, str]:
    """(the text that closes an assistant turn in the template, its first special token: what the sampler stops on)."""
    turn = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "A"}]
    tail = tok.apply_chat_template(turn, tokenize=False).rsplit("A", 1)[1]
    ids = [i for i in tok(tail, add_special_tokens=False)["input_ids"] if i in tok.all_special_ids]
    return tail, tok.convert_ids_to_tokens(ids[0]) if ids else ""


def tool_turn(tok, content: str) -> str:
    """The text the template puts between an assistant turn's end-of-turn token and the next assistant turn's first
    token when a tool answers `content`: the rest of the assistant turn, the tool turn (a user turn where the template
    renders no tool role) and the opened assistant turn."""
    base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "A"}]
    before = tok.apply_chat_template(base, tokenize=False)
    after = ""
    for role in ("tool", "user"):
        try:
            after = tok.apply_chat_template(base + [{"role": role, "content": content}], add_generation_prompt=True,
                                            tokenize=False)
        except Exception:  # noqa: BLE001 - a template that refuses the role: try the next
            continue
        if after.startswith(before) and content in after[len(before):]:
            break
    else:
        raise SystemExit("the chat template re-renders earlier turns or drops tool and user turns: multi-turn "
                         "rollouts need a template that appends each turn")
    tail, end = _turn_end(tok)
    return tail[tail.index(end) + len(end):] + after[len(before):] if end else after[len(before):]


def observation_ids(tok, obs: str, stopped: bool, budget: int = 0) -> tuple[list[int], bool]:
    """(the token ids of an observation, whether it was cut to `budget` tokens): the text itself without a chat
    template, else its tool turn through the template (preceded by the end-of-turn token when the action was cut by
    its budget before it); an empty observation (the episode's answer) adds nothing."""
    if not obs:
        return [], False
    ids = tok(obs, add_special_tokens=False)["input_ids"]
    cut = bool(budget) and len(ids) > budget
    if not chat_mode(tok):
        return ids[:budget] if cut else ids, cut
    content = tok.decode(ids[:budget]) if cut else obs
    close = [] if stopped else tok(_turn_end(tok)[1], add_special_tokens=False)["input_ids"]
    return close + tok(tool_turn(tok, content), add_special_tokens=False)["input_ids"], cut


def env_action(tok, text: str) -> tuple[str, str | None]:
    """The environment's action of a sampled reply: the text itself without a chat template, else its tool call."""
    return parse_tool_call(text) if chat_mode(tok) else (text, None)


# ---- the turn-by-turn episode runner ----
@dataclass
class Episode:
    """One finished episode. `ids` are the tokens after the initial context: actions (kind 1, sampled, EOS
    included when the policy stopped) and observations (kind 2, written by the environment)."""
    env: LookupEnv
    ids: list = field(default_factory=list)
    kind: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    turn: list = field(default_factory=list)  # turn index of each token (0-based, counted from the start state)
    actions: list = field(default_factory=list)  # the environment's actions, in order (the replies' tool calls)
    replies: list = field(default_factory=list)  # the sampled texts (the actions themselves without a template)
    observations: list = field(default_factory=list)  # what each turn showed the policy
    truncated: int = 0  # actions that hit the token budget without EOS
    obs_truncated: int = 0  # observations cut to the environment's max_obs_tokens
    context_limited: bool = False  # ended by the environment's max_context_tokens
    reward: float = 0.0


def encode_obs(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"] if text else []


@torch.no_grad()
def play(policy, tok, envs: list[LookupEnv], contexts: list[list[int]], max_action_tokens: int,
         temperature: float = 1.0, greedy: bool = False, first_turn: int = 0) -> list[Episode]:
    """Run every (env, context) to the end, one batched generation per turn: the sampled reply (with its behaviour
    log-probs) and then the environment's observation tokens are appended to each context; with a chat template the
    reply's tool call is the action and the observation a tool turn (env_action, observation_ids). The environment's
    token budgets (max_context_tokens, max_obs_tokens) are applied here and counted. `policy`: a common.Sampler (its
    copy or its vLLM engine) or a model, as common.generate takes it."""
    eps = [Episode(env) for env in envs]
    ctx = [list(c) for c in contexts]
    t = first_turn
    while True:
        live = [i for i, e in enumerate(eps) if not e.env.done]
        if not live:
            return eps
        ro = common.generate(policy, tok, [ctx[i] for i in live], 1, max_action_tokens, temperature,
                             greedy=greedy)
        for row, i in enumerate(live):
            e, n = eps[i], int(ro.completion_mask[row].sum())
            a_ids, stopped = ro.completion_ids[row, :n].tolist(), ro.finish_reasons[row] == "stop"
            action, error = env_action(tok, ro.texts[row])
            obs, r, done = e.env.step(action)
            shown = f"{obs} {error}" if error and obs == ERROR_OBS else obs  # a malformed call: what is wrong
            o_ids, cut = observation_ids(tok, shown, stopped, e.env.max_obs_tokens)
            if not done and e.env.max_context_tokens and len(ctx[i]) + n + len(o_ids) > e.env.max_context_tokens:
                (shown, r, done), e.context_limited = e.env.stop_at_limit(obs), True
                o_ids, cut = observation_ids(tok, shown, stopped, e.env.max_obs_tokens)
            e.ids += a_ids + o_ids
            e.kind += [1] * n + [2] * len(o_ids)
            e.logprobs += ro.logprobs[row, :n].tolist() + [0.0] * len(o_ids)
            e.turn += [t] * (n + len(o_ids))
            e.actions.append(action)
            e.replies.append(ro.texts[row])
            e.observations.append(shown)
            e.truncated += not stopped
            e.obs_truncated += cut
            e.reward = r
            ctx[i] += a_ids + o_ids
        t += 1


def evaluate(policy, tok, env: LookupEnv, seeds: list[int], max_action_tokens: int) -> dict:
    """Held-out greedy success, tool use (at least one successful lookup) and per-turn accuracy (teacher-forced:
    the greedy action given the expert's history equals the expert's action; with a chat template the expert's
    history holds its tool calls) of turn 1, 2, ...; `policy` as play's."""
    model = policy.model if isinstance(policy, common.Sampler) else policy
    was = model.training
    model.eval()
    envs = [env.clone() for _ in seeds]
    prompts = encode_prompts(tok, [e.reset(s) for e, s in zip(envs, seeds)])
    eps = play(policy, tok, envs, prompts, max_action_tokens, greedy=True)
    out = {"success": float(np.mean([e.reward for e in eps])),
           "tool_use": float(np.mean([any(o.startswith("=") for o in e.observations) for e in eps]))}
    experts = [env.clone() for _ in seeds]
    ctx = encode_prompts(tok, [e.reset(s) for e, s in zip(experts, seeds)])
    stop = tok.convert_tokens_to_ids(_turn_end(tok)[1]) if chat_mode(tok) else tok.eos_token_id
    turn = 0
    while not all(e.done for e in experts):
        live = [i for i, e in enumerate(experts) if not e.done]
        ro = common.generate(policy, tok, [ctx[i] for i in live], 1, max_action_tokens, greedy=True)
        hits = []
        for row, i in enumerate(live):
            a = experts[i].expert_action()
            hits.append(env_action(tok, ro.texts[row])[0].strip() == a)
            obs, _, _ = experts[i].step(a)
            text = tool_call(a) if chat_mode(tok) else a
            ctx[i] += tok(text, add_special_tokens=False)["input_ids"] + [stop] + observation_ids(tok, obs, True)[0]
        turn += 1
        out[f"turn{turn}_acc"] = float(np.mean(hits))
    model.train(was)
    return out
