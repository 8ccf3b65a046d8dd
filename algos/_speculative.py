"""Lossless speculative sampling: the sampler, drafters and KV cache of algos/spec_decode.py and algos/spec_rl.py.

A drafter proposes up to gamma tokens per row, the target scores them all in one cached forward, and a
rejection rule keeps a prefix and emits one more token, so that every emitted token is distributed exactly as
the target's processed distribution p (Leviathan et al., "Fast Inference from Transformers via Speculative
Decoding", arXiv:2211.17192; Chen et al., "Accelerating Large Language Model Decoding with Speculative
Sampling", arXiv:2302.01318). tests/test_spec_decode.py checks the distributions (one and two tokens, whole
5-token sequences by a chi-square test) and that the wrong rule min(1, q/p) fails; tests/test_spec_rl.py checks
the same with the previous epoch's rollouts as drafts.

Equations (each implemented by the function named on the right):
  processed distributions  p = topp(softmax(z_target / T)), q = topp(softmax(z_draft / T))      process_logits
                           (greedy: p and q are one-hot on the argmax, which makes the rule below exact greedy)
  accept draft x_j         u_j < min(1, p_j(x_j) / q_j(x_j))                                       accept_prob
  first rejection at j     emit y ~ norm(max(0, p_j - q_j)) and stop the round                      verify
  all gamma accepted       emit a bonus y ~ p_gamma                                                 verify
  acceptance at a position beta = sum_v min(p(v), q(v)); alpha = its mean over tested positions
                                                                          expected_acceptance, spec_generate
  tokens per target call   E[n] = (1 - alpha^(gamma+1)) / (1 - alpha)                          tokens_per_call_theory
  speedup with cost c      S = E[n] / (gamma c + 1),  c = cost(draft call) / cost(target call)    speedup_theory
  acceptance-aware gamma   gamma* = argmax_gamma S(alpha_hat, gamma, c)  ("EfficientRollout: System-Aware
                           Self-Speculative Decoding for RL Rollouts", arXiv:2606.18967)          best_gamma
  the round loop           draft, verify, append; stats per round                   spec_generate, SpecStats

Drafters (a drafter has reset(n_rows), calls, and propose(all_seqs, rows, k) -> drafts [n, k],
q [n, k, V] or None, n_draft [n]; all give the same output distribution, they differ in acceptance and cost):
  ModelDrafter   a smaller model (or a copy of the policy) with the same tokenizer samples k tokens from its
                 processed q, through its own CachedLM
  NgramDrafter   the majority continuation of the longest matching suffix in the group's other rows and any
                 extra texts of the same prompt (ngram_draft; "Seer: Online Context Learning for Fast
                 Synchronous LLM Reinforcement Learning", arXiv:2511.14617); deterministic, so q is one-hot

Token trees (spec_generate_tree; the chain path above is untouched): the draft proposes a tree gamma levels deep,
its top-b tokens under every node of the first d levels and its top token under every leaf after that
(ModelDrafter.propose_tree: one tree-masked draft forward per level, gamma per round as for a chain); the target
scores every node in ONE forward whose 4-D attention mask lets node i see the committed cache and its own ancestors
(CachedLM.tree_step, the mask built from kernels/tree_verify_attention.ancestor_mask; on a GPU the kernel of that
file computes the same attention); tree_accept keeps the longest accepted root-to-leaf path: at each node draw
y ~ p and descend while a child carries y, then emit y. The tree is a deterministic function of the context (a
one-hot q at each node), so this is exactly sampling from p at any temperature; greedy, it is exact greedy match.
(The multi-draft rule for SAMPLED sibling drafts, SpecInfer's "multi-step speculative sampling", is not implemented.)
"SpecInfer: Accelerating Large Language Model Serving with Tree-based Speculative Inference and Verification",
arXiv:2305.09781; DART, a parallel drafter, builds such draft-token trees for its target to verify. The non-kept
nodes become masked holes in the cache, as rejected chain drafts do (commit_tree).

KV cache with rollback by masking (CachedLM): the target, and the draft model, each keep one HF KV cache over
all rows. A round feeds each row only the tokens missing from its cache (last round's resampled or bonus token,
since accepted drafts are cached already, plus the new drafts; a row whose whole sequence is cached feeds its
last token again to get its next logits), right-aligned in one chunk with explicit position ids; after the
prompt, a round's target forward covers at most gamma + 1 new positions per row. Rejected drafts are never
recomputed and never removed: `sync` sets their cache columns' attention mask to 0, so they become holes, as do
the unused slots of rows with shorter chunks. The cache grows by the longest chunk every round and is never
compacted: fine for short rollouts; a serving engine (vLLM's paged cache) frees those slots.

Batched in lock-step: all live rows of a batch do one round together, so the batch needs as many target calls
as its slowest row; SpecStats counts both the batched calls and the per-sequence forwards. `verify` mirrors the
reference of kernels/spec_rejection.py draw for draw and adds per-row draft lengths.
"""
from __future__ import annotations

import inspect
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
from kernels import tree_verify_attention as tree_kernel  # noqa: E402


# ---- processed distributions ----
def process_logits(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0,
                   greedy: bool = False) -> torch.Tensor:
    """The distribution the sampler draws from: softmax(z / T) restricted to the top-p nucleus, renormalised.

    Same rule as transformers' TopPLogitsWarper (sort ascending, drop tokens whose cumulative mass is
    <= 1 - top_p, keep at least one). Greedy: one-hot on the argmax. logits [..., V] -> probs [..., V] fp32.
    """
    logits = logits.float()
    if greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / temperature
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum <= (1 - top_p)
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


# ---- the accept rule and the verifier ----
def accept_prob(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)): the rule that makes speculative sampling exact (a test swaps in min(1, q/p))."""
    return torch.clamp(p_x / q_x.clamp(min=1e-30), max=1.0)


def verify(drafts, q, p, n_draft, u):
    """Accept a prefix of each row's draft, then emit one more token (the resample or the bonus).

    drafts [B, K] (entries past n_draft ignored), q [B, K, V] draft distributions, p [B, K + 1, V] target
    distributions at the K + 1 positions, n_draft [B] draft length of each row (0..K), u [B, K + 1] uniforms
    (column j < K tests position j, column K drives the final draw, as in kernels/spec_rejection.py).
    Returns tokens [B, K + 1] (-1 after the last emitted token) and n_acc [B]; row i emits n_acc_i + 1 tokens.
    """
    B, K = drafts.shape
    V = p.shape[-1]
    ar = torch.arange(B, device=p.device)
    if K > 0:
        px = p[:, :K].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        qx = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        ok = (u[:, :K] < accept_prob(px, qx)) & (torch.arange(K, device=p.device)[None] < n_draft[:, None])
        n_acc = ok.long().cumprod(1).sum(1)
    else:
        n_acc = torch.zeros(B, dtype=torch.long, device=p.device)
    rejected = n_acc < n_draft
    p_r = p[ar, n_acc]
    q_r = q[ar, n_acc.clamp(max=max(K - 1, 0))] if K > 0 else torch.zeros_like(p_r)
    resid = torch.clamp(p_r - torch.where(rejected[:, None], q_r, torch.zeros_like(q_r)), min=0)
    use_res = rejected & (resid.sum(-1) > 0)  # rounding can leave no residual mass: fall back to p
    w = torch.where(use_res[:, None], resid, p_r)
    y = (w.cumsum(-1) <= (u[:, K] * w.sum(-1))[:, None]).sum(-1).clamp(max=V - 1)  # inverse CDF
    tokens = torch.full((B, K + 1), -1, dtype=torch.long, device=p.device)
    if K > 0:
        keep = torch.arange(K, device=p.device)[None] < n_acc[:, None]
        tokens[:, :K] = torch.where(keep, drafts, torch.full_like(drafts, -1))
    tokens[ar, n_acc] = y
    return tokens, n_acc


def expected_acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """beta = sum_v min(p(v), q(v)) = P(accept) at one position; alpha is its mean over tested positions."""
    return torch.minimum(p, q).sum(-1)


# ---- theory ----
def tokens_per_call_theory(alpha: float, gamma: int) -> float:
    """E[tokens emitted per target call] = (1 - alpha^(gamma+1)) / (1 - alpha) (= gamma + 1 at alpha = 1)."""
    return float(gamma + 1) if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def speedup_theory(alpha: float, gamma: int, c: float) -> float:
    """Expected wall-clock speedup over plain decoding when a draft call costs c target calls."""
    return tokens_per_call_theory(alpha, gamma) / (gamma * c + 1)


def best_gamma(alpha: float, c: float, gamma_max: int) -> int:
    """The draft length that maximises speedup_theory (EfficientRollout's acceptance-aware draft length); 0 = do
    not draft."""
    return max(range(gamma_max + 1), key=lambda g: (speedup_theory(alpha, g, c), -g))


# ---- a model with a KV cache that can take back rejected tokens ----
class CachedLM:
    """One model's KV cache over B rows that grow by different amounts each round.

    `step(seqs, keep)` feeds each row the tokens of seqs[j] not yet in the cache (right-aligned in one chunk;
    the unused slots are holes with attention mask 0) and returns the logits of the last `keep` slots [B, keep, V].
    `sync(seqs)` keeps, per row, the longest cached prefix that agrees with seqs[j] (minus its last token, which
    is always fed again) and masks out the rest: rejected drafts become holes, never recomputed.
    """

    def __init__(self, model, n_rows: int, pad_id: int):
        self.model, self.pad_id = model, pad_id
        self.device = next(model.parameters()).device
        self.cache, self.width = None, 0
        # the KV cache's keyword: `cache` in recent transformers (`past_key_values` warns there, and goes in 5.40),
        # `past_key_values` before; the output field has the same name
        self.cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.mask = torch.zeros(n_rows, 0, dtype=torch.long)
        self.cols: list[list[tuple[int, int]]] = [[] for _ in range(n_rows)]  # (column, token) of valid entries
        self.calls = 0
        self.pending: list = [None] * n_rows  # tree rounds: (column, token, parent, position) of uncommitted nodes

    def sync(self, seqs: list[list[int]]) -> None:
        for j, s in enumerate(seqs):
            if s is None:
                continue
            cols, n = self.cols[j], 0
            while n < len(cols) and n < len(s) - 1 and cols[n][1] == s[n]:
                n += 1
            for c, _ in cols[n:]:
                self.mask[j, c] = 0
            del cols[n:]

    @torch.no_grad()
    def step(self, seqs: list[list[int]], keep: int) -> torch.Tensor:
        self.sync(seqs)
        feeds = [s[len(self.cols[j]):] if s is not None else [] for j, s in enumerate(seqs)]
        m = max(max(len(f) for f in feeds), keep)
        ids = torch.full((len(seqs), m), self.pad_id, dtype=torch.long)
        pos = torch.zeros(len(seqs), m, dtype=torch.long)
        chunk_mask = torch.zeros(len(seqs), m, dtype=torch.long)
        for j, f in enumerate(feeds):
            if f:
                n0 = len(self.cols[j])
                ids[j, m - len(f):] = torch.tensor(f)
                pos[j, m - len(f):] = torch.arange(n0, n0 + len(f))
                chunk_mask[j, m - len(f):] = 1
                self.cols[j] += [(self.width + m - len(f) + t, tok) for t, tok in enumerate(f)]
        self.mask = torch.cat([self.mask, chunk_mask], 1)
        self.width += m
        out = self.model(input_ids=ids.to(self.device), attention_mask=self.mask.to(self.device),
                         position_ids=pos.to(self.device), use_cache=True, logits_to_keep=keep,
                         **{self.cache_kw: self.cache})
        self.cache = getattr(out, self.cache_kw)
        self.calls += 1
        return out.logits.float().cpu()

    def _tree_feeds(self, seqs, nodes):
        """Per row the tokens and positions of a tree round's chunk: on the round's first call the row is synced and
        its uncached tail goes first; then the new nodes, each one position past its parent."""
        open_ = {j for j, s in enumerate(seqs) if s is not None and self.pending[j] is None}
        self.sync([s if j in open_ else None for j, s in enumerate(seqs)])
        feeds = []
        for j, s in enumerate(seqs):
            if s is None:
                feeds.append(([], [], 0))
                continue
            tail = s[len(self.cols[j]):] if j in open_ else []
            if j in open_:
                self.pending[j] = []
            toks, pos = list(tail), list(range(len(self.cols[j]), len(self.cols[j]) + len(tail)))
            par_pos = [q for _, _, _, q in self.pending[j]]
            for t, par in nodes[j]:
                par_pos.append((len(s) - 1 if par < 0 else par_pos[par]) + 1)
                toks.append(t)
                pos.append(par_pos[-1])
            feeds.append((toks, pos, len(tail)))
        return feeds

    def _tree_mask(self, feeds, m):
        """The [B, 1, m, width + m] additive mask of a tree chunk (slot s at column width + s): a tail token sees the
        committed cache causally; a node sees the committed cache, the row's tail, its ancestors
        (kernels/tree_verify_attention.ancestor_mask over the round's nodes) and itself; an unused slot itself only."""
        B, W = len(feeds), self.width
        vis = torch.zeros(B, m, W + m, dtype=torch.bool)
        for j, (toks, _, n_tail) in enumerate(feeds):
            s0 = m - len(toks)
            vis[j, torch.arange(s0), torch.arange(W, W + s0)] = True
            committed, pend = self.mask[j].bool().clone(), self.pending[j] or []
            if pend:
                committed[[c for c, _, _, _ in pend]] = False
            for s in range(s0, s0 + n_tail):
                vis[j, s, :W + s + 1] = committed[:W + s + 1]
            n_new = len(toks) - n_tail
            if n_new:
                anc = tree_kernel.ancestor_mask(torch.tensor([[par for _, _, par, _ in pend]]))[0]
                cols = torch.tensor([c for c, _, _, _ in pend])
                for k in range(n_new):
                    vis[j, s0 + n_tail + k] = committed
                    vis[j, s0 + n_tail + k, cols[anc[len(pend) - n_new + k]]] = True
        dtype = next(self.model.parameters()).dtype
        return torch.zeros(B, 1, m, W + m, dtype=dtype).masked_fill(~vis[:, None], torch.finfo(dtype).min)

    @torch.no_grad()
    def tree_step(self, seqs: list, nodes: list) -> list:
        """Feed tree nodes in one forward with a 4-D tree mask. seqs[j]: row j's committed sequence (None: the row
        sits this call out); nodes[j]: new (token, parent) pairs, parent -1 for a child of seqs[j]'s last token or
        the index of a node of this round (fed by an earlier tree_step, or earlier in this list). The round's first
        call syncs the row and feeds its uncached tail first. Returns per row the logits [fed, V] of its fed slots
        in order (tail, then nodes); commit_tree closes the round."""
        feeds = self._tree_feeds(seqs, nodes)
        m = max(1, max(len(t) for t, _, _ in feeds))
        ids = torch.full((len(seqs), m), self.pad_id, dtype=torch.long)
        pos = torch.zeros(len(seqs), m, dtype=torch.long)
        chunk_mask = torch.zeros(len(seqs), m, dtype=torch.long)
        for j, (toks, ps, n_tail) in enumerate(feeds):
            if toks:
                c0 = m - len(toks)
                ids[j, c0:], pos[j, c0:], chunk_mask[j, c0:] = torch.tensor(toks), torch.tensor(ps), 1
                self.cols[j] += [(self.width + c0 + t, tok) for t, tok in enumerate(toks[:n_tail])]
                self.pending[j] += [(self.width + c0 + n_tail + i, tok, par, ps[n_tail + i])
                                    for i, (tok, par) in enumerate(nodes[j])]
        self.mask = torch.cat([self.mask, chunk_mask], 1)
        mask4 = self._tree_mask(feeds, m)
        self.width += m
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask4.to(self.device),
                         position_ids=pos.to(self.device), use_cache=True, **{self.cache_kw: self.cache})
        self.cache = getattr(out, self.cache_kw)
        self.calls += 1
        logits = out.logits.float().cpu()
        return [logits[j, m - len(t):] for j, (t, _, _) in enumerate(feeds)]

    def commit_tree(self, j: int, path: list[int]) -> None:
        """Close row j's tree round: the nodes on `path` (root to leaf, indices of the round's nodes) join the cached
        sequence, every other node becomes a masked hole."""
        pend, keep = self.pending[j] or [], set(path)
        self.cols[j] += [(pend[i][0], pend[i][1]) for i in path]
        for i, (c, _, _, _) in enumerate(pend):
            if i not in keep:
                self.mask[j, c] = 0
        self.pending[j] = None


# ---- drafters ----
class ModelDrafter:
    """A smaller model samples k tokens autoregressively from its processed distribution q (k cached forwards)."""

    name = "model"

    def __init__(self, model, pad_id: int, temperature: float, top_p: float, greedy: bool):
        self.model, self.pad_id = model, pad_id
        self.temperature, self.top_p, self.greedy = temperature, top_p, greedy
        self.lm, self.calls = None, 0

    def reset(self, n_rows: int) -> None:
        self.lm = CachedLM(self.model, n_rows, self.pad_id)

    @torch.no_grad()
    def propose(self, all_seqs: list[list[int]], rows: list[int], k: int):
        cur: list = [None] * len(all_seqs)
        for r in rows:
            cur[r] = list(all_seqs[r])
        toks, qs = [], []
        for _ in range(k):
            logits = self.lm.step(cur, 1)[rows, -1]
            q = process_logits(logits, self.temperature, self.top_p, self.greedy)
            x = q.argmax(-1) if self.greedy else torch.multinomial(q, 1).squeeze(-1)
            self.calls += 1
            toks.append(x)
            qs.append(q)
            for r, t in zip(rows, x.tolist()):
                cur[r].append(t)
        n = torch.full((len(rows),), k, dtype=torch.long)
        if k == 0:
            return torch.zeros(len(rows), 0, dtype=torch.long), None, n
        return torch.stack(toks, 1), torch.stack(qs, 1), n

    def _children(self, logits: torch.Tensor, width: int) -> list[list[int]]:
        """The top-`width` tokens of each row of logits [n, V] under the processed q (greedy: by logit), dropping
        tokens q gives no mass (the nucleus); the first is always kept. Deterministic given the context."""
        if self.greedy:
            return logits.topk(width, -1).indices.tolist()
        q = process_logits(logits, self.temperature, self.top_p, False)
        val, idx = q.topk(width, -1)
        return [[t for i, (v, t) in enumerate(zip(vs, ts)) if i == 0 or v > 0] for vs, ts in zip(val.tolist(),
                                                                                                  idx.tolist())]

    @torch.no_grad()
    def propose_tree(self, all_seqs: list[list[int]], rows: list[int], depth: list[int], branch: int,
                     branch_depth: int) -> list[tuple[list[int], list[int]]]:
        """A token tree per row of `rows`, depth[j] levels deep: the draft's top-`branch` tokens under every node of
        the first `branch_depth` levels, then its top token under every leaf; one tree-masked draft forward per level
        but the last (as many draft calls as a chain of the same depth). Returns per row (tokens, parents) in level
        order (parents[i] < i, -1 for a child of the row's last token)."""
        cur: list = [None] * len(all_seqs)
        for r in rows:
            cur[r] = list(all_seqs[r])
        trees = {r: ([], []) for r in rows}
        frontier = {r: [-1] for r in rows}  # the nodes whose children the next level adds
        logits = self.lm.tree_step(cur, [[] for _ in all_seqs])  # the tails: the last slot predicts the roots
        self.calls += 1
        dist = {r: logits[r][-1:] for r in rows}
        for level in range(max(depth, default=0)):
            new: list = [[] for _ in all_seqs]
            for j, r in enumerate(rows):
                if depth[j] <= level:
                    continue
                toks, pars = trees[r]
                kids = self._children(dist[r], branch if level < branch_depth else 1)
                nxt = []
                for parent, ks in zip(frontier[r], kids):
                    for t in ks:
                        nxt.append(len(toks))
                        toks.append(t)
                        pars.append(parent)
                        new[r].append((t, parent))
                frontier[r] = nxt
            if level + 1 < max(depth):
                logits = self.lm.tree_step([c if new[i] else None for i, c in enumerate(cur)], new)
                self.calls += 1
                dist = {r: logits[r] for r in rows if new[r]}
        for r in rows:
            self.lm.commit_tree(r, [])  # the draft keeps the committed sequence only
        return [trees[r] for r in rows]


def ngram_draft(ctx: list[int], corpus: list[list[int]], k: int, n_max: int) -> list[int]:
    """Continue ctx by the longest suffix (n_max..1 tokens) found in the corpus; among the continuations of
    that suffix, extend token by token with the majority next token (a vote over siblings)."""
    for n in range(min(n_max, len(ctx)), 0, -1):
        suf = ctx[-n:]
        conts = [seq[i + n:i + n + k] for seq in corpus for i in range(len(seq) - n)
                 if seq[i:i + n] == suf]
        conts = [c for c in conts if c]
        if not conts:
            continue
        out = []
        while conts and len(out) < k:
            counts: dict[int, int] = {}
            for c in conts:
                counts[c[0]] = counts.get(c[0], 0) + 1
            best = max(counts, key=lambda t: (counts[t], -t))
            out.append(best)
            conts = [c[1:] for c in conts if c[0] == best and len(c) > 1]
        return out
    return []


class NgramDrafter:
    """Suffix drafter over the text of the same group: the prompt, the siblings so far and any `extra`
    texts of the same prompt (e.g. earlier rollouts). Deterministic: q is one-hot on the drafted token."""

    name = "ngram"

    def __init__(self, group_size: int, vocab: int, n_max: int = 4, extra: dict | None = None):
        self.G, self.V, self.n_max, self.extra = group_size, vocab, n_max, extra or {}
        self.calls = 0

    def reset(self, n_rows: int) -> None:
        pass

    def propose(self, all_seqs: list[list[int]], rows: list[int], k: int):
        toks = torch.zeros(len(rows), k, dtype=torch.long)
        n = torch.zeros(len(rows), dtype=torch.long)
        for j, r in enumerate(rows):
            g, s = r // self.G, all_seqs[r]
            corpus = [all_seqs[o] for o in range(g * self.G, (g + 1) * self.G) if o != r]
            corpus += self.extra.get(g, [])
            d = ngram_draft(s, corpus, k, self.n_max) if k else []
            toks[j, :len(d)] = torch.tensor(d, dtype=torch.long)
            n[j] = len(d)
        q = torch.nn.functional.one_hot(toks, self.V).float() if k else None
        return toks, q, n


# ---- the speculative generation loop ----
@dataclass
class SpecStats:
    target_calls: int = 0  # batched target forwards
    row_calls: int = 0  # sum over target forwards of the rows in them (per-sequence forwards)
    draft_calls: int = 0  # batched draft-model forwards
    rounds_with_draft: int = 0  # row-rounds that had at least one drafted token
    drafted: int = 0  # drafted tokens offered to the verifier
    tested: int = 0  # drafted positions whose acceptance was tested (up to and including the first rejection)
    accepted: int = 0  # drafted tokens accepted
    alpha_sum: float = 0.0  # sum over tested positions of sum_v min(p, q)
    emitted: int = 0  # tokens kept (up to EOS and the budget)
    reused: int = 0  # accepted draft tokens that were kept (drafts accepted past an EOS are not)
    target_s: float = 0.0
    draft_s: float = 0.0

    def summary(self) -> dict:
        return {"target_calls": self.target_calls, "row_calls": self.row_calls, "draft_calls": self.draft_calls,
                "alpha": self.alpha_sum / max(self.tested, 1),
                "accept_rate": self.accepted / max(self.drafted, 1),
                "mean_accepted": self.accepted / max(self.rounds_with_draft, 1),
                "tokens_per_row_call": self.emitted / max(self.row_calls, 1),
                "row_calls_per_token": self.row_calls / max(self.emitted, 1),
                "emitted": self.emitted, "reused_frac": self.reused / max(self.emitted, 1),
                "target_s": self.target_s, "draft_s": self.draft_s}

    def count_round(self, p, q, n_draft, n_acc) -> float | None:
        """Count one round that had drafts (q [n, k, V], k > 0): the positions tested (the accepted ones and the
        first rejection), drafted, accepted, and the acceptance beta summed over the tested positions. Returns beta's
        mean over this round's tested positions (None when none was tested)."""
        k = q.shape[1]
        tested = torch.minimum(n_acc + 1, n_draft)
        tmask = torch.arange(k)[None] < tested[:, None]
        beta = (expected_acceptance(p[:, :k], q) * tmask).sum()
        self.alpha_sum += float(beta)
        self.tested += int(tested.sum())
        self.drafted += int(n_draft.sum())
        self.accepted += int(n_acc.sum())
        self.rounds_with_draft += int((n_draft > 0).sum())
        return float(beta / tested.sum()) if int(tested.sum()) else None


def propose_drafts(drafter, seqs: list[list[int]], rows: list[int], k: int, room, st: SpecStats):
    """Up to k draft tokens for each row of `rows`, cut to the row's room left in the budget (room [n]).

    Returns (drafts [n, k'], q [n, k', V] or None, n_draft [n], k' = the longest draft kept; 0 when k = 0).
    """
    q = None
    if k > 0:
        calls0 = drafter.calls
        drafts, q, n_draft = drafter.propose(seqs, rows, k)
        st.draft_calls += drafter.calls - calls0
        n_draft = torch.minimum(n_draft, room)
        k = int(n_draft.max())
        drafts, q = drafts[:, :k], q[:, :k] if q is not None else None
    if k == 0:
        drafts, n_draft = torch.zeros(len(rows), 0, dtype=torch.long), torch.zeros(len(rows), dtype=torch.long)
    return drafts, q, n_draft, k


@torch.no_grad()
def spec_generate(target, prompts: list[list[int]], group_size: int, max_new_tokens: int, pad_id: int,
                  eos_id: int, drafter=None, gamma: int = 4, temperature: float = 1.0, top_p: float = 1.0,
                  greedy: bool = False, adaptive_gamma: bool = False, draft_cost: float = -1.0, waves: int = 1,
                  keep_probs: bool = False):
    """Sample group_size completions per prompt with speculative sampling; rows group-major as common.generate.

    Returns (completions: list of token lists (EOS included when the row stopped), logprobs: list of lists
    (log p of each emitted token under the target's processed distribution), SpecStats, probs: per row a
    [len, V] tensor of p at each emitted position when keep_probs, else None).
    """
    seqs = [list(p) for p in prompts for _ in range(group_size)]  # prompt + generated, per row
    B = len(seqs)
    plen = [len(s) for s in seqs]
    lps: list[list[float]] = [[] for _ in range(B)]
    probs: list[list[torch.Tensor]] = [[] for _ in range(B)]
    done = [False] * B
    st = SpecStats()
    alpha_hat, c_hat = 0.8, (draft_cost if draft_cost >= 0 else 0.5)
    lm = CachedLM(target, B, pad_id)
    if drafter is not None:
        drafter.reset(B)
    wave_of = [min((r % group_size) * waves // group_size, waves - 1) for r in range(B)]
    for wave in range(waves):
        while True:
            rows = [r for r in range(B) if not done[r] and wave_of[r] == wave]
            if not rows:
                break
            room = torch.tensor([max_new_tokens - (len(seqs[r]) - plen[r]) - 1 for r in rows])  # leave 1 slot
            g = gamma if not adaptive_gamma else best_gamma(alpha_hat, c_hat, gamma)
            k = min(g, int(room.max())) if drafter is not None else 0
            t0 = time.perf_counter()
            drafts, q, n_draft, k = propose_drafts(drafter, seqs, rows, k, room, st)
            t1 = time.perf_counter()
            ext: list = [None] * B
            for j, r in enumerate(rows):
                ext[r] = seqs[r] + drafts[j, :int(n_draft[j])].tolist()
            logits = lm.step(ext, k + 1)[rows]  # [n, k+1, V]; each row's chunk ends at the right edge
            # row j's n_j + 1 predictions sit in the last n_j + 1 slots: move them to the front
            idx = (torch.arange(k + 1)[None] + (k - n_draft)[:, None]).clamp(max=k)
            p = process_logits(logits.gather(1, idx[..., None].expand(-1, -1, logits.shape[-1])), temperature,
                               top_p, greedy)
            t2 = time.perf_counter()
            st.target_calls += 1
            st.row_calls += len(rows)
            u = torch.rand(len(rows), k + 1)
            qq = q if k > 0 else torch.zeros(len(rows), 0, p.shape[-1])
            tokens, n_acc = verify(drafts, qq, p, n_draft, u)
            if k > 0:
                beta_mean = st.count_round(p, qq, n_draft, n_acc)
                if beta_mean is not None:
                    alpha_hat = 0.7 * alpha_hat + 0.3 * beta_mean
            st.target_s += t2 - t1
            st.draft_s += t1 - t0
            if k > 0 and draft_cost < 0 and st.draft_calls:
                c_hat = (st.draft_s / st.draft_calls) / max(st.target_s / st.target_calls, 1e-9)
            logp_all = torch.log(p.clamp(min=1e-30))
            for j, r in enumerate(rows):
                for pos in range(int(n_acc[j]) + 1):
                    t = int(tokens[j, pos])
                    seqs[r].append(t)
                    lps[r].append(float(logp_all[j, pos, t]))
                    if keep_probs:
                        probs[r].append(p[j, pos])
                    st.emitted += 1
                    st.reused += int(pos < int(n_acc[j]))
                    if t == eos_id or len(seqs[r]) - plen[r] >= max_new_tokens:
                        done[r] = True
                        break
    comp = [s[n:] for s, n in zip(seqs, plen)]
    return comp, lps, st, ([torch.stack(x) if x else torch.zeros(0) for x in probs] if keep_probs else None)


def tree_accept(tokens: list[int], parents: list[int], p: torch.Tensor, u: torch.Tensor):
    """The longest accepted root-to-leaf path of one row's tree, and the token emitted after it.

    p [n + 1, V]: the target's processed distributions at the row's last token (row 0) and at every node (row i + 1
    for node i); u [n + 1] uniforms. From the root: draw y ~ p at the current node (inverse CDF with the next
    uniform); if a child of that node carries y, descend to it and repeat; otherwise emit y and stop (at a leaf this
    is the bonus token). Returns (path: node indices root to leaf, y, the log p of each kept token).
    """
    children: dict[int, dict[int, int]] = {}
    for i, (t, par) in enumerate(zip(tokens, parents)):
        children.setdefault(par, {}).setdefault(t, i)
    node, path, lps = -1, [], []
    for step in range(len(tokens) + 1):
        w = p[node + 1]
        y = int((w.cumsum(-1) <= u[step] * w.sum()).sum().clamp(max=w.shape[-1] - 1))
        lps.append(float(torch.log(w[y].clamp(min=1e-30))))
        nxt = children.get(node, {}).get(y)
        if nxt is None:
            return path, y, lps
        path.append(nxt)
        node = nxt
    raise AssertionError("a tree path cannot be longer than the tree")


@torch.no_grad()
def spec_generate_tree(target, prompts: list[list[int]], group_size: int, max_new_tokens: int, pad_id: int,
                       eos_id: int, drafter: ModelDrafter, gamma: int = 4, branch: int = 2, branch_depth: int = 2,
                       temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False):
    """spec_generate with token TREES: the draft proposes a tree gamma levels deep (ModelDrafter.propose_tree), the
    target scores every node in one tree-masked forward (CachedLM.tree_step) and tree_accept keeps the longest
    accepted path. Lossless at any temperature: the tree is a deterministic function of the context, so drawing from
    the target and descending while a child matches is plain sampling from p (greedy: exact greedy match).
    Returns (completions, logprobs, SpecStats) as spec_generate (without the kept probabilities).
    """
    seqs = [list(p) for p in prompts for _ in range(group_size)]
    B = len(seqs)
    plen = [len(s) for s in seqs]
    lps: list[list[float]] = [[] for _ in range(B)]
    done = [False] * B
    st = SpecStats()
    lm = CachedLM(target, B, pad_id)
    drafter.reset(B)
    while True:
        rows = [r for r in range(B) if not done[r]]
        if not rows:
            break
        depth = [min(gamma, max_new_tokens - (len(seqs[r]) - plen[r]) - 1) for r in rows]
        t0 = time.perf_counter()
        calls0 = drafter.calls
        trees = drafter.propose_tree(seqs, rows, depth, branch, branch_depth) if max(depth) > 0 else \
            [([], []) for _ in rows]
        st.draft_calls += drafter.calls - calls0
        t1 = time.perf_counter()
        cur: list = [None] * B
        nodes: list = [[] for _ in range(B)]
        for j, r in enumerate(rows):
            cur[r], nodes[r] = seqs[r], list(zip(*trees[j]))
        logits = lm.tree_step(cur, nodes)
        st.target_s += time.perf_counter() - t1
        st.draft_s += t1 - t0
        st.target_calls += 1
        st.row_calls += len(rows)
        for j, r in enumerate(rows):
            toks, pars = trees[j]
            p = process_logits(logits[r][-(len(toks) + 1):], temperature, top_p, greedy)
            path, y, lp = tree_accept(toks, pars, p, torch.rand(len(toks) + 1))
            lm.commit_tree(r, path)
            st.drafted += len(toks)
            st.accepted += len(path)
            st.rounds_with_draft += int(len(toks) > 0)
            for pos, t in enumerate([toks[i] for i in path] + [y]):
                seqs[r].append(t)
                lps[r].append(lp[pos])
                st.emitted += 1
                st.reused += int(pos < len(path))
                if t == eos_id or len(seqs[r]) - plen[r] >= max_new_tokens:
                    done[r] = True
                    break
    return [s[n:] for s, n in zip(seqs, plen)], lps, st


def to_rollout(tok, prompts, group_size, comp, lps, eos_id) -> common.Rollout:
    """Pack the lists into the common.Rollout layout (left-padded prompts, right-padded completions)."""
    ids, mask = common.left_pad([p for p in prompts for _ in range(group_size)], tok.pad_token_id)
    C = max(1, max(len(c) for c in comp))
    cids = torch.full((len(comp), C), tok.pad_token_id, dtype=torch.long)
    cmask, lp = torch.zeros(len(comp), C, dtype=torch.long), torch.zeros(len(comp), C)
    for i, (c, l) in enumerate(zip(comp, lps)):
        cids[i, :len(c)], cmask[i, :len(c)], lp[i, :len(c)] = torch.tensor(c), 1, torch.tensor(l)
    finish = ["stop" if c and c[-1] == eos_id else "length" for c in comp]
    return common.Rollout(ids, mask, cids, cmask, lp, finish, tok.batch_decode(cids, skip_special_tokens=True))

