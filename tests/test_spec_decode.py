"""algos/spec_decode.py and the sampler it runs (algos/_speculative.py): losslessness on a tiny vocabulary (one
and two tokens; whole 5-token sequences with gamma >= 3 drafts, accepted chains, a context-dependent target,
ragged draft lengths and EOS), the wrong accept rule fails the same test, exact greedy with the real tiny models,
tokens per call against the formula, the kernel's reference, bad input."""
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from algos import _speculative as sampler
from algos import spec_decode as sd

V = 5  # toy vocabulary; token 4 plays EOS only where a test says so


class ToyBigram(torch.nn.Module):
    """A 'language model' whose next-token logits depend on the last real token only (a V x V table).

    Answers the HF call signature spec_decode uses (attention_mask, position_ids, past_key_values,
    logits_to_keep); it ignores the cache, which is exact for a bigram model."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.nn.Parameter(table.clone(), requires_grad=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                logits_to_keep=1):
        logits = self.table[input_ids][:, -logits_to_keep:]
        return SimpleNamespace(logits=logits, past_key_values=None)


def toy_pair(seed=0):
    g = torch.Generator().manual_seed(seed)
    return ToyBigram(torch.randn(V, V, generator=g) * 1.5), ToyBigram(torch.randn(V, V, generator=g) * 1.5)


def exact_two_token(target, prompt_tok, temperature, top_p):
    p1 = sampler.process_logits(target.table[prompt_tok], temperature, top_p)
    p2 = sampler.process_logits(target.table, temperature, top_p)  # [V, V]: row y1 = p(. | y1)
    return p1, p1[:, None] * p2


def empirical(comp, n):
    joint = torch.zeros(V, V)
    for c in comp:
        joint[c[0], c[1]] += 1
    return joint / n


N = 40000  # samples; TV noise ~ sqrt(V^2 / N) / 2 ~ 0.012


@pytest.mark.parametrize("drafter_kind,temperature,top_p,gamma", [
    ("model", 1.0, 1.0, 3), ("model", 0.7, 0.8, 2), ("ngram", 1.0, 1.0, 2), ("none", 1.0, 1.0, 0)])
def test_lossless_one_and_two_token_distribution(drafter_kind, temperature, top_p, gamma):
    torch.manual_seed(0)
    target, draft = toy_pair()
    prompt = [2]
    if drafter_kind == "model":
        drafter = sampler.ModelDrafter(draft, 0, temperature, top_p, False)
    elif drafter_kind == "ngram":  # deterministic drafts (one-hot q) from the siblings
        drafter = sampler.NgramDrafter(group_size=8, vocab=V, n_max=2)
    else:
        drafter = None
    comp, lps, st, _ = sampler.spec_generate(target, [prompt] * (N // 8), 8, 2, pad_id=0, eos_id=-1, drafter=drafter,
                                             gamma=gamma, temperature=temperature, top_p=top_p, waves=2)
    p1, joint = exact_two_token(target, prompt[0], temperature, top_p)
    emp = empirical(comp, N)
    tv1 = 0.5 * (emp.sum(1) - p1).abs().sum().item()
    tv2 = 0.5 * (emp - joint).abs().sum().item()
    assert tv1 < 0.02 and tv2 < 0.03, (tv1, tv2)
    # behaviour log-probs are the target's processed log-probs of the emitted tokens
    c, l = comp[0], lps[0]
    assert abs(l[0] - torch.log(p1[c[0]]).item()) < 1e-5
    if drafter_kind != "none" and top_p == 1.0:  # (with this toy pair the 0.8 nuclei barely overlap)
        assert st.accepted > 0


# ---- whole sequences, gamma >= 3: chains of accepted drafts, a context-dependent target, ragged drafts ----
VC, MC = 4, 3  # vocabulary and context classes of the context-dependent toy model


class ToyContextLM(torch.nn.Module):
    """Next-token logits = table[last token] + ctx[(sum of every visible token) mod MC]: the distribution depends
    on the whole context, accepted drafts included, so a rejected draft left visible in the cache (or a hole
    that is not masked) changes it. Its "KV cache" is the ids fed so far; it attends where attention_mask is 1."""

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

    def next_probs(self, context, temperature=1.0, top_p=1.0):
        t = torch.tensor([context])
        return sampler.process_logits(self.logits_of(t, torch.ones_like(t))[0, -1], temperature, top_p)


def context_pair(seed=0, noise=0.6):
    """A target and a draft close to it (acceptance ~0.9, so chains of 3-4 accepted drafts are common)."""
    g = torch.Generator().manual_seed(seed)
    t, c = torch.randn(VC, VC, generator=g) * 1.5, torch.randn(MC, VC, generator=g) * 1.5
    d, dc = t + noise * torch.randn(VC, VC, generator=g), c + noise * torch.randn(MC, VC, generator=g)
    return ToyContextLM(t, c), ToyContextLM(d, dc)


def exact_sequences(model, prompt, L, eos=-1, temperature=1.0, top_p=1.0) -> dict:
    """P(completion) under plain sampling, for every completion (length L, or ending at EOS)."""
    out = {}

    def rec(seq, pr):
        if pr == 0.0:
            return
        if len(seq) == L or (seq and seq[-1] == eos):
            out[tuple(seq)] = pr
            return
        p = model.next_probs(prompt + seq, temperature, top_p)
        for v in range(p.shape[0]):
            rec(seq + [v], pr * float(p[v]))

    rec([], 1.0)
    return out


def chi2_pvalue(comp, probs) -> float:
    """Pearson chi-square of the sampled completions against `probs` (cells with expected count < 5 pooled).
    A completion that plain sampling cannot produce fails at once."""
    n, counts = len(comp), {}
    for c in comp:
        counts[tuple(c)] = counts.get(tuple(c), 0) + 1
    impossible = [k for k in counts if k not in probs]
    assert not impossible, f"completions plain sampling never makes: {impossible[:3]}"
    obs, exp, pooled_o, pooled_e = [], [], 0, 0.0
    for k, p in probs.items():
        if p * n < 5:
            pooled_o, pooled_e = pooled_o + counts.get(k, 0), pooled_e + p * n
        else:
            obs.append(counts.get(k, 0))
            exp.append(p * n)
    if pooled_e > 0:
        obs.append(pooled_o)
        exp.append(pooled_e)
    o, e = torch.tensor(obs, dtype=torch.float64), torch.tensor(exp, dtype=torch.float64)
    stat = ((o - e) ** 2 / e).sum()
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2, dtype=torch.float64), stat / 2))


class RaggedDrafter:
    """A model drafter whose rows keep a random number (0..k) of their k drafts, drawn independently of the
    drafted tokens (so sampling stays exact): one target call verifies rows of different draft lengths."""

    name = "ragged"

    def __init__(self, inner, seed=0):
        self.inner, self.gen = inner, torch.Generator().manual_seed(seed)

    @property
    def calls(self):
        return self.inner.calls

    def reset(self, n_rows):
        self.inner.reset(n_rows)

    def propose(self, all_seqs, rows, k):
        toks, q, n = self.inner.propose(all_seqs, rows, k)
        return toks, q, torch.minimum(n, torch.randint(0, k + 1, (len(rows),), generator=self.gen))


NS, LS = 16000, 5  # samples; completion length (gamma >= 3 drafts fit: the first round has room for 4)
MULTI = {  # name: (drafter kind, gamma, temperature, top_p, eos, waves)
    "chain": ("model", 3, 1.0, 1.0, -1, 1),
    "chain-topp": ("model", 4, 0.7, 0.9, -1, 1),
    "ragged-eos": ("ragged", 4, 1.0, 1.0, 3, 1),
    "ngram": ("ngram", 3, 1.0, 1.0, -1, 2),
}


def run_multi(case, monkeypatch):
    """Sample NS completions of LS tokens speculatively; record every verify call's (n_draft, n_acc)."""
    kind, gamma, temperature, top_p, eos, waves = MULTI[case]
    torch.manual_seed(0)
    target, draft = context_pair()
    if kind == "ngram":
        drafter = sampler.NgramDrafter(group_size=8, vocab=VC, n_max=2)
    else:
        drafter = sampler.ModelDrafter(draft, 0, temperature, top_p, False)
        drafter = RaggedDrafter(drafter) if kind == "ragged" else drafter
    seen, verify = [], sampler.verify

    def spy(drafts, q, p, n_draft, u):
        tokens, n_acc = verify(drafts, q, p, n_draft, u)
        seen.append((n_draft.clone(), n_acc.clone()))
        return tokens, n_acc

    monkeypatch.setattr(sampler, "verify", spy)
    comp, lps, st, _ = sampler.spec_generate(target, [[1]] * (NS // 8), 8, LS, pad_id=0, eos_id=eos, drafter=drafter,
                                             gamma=gamma, temperature=temperature, top_p=top_p, waves=waves)
    return target, comp, lps, seen


@pytest.mark.parametrize("case", list(MULTI))
def test_lossless_whole_sequences_with_long_drafts(case, monkeypatch):
    """Chi-square of whole completions against plain sampling, with drafts of 3-4 tokens in one round."""
    target, comp, lps, seen = run_multi(case, monkeypatch)
    kind, gamma, temperature, top_p, eos, _ = MULTI[case]
    probs = exact_sequences(target, [1], LS, eos, temperature, top_p)
    pval = chi2_pvalue(comp, probs)
    assert pval > 1e-3, pval
    # the cases exercise what they name: drafts of >= 3 tokens, accepted chains of >= 2 drafts (model drafts:
    # whole 3-token chains), and, for ragged, rows of different draft lengths verified in the same target call
    n_draft = torch.cat([d for d, _ in seen])
    n_acc = torch.cat([a for _, a in seen])
    assert int(n_draft.max()) >= 3 and int((n_acc >= 2).sum()) > 100, (n_draft.max(), (n_acc >= 2).sum())
    if kind != "ngram":
        assert int((n_acc >= 3).sum()) > 1000
    if kind == "ragged":
        assert sum(len(set(d.tolist())) >= 3 for d, _ in seen) >= 2
        assert len({len(c) for c in comp}) >= 3  # EOS ends rows at different lengths
    # behaviour log-probs: the target's processed log-prob of every emitted token, at every position
    for c, lp in list(zip(comp, lps))[:40]:
        for t in range(len(c)):
            want = torch.log(target.next_probs([1] + c[:t], temperature, top_p)[c[t]]).item()
            assert abs(lp[t] - want) < 1e-4, (c, t, lp[t], want)


def test_wrong_accept_rule_fails_the_same_test(monkeypatch):
    """min(1, q/p) instead of min(1, p/q): the whole-sequence test above rejects it outright."""
    monkeypatch.setattr(sampler, "accept_prob", lambda p_x, q_x: torch.clamp(q_x / p_x.clamp(min=1e-30), max=1.0))
    target, comp, _, _ = run_multi("chain", monkeypatch)
    assert chi2_pvalue(comp, exact_sequences(target, [1], LS)) < 1e-6


def test_tokens_per_call_matches_formula():
    """Context-free p and q: alpha = sum min(p, q) exactly; tokens per target call follow the formula."""
    torch.manual_seed(1)
    pv = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    qv = torch.tensor([0.3, 0.2, 0.2, 0.2, 0.1])
    target = ToyBigram(pv.log().expand(V, V).clone())
    draft = ToyBigram(qv.log().expand(V, V).clone())
    alpha = torch.minimum(pv, qv).sum().item()  # 0.80
    for gamma in (1, 3, 5):
        comp, _, st, _ = sampler.spec_generate(target, [[1]] * 300, 1, 120, 0, -1,
                                               sampler.ModelDrafter(draft, 0, 1.0, 1.0, False), gamma=gamma)
        s = st.summary()
        # the last round of each row is cut by the budget; count only full rounds via the tested positions
        want = sampler.tokens_per_call_theory(alpha, gamma)
        assert abs(s["alpha"] - alpha) < 0.02
        assert abs(s["tokens_per_row_call"] - want) / want < 0.08, (gamma, s["tokens_per_row_call"], want)


def test_theory_helpers():
    assert sampler.tokens_per_call_theory(1.0, 4) == 5
    assert abs(sampler.tokens_per_call_theory(0.5, 2) - 1.75) < 1e-12
    assert sampler.best_gamma(0.0, 0.1, 8) == 0  # a drafter that is never right is never used
    assert sampler.best_gamma(0.95, 0.0, 8) == 8  # free drafts: draft as much as allowed
    g = sampler.best_gamma(0.8, 0.2, 10)
    assert all(sampler.speedup_theory(0.8, g, 0.2) >= sampler.speedup_theory(0.8, h, 0.2) for h in range(11))


def test_verify_matches_kernel_reference_draw_for_draw():
    from kernels.spec_rejection import spec_rejection_sample_ref

    torch.manual_seed(2)
    B, K = 64, 3
    p = torch.softmax(torch.randn(B, K + 1, V) * 2, -1)
    q = torch.softmax(torch.randn(B, K, V) * 2, -1)
    d = torch.multinomial(q.view(-1, V), 1).view(B, K)
    u = torch.rand(B, K + 1)
    a, na = sampler.verify(d, q, p, torch.full((B,), K), u)
    b, nb = spec_rejection_sample_ref(d, q, p, u)
    assert torch.equal(a, b) and torch.equal(na, nb)


def test_process_logits_matches_hf_top_p():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    torch.manual_seed(3)
    z = torch.randn(6, 40) * 3
    want = TopPLogitsWarper(0.85)(None, TemperatureLogitsWarper(0.7)(None, z.clone())).softmax(-1)
    assert torch.allclose(sampler.process_logits(z, 0.7, 0.85), want, atol=1e-6)
    assert torch.equal(sampler.process_logits(z, greedy=True).argmax(-1), z.argmax(-1))


# ---- real tiny models ----
def test_cached_lm_feeds_only_new_tokens_and_masks_rejected_drafts():
    """The header's cache: a round feeds only uncached tokens; rejected drafts stay in the cache as masked holes,
    never recomputed; the logits equal an uncached forward of each row's true sequence."""
    import common

    model, tok = common.load_model("tiny-0.6m")
    model.eval()
    widths = []
    model.register_forward_pre_hook(lambda m, a, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True)
    enc = lambda t: tok(t)["input_ids"]
    seqs = [enc("12+34="), enc("5+6="), enc("99+1=")]
    lm = sampler.CachedLM(model, 3, tok.pad_token_id)
    lm.step(seqs, 1)
    d = enc("7")[-1], enc("8")[-1], enc("9")[-1]
    lm.step([seqs[0] + list(d), seqs[1] + [d[0]], seqs[2]], 4)  # drafts of lengths 3, 1, 0
    # row 0 accepts its first draft and resamples; row 1 rejects its draft; row 2 emits one token
    new = [seqs[0] + [d[0], d[2]], seqs[1] + [d[1]], seqs[2] + [d[2]]]
    out = lm.step(new, 1)
    assert widths[-1] == 1  # one new token per row, nothing re-run
    assert lm.mask.sum(1).tolist() == [len(s) for s in new]  # rejected drafts masked out
    with torch.no_grad():
        for j, s in enumerate(new):
            ref = model(input_ids=torch.tensor([s])).logits[0, -1].float()
            assert torch.allclose(out[j, -1], ref, atol=1e-4), j


def test_greedy_equals_target_greedy_token_for_token(tmp_path):
    s = sd.main(sd.Args(greedy=True, prompts=6, group_size=2, max_new_tokens=24, out_dir=str(tmp_path),
                        exp_name="g"))
    assert s["greedy_identical"] == 1.0, s
    assert s["target_calls"] < s["plain_calls"]


def test_ngram_waves_run(tmp_path):
    s = sd.main(sd.Args(drafter="ngram", waves=2, prompts=4, group_size=4, gamma=6, compare_plain=False,
                        out_dir=str(tmp_path), exp_name="n"))
    assert s["alpha"] > 0.5 and s["mean_accepted"] > 1 and s["spec_acc"] > 0.5, s


@pytest.mark.parametrize("change,msg", [({"temperature": 0.0}, "temperature"), ({"top_p": 1.5}, "top-p"),
                                        ({"waves": 9}, "waves"), ({"gamma": -1}, "gamma"),
                                        ({"model": "tiny-nope"}, "unknown tiny model"), ({"threads": 0}, "--threads")])
def test_bad_input(tmp_path, change, msg):
    with pytest.raises(SystemExit, match=msg):
        sd.main(replace(sd.Args(out_dir=str(tmp_path)), **change))
