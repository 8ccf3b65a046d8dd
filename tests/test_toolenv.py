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
