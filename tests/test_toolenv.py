"""algos/_toolenv.py: the key-value lookup environment, its SFT traces and the turn-by-turn episode runner."""
import numpy as np
import pytest
import torch

import common
from algos import _toolenv
from algos._toolenv import ERROR_OBS, END_OBS, LIMIT_REWARD, LookupEnv, TraceTask


def play_texts(env, seed, actions):
    out = [env.reset(seed)]
    for a in actions:
        out.append(env.step(a))
        if env.done:
            break
    return out


def test_same_seed_same_episode_and_seeds_differ():
    env = LookupEnv()
    acts = ["#a", "#b", "xx", "#c"]
    assert play_texts(env, 123, acts) == play_texts(LookupEnv(), 123, acts)
    assert len({LookupEnv().reset(s) + str(LookupEnv.episode(s)) for s in range(50)}) > 40
    store, query = LookupEnv.episode(7)
    assert len(store) == 4 and len(set(query)) == 3 and set(query) <= set(store)


def test_expert_solves_every_episode_in_four_turns():
    task = TraceTask()
    for e in task.sample("train", 30, np.random.default_rng(0)):
        store, q = LookupEnv.episode(e.seed)
        assert [a for a, _ in e.turns] == [f"#{k}" for k in q] + [f"!{sum(store[k] for k in q)}"]
        assert e.turns[0][1] == f"={store[q[0]]};" and e.solution == "".join(a + o for a, o in e.turns)
        env = LookupEnv()
        env.reset(e.seed)
        assert [env.step(a) for a, _ in e.turns][-1] == ("", 1.0, True)


@pytest.mark.parametrize("action", ["", "#", "#ab", "?a", "!", "!x1", "a", "#A", "!-3", "#z ", "\u00e9", "!1234567", "!1+=3", "!1+2=",
                                    "!=3"])
def test_every_malformed_action_gets_the_error_observation(action):
    env = LookupEnv()
    env.reset(5)
    if action.strip() == "#z":  # a well-formed lookup of a key that is not in the store is an error too
        assert "z" not in env.store
    obs, reward, done = env.step(action)
    assert (obs, reward, done) == (ERROR_OBS, 0.0, False)


def test_wrong_answer_ends_with_zero_and_right_answer_with_one():
    env = LookupEnv()
    env.reset(11)
    assert env.step(f"!{env.answer + 1}") == ("", 0.0, True)
    env.reset(11)
    assert env.step(f"!{env.answer}") == ("", 1.0, True)
    env.reset(11)
    assert env.step(f"!1+2={env.answer}") == ("", 1.0, True)  # the scratchpad is not checked, the sum is
    env.reset(11)
    assert env.step(f"!1+2={env.answer}0") == ("", 0.0, True)
    with pytest.raises(RuntimeError):
        env.step("#a")


def test_turn_limit_ends_with_the_stated_reward():
    env = LookupEnv(max_turns=3, max_context=100)
    env.reset(3)
    key = next(iter(env.store))
    assert not env.step(f"#{key}")[2] and not env.step("junk")[2]
    assert env.step(f"#{key}") == (END_OBS, LIMIT_REWARD, True)


def test_context_limit_ends_with_the_stated_reward():
    env = LookupEnv(max_turns=10, max_context=18)
    prompt = env.reset(3)
    assert len(prompt) == 6
    assert env.step("#q#q") == (ERROR_OBS, 0.0, False)  # 6 + 4 + 4 = 14 characters
    assert env.step("#q") == (END_OBS, LIMIT_REWARD, True)  # 14 + 2 + 4 > 18
    env = LookupEnv(max_turns=10, max_context=19)
    env.reset(3)
    key = next(iter(env.store))
    assert env.step(f"#{key}")[2] is False and env.step(f"#{key}")[0] == f"={env.store[key]};"  # 6 + 5 + 5
    assert env.step(f"#{key}") == (END_OBS, LIMIT_REWARD, True)  # a lookup whose answer would not fit
    with pytest.raises(ValueError):
        LookupEnv(max_context=2)


def test_held_out_split_is_disjoint():
    env = LookupEnv()
    test = env.seeds("test", 200, np.random.default_rng(0))
    train = env.seeds("train", 2000, np.random.default_rng(0))
    episode = lambda s: repr((sorted(LookupEnv.episode(s)[0].items()), LookupEnv.episode(s)[1]))  # noqa: E731
    assert not {episode(s) for s in test} & {episode(s) for s in train}
    assert 0.05 < np.mean([env.is_held_out(s) for s in range(2000)]) < 0.15


def test_play_appends_observations_and_records_masks():
    """The episode runner: action tokens (kind 1) carry behaviour log-probs, observation tokens (kind 2) are the
    environment's text, and the transcript equals prompt + decoded tokens."""
    torch.manual_seed(0)
    model, tok = common.load_model("tiny-0.6m")
    envs = [LookupEnv() for _ in range(6)]
    prompts = common.encode_prompts(tok, [e.reset(s) for e, s in zip(envs, range(6))])
    eps = _toolenv.play(model, tok, envs, prompts, 4)
    for e in eps:
        assert e.env.done and len(e.actions) == len(e.observations) <= e.env.max_turns
        assert len(e.ids) == len(e.kind) == len(e.logprobs) == len(e.turn)
        obs_text = tok.decode([t for t, k in zip(e.ids, e.kind) if k == 2])
        assert obs_text == "".join(e.observations)
        assert all(lp == 0.0 for lp, k in zip(e.logprobs, e.kind) if k == 2)
        assert all(lp < 0.0 for lp, k in zip(e.logprobs, e.kind) if k == 1)
        assert e.env.transcript == e.env.transcript[:6] + "".join(a + o for a, o in zip(e.actions, e.observations))


def test_episode_split_is_the_hash_of_store_and_query():
    """The default split is unchanged: an episode is held out when the md5 of (store, query) is 0 mod 10."""
    import hashlib

    env = LookupEnv()
    for s in range(300):
        store, query = LookupEnv.episode(s)
        h = int(hashlib.md5(repr((sorted(store.items()), query)).encode()).hexdigest(), 16) % 10
        assert env.is_held_out(s) == (h == 0) and env.split_of(s) == ("test" if h == 0 else "train")
    with pytest.raises(ValueError, match="env-split prompt"):
        env.seeds("val", 1, np.random.default_rng(0))


def test_prompt_split_never_trains_on_a_held_out_or_validation_prompt():
    """split='prompt': the visible prompt alone decides, so the test, validation and training prompts are disjoint
    (under the episode split a held-out episode's prompt does occur in training); deterministic in the seeds."""
    prompt = lambda s: "+".join(LookupEnv.episode(s)[1]) + "?"  # noqa: E731
    env = LookupEnv(split="prompt")
    got = {split: env.seeds(split, n, np.random.default_rng(i))
           for i, (split, n) in enumerate((("test", 300), ("val", 300), ("train", 3000)))}
    P = {k: {prompt(s) for s in v} for k, v in got.items()}
    assert not P["test"] & P["train"] and not P["val"] & P["train"] and not P["test"] & P["val"]
    assert len(P["test"]) >= 10 and len(P["val"]) >= 10 and len(P["train"]) >= 200
    assert all(LookupEnv(split="prompt").reset(s) == prompt(s) for s in got["test"][:20])
    assert got["test"][:20] == LookupEnv(split="prompt").seeds("test", 20, np.random.default_rng(0))
    for split in ("test", "val"):
        assert 0.05 < np.mean([env.split_of(s) == split for s in range(3000)]) < 0.15
    episode = LookupEnv()
    assert {prompt(s) for s in episode.seeds("test", 300, np.random.default_rng(0))} & \
        {prompt(s) for s in episode.seeds("train", 3000, np.random.default_rng(1))}
    with pytest.raises(ValueError, match="split"):
        LookupEnv(split="store")


def test_actions_cut_by_the_token_budget_are_counted_and_logged():
    """An action budget of one token never reaches EOS: every action is truncated, counted by play and logged by
    episode_metrics; with a budget that fits the expert's actions the same seeds show fewer."""
    from algos import multiturn_grpo as mt

    torch.manual_seed(0)
    model, tok = common.load_model("tiny-toolenv")
    counts = []
    for budget in (1, 6):
        envs = [LookupEnv() for _ in range(6)]
        prompts = common.encode_prompts(tok, [e.reset(s) for e, s in zip(envs, range(6))])
        eps = _toolenv.play(model, tok, envs, prompts, budget, greedy=True)
        m = mt.episode_metrics(eps)
        n = sum(len(e.actions) for e in eps)
        assert m["rollout/turns"] == n / 6 and m["rollout/truncated"] == sum(e.truncated for e in eps)
        counts.append(m["rollout/truncated_action_frac"])
    assert counts[0] == 1.0 and counts[1] < 0.5


# ---- CalculatorEnv: reasoning-gym arithmetic with a calculator tool ----
def random_expression(rng, depth: int = 0) -> tuple[str, "Fraction"]:
    """(text, exact value) of a random expression over integers, + - * /, parentheses and unary minus."""
    from fractions import Fraction

    if depth > 2 or rng.random() < 0.3:
        n = int(rng.integers(0, 1000))
        return str(n), Fraction(n)
    kind = rng.integers(0, 3)
    if kind == 0:
        text, v = random_expression(rng, depth + 1)
        return f"-({text})", -v
    (a, va), (b, vb) = random_expression(rng, depth + 1), random_expression(rng, depth + 1)
    op = "+-*/"[int(rng.integers(0, 4))]
    if op == "/" and vb == 0:
        op = "+"
    v = {"+": va + vb, "-": va - vb, "*": va * vb, "/": va / vb if vb else 0}[op]
    return (f"({a}{op}{b})" if kind == 1 else f"({a} {op} {b})"), v


def test_calculator_equals_python_arithmetic_on_random_expressions():
    """calculate() is exact (fractions): an integer where the value is whole, else 10 significant digits; Python's own
    float arithmetic on the same text agrees to 1e-9 relative."""
    from fractions import Fraction

    rng = np.random.default_rng(0)
    for _ in range(300):
        text, v = random_expression(rng)
        got, err = _toolenv.calculate(text)
        assert err is None, (text, err)
        if v.denominator == 1:
            assert got == str(v.numerator), text
        else:
            assert abs(Fraction(got) - v) <= abs(v) * 1e-9, text
        assert abs(float(Fraction(got)) - eval(text)) <= 1e-9 * max(1.0, abs(eval(text))), text  # noqa: S307 - our text
    assert _toolenv.calculate("( 56 + -33 ) - 84") == ("-61", None)
    assert _toolenv.calculate("7/2") == ("3.5", None) and _toolenv.calculate("-+-2.5*2") == ("5", None)


@pytest.mark.parametrize("text", ["2**3", "9**9**9", "__import__('os').system('true')", "x", "abs(-1)", "(1).real",
                                  "[1][0]", "'1'", "True", "1j", "1 if 1 else 2", "lambda: 1", "1; 2", "1 < 2",
                                  "1 // 2", "1 % 2", "1 << 99", "~1", "not 1", "1/0", "1/(2-2)", "", " ", "1+",
                                  "9" * 101, "(" * 60 + "1" + ")" * 60])
def test_calculator_refuses_everything_but_arithmetic(text):
    value, err = _toolenv.calculate(text)
    assert value is None and err
    env = _toolenv.CalculatorEnv(max_context=400)
    env.reset(3)
    assert env.step("#" + text) == (ERROR_OBS, 0.0, False)


def test_calculator_env_expert_solves_every_episode_in_two_turns():
    env = _toolenv.CalculatorEnv()
    seeds = env.seeds("train", 40, np.random.default_rng(0)) + env.seeds("test", 10, np.random.default_rng(1))
    for s in seeds:
        question = env.reset(s)
        assert question == env.entry["question"] and env.expert_action() == "#" + env.expression
        obs, r, done = env.step(env.expert_action())
        assert obs == f"={env.answer};" and (r, done) == (0.0, False)
        assert env.expert_action() == f"!{env.answer}" and env.step(env.expert_action()) == ("", 1.0, True)
    assert len({_toolenv.CalculatorEnv().reset(s) for s in seeds}) > 45


def test_calculator_env_rewards_only_the_right_answer_and_answers_errors():
    env = _toolenv.CalculatorEnv()
    for bad in ("", "3", "#", "!", "!x", "!1e3", "calc 1+2", "#import os"):
        env.reset(5)
        assert env.step(bad) == (ERROR_OBS, 0.0, False), bad
    assert env.step(f"!{int(env.answer) + 1}") == ("", 0.0, True)
    env.reset(5)
    assert env.step(f"!{env.answer}") == ("", 1.0, True)
    with pytest.raises(RuntimeError):
        env.step("!1")
    env = _toolenv.CalculatorEnv(max_turns=2)
    env.reset(5)
    assert env.step("#1+1") == ("=2;", 0.0, False) and env.step("#1+1") == (END_OBS, LIMIT_REWARD, True)
    env = _toolenv.CalculatorEnv(max_context=8)  # the characters after the question: `#1+1` and `=2;` fit, no more
    env.reset(5)
    assert env.step("#1+1") == ("=2;", 0.0, False) and env.step("#1") == (END_OBS, LIMIT_REWARD, True)
    with pytest.raises(ValueError):
        _toolenv.CalculatorEnv(split="store")


def test_calculator_env_held_out_questions_never_occur_in_training():
    env = _toolenv.CalculatorEnv()
    test = {env.problem(s)[1]["question"] for s in env.seeds("test", 100, np.random.default_rng(0))}
    train = {env.problem(s)[1]["question"] for s in env.seeds("train", 1000, np.random.default_rng(1))}
    assert len(test) > 80 and not test & train
    assert 0.05 < np.mean([env.is_held_out(s) for s in range(1000)]) < 0.15
    by_prompt = _toolenv.CalculatorEnv(split="prompt")
    val = {env.problem(s)[1]["question"] for s in by_prompt.seeds("val", 50, np.random.default_rng(2))}
    train_p = {env.problem(s)[1]["question"] for s in by_prompt.seeds("train", 500, np.random.default_rng(3))}
    assert len(val) > 40 and not val & train_p and not val & test
    with pytest.raises(ValueError, match="env-split prompt"):
        env.seeds("val", 1, np.random.default_rng(0))


def test_semi_online_accepts_the_calculator_experts_steps():
    """semi_online.py's match test on --env calc: the expert's calculator call and answer, or another expression worth
    the same, are accepted; a wrong value, a repeated calculation and a wrong answer are not."""
    from algos import semi_online

    env = _toolenv.CalculatorEnv()
    env.reset(7)
    assert semi_online.accepts(env, env.expert_action()) and semi_online.accepts(env, f"#{env.answer}+0")
    assert not semi_online.accepts(env, f"#{env.answer}+1") and not semi_online.accepts(env, f"!{int(env.answer) + 1}")
    env.step(env.expert_action())
    assert not semi_online.accepts(env, "#" + env.expression) and semi_online.accepts(env, env.expert_action())
    assert semi_online.expert_steps(semi_online.Args(env="calc")) == 2 and semi_online.expert_steps(semi_online.Args()) == 4
