"""Running float64 sums: many small batches equal one big batch; sums merge across workers."""

import torch

from featcal.calibration.moments import LinearMoments, NormMoments, moments_from_arrays, moments_to_arrays


def test_moments_over_small_batches_equal_one_big_batch():
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(500, 16, generator=g, dtype=torch.float32) * 3
    xe = torch.randn(500, 16, generator=g, dtype=torch.float32)
    w = torch.rand(500, generator=g, dtype=torch.float64)
    whole = LinearMoments()
    whole.add(xs, xe, w)
    parts = LinearMoments()
    for chunk in range(0, 500, 7):
        parts.add(xs[chunk:chunk + 7], xe[chunk:chunk + 7], w[chunk:chunk + 7])
    for name, value in moments_to_arrays(whole).items():
        other = moments_to_arrays(parts)[name]
        assert value.dtype == torch.float64
        assert torch.allclose(value, other, rtol=1e-12, atol=1e-12), name


def test_moments_merge_across_workers_and_round_trip():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(100, 8, generator=g)
    a, b, whole = NormMoments(), NormMoments(), NormMoments()
    a.add(z[:30])
    b.add(z[30:])
    whole.add(z)
    merged = moments_from_arrays("norm", moments_to_arrays(a)).merge(b)
    assert torch.allclose(merged.mean, whole.mean, rtol=1e-12, atol=1e-12)
    assert torch.allclose(merged.mean_square, whole.mean_square, rtol=1e-12, atol=1e-12)


def test_moments_means_are_the_spec_statistics():
    xs = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    xe = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    m = LinearMoments()
    m.add(xs, xe)
    assert torch.allclose(m.gram, (xs.T @ xs).double() / 2)
    assert torch.allclose(m.cross_mean, (xe.T @ xs).double() / 2)
    assert torch.allclose(m.target_mean(0.25), (0.25 * xe + 0.75 * xs).double().mean(0))


def test_packed_moments_round_trip_exactly():
    from featcal.calibration.moments import pack_moments, packed_row, unpack_moments

    g = torch.Generator().manual_seed(2)
    moments = {}
    for module, d in (("query", 4), ("dense", 6)):
        moments[module] = {}
        for task in ("b", "a"):
            m = LinearMoments()
            m.add(torch.randn(5, d, generator=g), torch.randn(5, d, generator=g))
            moments[module][task] = m
    norm = NormMoments()
    norm.add(torch.randn(7, 4, generator=g))
    moments["LayerNorm"] = {"a": norm, "b": NormMoments().merge(norm)}
    packed, meta = pack_moments(moments)
    assert packed.shape == (2, meta["total"])   # one array, a row per task, whatever the modules and fields
    consumed = {m: dict(per_task) for m, per_task in moments.items()}
    rows = [packed_row(consumed, meta, t, release=True) for t in meta["tasks"]]   # what the calibrate stage writes
    assert all(per_task == {} for per_task in consumed.values())
    assert torch.equal(torch.stack(rows), packed)
    back = unpack_moments(packed, meta)
    for module, per_task in moments.items():
        for task, m in per_task.items():
            for name, value in moments_to_arrays(m).items():
                assert torch.equal(moments_to_arrays(back[module][task])[name], value), (module, task, name)


def test_blocked_gram_equals_the_plain_product():
    from featcal.calibration.moments import gram_of
    x = torch.randn(300, 1100, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    assert torch.allclose(gram_of(x, block=256), x.T @ x, rtol=1e-12, atol=1e-9)
    assert torch.equal(gram_of(x[:, :100], block=256), x[:, :100].T @ x[:, :100])   # narrow: one product


def _plain_float32_sums(xs, xe, pe, w):
    """What float32 products of uncentred rows give (the products before centring), for comparison."""
    xs_w, pe_w = xs * w[:, None].float(), pe * w[:, None].float()
    return {"student_gram": (xs_w.T @ xs).double(), "projected_cross": (pe_w.T @ xs).double()}


def test_reduced_precision_products_centre_the_rows_and_keep_every_field_exact_to_float32_rounding():
    """float32 products of rows far from zero round relative to |x|; of batch-centred rows relative to
    |x − m|, the mean's terms added in float64. Both paths (`add`, `add_projected` with W_e x_s from rows)
    hold the float64 path's fields to float32 rounding of the centred rows, several times closer than
    uncentred float32 products. Only the student Gram is multiplied in float32: every other field is the float64
    path's, bit for bit (the crosses' float32 rounding was most of float32's distance to the float64 weights)."""
    g = torch.Generator().manual_seed(4)
    n, d, out = 400, 48, 12
    xs = (torch.randn(n, d, generator=g) + 8.0 * torch.rand(d, generator=g)).float()   # large per-feature means
    xe = (xs + 0.1 * torch.randn(n, d, generator=g)).float()
    weight = torch.randn(out, d, generator=g)
    pe = xe @ weight.T
    w = torch.where(torch.rand(n, generator=g) < 0.2, 1.0, 0.3).double()
    for weights in (None, w):
        exact, fast = LinearMoments(), LinearMoments()
        exact.add_projected(xs, xe, pe, weights, torch.float64, weight)
        fast.add_projected(xs, xe, pe, weights, torch.float32, weight)
        via_add = LinearMoments()
        via_add.add(xs, xe, weights, pe, torch.float32)
        ones = torch.ones(n, dtype=torch.float64) if weights is None else weights
        plain = _plain_float32_sums(xs, xe, pe, ones)
        assert set(moments_to_arrays(fast)) == set(moments_to_arrays(exact))
        for name, value in moments_to_arrays(exact).items():
            err = float((moments_to_arrays(fast)[name] - value).abs().max() / value.abs().max())
            assert err < 1e-6, (name, err)
            if name != "student_gram":
                assert torch.equal(moments_to_arrays(fast)[name], value), name
            if name in plain:
                plain_err = float((plain[name] - value).abs().max() / value.abs().max())
                assert err < plain_err / 4, (name, err, plain_err)
            if name in moments_to_arrays(via_add):
                assert torch.allclose(moments_to_arrays(via_add)[name], moments_to_arrays(fast)[name], rtol=1e-6,
                                      atol=1e-6 * float(value.abs().max())), name
        assert float(fast.count) == float(exact.count)
