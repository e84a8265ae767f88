"""Numerical core of probing (entoscope.probing), every number checked against something independent:
the analytic Bayes rate, scikit-learn's solvers and metrics, or an exact identity.
"""

import math

import numpy as np
import pytest
import torch

# One thread: the machine has 2 shared cores (other jobs run beside the tests); these tests check
# numbers, not speed, and two busy threads there are slower than one. (conftest.py does the same.)
torch.set_num_threads(1)

sklearn = pytest.importorskip("sklearn")
from sklearn.linear_model import LogisticRegression, Ridge  # noqa: E402
from sklearn.metrics import accuracy_score, f1_score, mean_squared_error, r2_score, roc_auc_score  # noqa: E402

from entoscope.errors import DataError  # noqa: E402
from entoscope.probing import (  # noqa: E402
    accuracy,
    auroc,
    auroc_ovr,
    f1_macro,
    fit_probes,
    holdout_split,
    kfold_splits,
    load_directions,
    mse,
    project_out,
    r2,
    shuffled_labels,
)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def standardised_np(X, rows):
    """Independent standardisation (numpy, float64): statistics of the training rows."""
    Xr = X[rows]
    mean, std = Xr.mean(0), Xr.std(0)
    return lambda idx: (X[idx] - mean) / std


def planted(N, D, S, mu, seed, scales=None):
    """X = s * mu * u + N(0, I) noise (s = +-1 the label), then each feature times scales[d]."""
    g = gen(seed)
    y = torch.randint(0, 2, (N,), generator=g)
    u = torch.randn(D, generator=g, dtype=torch.float64)
    u /= u.norm()
    X = (2 * y - 1)[None, :, None] * mu * u + torch.randn(S, N, D, generator=g, dtype=torch.float64)
    if scales is not None:
        X = X * scales
    return X, y, u


# ---------------------------------------------------------------- planted direction, Bayes rate
def test_planted_direction_recovered_and_accuracy_at_bayes_rate():
    N, D, S, mu = 2000, 48, 2, 1.0
    scales = torch.exp(torch.randn(D, generator=gen(7), dtype=torch.float64))  # anisotropic raw basis
    X, y, u = planted(N, D, S, mu, seed=1, scales=scales)
    # Two Gaussians N(+-mu u, I), equal priors: the Bayes rule is sign(u . x), accuracy Phi(mu).
    # Scaling feature d by c_d leaves the rate unchanged and turns the Bayes direction into u / c.
    bayes = 0.5 * (1 + math.erf(mu / math.sqrt(2)))
    target = u / scales
    target /= target.norm()
    fit = fit_probes(X.float(), y, split="kfold", k=5, seed=0)
    # 5 folds: every row is a test row once, so the mean accuracy has sd ~ sqrt(.84 * .16 / 2000)
    # = 0.008; 0.03 allows that plus the finite-sample excess error of 48 fitted weights.
    acc = fit.test["accuracy"].mean(0)
    assert torch.all((acc - bayes).abs() < 0.03), (acc, bayes)
    cos = fit.directions[:, 0, :] @ target
    assert torch.all(cos > 0.95), cos
    assert torch.all(fit.direction_agreement > 0.95)
    assert fit.converged.all()


# ---------------------------------------------------------------- logistic regression = sklearn
@pytest.mark.parametrize("n_classes", [2, 4])
@pytest.mark.parametrize("D", [20, 150])  # 150 > 120 training rows: the row-space reduction path
@pytest.mark.parametrize("solver", ["newton", "lbfgs"])
def test_logistic_equals_sklearn(n_classes, D, solver):
    N, S = 200, 3
    g = gen(10 * n_classes + D)
    y = torch.randint(0, n_classes, (N,), generator=g)
    centers = torch.randn(n_classes, D, generator=g, dtype=torch.float64) * 0.4
    X = centers[y][None] + torch.randn(S, N, D, generator=g, dtype=torch.float64)
    X = X * torch.exp(torch.randn(S, 1, D, generator=g, dtype=torch.float64)) + 3.0
    sp = holdout_split(y, seed=3)
    # sklearn's own solvers, whichever reaches tol 1e-12 quickly here (same objective): lbfgs,
    # except multinomial with few features, where newton-cholesky is ~20x faster
    sk_solver = "newton-cholesky" if (n_classes > 2 and D < 100) else "lbfgs"
    for C in (0.05, 5.0):
        fit = fit_probes(X, y, split=sp, C_grid=[C], control=None, solver=solver, tol=1e-10)
        assert fit.converged.all()
        for s in range(S):
            Zf = standardised_np(X[s].numpy(), sp.train.numpy())
            ref = LogisticRegression(C=C, tol=1e-12, max_iter=100_000, solver=sk_solver).fit(
                Zf(sp.train.numpy()), y[sp.train].numpy())
            coef = fit.coef[0, s].numpy()
            scale = np.abs(ref.coef_).max()
            assert np.abs(coef - ref.coef_).max() <= 1e-3 * scale, (C, s)
            assert np.abs(fit.intercept[0, s].numpy() - ref.intercept_).max() <= 1e-3 * max(1.0, np.abs(ref.intercept_).max())
            Zte = Zf(sp.test.numpy())
            acc_ref = accuracy_score(y[sp.test].numpy(), ref.predict(Zte))
            assert fit.test["accuracy"][0, s].item() == pytest.approx(acc_ref, abs=1e-12)
            if n_classes == 2:
                auc_ref = roc_auc_score(y[sp.test].numpy(), ref.decision_function(Zte))
            else:
                auc_ref = roc_auc_score(y[sp.test].numpy(), ref.predict_proba(Zte), multi_class="ovr")
            assert fit.test["auroc"][0, s].item() == pytest.approx(auc_ref, abs=1e-6)


def test_choice_of_C_equals_sklearn_validation_search():
    """Per site: the C with the best validation accuracy, ties going to the smaller C (stronger)."""
    N, D, S = 240, 30, 6
    X, y, _ = planted(N, D, S, mu=0.25, seed=1)  # weak signal, 48 validation rows: ties happen
    sp = holdout_split(y, seed=1)
    grid = [1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0]
    fit = fit_probes(X, y, split=sp, C_grid=grid, control=None)
    n_ties = 0
    for s in range(S):
        Zf = standardised_np(X[s].numpy(), sp.train.numpy())
        accs = []
        for C in grid:
            m = LogisticRegression(C=C, solver="newton-cholesky", tol=1e-10, max_iter=1000).fit(
                Zf(sp.train.numpy()), y[sp.train].numpy())
            accs.append(accuracy_score(y[sp.val].numpy(), m.predict(Zf(sp.val.numpy()))))
        n_ties += accs.count(max(accs)) > 1
        assert fit.chosen[0, s].item() == grid[accs.index(max(accs))]
        assert fit.val["accuracy"][0, s].item() == pytest.approx(max(accs), abs=1e-12)
    assert n_ties >= 1  # the tie rule was exercised


def test_duplicate_rows_take_the_stable_reduction_and_still_equal_sklearn():
    """D > n with duplicated prompts: the Gram matrix is singular, the QR reduction is used."""
    from entoscope.probing.solvers import _RowSpace, logistic_path

    g = gen(11)
    Z = torch.randn(2, 60, 200, generator=g, dtype=torch.float64)
    Z[:, 30:] = Z[:, :30]
    y = torch.randint(0, 2, (60,), generator=g)
    assert _RowSpace(Z).Q is not None  # fell back to QR
    Zc = torch.randn(2, 60, 200, generator=g, dtype=torch.float64)
    assert _RowSpace(Zc - Zc.mean(1, keepdim=True)).Q is None  # centred rows (as standardised): fast path
    sol = logistic_path(Z, y, [1.0])[0]
    for s in range(2):
        ref = LogisticRegression(C=1.0, tol=1e-12, max_iter=100_000).fit(Z[s].numpy(), y.numpy())
        assert np.abs(sol.coef[0, s, 0].numpy() - ref.coef_[0]).max() <= 1e-3 * np.abs(ref.coef_).max()


@pytest.mark.parametrize("solver", ["newton", "lbfgs"])
def test_batch_compaction_and_per_problem_C_match_single_fits(solver, monkeypatch):
    """Problems with very different C in one batch: the slow ones continue in a compacted batch;
    every problem's answer equals fitting it alone."""
    from entoscope.probing import solvers
    from entoscope.probing.solvers import LogisticProbe

    calls = []
    for cls in (solvers._Binary, solvers._Multinomial):
        orig = cls.subset
        monkeypatch.setattr(cls, "subset", lambda self, mask, orig=orig: calls.append(int(mask.sum())) or orig(self, mask))
    g = gen(21)
    S, n, D = 6, 150, 12
    for K in (2, 3):
        Z = torch.randn(S, n, D, generator=g, dtype=torch.float64)
        y = torch.randint(0, K, (n,), generator=g)
        Z[..., 0] += y
        Cs = torch.tensor([[1e-3, 1e-3, 1e-3, 1e-3, 1e-2, 1e3]], dtype=torch.float64)
        joint = LogisticProbe(Z, y, n_classes=K, solver=solver).fit(Cs, tol=1e-10)
        assert joint.converged.all()
        for s in range(S):
            alone = LogisticProbe(Z[s : s + 1], y, n_classes=K, solver=solver).fit(Cs[0, s].item(), tol=1e-10)
            torch.testing.assert_close(joint.coef[0, s], alone.coef[0, 0], rtol=1e-6, atol=1e-8)
            torch.testing.assert_close(joint.intercept[0, s], alone.intercept[0, 0], rtol=1e-6, atol=1e-8)
    assert calls, "the batch was never compacted"


# ---------------------------------------------------------------- ridge = sklearn
@pytest.mark.parametrize("D", [25, 200])
def test_ridge_equals_sklearn(D):
    N, S = 250, 2
    g = gen(D)
    X = torch.randn(S, N, D, generator=g, dtype=torch.float64) * 2 + 1
    w = torch.randn(D, generator=g, dtype=torch.float64)
    y = X[0] @ w / D**0.5 + 0.5 * torch.randn(N, generator=g, dtype=torch.float64) + 4.0
    sp = holdout_split(y, seed=0, stratify=False)
    for alpha in (0.1, 30.0):
        fit = fit_probes(X, y, "regression", split=sp, alpha_grid=[alpha], control=None)
        for s in range(S):
            Zf = standardised_np(X[s].numpy(), sp.train.numpy())
            ref = Ridge(alpha=alpha).fit(Zf(sp.train.numpy()), y[sp.train].numpy())
            np.testing.assert_allclose(fit.coef[0, s, 0].numpy(), ref.coef_, rtol=1e-8, atol=1e-10)
            assert fit.intercept[0, s, 0].item() == pytest.approx(ref.intercept_, rel=1e-10)
            pred = ref.predict(Zf(sp.test.numpy()))
            yt = y[sp.test].numpy()
            assert fit.test["r2"][0, s].item() == pytest.approx(r2_score(yt, pred), abs=1e-9)
            assert fit.test["mse"][0, s].item() == pytest.approx(mean_squared_error(yt, pred), rel=1e-9)


# ---------------------------------------------------------------- random labels
def test_random_labels_at_chance_and_selectivity_near_zero():
    N, D, S = 2000, 32, 3
    g = gen(99)
    X = torch.randn(S, N, D, generator=g)
    y = torch.randint(0, 2, (N,), generator=g)
    fit = fit_probes(X, y, split="kfold", k=5, seed=0)
    # Every row is a test row once: a chance-level accuracy estimate has sd sqrt(.25 / 2000) = 0.011.
    # 0.05 is > 4 sd; the selectivity (difference of two such estimates) sd is ~0.016: 0.07 > 4 sd.
    chance = fit.chance_accuracy.mean().item()
    assert abs(chance - 0.5) < 0.05
    acc = fit.test["accuracy"].mean(0)
    assert torch.all((acc - 0.5).abs() < 0.05), acc
    sel = fit.selectivity.mean(0)
    assert torch.all(sel.abs() < 0.07), sel
    # while a real signal is selective
    Xs, ys, _ = planted(N, D, 1, mu=1.0, seed=3)
    fs = fit_probes(Xs, ys, split="kfold", k=5)
    assert fs.selectivity.mean().item() > 0.25
    assert (fs.control_test["accuracy"].mean() - 0.5).abs() < 0.05


def test_group_control_detects_memorisable_groups():
    """Type-level control (Hewitt & Liang): groups that the features separate can be memorised."""
    N, D, G = 600, 16, 12
    g = gen(4)
    groups = torch.randint(0, G, (N,), generator=g)
    y = torch.randint(0, 2, (N,), generator=g)
    X = (torch.randn(G, D, generator=g) * 4)[groups][None] + torch.randn(1, N, D, generator=g)
    fit_g = fit_probes(X, y, split="kfold", k=5, control="groups", groups=groups.numpy())
    fit_s = fit_probes(X, y, split="kfold", k=5, control="shuffle")
    assert fit_g.control_test["accuracy"].mean() > 0.8  # memorised group identity
    assert (fit_s.control_test["accuracy"].mean() - 0.5).abs() < 0.08
    labels = torch.as_tensor(np.unique(groups.numpy(), return_inverse=True)[1])
    from entoscope.probing import group_labels

    gl = group_labels(y, groups.numpy(), seed=0)
    for k in range(G):  # one label per group
        assert gl[labels == k].unique().numel() == 1


def test_shuffled_labels_keep_counts_and_are_seeded():
    y = torch.randint(0, 3, (500,), generator=gen(0))
    a, b, c = shuffled_labels(y, seed=1), shuffled_labels(y, seed=1), shuffled_labels(y, seed=2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(torch.bincount(a), torch.bincount(y))


# ---------------------------------------------------------------- metrics = sklearn.metrics
def test_metrics_equal_sklearn():
    g = gen(123)
    S, N, K = 4, 301, 3
    y = torch.randint(0, K, (N,), generator=g)
    yhat = torch.randint(0, K, (S, N), generator=g)
    yhat[1][yhat[1] == 2] = 0  # class 2 never predicted at one site
    yb = torch.randint(0, 2, (N,), generator=g)
    score = torch.round(torch.randn(S, N, generator=g, dtype=torch.float64) * 3) / 3  # many ties
    score[2] = 0.0  # all tied: AUROC 0.5
    logits = torch.round(torch.randn(S, N, K, generator=g, dtype=torch.float64) * 2)
    prob = torch.softmax(logits, -1)
    yr = torch.randn(N, generator=g, dtype=torch.float64)
    pr = yr + torch.randn(S, N, generator=g, dtype=torch.float64)
    acc, f1 = accuracy(y, yhat), f1_macro(y, yhat, K)
    auc, auc3 = auroc(yb, score), auroc_ovr(y, prob)
    r2v, msev = r2(yr, pr), mse(yr, pr)
    for s in range(S):
        assert acc[s].item() == pytest.approx(accuracy_score(y, yhat[s]), abs=1e-15)
        assert f1[s].item() == pytest.approx(f1_score(y, yhat[s], average="macro"), abs=1e-12)
        assert auc[s].item() == pytest.approx(roc_auc_score(yb, score[s]), abs=1e-12)
        assert auc3[s].item() == pytest.approx(roc_auc_score(y, prob[s], multi_class="ovr"), abs=1e-12)
        assert r2v[s].item() == pytest.approx(r2_score(yr, pr[s]), abs=1e-12)
        assert msev[s].item() == pytest.approx(mean_squared_error(yr, pr[s]), abs=1e-12)
    assert auc[2].item() == 0.5
    # a class absent from both labels and predictions does not enter the macro mean
    assert f1_macro(torch.tensor([0, 0, 1]), torch.tensor([0, 1, 1]), 5).item() == pytest.approx(
        f1_score([0, 0, 1], [0, 1, 1], average="macro"))
    assert math.isnan(auroc(torch.ones(5, dtype=torch.long), torch.randn(5)).item())


# ---------------------------------------------------------------- splits
def test_holdout_split_deterministic_disjoint_covering_stratified():
    y = torch.cat([torch.zeros(300), torch.ones(100), 2 * torch.ones(37)]).long()
    y = y[torch.randperm(len(y), generator=gen(0))]
    a, b = holdout_split(y, seed=5), holdout_split(y, seed=5)
    c = holdout_split(y, seed=6)
    assert all(torch.equal(p, q) for p, q in zip((a.train, a.val, a.test), (b.train, b.val, b.test)))
    assert not torch.equal(a.test, c.test)
    allidx = torch.cat([a.train, a.val, a.test])
    assert allidx.numel() == len(y) and torch.equal(allidx.sort().values, torch.arange(len(y)))
    for part, frac in ((a.test, 0.2), (a.val, 0.2), (a.train, 0.6)):
        counts = torch.bincount(y[part], minlength=3)
        expected = torch.bincount(y) * frac
        assert torch.all((counts - expected).abs() <= 1), (counts, expected)


def test_kfold_splits_every_row_tested_once_and_stratified():
    y = torch.cat([torch.zeros(53), torch.ones(22), 2 * torch.ones(9)]).long()
    k = 5
    sps = kfold_splits(y, k, seed=2)
    assert [s.test.tolist() for s in sps] == [s.test.tolist() for s in kfold_splits(y, k, seed=2)]
    test_all = torch.cat([s.test for s in sps])
    val_all = torch.cat([s.val for s in sps])
    assert torch.equal(test_all.sort().values, torch.arange(len(y)))
    assert torch.equal(val_all.sort().values, torch.arange(len(y)))
    sizes = [s.test.numel() for s in sps]
    assert max(sizes) - min(sizes) <= 1
    for s in sps:
        assert torch.cat([s.train, s.val, s.test]).unique().numel() == len(y)  # disjoint, covering
        counts = torch.bincount(y[s.test], minlength=3).double()
        assert torch.all((counts - torch.bincount(y).double() / k).abs() < 1)


# ---------------------------------------------------------------- test rows never influence choices
def test_choice_and_weights_ignore_test_labels():
    N, D, S = 300, 40, 3
    X, y, _ = planted(N, D, S, mu=0.4, seed=8)
    sp = holdout_split(y, seed=0)
    grid = [1e-3, 1e-2, 1e-1, 1.0, 10.0]
    a = fit_probes(X, y, split=sp, C_grid=grid, control=None)
    y2 = y.clone()
    y2[sp.test] = torch.randint(0, 2, (sp.test.numel(),), generator=gen(1))  # arbitrary test labels
    y2[sp.test[:5]] = 1 - y[sp.test[:5]]  # certainly changed
    b = fit_probes(X, y2, split=sp, C_grid=grid, control=None)
    assert torch.equal(a.chosen, b.chosen)
    assert torch.equal(a.coef, b.coef) and torch.equal(a.intercept, b.intercept)
    assert torch.equal(a.mean, b.mean) and torch.equal(a.std, b.std)
    assert not torch.equal(a.test["accuracy"], b.test["accuracy"])  # the change was seen by the test score
    for m in a.val:
        assert torch.equal(a.val[m], b.val[m]) and torch.equal(a.train[m], b.train[m])


# ---------------------------------------------------------------- directions: raw map, save, load
def test_raw_map_save_load_roundtrip(tmp_path):
    N, D, S = 240, 20, 2
    X, y, _ = planted(N, D, S, mu=0.8, seed=2, scales=torch.linspace(0.1, 10, 20, dtype=torch.float64))
    X = X + 5.0
    fit = fit_probes(X, y, split="kfold", k=3, site_names=["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"])
    # the raw-basis map reproduces the standardised probe's logits on raw activations
    for f in range(fit.n_folds):
        Z = (X - fit.mean[f][:, None, :]) / fit.std[f][:, None, :]
        logit_std = torch.einsum("snd,sd->sn", Z, fit.coef[f, :, 0]) + fit.intercept[f, :, :1]
        logit_raw = torch.einsum("snd,sd->sn", X, fit.raw_coef[f, :, 0]) + fit.raw_intercept[f, :, :1]
        torch.testing.assert_close(logit_raw, logit_std, rtol=1e-9, atol=1e-9)
    path = fit.save_directions(tmp_path / "probe")
    assert path.exists() and path.with_suffix(".json").exists()
    loaded = load_directions(path)
    torch.testing.assert_close(loaded.directions, fit.directions)
    torch.testing.assert_close(loaded.raw_coef, fit.raw_coef)
    assert loaded.site_names == fit.site_names and loaded.meta["task"] == "classification"
    torch.testing.assert_close(loaded.direction("blocks.1.hook_resid_post"), fit.directions[1])
    torch.testing.assert_close(fit.directions.norm(dim=-1), torch.ones(S, 1, dtype=torch.float64))
    df = fit.to_frame()
    assert list(df["site"]) == fit.site_names and "selectivity" in df and "train_accuracy" in df
    assert len(fit.to_frame(per_fold=True)) == S * 3


# ---------------------------------------------------------------- project_out
def test_project_out():
    g = gen(0)
    D = 24
    dirs = torch.randn(3, D, generator=g, dtype=torch.float64) * torch.tensor([[0.1], [5.0], [1.0]])
    dirs = torch.cat([dirs, (2 * dirs[0] - dirs[2])[None]])  # a dependent fourth direction
    x = torch.randn(7, 5, D, generator=g, dtype=torch.float64)
    px = project_out(x, dirs)
    assert (px @ dirs.T).abs().max() < 1e-10  # orthogonal to every direction
    torch.testing.assert_close(project_out(px, dirs), px, rtol=0, atol=1e-12)  # idempotent
    # the orthogonal complement is untouched: a vector already orthogonal to the span is unchanged
    Qf, _ = torch.linalg.qr(torch.cat([dirs[:3].T, torch.randn(D, 5, generator=g, dtype=torch.float64)], 1))
    comp = Qf[:, 3:].T  # orthonormal, orthogonal to dirs
    torch.testing.assert_close(project_out(comp, dirs), comp, rtol=0, atol=1e-12)
    # x = (part in span) + (part in complement): only the first is removed; rank 3 removed, not 4
    assert torch.linalg.matrix_rank((x - px).reshape(-1, D)).item() == 3
    x32 = x.float()
    assert project_out(x32, dirs).dtype == torch.float32


# ---------------------------------------------------------------- guard rails and chunking
def test_refusals_and_site_chunking_give_same_numbers():
    X, y, _ = planted(120, 10, 3, mu=1.0, seed=0)
    with pytest.raises(DataError):
        fit_probes(X, torch.zeros(120), control=None)  # one class
    with pytest.raises(DataError):
        fit_probes(X, y[:100])  # length mismatch
    Xn = X.clone()
    Xn[1, 3, 2] = float("nan")
    with pytest.raises(DataError):
        fit_probes(Xn, y)
    y3 = y.clone()
    y3[:2] = 2  # a class with 2 rows: some fold has none of it in training rows
    with pytest.raises(DataError):
        fit_probes(X, y3, split="kfold", k=5)
    a = fit_probes(X, y, C_grid=[0.01, 1.0])
    b = fit_probes(X, y, C_grid=[0.01, 1.0], site_chunk=1)
    torch.testing.assert_close(a.coef, b.coef)
    assert torch.equal(a.chosen, b.chosen)
