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

CalculatorEnv, a real task beside the toy (the scripts' `--env calc`): each episode is a reasoning-gym arithmetic
problem (`basic_arithmetic`: 2 to 4 terms of 1 to 2 digits, + - * /, parentheses, negation; `Calculate ( 56 + -33 )
- 84.`), with a calculator tool and a final answer:
    #EXPR  the calculator on EXPR      -> `=V;` (exact: fractions, an integer when whole); an expression that is not
                                          numbers, + - * / ( ) and unary minus, or a division by zero -> `err;`
    !V                                 -> the episode ends; reward 1 if the generator's scorer gives V full marks
In chat turns the tools are `calculator(expression)` and `answer(value)` (CALC_TOOLS, CALC_SYSTEM_PROMPT). The
calculator parses with `ast` and evaluates only number literals and those operators: it never runs model text. The
expert calls the calculator on the whole expression, then answers; the split hashes the question (the problem is the
whole episode); --max-context counts the characters after the question. No shipped policy is trained on it: it is for
chat models.

Shared by algos/sft.py (traces, per-turn accuracy of the shipped `tiny-toolenv`), algos/multiturn_grpo.py,
algos/echo.py and algos/hgpo.py: the environment, the turn-by-turn episode runner `play` (batched generation through
`common.generate`, observation tokens appended to each context), the chat-template turns, and the held-out evaluation.
"""
from __future__ import annotations

import ast
import copy
import hashlib
import json
import re
import string
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import torch

import common
from algos import _llm as llm

LIMIT_REWARD = 0.0  # reward of an episode ended by the turn or the context limit (and of a wrong answer)
ERROR_OBS = "err;"
END_OBS = "end;"


class EpisodeEnv:
    """What every environment here shares: held-out and validation episodes by `split_of(seed)`, a limit counted
    outside the environment (stop_at_limit) and copies (clone). A subclass gives split_of, reset, step and
    expert_action, and keeps `transcript`, `done` and `reward`."""

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

    def stop_at_limit(self, obs: str) -> tuple[str, float, bool]:
        """End the episode at a limit counted outside the environment (play's context token budget), after a step
        that answered `obs`: that answer becomes the limit's observation and reward, as at the turn limit."""
        self.transcript = self.transcript[:len(self.transcript) - len(obs)] + END_OBS
        self.done, self.reward = True, LIMIT_REWARD
        return END_OBS, LIMIT_REWARD, True

    def clone(self):
        return copy.deepcopy(self)


class LookupEnv(EpisodeEnv):
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

    def expert_action(self) -> str:
        """The shortest solution's next action: look up the queried keys in order, then answer their sum `!N`."""
        for k in self.query:
            if f"#{k}" not in self.transcript:
                return f"#{k}"
        return f"!{self.answer}"

    # the chat protocol: the system turn's tool schemas, an action as a tool call and back
    @property
    def system_prompt(self) -> str:
        return SYSTEM_PROMPT

    def tool_call(self, action: str) -> str:
        return tool_call(action)

    def parse_tool_call(self, text: str) -> tuple[str, str | None]:
        return parse_tool_call(text)


class CalculatorEnv(EpisodeEnv):
    """reasoning-gym arithmetic with a calculator tool; LookupEnv's interface (reset, step, expert_action, seeds, ...).

    Actions: `#EXPR` (the calculator: observation `=V;`, or `err;` for anything but numbers, + - * / ( ) and unary
    minus, or a division by zero), `!V` (the final answer: reward 1 when the generator's scorer gives it full marks,
    else 0); anything else `err;`. Limits as LookupEnv's (`end;`, reward LIMIT_REWARD), the character limit counting
    the actions and observations after the question."""

    MAX_EXPR = 100  # characters of a calculator expression (bounds the parse and the numbers it can build)

    def __init__(self, dataset: str = "basic_arithmetic", max_turns: int = 5, max_context: int = 40,
                 split: str = "episode", max_context_tokens: int = 0, max_obs_tokens: int = 0, max_terms: int = 4,
                 max_digits: int = 2):
        if max_turns < 1 or max_context < 8 or max_context_tokens < 0 or max_obs_tokens < 0:
            raise ValueError("CalculatorEnv needs max_turns >= 1, max_context >= 8 and token budgets >= 0 (0 = none)")
        if split not in ("episode", "prompt"):
            raise ValueError(f"CalculatorEnv split must be 'episode' or 'prompt', got {split!r}")
        import reasoning_gym  # noqa: F401 - fail here, not in the first reset

        self.dataset, self.max_terms, self.max_digits = dataset, max_terms, max_digits
        self.max_turns, self.max_context, self.split = max_turns, max_context, split
        self.max_context_tokens, self.max_obs_tokens = max_context_tokens, max_obs_tokens
        self.name, self.done, self.transcript = f"calc-{dataset}", True, ""

    def problem(self, seed: int):
        """(the generator's dataset, entry) of episode `seed`: entry 0 of the dataset generated with that seed."""
        import reasoning_gym

        data = reasoning_gym.create_dataset(self.dataset, size=1, seed=int(seed), max_terms=self.max_terms,
                                            max_digits=self.max_digits)
        return data, data[0]

    def split_of(self, seed: int) -> str:
        """'train', 'val' or 'test' by the md5 of the question (the visible prompt is the whole episode): 0 mod 10 ->
        test, 1 -> val under split='prompt' (train under 'episode'), else train."""
        h = int(hashlib.md5(self.problem(seed)[1]["question"].encode()).hexdigest(), 16) % 10
        return "test" if h == 0 else "val" if h == 1 and self.split == "prompt" else "train"

    def reset(self, seed: int) -> str:
        self.seed = int(seed)
        self.entry = self.problem(seed)[1]
        self.expression = "".join(self.entry["metadata"]["expression"].split())
        self.answer = self.entry["answer"]
        self.question = self.transcript = self.entry["question"]
        self.turns, self.done, self.reward = 0, False, 0.0
        return self.question

    def step(self, action: str) -> tuple[str, float, bool]:
        if self.done:
            raise RuntimeError("step() after the episode ended: call reset(seed)")
        self.turns += 1
        self.transcript += action
        a = action.strip()
        obs, reward, done = ERROR_OBS, 0.0, False
        if a.startswith("#"):
            value, _ = calculate(a[1:])
            obs = ERROR_OBS if value is None else f"={value};"
        elif re.fullmatch(r"!-?\d{1,16}(\.\d{1,8})?", a):
            obs, reward, done = "", float(self.score(a[1:]) == 1.0), True
        if not done and (self.turns >= self.max_turns or
                         len(self.transcript) - len(self.question) + len(obs) > self.max_context):
            obs, reward, done = END_OBS, LIMIT_REWARD, True
        self.transcript += obs
        self.done, self.reward = done, reward
        return obs, reward, done

    def score(self, answer: str) -> float:
        """The generator's scorer on the answer's text (1.0: full marks)."""
        return self.problem(self.seed)[0].score_answer(answer, self.entry)

    def expert_action(self) -> str:
        """The calculator on the whole expression (spaces removed), then its value as the answer."""
        value, _ = calculate(self.expression)
        return f"!{value}" if f"={value};" in self.transcript[len(self.question):] else f"#{self.expression}"

    @property
    def system_prompt(self) -> str:
        return CALC_SYSTEM_PROMPT

    def tool_call(self, action: str) -> str:
        """The hermes-style tool call of an action (`#3*4` -> calculator, `!12` -> answer)."""
        call = {"name": "calculator", "arguments": {"expression": action[1:]}} if action.startswith("#") else \
            {"name": "answer", "arguments": {"value": action[1:]}}
        return f"<tool_call>{json.dumps(call)}</tool_call>"

    def parse_tool_call(self, text: str) -> tuple[str, str | None]:
        """(the action, None) from the reply's first tool call, or ("", what is wrong): never an exception. The
        calculator's expression loses its spaces; the answer's value is an integer or a number as text."""
        name, args, error = read_tool_call(text)
        if error:
            return "", error
        if name == "calculator" and isinstance(args.get("expression"), str):
            return "#" + "".join(args["expression"].split()), None
        value = args.get("value")
        if name == "answer" and isinstance(value, (int, float, str)) and not isinstance(value, bool):
            v = str(value).strip()
            if re.fullmatch(r"-?\d{1,16}(\.\d{1,8})?", v):
                return "!" + v, None
        return "", (f"unknown tool {name!r} or bad arguments (calculator takes an expression string, answer a "
                    f"number)")


def calculate(expression: str) -> tuple[str | None, str | None]:
    """(the value as text, None) of an arithmetic expression, or (None, what is wrong). Parsed with `ast` and evaluated
    exactly (fractions) over number literals, + - * / and unary minus and plus only: names, calls, attributes,
    subscripts, powers and every other node are refused, so model text never runs. A whole value is written as an
    integer, any other to 10 significant digits."""
    if not 0 < len(expression) <= CalculatorEnv.MAX_EXPR:
        return None, f"an expression of 1 to {CalculatorEnv.MAX_EXPR} characters"
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError, RecursionError) as e:
        return None, f"not an arithmetic expression ({type(e).__name__})"
    ops = {ast.Add: lambda x, y: x + y, ast.Sub: lambda x, y: x - y, ast.Mult: lambda x, y: x * y,
           ast.Div: lambda x, y: x / y}

    def value(node) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(str(node.value)) if isinstance(node.value, float) else Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.left), value(node.right))
        raise TypeError(f"{type(getattr(node, 'op', node)).__name__} is not allowed")

    try:
        v = value(tree.body)
        return (str(v.numerator) if v.denominator == 1 else f"{float(v):.10g}"), None
    except ZeroDivisionError:
        return None, "division by zero"
    except (TypeError, ValueError, RecursionError, OverflowError) as e:
        return None, str(e)


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
CALC_TOOLS = [
    {"type": "function", "function": {"name": "calculator",
                                      "description": "Evaluate an arithmetic expression: numbers, + - * / and "
                                                     "parentheses.",
                                      "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                                     "required": ["expression"]}}},
    {"type": "function", "function": {"name": "answer", "description": "Give the final answer and end the episode.",
                                      "parameters": {"type": "object", "properties": {"value": {"type": "number"}},
                                                     "required": ["value"]}}},
]
CALC_SYSTEM_PROMPT = ("Solve the user's arithmetic problem. Compute it with the calculator tool, then call answer "
                      "with the result. Call exactly one tool per turn, as <tool_call>{\"name\": <tool name>, "
                      "\"arguments\": <JSON object>}</tool_call>. Tools: " + json.dumps(CALC_TOOLS))


def chat_mode(tok) -> bool:
    """A tokenizer with a chat template plays in chat turns and tool calls; one without (the shipped character world,
    whose template is the trivial one) plays raw text actions (`#b`, `!13`) and observations."""
    return bool(getattr(tok, "chat_template", None))


def encode_prompts(tok, texts: list[str], system: str = SYSTEM_PROMPT) -> list[list[int]]:
    """Each episode's first context: the prompt's tokens (no chat template), or the chat template's system turn (the
    protocol and the tool schemas: the environment's `system_prompt`) and user turn (the prompt) with the assistant
    turn opened."""
    if not chat_mode(tok):
        return common.encode_prompts(tok, texts)
    return [list(tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": t}],
                                         add_generation_prompt=True, tokenize=True, return_dict=False)) for t in texts]


def tool_call(action: str) -> str:
    """The hermes-style tool call of an environment action (`#b` -> lookup b, `!13` -> answer 13)."""
    call = {"name": "lookup", "arguments": {"key": action[1:]}} if action.startswith("#") else \
        {"name": "answer", "arguments": {"value": int(action.rsplit("=", 1)[-1].lstrip("!"))}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def read_tool_call(text: str) -> tuple[str | None, dict, str | None]:
    """(name, arguments, None) of the first `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` of a reply, or
    (None, {}, what is wrong) for a malformed call: never an exception."""
    m = re.search(r"<tool_call>(.*?)</tool_call>", text, re.S)
    if m is None:
        return None, {}, "no <tool_call>...</tool_call> in the reply"
    try:
        call = json.loads(m.group(1))
    except json.JSONDecodeError as e:
        return None, {}, f"the tool call is not JSON ({e.msg})"
    args = call.get("arguments") if isinstance(call, dict) else None
    if not isinstance(args, dict):
        return None, {}, "a tool call is an object with a name and an arguments object"
    return call.get("name"), args, None


def parse_tool_call(text: str) -> tuple[str, str | None]:
    """(the lookup environment's action, None) from the first tool call of a reply (read_tool_call), or ("", what is
    wrong) for a malformed call: never an exception."""
    name, args, error = read_tool_call(text)
    if error:
        return "", error
    if name == "lookup" and isinstance(args.get("key"), str):
        return "#" + args["key"], None
    value = args.get("value")
    if name == "answer" and (isinstance(value, int) and not isinstance(value, bool) or
                                         isinstance(value, str) and value.isdigit()):
        return f"!{int(value)}", None
    return "", f"unknown tool {name!r} or bad arguments (lookup takes a key, answer an integer value)"


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


def env_action(tok, text: str, env=None) -> tuple[str, str | None]:
    """The environment's action of a sampled reply: the text itself without a chat template, else its tool call (as
    `env` reads it; the lookup's without one)."""
    if not chat_mode(tok):
        return text, None
    return env.parse_tool_call(text) if env is not None else parse_tool_call(text)


# ---- the turn-by-turn episode runner ----
@dataclass
class Episode:
    """One finished episode. `ids` are the tokens after the initial context: actions (kind 1, sampled, EOS
    included when the policy stopped) and observations (kind 2, written by the environment)."""
    env: LookupEnv | CalculatorEnv
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
def play(policy, tok, envs: list[LookupEnv | CalculatorEnv], contexts: list[list[int]], max_action_tokens: int,
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
            action, error = env_action(tok, ro.texts[row], e.env)
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


def evaluate(policy, tok, env: LookupEnv | CalculatorEnv, seeds: list[int], max_action_tokens: int) -> dict:
    """Held-out greedy success, tool use (at least one tool call answered with a value) and per-turn accuracy
    (teacher-forced: the greedy action given the expert's history equals the expert's action; with a chat template the
    expert's history holds its tool calls) of turn 1, 2, ...; `policy` as play's."""
    model = policy.model if isinstance(policy, common.Sampler) else policy
    was = model.training
    model.eval()
    envs = [env.clone() for _ in seeds]
    prompts = encode_prompts(tok, [e.reset(s) for e, s in zip(envs, seeds)], env.system_prompt)
    eps = play(policy, tok, envs, prompts, max_action_tokens, greedy=True)
    out = {"success": float(np.mean([e.reward for e in eps])),
           "tool_use": float(np.mean([any(o.startswith("=") for o in e.observations) for e in eps]))}
    experts = [env.clone() for _ in seeds]
    ctx = encode_prompts(tok, [e.reset(s) for e, s in zip(experts, seeds)], env.system_prompt)
    stop = tok.convert_tokens_to_ids(_turn_end(tok)[1]) if chat_mode(tok) else tok.eos_token_id
    turn = 0
    while not all(e.done for e in experts):
        live = [i for i, e in enumerate(experts) if not e.done]
        ro = common.generate(policy, tok, [ctx[i] for i in live], 1, max_action_tokens, greedy=True)
        hits = []
        for row, i in enumerate(live):
            a = experts[i].expert_action()
            hits.append(env_action(tok, ro.texts[row], experts[i])[0].strip() == a)
            obs, _, _ = experts[i].step(a)
            text = experts[i].tool_call(a) if chat_mode(tok) else a
            ctx[i] += tok(text, add_special_tokens=False)["input_ids"] + [stop] + observation_ids(tok, obs, True)[0]
        turn += 1
        out[f"turn{turn}_acc"] = float(np.mean(hits))
    model.train(was)
    return out
