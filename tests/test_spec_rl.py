"""algos/spec_rl.py: SPEC-RL drafts are exact for a fresh draft (whole 5-token sequences, drafts of up to 4 old
tokens, a context-dependent policy, old completions of different lengths, with and without n-gram drafts after
the first rejection), the reuse rate, the int8 copy, GRPO with speculative rollouts learns like plain GRPO
through the same sampler with fewer target forwards, bad input.

The distribution tests use only public names (PrevDrafter of algos/spec_rl.py; spec_generate, NgramDrafter,
accept_prob of the shared sampler algos/_speculative.py) and the drafter attributes the training loop sets
(prior, plen)."""
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from algos import _speculative as sampler
from algos import spec_rl

V = 5


class ToyBigram(torch.nn.Module):
    def __init__(self, table):
        super().__init__()
        self.table = torch.nn.Parameter(table.clone(), requires_grad=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                logits_to_keep=1):
        return SimpleNamespace(logits=self.table[input_ids][:, -logits_to_keep:], past_key_values=None)


VC, MC = 4, 3  # vocabulary and context classes of the context-dependent toy policy
EOS = 3


class ToyContextLM(torch.nn.Module):
    """Next-token logits = table[last token] + ctx[(sum of every visible token) mod MC]: depends on the whole
    context (accepted drafts included). Its "KV cache" is the ids fed so far; it attends where the mask is 1."""

    def __init__(self, table, ctx):
        super().__init__()
        self.table = torch.nn.Parameter(table.clone(), requires_grad=False)
        self.ctx = torch.nn.Parameter(ctx.clone(), requires_grad=False)

    def logits_of(self, ids, mask):
        return self.table[ids] + self.ctx[(ids * mask).cumsum(1) % MC]

    def forward(self, input_ids, attention_mask=None, past_key_values=None, logits_to_keep=1, **kw):
        ids = input_ids if past_key_values is None else torch.cat([past_key_values, input_ids], 1)
        mask = torch.ones_like(ids) if attention_mask is None else attention_mask
        return SimpleNamespace(logits=self.logits_of(ids, mask)[:, -logits_to_keep:], past_key_values=ids)

    def next_probs(self, context):
        t = torch.tensor([context])
        return self.logits_of(t, torch.ones_like(t))[0, -1].softmax(-1)


def old_and_new_policy(seed=0, noise=0.6):
    """The current policy and last epoch's, a small update apart (chains of accepted old tokens are common)."""
    g = torch.Generator().manual_seed(seed)
    t, c = torch.randn(VC, VC, generator=g) * 1.5, torch.randn(MC, VC, generator=g) * 1.5
    old = ToyContextLM(t + noise * torch.randn(VC, VC, generator=g), c + noise * torch.randn(MC, VC, generator=g))
    return old, ToyContextLM(t, c)


def exact_sequences(model, prompt, L, eos):
    """P(completion) under plain sampling for every completion (length L, or ending at EOS)."""
    out = {}

    def rec(seq, pr):
        if len(seq) == L or (seq and seq[-1] == eos):
            out[tuple(seq)] = pr
            return
        p = model.next_probs(prompt + seq)
        for v in range(VC):
            rec(seq + [v], pr * float(p[v]))

    rec([], 1.0)
    return out


def chi2_pvalue(comp, probs) -> float:
    """Pearson chi-square of sampled completions against `probs` (cells with expected count < 5 pooled)."""
    n, counts = len(comp), {}
    for c in comp:
        counts[tuple(c)] = counts.get(tuple(c), 0) + 1
    assert all(k in probs for k in counts), "a completion plain sampling never makes"
    obs, exp, pooled_o, pooled_e = [], [], 0, 0.0
    for k, p in probs.items():
        if p * n < 5:
            pooled_o, pooled_e = pooled_o + counts.get(k, 0), pooled_e + p * n
        else:
            obs.append(counts.get(k, 0))
            exp.append(p * n)
    obs.append(pooled_o)
    exp.append(pooled_e)
    o, e = torch.tensor(obs, dtype=torch.float64), torch.tensor(exp, dtype=torch.float64)
    stat = ((o - e) ** 2 / e).sum()
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2, dtype=torch.float64), stat / 2))


def expected_reused(old, new, prompt, k, eos):
    """E[accepted old tokens in the first round] = sum_j P(the first j old tokens exist and are all accepted);
    P(a given old prefix x_1..x_j is accepted) = prod_i p_old(x_i) min(1, p_new/p_old) = prod_i min(p_old, p_new)."""
    total = 0.0

    def rec(seq, w):
        nonlocal total
        po, pn = old.next_probs(prompt + seq), new.next_probs(prompt + seq)
        for v in range(VC):
            wv = w * float(torch.minimum(po[v], pn[v]))
            total += wv
            if v != eos and len(seq) + 1 < k:
                rec(seq + [v], wv)

    rec([], 1.0)
    return total


G, GROUPS, L = 8, 2000, 5  # 16000 rollouts of up to 5 tokens; the first round drafts up to 4 old tokens


@pytest.mark.parametrize("then", [False, True], ids=["prev", "prev+ngram"])
def test_prev_drafter_is_lossless_past_position_0(then):
    """SPEC-RL: last epoch's completion o' (a fresh sample of p_old, EOS ends some early, so rows draft different
    lengths) is the draft with q = p_old(. | x, o'_<j); the new rollouts must follow p_new as whole sequences."""
    torch.manual_seed(0)
    old, new = old_and_new_policy()
    prompts = [[1]] * GROUPS
    comp_old, _, _, probs_old = sampler.spec_generate(old, prompts, G, L, 0, EOS, None, 0, keep_probs=True)
    assert len({len(c) for c in comp_old}) >= 3  # old drafts of different lengths
    ng = sampler.NgramDrafter(G, VC, 2) if then else None
    drafter = spec_rl.PrevDrafter(G, ng, 4) if then else spec_rl.PrevDrafter(G)
    drafter.prior = {g: [(comp_old[r], probs_old[r]) for r in range(g * G, (g + 1) * G)] for g in range(GROUPS)}
    drafter.plen = [1] * (G * GROUPS)
    if then:
        ng.extra = {g: [[1] + comp_old[r] for r in range(g * G, (g + 1) * G)] for g in range(GROUPS)}
    comp, _, st, _ = sampler.spec_generate(new, prompts, G, L, 0, EOS, drafter, gamma=4)
    pval = chi2_pvalue(comp, exact_sequences(new, [1], L, EOS))
    assert pval > 1e-3, pval
    rows = G * GROUPS
    if then:  # rows rejected in the first round keep drafting (n-gram)
        assert st.rounds_with_draft > 1.2 * rows, st.rounds_with_draft
    else:
        # old tokens are reused at the rate speculative sampling predicts, counted over all 4 drafted positions
        want = expected_reused(old, new, [1], 4, EOS)
        assert want > 1.5  # chains well past position 0
        assert abs(st.accepted / rows - want) < 0.05, (st.accepted / rows, want)


def test_prev_drafter_wrong_accept_rule_fails_the_same_test(monkeypatch):
    """min(1, q/p) in place of min(1, p/q): the same whole-sequence test rejects it."""
    monkeypatch.setattr(sampler, "accept_prob", lambda p_x, q_x: torch.clamp(q_x / p_x.clamp(min=1e-30), max=1.0))
    torch.manual_seed(0)
    old, new = old_and_new_policy()
    prompts = [[1]] * GROUPS
    comp_old, _, _, probs_old = sampler.spec_generate(old, prompts, G, L, 0, EOS, None, 0, keep_probs=True)
    drafter = spec_rl.PrevDrafter(G)
    drafter.prior = {g: [(comp_old[r], probs_old[r]) for r in range(g * G, (g + 1) * G)] for g in range(GROUPS)}
    drafter.plen = [1] * (G * GROUPS)
    comp, _, _, _ = sampler.spec_generate(new, prompts, G, L, 0, EOS, drafter, gamma=4)
    assert chi2_pvalue(comp, exact_sequences(new, [1], L, EOS)) < 1e-6


def test_fake_int8_copy_is_close_but_not_equal():
    from common import load_model

    m, _ = load_model("tiny-0.6m")
    q = spec_rl.fake_int8_copy(m)
    w, wq = m.model.layers[0].mlp.up_proj.weight, q.model.layers[0].mlp.up_proj.weight
    assert not torch.equal(w, wq) and (w - wq).abs().max() <= w.abs().max() / 127
    assert not wq.requires_grad


SMALL = spec_rl.Args(steps=48, pool_size=128, eval_every=48, eval_examples=300, pass_k=0, eval_hard=False,
                     out_dir="", exp_name="t")


@pytest.mark.slow
def test_spec_rl_learns_like_plain_grpo_with_fewer_target_forwards(tmp_path):
    plain = spec_rl.main(replace(SMALL, drafter="none", out_dir=str(tmp_path / "plain")))
    spec = spec_rl.main(replace(SMALL, drafter="prev", out_dir=str(tmp_path / "prev")))
    # stated band: the same config with speculation off is the baseline; lossless rollouts keep the held-out
    # accuracy within 6 points of it (different random draws, so not identical)
    assert spec["eval_acc_end"] >= plain["eval_acc_end"] - 0.06, (spec, plain)
    assert spec["eval_acc_end"] >= spec["eval_acc_start"] + 0.04
    assert spec["row_calls_per_token"] < 0.8 * plain["row_calls_per_token"]
    assert spec["reused_frac"] > 0.3 and spec["logprob_mismatch"] < 1e-3


@pytest.mark.parametrize("drafter", ["ngram", "model", "self"])
def test_other_drafters_run(tmp_path, drafter):
    s = spec_rl.main(replace(SMALL, steps=5, pool_size=64, eval_every=5, eval_examples=20, drafter=drafter,
                             out_dir=str(tmp_path)))
    assert s["gen_tokens"] > 0 and s["logprob_mismatch"] < 1e-3 and 0 <= s["alpha"] <= 1


@pytest.mark.parametrize("change,msg", [({"group_size": 1}, "group-size"), ({"pool_size": 8}, "pool-size"),
                                        ({"temperature": 0.0}, "temperature"), ({"top_p": 0.0}, "top-p"),
                                        ({"task": "subtract"}, "unknown task")])
def test_bad_input(tmp_path, change, msg):
    with pytest.raises(SystemExit, match=msg):
        spec_rl.main(replace(SMALL, out_dir=str(tmp_path), **change))
