"""The LLM scripts' shared plumbing: the flags every one of them takes (LLMArgs), the tasks and verifiers, loading a
policy with its sampler, and the optimiser step. Like common.py it holds no algorithm's idea, only what the LLM
scripts need as is; the offline-RL and world-model scripts never import it.

A script writes `class Args(LLMArgs)` holding only its method's fields and the defaults it changes; tyro keeps the
command line flat (`python algos/grpo.py --help` lists every flag, inherited ones included).
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib
import itertools
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import torch
import tyro
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
from algos._shard import all_ranks_sum, load_sharded, step_counts  # noqa: E402,F401 (llm.step_counts: the scripts)


# ---- tasks and verifiers ----
@dataclass
class Example:
    prompt: str  # what the policy sees (before any chat template)
    answer: str  # the reference final answer the verifier compares against
    solution: str = ""  # the full target response (SFT target; privileged context for self-distillation)


def addition_scratchpad(a: int, b: int) -> str:
    """Digit-by-digit addition with carries, least significant digit first: 47+85 -> '7+5=12;4+8+1=13;=132'."""
    steps, carry, da, db = [], 0, str(a)[::-1], str(b)[::-1]
    for i in range(max(len(da), len(db))):
        x, y = int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0
        terms = f"{x}+{y}" + ("+1" if carry else "")
        s = x + y + carry
        steps.append(f"{terms}={s}")
        carry = s // 10
    return ";".join(steps) + f";={a + b}"


class ArithmeticTask:
    """Synthetic verifiable addition with a held-out split.

    kind 'add': answer only ('23+45=' -> '68'). kind 'addsteps': a scratchpad first ('23+45:' ->
    '3+5=8;2+4=6;=68'), so response length grows with `digits`. Operands are uniform in [0, 10^digits).
    A pair belongs to the held-out split when a hash of the unordered pair is 0 mod 10, so train never sees a
    held-out pair nor its commuted twin (b, a); raising `digits` is the out-of-distribution knob.
    """

    def __init__(self, kind: str = "add", digits: int = 2):
        if kind not in ("add", "addsteps"):
            raise ValueError(f"unknown arithmetic task {kind!r}: use 'add' or 'addsteps'")
        if not 1 <= digits <= 9:
            raise ValueError(f"digits must be in 1..9, got {digits}")
        self.kind, self.digits, self.name = kind, digits, f"{kind}{digits}"

    @staticmethod
    def is_held_out(*operands: int) -> bool:
        """True for about 1 in 10 operand multisets (order does not matter; SumsTask uses it too)."""
        return int(hashlib.md5(",".join(map(str, sorted(operands))).encode()).hexdigest(), 16) % 10 == 0

    def make(self, a: int, b: int) -> Example:
        sep = "=" if self.kind == "add" else ":"
        sol = str(a + b) if self.kind == "add" else addition_scratchpad(a, b)
        return Example(prompt=f"{a}+{b}{sep}", answer=str(a + b), solution=sol)

    def sample(self, split: str, n: int, rng: np.random.Generator) -> list[Example]:
        """n examples from 'train' or 'test' (with replacement), drawn with `rng`."""
        out, hi = [], 10 ** self.digits
        while len(out) < n:
            a, b = (int(x) for x in rng.integers(0, hi, size=2))
            if self.is_held_out(a, b) == (split == "test"):
                out.append(self.make(a, b))
        return out

    @staticmethod
    def parse(response: str) -> str:
        """The final answer as verify reads it: what follows the last '='."""
        return response.strip().rsplit("=", 1)[-1]

    def verify(self, response: str, answer: str) -> tuple[float, dict]:
        """Reward 1 for the exact final answer, else 0; components say whether the format was right."""
        pattern = r"\d+" if self.kind == "add" else r"(\d\+\d(\+1)?=\d+;)+=\d+"
        fmt = re.fullmatch(pattern, response.strip()) is not None
        final = response.strip().rsplit("=", 1)[-1]
        correct = fmt and final == answer
        return float(correct), {"format": float(fmt), "correct": float(correct)}


class SumsTask:
    """Multi-operand sums with running totals, the long-response task: '17+5+30:' -> '17+5=22;22+30=52;=52'.
    `operands` (2..16) and `digits` (operands uniform in [0, 10^digits)) set length and difficulty: a reference
    response has on average (within 5%) (operands - 1) * (3 * digits + 5) + digits characters (9 for 2 one-digit
    operands, 165 for 16 two-digit ones). operands='mix' draws the count per prompt from a truncated Zipf law,
    P(n) ~ (n - 1)^-1.5 on 2..16 (P(2) = 0.48, P(n >= 9) = 0.11): a batch holds a few very long responses.
    Held out: a hash of the sorted operands is 0 mod 10. Reward: 1 for the exact final answer in the format;
    components 'format' and 'partial': the fraction of the prompt's running totals that the response's steps
    get right, in order (0 when malformed). For that the answer (the final sum, a str) also carries the totals
    (`answer.totals`); given a plain string, 'partial' grades against the operands the response wrote."""

    class Answer(str):
        """A final answer that also carries the reference running totals."""

    MIX = np.arange(1, 16) ** -1.5 / (np.arange(1, 16) ** -1.5).sum()  # P(n) for n = 2..16

    def __init__(self, operands: int | str = 5, digits: int = 2):
        if not (operands == "mix" or isinstance(operands, int) and 2 <= operands <= 16) or not 1 <= digits <= 9:
            raise ValueError(f"sums needs operands in 2..16 or 'mix' and digits in 1..9, got {operands!r}, {digits}")
        self.kind, self.operands, self.digits, self.name = "sums", operands, digits, f"sums{operands}d{digits}"

    def make(self, xs: list[int]) -> Example:
        t = list(itertools.accumulate(xs))
        sol = ";".join(f"{a}+{x}={b}" for a, x, b in zip(t, xs[1:], t[1:])) + f";={t[-1]}"
        answer = SumsTask.Answer(t[-1])
        answer.totals = t[1:]
        return Example(prompt="+".join(map(str, xs)) + ":", answer=answer, solution=sol)

    def sample(self, split: str, n: int, rng: np.random.Generator) -> list[Example]:
        out = []
        while len(out) < n:
            k = int(rng.choice(np.arange(2, 17), p=self.MIX)) if self.operands == "mix" else self.operands
            xs = [int(x) for x in rng.integers(0, 10 ** self.digits, size=k)]
            if ArithmeticTask.is_held_out(*xs) == (split == "test"):
                out.append(self.make(xs))
        return out

    parse = staticmethod(ArithmeticTask.parse)

    def verify(self, response: str, answer: str) -> tuple[float, dict]:
        r = response.strip()
        fmt = re.fullmatch(r"(\d+\+\d+=\d+;)+=\d+", r) is not None
        steps = [tuple(map(int, m)) for m in re.findall(r"(\d+)\+(\d+)=(\d+);", r)] if fmt else []
        own = list(itertools.accumulate([steps[0][0]] + [x for _, x, _ in steps]))[1:] if steps else []
        ref = getattr(answer, "totals", own)  # the prompt's running totals (missing steps count as wrong)
        partial = sum(t == s for (_, _, t), s in zip(steps, ref)) / max(1, len(ref)) if fmt else 0.0
        correct = fmt and r.rsplit("=", 1)[-1] == answer
        return float(correct), {"format": float(fmt), "partial": float(partial), "correct": float(correct)}


class WordProblemTask:
    """GSM8K-style word problems, generated: one or two steps of +, - or x on small numbers, written as text for a
    real pretrained chat model ('Mia has 12 pens. She buys 7 more ... How many pens does Mia have now?'). The reward
    reads the last number of the response, as GSM8K graders do. Held out: a hash of (template, numbers) is 0 mod 10."""

    TEMPLATES = (  # (text, answer from the numbers a, b, c)
        ("{n} has {a} {x}. {p} buys {b} more. How many {x} does {n} have now?", lambda a, b, c: a + b),
        ("{n} has {a} {x} and gives {b} of them to a friend. How many {x} does {n} have left?", lambda a, b, c: a - b),
        ("{n} buys {a} boxes with {b} {x} in each box. How many {x} does {n} buy?", lambda a, b, c: a * b),
        ("{n} has {a} {x}, buys {b} more and then gives away {c}. How many {x} does {n} have?",
         lambda a, b, c: a + b - c),
        ("{n} packs {a} bags of {b} {x} and finds {c} more. How many {x} are there in all?", lambda a, b, c: a * b + c),
    )
    NAMES, ITEMS = (("Mia", "She"), ("Tom", "He"), ("Ava", "She"), ("Leo", "He")), ("pens", "apples", "stamps", "cards")

    def __init__(self):
        self.kind, self.name = "words", "words"

    def sample(self, split: str, n: int, rng: np.random.Generator) -> list[Example]:
        out = []
        while len(out) < n:
            k, (name, pron), item = rng.integers(len(self.TEMPLATES)), self.NAMES[rng.integers(4)], rng.choice(self.ITEMS)
            text, fn = self.TEMPLATES[k]
            a, b = int(rng.integers(2, 20)), int(rng.integers(2, 10))
            c = int(rng.integers(1, min(a, 10))) if "{c}" in text else 0  # the split hashes only what the text shows
            if a <= b and k == 1 or ArithmeticTask.is_held_out(100 * int(k), a, b, c) != (split == "test"):
                continue
            prompt = text.format(n=name, p=pron, x=item, a=a, b=b, c=c) + " Give the answer as a number at the end."
            out.append(Example(prompt, str(fn(a, b, c))))
        return out

    def parse(self, response: str) -> str | None:
        return final_answer(response)

    def verify(self, response: str, answer: str) -> tuple[float, dict]:
        """Correct when the final answer (final_answer: the one boxed answer, else the last number) equals the answer;
        'format' is 1 when the response ends in the form the prompt asks for (a number at the end, or one boxed)."""
        final = final_answer(response)
        correct = final is not None and _same_number(final, answer)
        return float(correct), {"format": answer_format(response), "correct": float(correct)}


class DatasetTask:
    """Prompt/answer records (a local JSONL file or GSM8K via `datasets`), checked with math-verify."""

    def __init__(self, name: str, train: list[Example], test: list[Example]):
        self.name, self.train, self.test, self.kind = name, train, test, "dataset"

    def sample(self, split: str, n: int, rng: np.random.Generator) -> list[Example]:
        pool = self.train if split == "train" else self.test
        return [pool[i] for i in rng.integers(0, len(pool), size=n)]

    def parse(self, response: str) -> str | None:
        return final_answer(response)

    def verify(self, response: str, answer: str) -> tuple[float, dict]:
        from math_verify import parse, verify  # lazy: slow import, only real-data tasks need it

        try:  # math-verify reads the final answer itself (the last boxed one, else the last expression)
            correct = bool(verify(parse(answer), parse(response))) and final_answer(response) is not None
        except Exception:  # math-verify raises on some malformed inputs: a malformed answer is wrong
            correct = False
        return float(correct), {"format": answer_format(response), "correct": float(correct)}


BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
NUMBER = r"-?\d+(?:\.\d+)?"


def final_answer(response: str) -> str | None:
    """The answer a grader reads from a free-text response: the content of \\boxed{...} when the response boxes one
    distinct answer (None when it boxes two different ones: no credit for hedging), else its last number, as GSM8K
    graders do (so a correct number mid-way followed by another one is not the answer)."""
    boxed = {b.strip() for b in BOXED.findall(response)}
    if boxed:
        return boxed.pop() if len(boxed) == 1 else None
    nums = re.findall(NUMBER, response.replace(",", ""))
    return nums[-1] if nums else None


def answer_format(response: str) -> float:
    """1 when the response gives its final answer in a form a grader can read unambiguously: exactly one distinct
    non-empty \\boxed{...}, or (no box) a number as the last thing it says; else 0."""
    boxed = {b.strip() for b in BOXED.findall(response)}
    if boxed:
        return float(len(boxed) == 1 and "" not in boxed)
    return float(re.search(NUMBER + r"\s*[.!]?\s*$", response.replace(",", "")) is not None)


def _same_number(text: str, answer: str) -> bool:
    try:
        return float(text.replace(",", "")) == float(answer)
    except ValueError:
        return False


class ReasoningGymTask:
    """`--task rg:NAME[:FIELD=VALUE...][,NAME...]`: procedural reasoning tasks from the reasoning-gym package (offline
    generators, each with its own scorer: word problems such as gsm_symbolic, chain_sum, basic_arithmetic, algebra...).
    The held-out split is generated with its own seed, and train drops any question it shares; prompts ask for a boxed
    answer. A generator's config fields follow its name: `rg:leg_counting:max_animals=2:max_instances=4`."""

    TRAIN, TEST, INSTRUCTION = (2000, 0), (500, 1), " Put the final answer in \\boxed{}."

    class Answer(str):
        """The reference answer, carrying the generator's entry and scorer."""

    def __init__(self, names: str):
        try:
            import reasoning_gym
        except ImportError:
            raise SystemExit("--task rg:... needs the reasoning-gym package: pip install reasoning-gym")
        known = sorted(reasoning_gym.factory.DATASETS)
        specs = [self.parse_spec(spec) for spec in names.split(",")]
        unknown = [n for n, _ in specs if n not in known]
        if unknown or not names:
            raise SystemExit(f"--task rg:{names}: unknown reasoning-gym task(s) {unknown}; "
                             f"available: {', '.join(known)}")
        self.name, self.kind = f"rg:{names}", "reasoning-gym"
        self.train, self.test = [], []
        for name, settings in specs:
            make = lambda size, seed: self._create(reasoning_gym, name, settings, size, seed)  # noqa: E731
            test = self._examples(make(*self.TEST))
            held_out = {e.prompt for e in test}
            train = self._examples(make(*self.TRAIN))
            self.test += test
            self.train += [e for e in train if e.prompt not in held_out]

    @staticmethod
    def parse_spec(spec: str) -> tuple[str, dict]:
        """'leg_counting:max_animals=2:max_instances=4' -> ('leg_counting', {'max_animals': 2, 'max_instances': 4}):
        a generator's name, then its config fields (numbers read as numbers, anything else kept as text)."""
        name, *fields = spec.split(":")
        settings = {}
        for field_ in fields:
            key, sep, value = field_.partition("=")
            if not sep or not key:
                raise SystemExit(f"--task rg:{spec}: settings are written NAME:FIELD=VALUE[:FIELD=VALUE...], "
                                 f"got {field_!r}")
            try:
                settings[key] = int(value)
            except ValueError:
                try:
                    settings[key] = float(value)
                except ValueError:
                    settings[key] = value
        return name, settings

    @staticmethod
    def _create(reasoning_gym, name: str, settings: dict, size: int, seed: int):
        """The generator with its config fields overridden; an unknown field is an error naming the known ones."""
        config_cls = reasoning_gym.factory.DATASETS[name][1]
        fields = sorted(f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size"))
        bad = sorted(set(settings) - set(fields))
        if bad:
            raise SystemExit(f"--task rg:{name}: unknown setting(s) {bad}; {name} takes: {', '.join(fields)}")
        try:
            return reasoning_gym.create_dataset(name, size=size, seed=seed, **settings)
        except (AssertionError, ValueError, TypeError) as e:
            raise SystemExit(f"--task rg:{name}: invalid settings {settings}: {e}")

    def _examples(self, dataset) -> list[Example]:
        out = []
        for entry in dataset:
            answer = ReasoningGymTask.Answer(entry["answer"])
            answer.entry, answer.dataset = entry, dataset
            out.append(Example(entry["question"] + self.INSTRUCTION, answer))
        return out

    def sample(self, split: str, n: int, rng: np.random.Generator) -> list[Example]:
        pool = self.train if split == "train" else self.test
        return [pool[i] for i in rng.integers(0, len(pool), size=n)]

    @staticmethod
    def parse(response: str) -> str | None:
        """The one boxed answer (None for none, or two different ones)."""
        boxed = {b.strip() for b in BOXED.findall(response)}
        return boxed.pop() if len(boxed) == 1 else None

    def verify(self, response: str, answer) -> tuple[float, dict]:
        """The generator's own scorer on the boxed answer: reward 1 when it scores 1; 'score' keeps partial credit."""
        final = self.parse(response)
        score = float(answer.dataset.score_answer(final, answer.entry)) if final is not None else 0.0
        return float(score >= 1.0), {"format": float(final is not None and final != ""), "score": score,
                                     "correct": float(score >= 1.0)}


def load_jsonl_task(path: str, test_frac: float = 0.1) -> DatasetTask:
    """Lines of JSON with 'prompt', 'answer' (optional 'solution'); the first `test_frac` of them held out."""
    if not Path(path).is_file():
        raise SystemExit(f"--task jsonl:{path}: no such file")
    rows = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise SystemExit(f"--task jsonl:{path}: not UTF-8 text (byte {e.start}); save the file as UTF-8")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"--task jsonl:{path}: line {i} is not valid JSON ({e.msg})")
        if not isinstance(r, dict) or {"prompt", "answer"} - set(r):
            raise SystemExit(f"--task jsonl:{path}: line {i} needs fields 'prompt' and 'answer' (found {line[:80]!r})")
        if not all(isinstance(r.get(k, ""), str) for k in ("prompt", "answer", "solution")):
            raise SystemExit(f"--task jsonl:{path}: line {i}: 'prompt', 'answer' (and 'solution') must be strings, "
                             f"found {line[:80]!r}")
        rows.append(Example(r["prompt"], r["answer"], r.get("solution") or ""))
    if len(rows) < 2:
        raise SystemExit(f"--task jsonl:{path}: need at least 2 records, found {len(rows)}")
    n_test = max(1, int(len(rows) * test_frac))
    return DatasetTask(f"jsonl:{Path(path).name}", rows[n_test:], rows[:n_test])


def load_gsm8k() -> DatasetTask:
    import datasets

    try:
        ds = datasets.load_dataset("openai/gsm8k", "main")
    except Exception as e:
        raise SystemExit(f"--task gsm8k: could not load 'openai/gsm8k' through datasets ({type(e).__name__}). "
                         "Without network access, export it to JSONL once and use --task jsonl:PATH.")
    conv = lambda r: Example(r["question"], r["answer"].split("####")[-1].strip(), r["answer"])  # noqa: E731
    return DatasetTask("gsm8k", [conv(r) for r in ds["train"]], [conv(r) for r in ds["test"]])


def make_task(name: str, digits: int = 2):
    """A task by name (TASKS): 'add', 'addsteps', 'sums<N>' (N operands, 2..16), 'sumsmix' (heavy-tailed N), 'sums'
    (= sums5), 'words' (word problems for a pretrained chat model), 'jsonl:PATH', 'gsm8k' or
    'rg:NAME[:FIELD=VALUE...][,NAME...]'. `digits` only applies to the arithmetic tasks (tiny-sums is made for 'sums'
    with digits=1)."""
    try:  # a bad operand count or digit count: the task's ValueError, as a message naming the flags
        if name in ("add", "addsteps"):
            return ArithmeticTask(name, digits)
        if re.fullmatch(r"sums(\d+|mix)?", name):
            ops = name[4:] or "5"
            return SumsTask(ops if ops == "mix" else int(ops), digits)
    except ValueError as e:
        raise SystemExit(f"--task {name} --digits {digits}: {e}") from None
    if name == "words":
        return WordProblemTask()
    if name.startswith("jsonl:"):
        return load_jsonl_task(name[len("jsonl:"):])
    if name == "gsm8k":
        return load_gsm8k()
    if name.startswith("rg:"):
        return ReasoningGymTask(name[len("rg:"):])
    raise SystemExit(f"unknown task {name!r}: choose {TASKS}")

TASKS = ("add, addsteps, sums (= sums5), sums<N> (N operands, 2..16), sumsmix, words, jsonl:PATH, gsm8k or "
         "rg:NAME[:FIELD=VALUE...][,NAME...] (reasoning-gym)")
"""Every name make_task takes: the --task help is made from it, so it cannot go stale."""



def drop_long_prompts(task, tok, limit: int) -> dict[str, int]:
    """Remove from a task's fixed pools (a dataset's train and test records) every prompt whose chat-encoded length
    exceeds `limit` tokens (the context less the completion budget), so no batch fails half-way through a run.
    Returns how many left each pool; refuses when a pool is left empty. Generated tasks have no pools: {}."""
    dropped = {}
    for split in ("train", "test"):
        pool = getattr(task, split, None)
        if not isinstance(pool, list):
            continue
        lengths = [len(ids) for ids in common.encode_prompts(tok, [e.prompt for e in pool])]
        setattr(task, split, [e for e, n in zip(pool, lengths) if n <= limit])
        dropped[split] = len(pool) - len(getattr(task, split))
        if pool and not getattr(task, split):
            raise SystemExit(f"every {split} prompt of task {task.name!r} is longer than {limit} tokens (the context "
                             f"less --max-new-tokens): raise the context or lower --max-new-tokens")
    return dropped


# ---- rewards: built-in or your own, combined by weight ----
def reward_correct(prompts, completions, answers, task, **kw) -> list[float]:
    """1 for the task's verified final answer, else 0 (the task's own verifier)."""
    return [task.verify(c, a)[0] for c, a in zip(completions, answers)]


def reward_format(prompts, completions, answers, task, **kw) -> list[float | None]:
    """1 when the response is in the form the task asks for (the verifier's 'format'; None where it has none)."""
    return [task.verify(c, a)[1].get("format") for c, a in zip(completions, answers)]


def reward_length(prompts, completions, answers, task, completion_lengths=None, max_new_tokens=None, **kw):
    """-(completion tokens / generation budget): a length penalty in [-1, 0]."""
    return [-n / max(1, max_new_tokens) for n in completion_lengths]


BUILTIN_REWARDS = {"correct": reward_correct, "format": reward_format, "length": reward_length}


class Rewards:
    """`--reward NAME[:WEIGHT] ...`: built-ins (correct, format, length) or `module:function` importable from the
    working directory, each called with TRL's convention, fn(prompts, completions, answers, **kw) -> one float (or
    None: not applicable, counted as 0) per completion; kw holds task, completion_lengths and max_new_tokens. The
    total is the weighted sum; `terms` keeps each function's values, logged as reward/<name>."""

    def __init__(self, specs):
        self.terms = []
        for spec in specs:
            name, _, weight = spec.rpartition(":")
            try:
                weight = float(weight)
            except ValueError:
                name, weight = spec, 1.0
            name = name or spec
            self.terms.append((name, self._resolve(name), weight))
        if not self.terms:
            raise SystemExit("--reward needs at least one term, e.g. --reward correct format:0.1")

    @staticmethod
    def _resolve(name: str):
        if name in BUILTIN_REWARDS:
            return BUILTIN_REWARDS[name]
        module, _, attr = name.partition(":")
        if not attr:
            raise SystemExit(f"--reward {name!r}: not a built-in ({', '.join(BUILTIN_REWARDS)}) nor module:function")
        sys.path.insert(0, str(Path.cwd()))
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise SystemExit(f"--reward {name!r}: cannot import it ({type(e).__name__}: {e})")

    def __call__(self, prompts, completions, answers, **kw) -> tuple[list[float], dict[str, list]]:
        total, terms = [0.0] * len(completions), {}
        for name, fn, weight in self.terms:
            try:
                values = fn(prompts=prompts, completions=completions, answers=answers, **kw)
            except Exception as e:  # noqa: BLE001 - name the user's function, not a frame deep inside it
                raise SystemExit(f"reward {name!r} raised {type(e).__name__}: {e}")
            values = list(values) if values is not None else []
            if len(values) != len(completions):
                raise SystemExit(f"reward {name!r} returned {len(values)} values for {len(completions)} completions")
            bad = next(((i, v) for i, v in enumerate(values) if v is not None and not (
                isinstance(v, (int, float, np.number)) and math.isfinite(float(v)))), None)
            if bad is not None:
                raise SystemExit(f"reward {name!r} returned {bad[1]!r} for completion {bad[0]}: need a finite number "
                                 "or None")
            terms[name] = values
            total = [t + weight * float(v or 0.0) for t, v in zip(total, values)]
        return total, terms

# ---- the flags every LLM script takes ----
@dataclass
class LLMArgs:
    """Plumbing flags: run bookkeeping, model and device, engine, optimiser and schedule, micro-batching, evaluation,
    checkpoints, LoRA. A script's Args extends it with its method's fields."""
    exp_name: str = ""
    """name of the run: the output folder is out_dir/exp_name (empty: the script's own name)"""
    seed: int = 0
    """random seed: prompts and sampling of step s depend only on (seed, s, rank), which makes resume exact"""
    track: bool = False
    """log to Weights & Biases as well (WANDB_MODE=offline works without network)"""
    out_dir: str = "runs"
    """where metrics.jsonl, summary.json, the curve and checkpoints go"""
    model: str = "tiny-0.6m"
    """tiny-0.6m, tiny-5m, tiny-sums, smollm2-135m, a Hugging Face id or a local path"""
    task: Annotated[str, tyro.conf.arg(help=f"training and held-out task: {TASKS}")] = "add"
    digits: int = 2
    """operand digits of the arithmetic tasks (training and the main held-out eval)"""
    device: str = "auto"
    """auto (CUDA if present), cpu or cuda"""
    threads: int = 2
    """torch CPU threads per process"""
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """compute dtype: auto = bf16 autocast on CUDA (fp32 weights, optimiser, log-softmax and losses), fp32 on CPU"""
    attention_fp32: bool = False
    """under bf16 autocast, attention (SDPA) in fp32 while every projection stays a bf16 matmul: on CPU PyTorch's bf16
    flash-attention kernel is the slower one (fp32_attention); one process only"""
    inverse_cdf_sampling: bool = False
    """draw each sampled token by inverse CDF (one uniform per row, inverse_cdf_draw) instead of torch.multinomial's
    exponential per vocabulary entry: the same distribution, another random stream; on CPU the exponentials were a
    sixth of SmolLM2-135M's generation time (a 49,152-token vocabulary); HF engine only"""
    keep_freed_memory: bool = False
    """glibc's malloc serves every block from its heap and keeps what the process frees (keep_freed_memory): with a
    real vocabulary the [rows x vocab] tensors of each decoding step and update then reuse warm pages instead of
    faulting in fresh ones (SmolLM2-135M on CPU: an update 1.6x faster); resident memory stays at its peak; glibc"""
    fused_adamw: bool = False
    """AdamW's fused kernel: one pass over all parameters, the same update up to rounding (on CPU 6x faster than the
    default per-parameter loop for SmolLM2-135M); off by default, so that runs repeat the committed results exactly"""
    engine: Literal["hf", "vllm"] = "hf"
    """rollout engine: Hugging Face generate (CPU or GPU) or vLLM (GPU)"""
    vllm_gpu_memory: float = 0.3
    """fraction of GPU memory vLLM may take (the trainer shares the GPU)"""
    vllm_max_model_len: int = 2048
    """vLLM's context (prompt + completion tokens); longer dataset prompts are dropped when the run starts"""
    vllm_sleep: bool = False
    """vLLM sleep mode: after each generate call its weights go to host memory and its KV cache is freed (level 1),
    so training has the GPU; woken for the weight sync and the next call"""
    max_new_tokens: int = 8
    """generation budget per completion"""
    temperature: float = 1.0
    """sampling temperature (the trainer scores with the same temperature)"""
    top_p: float = 1.0
    """nucleus sampling threshold"""
    steps: int = 400
    """rollout batches"""
    micro_batch_size: int = 256
    """sequences per forward/backward (gradient accumulation inside a mini-batch)"""
    lr: float = 1e-4
    """peak learning rate (AdamW); 1e-3 collapses the tiny policy, real LLMs want about 1e-6"""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """after warm-up: constant, or cosine decay to 10% over all optimiser steps"""
    warmup_steps: int = 0
    """linear warm-up (optimiser steps)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm (> 0; a large value such as 1e9 turns it off)"""
    grad_checkpointing: bool = False
    """recompute each decoder layer in the backward (HF, non-reentrant): activations of one layer instead of all;
    off by default: the tiny CPU default needs no memory and its update takes 2.2x as long with it (0.20 vs 0.09 s
    for 256 sequences on one thread; recomputed layers also run every row's prompt, see common.prompt_shared_hidden);
    on for real models on a GPU (benchmarks/results/memory_plan.md)"""
    eval_every: int = 25
    """rollout batches between held-out evaluations"""
    eval_examples: int = 500
    """held-out prompts for greedy accuracy (0 skips the evaluations: the accuracies read nan)"""
    pass_k: int = 8
    """k of pass@k (on the first 100 held-out prompts; 0 = off)"""
    eval_hard: bool = True
    """also evaluate one digit harder than training (out of distribution)"""
    save_every: int = 0
    """rollout batches between checkpoints (0 = only at the end)"""
    resume: str = ""
    """checkpoint folder to resume from (exact: same metrics as an uninterrupted run)"""
    lora_rank: int = 0
    """LoRA rank through peft (0 = full fine-tuning): frozen base weights, a KL reference = the base (no second copy)"""
    lora_alpha: float = 16
    """LoRA scale alpha: each adapted layer computes W x + (alpha / rank) B A x"""
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """layers that get adapters (module names): by default every attention and MLP projection of Llama-style models"""

    def __post_init__(self):
        if not self.exp_name:  # the script's file name: algos/grpo.py -> grpo
            self.exp_name = Path(getattr(sys.modules.get(type(self).__module__), "__file__", "run")).stem


def check_plumbing(args: LLMArgs) -> None:
    """Fail early on a bad plumbing flag, naming it, instead of deep inside torch or transformers (Run calls it; a
    script without Run calls it from its check_args). Each script still checks its own flags; of those, the ones whose
    name says what they are (rates *_lr, weights *_coef, importance-weight caps *_cap, counts *_rows, *_samples,
    *_rollouts, and agg_const) must not be negative here too."""
    flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731
    for name in ("threads", "micro_batch_size", "eval_every", "max_grad_norm", "temperature", "vllm_max_model_len"):
        if not getattr(args, name) > 0:
            hint = " (a large value such as 1e9 turns clipping off)" if name == "max_grad_norm" else ""
            raise SystemExit(f"{flag(name)} {getattr(args, name)}: must be positive{hint}")
    for name in ("lr", "warmup_steps", "weight_decay", "eval_examples", "pass_k", "save_every"):
        if getattr(args, name) < 0:
            raise SystemExit(f"{flag(name)} {getattr(args, name)}: must not be negative")
    for field in dataclasses.fields(args):  # a script's own rates, weights, caps and counts, named by kind
        value = getattr(args, field.name)
        if field.name.endswith(("_lr", "_coef", "_cap", "_rows", "_samples", "_rollouts")) or field.name == "agg_const":
            if not isinstance(value, bool) and isinstance(value, (int, float)) and value < 0:
                raise SystemExit(f"{flag(field.name)} {value}: must not be negative")
    if not 0 < args.top_p <= 1:
        raise SystemExit(f"--top-p {args.top_p}: must be in (0, 1] (1 = no nucleus cut)")
    if not 0 < args.vllm_gpu_memory <= 1:
        raise SystemExit(f"--vllm-gpu-memory {args.vllm_gpu_memory}: a fraction of the GPU's memory, in (0, 1]")
    if args.lora_rank and not args.lora_alpha > 0:
        raise SystemExit(f"--lora-alpha {args.lora_alpha}: must be positive")
    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", args.device):
        raise SystemExit(f"--device {args.device!r}: use auto, cpu, cuda, cuda:N or mps")
    hardest = args.digits + (1 if getattr(args, "eval_hard", False) else 0)  # --eval-hard adds a digit
    if re.fullmatch(r"add|addsteps|sums(\d+|mix)?", args.task) and not 1 <= args.digits <= hardest <= 9:
        raise SystemExit(f"--digits {args.digits}: the arithmetic tasks take 1 to 9 digits"
                         + (" (8 at most with --eval-hard, which evaluates one digit more)" if 1 <= args.digits <= 9
                            else ""))


# ---- loading, LoRA, the optimiser step, step-global counts ----
def load_policy(args: LLMArgs, accel, with_ref: bool = False):
    """(policy in train mode, tokenizer, frozen reference or None, Sampler): gradient checkpointing when asked, LoRA
    adapters when --lora-rank > 0 (add_lora), the reference only when asked (a KL term; with LoRA the same model with
    its adapters disabled, common.AdaptersOff, not a copy), the sampler (common.Sampler: the trainer, a bf16 copy, a
    gathered copy or a vLLM engine; LoRASampler for LoRA), then policy and reference sharded with FSDP2 when several
    processes run (common.shard: after peft has wrapped the layers). Full fine-tuning with several processes: no rank
    loads the whole model, rank 0 reads the weights into the shards (algos/_shard.py), the copies are made from them."""
    for flag in ("attention_fp32", "inverse_cdf_sampling"):  # the CPU speed-ups of benchmarks/profile_smollm2.py
        if getattr(args, flag) and (accel.num_processes > 1 or args.engine != "hf"):
            raise SystemExit(f"--{flag.replace('_', '-')} runs in one process with --engine hf")
    if args.keep_freed_memory:  # before the weights and every tensor after them
        keep_freed_memory()
    engine = None
    if args.engine == "vllm":
        from algos._vllm import VLLMEngine

        engine = VLLMEngine(common.resolve_model_path(args.model), args.vllm_gpu_memory, args.vllm_max_model_len,
                            seed=args.seed + accel.process_index, sleep=args.vllm_sleep)
    if accel.num_processes > 1 and not args.lora_rank:
        amp = args.dtype == "bf16" or args.dtype == "auto" and accel.device.type == "cuda"  # as common.load_model
        return load_sharded(args.model, accel, amp, args.grad_checkpointing, with_ref, engine)
    model, tok = common.load_model(args.model, accel.device, args.dtype)
    model.train()
    if args.attention_fp32:
        fp32_attention(model)
    if args.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.lora_rank:
        model = add_lora(model, args)
    ref_model = None
    if with_ref:
        ref_model = common.AdaptersOff(model) if args.lora_rank else copy.deepcopy(model).eval().requires_grad_(False)
    sampler = (LoRASampler if args.lora_rank else common.Sampler)(model, engine, sharded=accel.num_processes > 1)
    sampler.draw = inverse_cdf_draw if args.inverse_cdf_sampling else None
    ref_model = ref_model if args.lora_rank else common.shard(ref_model, accel)  # AdaptersOff: sharded with the policy
    return common.shard(model, accel), tok, ref_model, sampler


def inverse_cdf_draw(logprobs: torch.Tensor) -> torch.Tensor:
    """One token per row of [B, V] log-probs (after temperature and top-p), [B, 1]: the first index whose float64
    cumulative probability exceeds u * total, u uniform in [0, 1) (a token of probability 0 is never drawn)."""
    cdf = logprobs.double().exp().cumsum(-1)
    u = torch.rand(len(cdf), 1, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[1] - 1)


def keep_freed_memory() -> None:
    """--keep-freed-memory: glibc's malloc serves every block from its heap and keeps what this process frees for its
    next allocations instead of handing it back to the system. Why: with a real vocabulary each decoding step
    allocates and frees several [batch x vocab] fp32 tensors (6 MiB at 32 x 49,152: logits, temperature, log-softmax,
    the sampling draw) and each update several [positions x vocab] ones (75 MiB for 8 x 48 positions), above glibc's
    threshold for serving a block by a mapping of its own, so each is mapped, faulted in page by page (zero-filled by
    the kernel) and unmapped again; with it, they come from memory the process already holds (the test of this
    function counts the page faults of a decoding call both ways; benchmarks/results/smollm2_step.md times SmolLM2's
    step with and without it). It changes no computation. The price: resident memory stays at its peak."""
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        raise SystemExit("--keep-freed-memory needs Linux with glibc (its mallopt)")
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4  # glibc's malloc.h
    if not (mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, 2**31 - 1) and mallopt(M_TOP_PAD, 64 << 20)):
        raise SystemExit("--keep-freed-memory: glibc's mallopt refused the settings")


def fp32_attention(model) -> None:
    """--attention-fp32: the model's scaled-dot-product attention takes fp32 queries, keys and values (outside autocast)
    and returns its output in their dtype, so only the attention kernel changes precision, in generation and in the
    update alike. Why: on CPU, PyTorch's bf16 flash-attention kernel is slower than its fp32 one while bf16 matmuls run
    4x faster than fp32 ones; in one update of SmolLM2-135M its backward took 1.48 s in bf16 and 0.62 s in fp32
    (benchmarks/results/smollm2_step_profile.txt)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model, "amp_dtype", None) is None:
        raise SystemExit("--attention-fp32 changes bf16 attention only: use it with --dtype bf16")

    def sdpa_fp32(module, query, key, value, attention_mask, **kw):  # sdpa_mask's masks are boolean (or None)
        with torch.autocast(query.device.type, enabled=False):
            out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                                  **kw)
        return out.to(query.dtype), weights

    AttentionInterface.register("sdpa_fp32", sdpa_fp32)
    AttentionMaskInterface.register("sdpa_fp32", sdpa_mask)  # else a name Hugging Face does not know gets no mask
    model.set_attn_implementation("sdpa_fp32")


def add_lora(model, args: LLMArgs):
    """The model wrapped by peft with LoRA adapters (--lora-rank, --lora-alpha, --lora-targets; no dropout): the base
    weights frozen, each target layer computing W x + (alpha / rank) B A x, with B = 0 at the start (the policy starts
    as the base model). Only the adapters train: AdamW keeps no state for the frozen weights."""
    if args.lora_rank < 0:
        raise SystemExit(f"--lora-rank must be 0 (full fine-tuning) or positive, got {args.lora_rank}")
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise SystemExit("--lora-rank needs peft: pip install peft (pinned in requirements.txt)")
    config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                        target_modules=list(args.lora_targets), task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, config)
    except ValueError as e:  # no module of the model matches the targets
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise SystemExit(f"--lora-targets {' '.join(args.lora_targets)}: {e}; this model's linear layers: {linear}")


def merged_weights(model):
    """(name, tensor) of a LoRA model's weights as the plain model names them, each adapted layer's weight merged in
    fp32: W + (alpha / rank) B A. Each tensor is gathered when FSDP2 shards it (a collective: every rank iterates)."""
    full = lambda p: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()  # noqa: E731
    base = model.get_base_model()
    for name, p in base.named_parameters():
        if ".base_layer." in name:  # an adapted layer: its lora_A and lora_B are merged here, never sent alone
            m = base.get_submodule(name.split(".base_layer.")[0])
            p = full(p) + m.scaling["default"] * (full(m.lora_B["default"].weight) @ full(m.lora_A["default"].weight))
        if ".lora_" not in name:
            yield name.replace(".base_layer", ""), full(p)


class LoRASampler(common.Sampler):
    """The sampler of a LoRA policy (common.Sampler's paths, with merged weights wherever it decodes with a copy):
    - the trainer itself (CPU, or fp32 on a GPU) decodes through its adapters, W x + s B A x: the very computation of
      the loss, so the update stays exactly on-policy (no importance weight);
    - the bf16 copy on one GPU, the gathered copy of a sharded policy and vLLM get merged weights (merged_weights:
      W + s B A summed in fp32, then rounded once): a plain model, which the static cache compiles and vLLM loads as it
      is, one matmul per layer instead of three; the truncated importance weight covers what rounding changes."""

    def __init__(self, model, engine=None, sharded: bool = False, fast: bool | None = None):
        super().__init__(model, engine, sharded, fast)
        if self.full is not None:  # the base class copied the peft model: a plain model with the adapters merged
            self.full = self.full.merge_and_unload()

    def module(self):
        if self.full is not None or not (self.fast and self.half):
            return super().module()
        if self.bf16 is None:  # not a submodule of the trainer: not in model.parameters() nor its state_dict
            self.bf16 = copy.deepcopy(self.model).merge_and_unload().to(self.model.amp_dtype).eval()
        self._load(self.bf16)
        return self.bf16

    @torch.no_grad()
    def _load(self, module) -> None:
        params = dict(module.named_parameters())
        for name, w in merged_weights(self.model):
            params[name].copy_(w)

    @torch.no_grad()
    def refresh(self) -> None:
        """After an optimiser step: the merged weights into the gathered copy, or to the vLLM engine (whose
        sync_weights reads named_parameters() of what it is given)."""
        if self.full is not None:
            self._load(self.full)
        if self.engine is not None:
            self.engine.sync_weights(type("Merged", (), {"named_parameters": lambda _: merged_weights(self.model)})())


def lr_factor(step: int, total: int, args: LLMArgs) -> float:
    """Linear warm-up over --warmup-steps, then constant or cosine decay to 10% at optimiser step `total`."""
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    if args.lr_schedule == "constant":
        return 1.0
    progress = (step - args.warmup_steps) / max(1, total - args.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def optimizer_step(model, opt, args: LLMArgs, step: int, total: int, sampler=None) -> float:
    """NaN guard, clip, scheduled lr (optimiser step `step` of `total`), step, then the sampler's refresh; returns
    the gradient norm. With several processes FSDP2 has already summed the gradients over ranks (the loss used
    step-global normalisers) and the norm is the global one."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
    grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor when sharded
    if not math.isfinite(grad_norm):  # the same global value on every rank, so all ranks stop together
        raise SystemExit(f"non-finite loss or gradient at optimiser step {step}; the last checkpoint is "
                         "intact. Lower --lr or check the rewards.")
    for group in opt.param_groups:
        group["lr"] = args.lr * lr_factor(step, total, args)
    opt.step()
    if sampler is not None:
        sampler.refresh()
    return grad_norm


def make_optimizer(params, args: LLMArgs) -> torch.optim.Optimizer:
    """AdamW at --lr with --weight-decay (the schedule is applied by optimizer_step); its fused kernel with
    --fused-adamw (flags of another script's own Args without it: the default loop)."""
    fused = getattr(args, "fused_adamw", False) or None  # None: PyTorch's default implementation
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, fused=fused)


# ---- the bookkeeping of a training run ----
class Run:
    """What every LLM script's main does around its algorithm, in one place: the accelerator (several processes
    under torchrun / accelerate launch), threads and seed, the task and its fixed held-out sets, resuming from
    --resume, the tracker (metrics.jsonl, samples.jsonl, wandb), per-step seeding and the progress bar, evaluation
    every --eval-every, checkpoints every --save-every, and the summary with its curve.

        run = llm.Run(args)
        model, tok, ref, sampler = llm.load_policy(args, run.accel)
        run.start(model, tok, opt, sampler)            # resume, then the step-0 evaluation
        for step, rng in run.steps():                  # every draw of a step depends on (seed, step, rank) only
            with run.timer("gen"): batch = rollout(...)
            with run.timer("train"): stats = update(...)
            run.log_step(step, batch, stats)           # rollout/ metrics, timings, evaluation, checkpoint
        return run.finish("GRPO")
    """

    def __init__(self, args: LLMArgs, eval_hard: bool | None = None, tasks: bool = True, total: int | None = None):
        from accelerate import Accelerator

        check_plumbing(args)
        self.args = args
        self.accel = Accelerator(cpu=common.get_device(args.device).type == "cpu" or args.device == "cuda" and
                                 not torch.cuda.is_available())
        self.rank, self.is_main = self.accel.process_index, self.accel.is_main_process
        torch.set_num_threads(args.threads)
        common.set_seed(args.seed)
        self.task = self.hard_task = None
        if tasks:
            self.task = make_task(args.task, args.digits)
            hard = args.eval_hard if eval_hard is None else eval_hard
            self.hard_task = make_task(args.task, args.digits + 1) if hard and hasattr(self.task, "digits") else None
            self.eval_sets = common.held_out_sets(self.task, args.eval_examples, self.hard_task)
        self.run_dir = Path(args.out_dir) / args.exp_name
        self.total = args.steps if total is None else total  # the last step (a script with stages: more)
        self.timer, self.history, self.extra, self.counters = common.Timer(), [], None, {}
        self.gen_tokens, self.gen_time, self.start_step, self.wall_before = 0, 0.0, 0, 0.0

    def start(self, model, tok, opt, sampler, extra: dict | None = None, evaluate=None,
              counters: dict | None = None) -> None:
        """Resume from --resume (weights, optimiser, counters, history; `extra` modules such as a critic), open the
        tracker and log the step-0 evaluation. `evaluate()` -> eval/ metrics (default: common.run_eval); `counters`:
        the script's own running totals (run.counters), saved in and restored from each checkpoint."""
        self.model, self.tok, self.opt, self.sampler, self.extra = model, tok, opt, sampler, extra
        context = getattr(model.config, "max_position_embeddings", None) if hasattr(model, "config") else None
        if self.args.engine == "vllm":  # the engine's own context is the limit then
            context = min(context or self.args.vllm_max_model_len, self.args.vllm_max_model_len)
        if self.task is not None and context:
            dropped = drop_long_prompts(self.task, tok, context - self.args.max_new_tokens)
            if any(dropped.values()):
                print(f"dropped prompts longer than {context - self.args.max_new_tokens} tokens: {dropped}")
                self.eval_sets = common.held_out_sets(self.task, self.args.eval_examples, self.hard_task)
        self.evaluate = evaluate or (lambda: common.run_eval(
            sampler, tok, self.task, self.eval_sets, self.args.max_new_tokens, self.args.pass_k, self.args.temperature,
            self.hard_task))
        state = common.load_checkpoint(self.args.resume, model, opt, extra) if self.args.resume else {}
        if self.args.resume:
            sampler.refresh()
        self.start_step, self.history = state.get("step", 0), state.get("history", [])
        self.counters = {k: state.get(k, v) for k, v in (counters or {}).items()}
        self.gen_tokens, self.gen_time = state.get("gen_tokens", 0), state.get("gen_time", 0.0)
        self.tracker = common.Tracker(self.run_dir, self.args, self.args.track, run_name=self.args.exp_name) \
            if self.is_main else None
        self.t_start = time.time() - state.get("wall_s", 0.0)
        if self.start_step == 0 and self.is_main:
            self.log(self.evaluate(), 0)

    def log(self, metrics: dict, step: int) -> None:
        self.history.append({"step": step, **metrics})
        if self.tracker is not None:
            self.tracker.log(metrics, step)

    def steps(self):
        """(step, rng) from the one after the last checkpoint to --steps, with torch's seed and the numpy generator
        derived from (seed, step, rank): a resumed run draws exactly what an uninterrupted one would."""
        self.bar = tqdm(range(self.start_step + 1, self.total + 1), desc=self.args.exp_name, dynamic_ncols=True,
                        disable=not self.is_main, initial=self.start_step, total=self.total)
        for step in self.bar:
            torch.manual_seed(hash((self.args.seed, step, self.rank)) % 2**31)
            yield step, np.random.default_rng([self.args.seed, step, self.rank])

    def log_step(self, step: int, batch: dict, stats: dict, extra: dict | None = None, group_size: int | None = None,
                 last: bool = False):
        """Log one rollout batch: rollout/ metrics (reward, length, truncation, tokens/s) and reward/ terms, the
        update's statistics, `extra` metrics, timings, the held-out evaluation every --eval-every; then the checkpoint.
        `last`: this step ends the run early (a budget ran out): evaluate and save as at --steps."""
        t = self.timer.pop()
        self.gen_tokens += int(batch["completion_mask"].sum())
        self.gen_time += t.get("gen", 0.0)
        metrics = {**common.rollout_metrics(batch["rewards"], batch["completion_mask"], batch["finish_reasons"],
                                            group_size or getattr(self.args, "group_size", 1), t.get("gen", 0.0)),
                   **batch.get("reward_terms", {}), **stats, **(extra or {}), "perf/lr": self.opt.param_groups[0]["lr"],
                   **{f"perf/{k}_s": v for k, v in t.items()}}
        last = last or step == self.total
        if self.is_main and (step % self.args.eval_every == 0 or last):
            metrics.update(self.evaluate())
        self.log(metrics, step)
        if self.is_main:
            self.bar.set_postfix(reward=f"{metrics['rollout/reward']:.2f}", acc=f"{self.last('eval/acc'):.2f}")
        if self.args.save_every and step % self.args.save_every == 0 or last:
            self.save(step)
        return metrics

    def last(self, key: str, default=float("nan")):
        """The last logged value of `key`."""
        return next((h[key] for h in reversed(self.history) if key in h), default)

    def save(self, step: int) -> None:
        """A checkpoint (every rank: shards when sharded) with the counters and history that make resume exact."""
        common.save_checkpoint(self.run_dir / "checkpoint", self.accel.unwrap_model(self.model), self.tok, self.opt,
                               {"step": step, "history": self.history, "wall_s": time.time() - self.t_start,
                                "gen_tokens": self.gen_tokens, "gen_time": self.gen_time, **self.counters}, self.extra)

    def finish(self, title: str, extra: dict | None = None, hlines: dict | None = None) -> dict:
        """summary.json (the shared keys, plus `extra`) and curve.png on the main process; {} on the others."""
        if not self.is_main:
            return {}
        summary = {**common.summarize(self.history, self.gen_tokens, self.gen_time, time.time() - self.t_start),
                   **(extra or {})}
        where = f" on {self.task.name}" if self.task is not None else ""
        common.save_curve(self.history, self.run_dir / "curve.png", f"{title}{where} ({self.args.model})", hlines)
        return self.tracker.finish(summary)
