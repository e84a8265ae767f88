"""Nonnegative least squares (lens/nnls.py, Lawson-Hanson) against scipy's solver and the KKT conditions, and the
Jacobian-lens decomposition running where scipy is absent (it is not a dependency of entoscope)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from entoscope.lens.nnls import nnls


def _kkt(A, b, x):
    """The optimality conditions of min ||Ax - b|| s.t. x >= 0: x >= 0, the gradient w = A^T (b - Ax) is <= 0
    where x = 0 and 0 where x > 0 (to rounding, relative to |A| |b|)."""
    w = A.T @ (b - A @ x)
    scale = 1e-9 * np.abs(A).sum(0).max() * max(np.linalg.norm(b), 1e-300)
    assert (x >= 0).all()
    assert (w[x == 0] <= scale).all()
    assert np.abs(w[x > 0]).max(initial=0) <= scale


def test_a_hand_computed_case():
    """A = I: the solution is b with its negative entries set to 0; one column against a negative target: 0."""
    x, r = nnls(np.eye(3), np.array([1.0, -2.0, 3.0]))
    assert x.tolist() == [1.0, 0.0, 3.0] and r == pytest.approx(2.0)
    x, r = nnls(np.array([[1.0], [1.0]]), np.array([-1.0, -3.0]))
    assert x.tolist() == [0.0] and r == pytest.approx(np.sqrt(10))
    x, _ = nnls(np.array([[1.0, 1.0], [0.0, 1.0]]), np.array([2.0, 1.0]))  # exact: 1 a0 + 1 a1
    assert x == pytest.approx([1.0, 1.0])


@pytest.mark.parametrize("seed", range(6))
def test_random_problems_agree_with_scipy_and_satisfy_kkt(seed):
    scipy_nnls = pytest.importorskip("scipy.optimize").nnls
    rng = np.random.default_rng(seed)
    for _ in range(60):
        m, n = int(rng.integers(2, 80)), int(rng.integers(1, 30))
        A = rng.standard_normal((m, n))
        if seed % 2:  # nonnegative columns, as the lens vectors' correlations often are: many active at once
            A = np.abs(A)
        b = rng.standard_normal(m) * 10.0 ** rng.uniform(-5, 5)
        x, r = nnls(A, b)
        y, s = scipy_nnls(A, b)
        _kkt(A, b, x)
        assert r == pytest.approx(s, rel=1e-10, abs=1e-12 * np.linalg.norm(b))
        if m >= n:  # full column rank (almost surely): the solution is unique
            np.testing.assert_allclose(x, y, rtol=1e-7, atol=1e-9 * np.abs(y).max(initial=1.0))


def test_dependent_columns_give_an_optimal_solution():
    """Duplicated and zero columns: the solution is not unique; the residual is scipy's and KKT holds."""
    scipy_nnls = pytest.importorskip("scipy.optimize").nnls
    rng = np.random.default_rng(7)
    base = rng.standard_normal((20, 5))
    A = np.concatenate([base, base[:, :3], np.zeros((20, 1))], axis=1)
    for _ in range(20):
        b = rng.standard_normal(20)
        x, r = nnls(A, b)
        _kkt(A, b, x)
        assert r == pytest.approx(scipy_nnls(A, b)[1], rel=1e-10)


def test_the_decomposition_runs_without_scipy(tmp_path):
    """`JacobianLens.decompose` (and decompose_many, coordinate patching's) in a process where importing scipy
    fails, as on a plain `pip install entoscope`; on main it failed with ModuleNotFoundError."""
    script = textwrap.dedent("""
        import sys
        sys.modules["scipy"] = None  # import scipy -> ImportError, as if it were not installed
        sys.modules["sklearn"] = None
        import torch
        from entoscope.lens.jspace import decompose
        atoms = torch.eye(6, dtype=torch.float64)[:, :4].T.contiguous() + 0.1
        x = 2.0 * atoms[1] + 0.5 * atoms[3]
        d = decompose(x, atoms, k=3)
        print(sorted(d.support), round(d.error, 9))
    """)
    src = Path(__file__).resolve().parent.parent / "src"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[1, 3] 0.0"
