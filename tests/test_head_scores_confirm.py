"""Head scores tested against chance (issue 34): `excess` = score - chance per prompt, where chance is the
score of a head attending uniformly over the causal keys (1 / (q + 1) on each k <= q), tested against 0
(sign-flip p below 1 - ci_level, Benjamini-Hochberg q over every kind x head), and confirmed on fresh prompts.

The references: the model's own attention patterns (run_with_cache), targets and chance counted by hand
with loops, the sign-flip p by enumerating all 2^n sign patterns, q by the Benjamini-Hochberg definition;
a head planted with a hook (perfect induction) is confirmed on fresh prompts while a head attending at
random over the causal keys (a Dirichlet(1) row: chance in expectation) is not."""

import itertools

import numpy as np
import pytest
import torch

import entoscope as es
from entoscope.confirm import SEED_STEP
from entoscope.models import adapt

N = 12


@pytest.fixture(scope="module")
def demo():
    return es.load_model("demo")


def _targets(kind, tok, q):
    if kind == "previous_token":
        return [q - 1] if q >= 1 else []
    if kind == "duplicate_token":
        return [k for k in range(q) if tok[k] == tok[q]]
    return [k for k in range(1, q + 1) if tok[k - 1] == tok[q]]  # induction


def _by_hand(model, data, exclude_bos):
    """{kind: (score [n, L, H], chance [n])} from the cache, with loops; NaN where a prompt has no target."""
    a = adapt(model)
    s = a.structure
    out = {}
    for kind in ("previous_token", "duplicate_token", "induction"):
        score, chance = np.full((len(data), s.n_layers, s.n_heads), np.nan), np.full(len(data), np.nan)
        for i, ex in enumerate(data):
            tok = a.tokenize(ex.prompt, prepend_bos=isinstance(ex.prompt, str))
            _, cache = model.run_with_cache(torch.tensor([tok]))
            pats = [cache[f"blocks.{L}.attn.hook_pattern"][0].double().numpy() for L in range(s.n_layers)]
            mass, uniform = [], []
            for q in range(len(tok)):
                t = _targets(kind, tok, q)
                if not t:
                    continue
                kept = [k for k in t if not (exclude_bos and k == 0)]
                mass.append(np.stack([p[:, q, kept].sum(-1) for p in pats]))  # [L, H]
                uniform.append(len(kept) / (q + 1))
            if mass:
                score[i], chance[i] = np.mean(mass, 0), np.mean(uniform)
        out[kind] = (score, chance)
    return out


def _sign_flip_by_enumeration(x):
    """Two-sided p of |sum x| over all 2^n sign patterns, per column (NaN: 0)."""
    x = np.nan_to_num(x)
    signs = np.array(list(itertools.product([1.0, -1.0], repeat=len(x))))  # [2^n, n]
    observed = np.abs(x.sum(0))
    return (np.abs(signs @ x) >= observed - 1e-9 * np.abs(x).sum(0)).mean(0)


def _bh_by_definition(p):
    m = len(p)
    return np.array([min(1.0, min(p[j] * m / np.sum(p <= p[j]) for j in range(m) if p[j] >= p[i])) for i in range(m)])


@pytest.mark.parametrize("exclude_bos", [False, True])
def test_excess_over_chance_and_its_p_equal_a_brute_force_computation(demo, exclude_bos):
    data = es.tasks.induction(n=N, seed=5)
    t = es.HeadScores(exclude_bos=exclude_bos).run(demo, data, quiet=True).table
    hand = _by_hand(demo, data, exclude_bos)
    level = float(t["ci_level"].iloc[0])
    refined = 0
    for kind, (score, chance) in hand.items():
        sub = t[t["kind"] == kind].sort_values(["layer", "head"])
        excess = (score - chance[:, None, None]).reshape(N, -1)
        np.testing.assert_allclose(sub["score"], np.nanmean(score.reshape(N, -1), 0), atol=1e-6)
        np.testing.assert_allclose(sub["chance"], np.nanmean(chance), rtol=1e-9)
        np.testing.assert_allclose(sub["excess"], np.nanmean(excess, 0), atol=1e-6)
        p = sub["excess_p"].to_numpy()
        small = p < 1 - level  # below 1 - ci_level, p is the sign-flip test's
        np.testing.assert_allclose(p[small], _sign_flip_by_enumeration(excess)[small], rtol=1e-9)
        excludes = (sub["excess_ci_low"] > 0) | (sub["excess_ci_high"] < 0)
        assert (small == excludes.to_numpy()).all()  # above it: the interval's own inversion
        refined += int(small.sum())
    assert refined >= 3  # the comparison is not of empty sets
    np.testing.assert_allclose(t["excess_q"], _bh_by_definition(t["excess_p"].to_numpy()), rtol=1e-12)
    assert list(t["significant"]) == list(t["excess_q"] <= 0.05)


def test_a_planted_induction_head_is_confirmed_and_a_random_head_is_not():
    model = es.load_model("demo")  # its own copy: the hook stays on it
    P = 6
    gen = torch.Generator().manual_seed(0)

    def plant(pattern, hook):  # head 0: perfect induction on the second copy (BOS elsewhere); head 1: random
        B, H, T, _ = pattern.shape
        out = pattern.clone()
        q = torch.arange(1 + P, T)
        perfect = torch.zeros(T, T)
        perfect[:, 0] = 1
        perfect[q, 0] = 0
        perfect[q, q - P + 1] = 1
        out[:, 0] = perfect
        noise = -torch.log(torch.rand(B, T, T, generator=gen)) * torch.tril(torch.ones(T, T))  # Dirichlet(1) rows
        out[:, 1] = noise / noise.sum(-1, keepdim=True)
        return out
    model.add_hook("blocks.0.attn.hook_pattern", plant, is_permanent=True)
    data = {"task": "repeated_tokens", "n": 12, "params": {"length": P}}
    r = es.HeadScores(kinds=["induction"], period=P, confirm={"k": 12}).run(model, data, quiet=True)
    c = r.confirmation.set_index("site")
    screen = r.table.set_index("site")
    np.testing.assert_allclose(screen.loc["a0.h0", "score"], 1.0, atol=1e-6)
    # chance by hand: BOS + two copies of 6 tokens, induction queries q = 7..12, one target each: mean 1 / (q + 1)
    np.testing.assert_allclose(screen.loc["a0.h0", "chance"], np.mean([1 / (q + 1) for q in range(7, 13)]), rtol=1e-6)
    assert c.loc["a0.h0", "confirmed"] and c.loc["a0.h0", "excess_p"] == 2.0 ** -11  # the test's limit at 12
    assert not c.loc["a0.h1", "confirmed"] and c.loc["a0.h1", "excess_p"] > 0.05
    assert (c["n_prompts"] == 12).all() and len(c) == 12


def test_head_scores_confirm_on_fresh_prompts_as_a_fresh_run_gives(demo):
    r = es.HeadScores(confirm={"k": 3}).run(demo, {"task": "induction", "n": 8, "seed": 2}, quiet=True)
    c = r.confirmation
    t = r.table
    top = t.sort_values(["excess_p", "excess"], key=lambda s: s if s.name == "excess_p" else -s.abs(), kind="stable")
    assert list(zip(c["kind"], c["site"])) == list(zip(top["kind"], top["site"]))[:3]  # a head once per kind
    fresh = es.HeadScores().run(demo, {"task": "induction", "n": 8, "seed": 2 + SEED_STEP}, quiet=True).table
    fresh = fresh.set_index(["kind", "site"]).loc[list(zip(c["kind"], c["site"]))]
    for col in ("excess", "excess_ci_low", "excess_ci_high", "excess_p"):
        np.testing.assert_allclose(c[col], fresh[col], rtol=1e-9, err_msg=col)
    assert r.plan.screen["m"] == len(t) == 3 * 12  # the plan's screen counts every kind x head
    # 36 cells over 8 prompts: 2^-7 x 36 > 0.05, so no cell alone (6 at 2^-7 together: 6 x 0.05 / 36 >= 2^-7);
    # the confirmation's BH counts its 3 cells (3 x 2^-7 < 0.05), so its run does not warn
    blind = [w["message"] for w in r.warnings if w["code"] == "screen_blind"]
    assert len(blind) == 1 and "only 6 or more cells" in blind[0] and "top 3 on fresh prompts needs p <= 0.017" in blind[0]
    assert not [w for w in r.manifest["confirmation"]["warnings"] if w["code"] == "screen_blind"]
