"""The closed forms against independent least-squares solutions on random problems."""

import pytest
import torch

from featcal.calibration import solve
from featcal.calibration.moments import LinearMoments, NormMoments


@pytest.fixture(autouse=True)
def float64_default():
    """The reference least-squares solutions need float64 inputs; restore the default after."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def random_tasks(n_tasks=3, d=6, m=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    tasks = []
    for i in range(n_tasks):
        scale = 10.0 ** (i - 1)  # unequal feature scales across tasks
        n = 40 + 7 * i
        xs = scale * torch.randn(n, d, generator=g)
        xe = xs + 0.3 * scale * torch.randn(n, d, generator=g)
        tasks.append(dict(xs=xs, xe=xe, w=torch.randn(m, d, generator=g), b=torch.randn(m, generator=g)))
    anchor_w = torch.randn(m, d, generator=g)
    anchor_b = torch.randn(m, generator=g)
    return tasks, anchor_w, anchor_b


def moments_of(task, alpha):
    m = LinearMoments()
    m.add(task["xs"], task["xe"])
    return m


def test_solve_matches_weighted_lstsq():
    alpha, ridge = 0.3, 0.05
    tasks, w_anc, _ = random_tasks()
    stats = [moments_of(t, alpha) for t in tasks]
    grams = [s.gram for s in stats]
    omegas = solve.task_weights(grams)
    w_star, report = solve.solve_linear_weight(
        grams, [s.cross_mean for s in stats], [t["w"] for t in tasks], w_anc, alpha, ridge, omegas
    )
    # Independent: stack √(ω_i / n_i)-weighted rows, plus √λ·I rows pulling toward the anchor.
    rows, targets = [], []
    for t, om in zip(tasks, omegas):
        xt = alpha * t["xe"] + (1 - alpha) * t["xs"]
        c = (om / t["xs"].shape[0]).sqrt()
        rows.append(c * t["xs"])
        targets.append(c * xt @ t["w"].T)
    d = w_anc.shape[1]
    rows.append(ridge**0.5 * torch.eye(d))
    targets.append(ridge**0.5 * w_anc.T)
    expected = torch.linalg.lstsq(torch.cat(rows), torch.cat(targets), driver="gelsd").solution.T
    assert torch.linalg.norm(w_star - expected) / torch.linalg.norm(expected) < 1e-8
    assert report.method == "cholesky"


def test_normal_equations_from_a_generator_equal_the_listed_solve_bit_for_bit():
    """What solve_modules does: one task's (G_i, W_i C_i) alive at a time, ω_i computed on the way."""
    tasks, w_anc, _ = random_tasks(n_tasks=4, seed=5)
    stats = [moments_of(t, 0.3) for t in tasks]
    grams = [s.gram for s in stats]
    targets = [s.target_product(t["w"], 0.3) for s, t in zip(stats, tasks)]
    listed, _ = solve.solve_linear_targets(grams, targets, w_anc, 0.05, solve.task_weights(grams))
    alive = []

    def pairs():
        for s, t in zip(stats, tasks):
            alive.append(len(alive))
            yield s.gram, s.target_product(t["w"], 0.3)

    lhs, rhs, omegas = solve.normal_equations(pairs(), w_anc, 0.05)
    streamed, _ = solve.solve_normal_equations(lhs, rhs)
    assert alive == [0, 1, 2, 3]
    assert torch.equal(omegas, solve.task_weights(grams))
    assert torch.equal(streamed, listed)


def test_bias_matches_per_channel_lstsq():
    alpha, ridge = 0.4, 0.1
    tasks, w_anc, b_anc = random_tasks(seed=1)
    stats = [moments_of(t, alpha) for t in tasks]
    omegas = solve.task_weights([s.gram for s in stats])
    w_star = torch.randn_like(w_anc)
    b_star = solve.solve_bias(
        w_star, [s.student_mean for s in stats],
        [solve.expert_output(t["w"], t["b"], s.target_mean(alpha)) for s, t in zip(stats, tasks)], b_anc, ridge, omegas,
    )
    rows, targets = [], []
    for t, om in zip(tasks, omegas):
        xt = alpha * t["xe"] + (1 - alpha) * t["xs"]
        c = (om / t["xs"].shape[0]).sqrt()
        residual = xt @ t["w"].T + t["b"] - t["xs"] @ w_star.T  # what the bias must explain
        rows.append(c * torch.ones(t["xs"].shape[0], 1))
        targets.append(c * residual)
    rows.append(torch.full((1, 1), ridge**0.5))
    targets.append(ridge**0.5 * b_anc[None])
    expected = torch.linalg.lstsq(torch.cat(rows), torch.cat(targets)).solution[0]
    assert torch.linalg.norm(b_star - expected) / torch.linalg.norm(expected) < 1e-8


def norm_problem(seed=2, n_tasks=3, d=5):
    g = torch.Generator().manual_seed(seed)
    zs = [torch.randn(30 + i, d, generator=g) * (1 + i) + i for i in range(n_tasks)]
    gammas = [torch.randn(d, generator=g) for _ in range(n_tasks)]
    betas = [torch.randn(d, generator=g) for _ in range(n_tasks)]
    return zs, gammas, betas, torch.randn(d, generator=g), torch.randn(d, generator=g)


def test_layernorm_affine_matches_per_channel_lstsq():
    ridge = 0.07
    zs, gammas, betas, g_anc, b_anc = norm_problem()
    stats = []
    for z in zs:
        m = NormMoments()
        m.add(z)
        stats.append(m)
    gamma, beta = solve.solve_layernorm(
        [m.mean for m in stats], [m.mean_square for m in stats], gammas, betas, g_anc, b_anc, ridge
    )
    for c in range(zs[0].shape[1]):
        rows, targets = [], []
        for z, gi, bi in zip(zs, gammas, betas):
            s = 1 / z.shape[0] ** 0.5
            rows.append(s * torch.stack([z[:, c], torch.ones(z.shape[0])], 1))
            targets.append(s * (gi[c] * z[:, c] + bi[c]))
        rows.append(ridge**0.5 * torch.eye(2))
        targets.append(ridge**0.5 * torch.stack([g_anc[c], b_anc[c]]))
        expected = torch.linalg.lstsq(torch.cat(rows), torch.cat(targets)[:, None]).solution[:, 0]
        assert torch.allclose(torch.stack([gamma[c], beta[c]]), expected, rtol=1e-8, atol=0)


def test_rmsnorm_gain_matches_per_channel_lstsq():
    ridge = 0.03
    zs, gammas, _, g_anc, _ = norm_problem(seed=3)
    stats = []
    for z in zs:
        m = NormMoments()
        m.add(z)
        stats.append(m)
    gamma = solve.solve_rmsnorm([m.mean_square for m in stats], gammas, g_anc, ridge)
    for c in range(zs[0].shape[1]):
        rows = [z[:, c:c + 1] / z.shape[0] ** 0.5 for z in zs] + [torch.full((1, 1), ridge**0.5)]
        targets = [gi[c] * z[:, c:c + 1] / z.shape[0] ** 0.5 for z, gi in zip(zs, gammas)]
        targets.append(torch.full((1, 1), ridge**0.5 * float(g_anc[c])))
        expected = torch.linalg.lstsq(torch.cat(rows), torch.cat(targets)).solution[0, 0]
        assert abs(float(gamma[c]) - float(expected)) <= 1e-8 * abs(float(expected))


def test_large_ridge_returns_anchor():
    tasks, w_anc, _ = random_tasks(seed=4)
    stats = [moments_of(t, 0.25) for t in tasks]
    w_star, _ = solve.solve_linear_weight(
        [s.gram for s in stats], [s.cross_mean for s in stats], [t["w"] for t in tasks], w_anc, 0.25, 1e12
    )
    assert torch.allclose(w_star, w_anc, rtol=1e-9, atol=1e-9)


def test_alpha_zero_with_experts_equal_to_anchor_changes_nothing():
    # α = 0 (targets are the student's own inputs) and W_i = W_anc: the solve returns W_anc exactly.
    tasks, w_anc, _ = random_tasks(seed=5)
    stats = [moments_of(t, 0.0) for t in tasks]
    w_star, _ = solve.solve_linear_weight(
        [s.gram for s in stats], [s.cross_mean for s in stats], [w_anc] * len(tasks), w_anc, 0.0, 0.05
    )
    assert torch.allclose(w_star, w_anc, rtol=1e-10, atol=1e-10)


def test_singular_system_falls_back_and_is_reported(caplog):
    d = 4
    g = torch.zeros(d, d)
    g[0, 0] = 1.0  # rank one, and no ridge: not positive definite
    w, report = solve.solve_linear_weight([g], [g], [torch.ones(2, d)], torch.zeros(2, d), 0.5, 0.0)
    assert report.method == "eigh-pinv" and report.ill_conditioned
    assert torch.isfinite(w).all()
    assert "not positive definite" in caplog.text


def test_condition_estimate_tracks_the_true_condition_number():
    g = torch.Generator().manual_seed(7)
    q, _ = torch.linalg.qr(torch.randn(40, 40, generator=g))
    eigenvalues = torch.logspace(-6, 2, 40)
    a = q @ torch.diag(eigenvalues) @ q.T
    estimate = solve.condition_estimate(a, torch.linalg.cholesky(a), iterations=200)
    assert 0.5 * 1e8 < estimate <= 1e8 * (1 + 1e-6)


def test_symmetrize_in_place_gives_the_numbers_of_the_two_buffer_form():
    """spd_solve symmetrizes its system block by block in place: bit for bit ½(A + Aᵀ), also where
    the blocks do not divide the width."""
    a = torch.randn(37, 37, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    expected = 0.5 * (a + a.T)
    out = solve.symmetrize_(a, block=8)
    assert out is a and torch.equal(a, expected)


def test_cholesky_solve_gives_torchs_numbers_without_its_copy_of_the_factor():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 30, dtype=torch.float64, generator=g)
    chol = torch.linalg.cholesky(x.T @ x + torch.eye(30, dtype=torch.float64))
    rhs = torch.randn(30, 7, dtype=torch.float64, generator=g)
    got = solve.cholesky_solve(rhs, chol)
    assert torch.allclose(got, torch.cholesky_solve(rhs, chol), rtol=1e-12, atol=0)
    assert torch.allclose(chol @ (chol.T @ got), rhs, rtol=1e-9, atol=1e-12)
