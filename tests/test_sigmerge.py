"""SigMerge: conflict → capacity, deficit → allocation, sequential claiming, and the whole method."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from featcal.merging.sigmerge import (
    SigMergeOptions,
    anchor_merge,
    apply_claims,
    capacities,
    claim,
    claiming_order,
    conflict_scores,
    deficits,
    demand_signal,
    direction_signal,
    geometry_signal,
    linear_cka,
    normalise_across_blocks,
    plot_admitted,
    quota,
    quotas,
    shares,
    sigmerge,
)

# --------------------------------------------------------------------------- helpers


def _random_tau(n: int, gen: torch.Generator, zero_frac: float = 0.25) -> torch.Tensor:
    tau = torch.randn(n, generator=gen, dtype=torch.float64)
    tau[torch.rand(n, generator=gen) < zero_frac] = 0.0
    return tau


def _random_orthogonal(d: int, gen: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


BLOCK_OF = {"emb.weight": None, "b0.w": 0, "b0.bias": 0, "b1.w": 1, "b1.bias": 1, "norm.weight": None}


def _tiny_pool(seed: int = 0):
    """Base, 3 experts, a TA anchor and pooled block outputs for 2 blocks; some τ entries are zero."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "emb.weight": (5, 4),
        "b0.w": (6, 4),
        "b0.bias": (6,),
        "b1.w": (4, 6),
        "b1.bias": (4,),
        "norm.weight": (4,),
    }
    base = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    base["position_ids"] = torch.arange(5)
    experts = {}
    for d in ("code", "law", "math"):
        sd = {}
        for n, t in base.items():
            if not t.is_floating_point():
                sd[n] = t.clone()
                continue
            delta = 0.1 * torch.randn(t.shape, generator=gen)
            delta[torch.rand(t.shape, generator=gen) < 0.5] = 0.0  # sparse task vectors
            sd[n] = t + delta
        experts[d] = sd
    anchor = anchor_merge(base, experts, SigMergeOptions())
    outputs = {b: {d: torch.randn(10, 3, generator=gen) for d in experts} for b in (0, 1)}
    return base, experts, anchor, outputs


# --------------------------------------------------------------------------- claiming


@pytest.mark.parametrize("seed", range(6))
def test_claiming_maximises_admitted_task_vector_mass_per_stage_brute_force(seed):
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(6, 13, (1,), generator=gen))
    domains = ["a", "b", "c"]
    taus = {d: _random_tau(n, gen) for d in domains}
    if seed % 2:  # repeated magnitudes make ties at the threshold
        taus["b"] = torch.round(taus["b"] * 2) / 2
    q = {d: int(torch.randint(1, 5, (1,), generator=gen)) for d in domains}
    order = ["c", "a", "b"]
    masks = claim(taus, q, order)
    claimed: set[int] = set()
    for d in order:
        available = [i for i in range(n) if i not in claimed and taus[d][i] != 0]
        k = min(q[d], len(available))
        mine = set(torch.nonzero(masks[d]).flatten().tolist())
        assert len(mine) == k and mine <= set(available)
        got = sum(abs(float(taus[d][i])) for i in mine)
        best = max(sum(abs(float(taus[d][i])) for i in subset) for subset in itertools.combinations(available, k))
        assert got == pytest.approx(best, rel=0, abs=1e-12)
        claimed |= mine


def test_claimed_sets_are_disjoint_and_total_admitted_at_most_sum_of_quotas():
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        taus = {d: _random_tau(30, gen, zero_frac=0.4) for d in ("a", "b", "c")}
        q = {d: int(torch.randint(0, 20, (1,), generator=gen)) for d in taus}
        masks = claim(taus, q, claiming_order({"a": 1.0, "b": 3.0, "c": 2.0}))
        stacked = torch.stack(list(masks.values())).int()
        assert int(stacked.sum(0).max()) <= 1
        assert int(stacked.sum()) <= sum(q.values())
        for d in taus:
            assert int(masks[d].sum()) <= q[d]


def test_coordinates_with_zero_task_vector_are_never_claimed():
    tau = {"a": torch.tensor([0.0, 2.0, 0.0, -1.0, 0.0]), "b": torch.tensor([0.0, 5.0, 0.0, 0.0, 0.0])}
    masks = claim(tau, {"a": 5, "b": 5}, ["b", "a"])
    assert masks["b"].tolist() == [False, True, False, False, False]
    assert masks["a"].tolist() == [False, False, False, True, False]  # index 1 already claimed by b


def test_claiming_is_deterministic_under_ties_lower_index_first():
    tau = {"a": torch.tensor([1.0, -3.0, 3.0, 1.0, -3.0, 1.0]), "b": torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0])}
    first = claim(tau, {"a": 2, "b": 2}, ["a", "b"])
    assert first["a"].tolist() == [False, True, True, False, False, False]
    assert first["b"].tolist() == [True, False, False, True, False, False]
    again = claim(tau, {"a": 2, "b": 2}, ["a", "b"])
    assert all(torch.equal(first[d], again[d]) for d in tau)


def test_claiming_order_is_descending_deficit_ties_by_name():
    assert claiming_order({"math": 2.0, "code": 5.0, "law": 2.0, "bio": 0.0}) == ["code", "law", "math", "bio"]


def test_apply_claims_sets_admitted_coordinates_to_source_and_scales_with_gamma():
    anchor = torch.tensor([0.0, 1.0, 2.0, 3.0])
    experts = {"a": torch.tensor([10.0, 11.0, 12.0, 13.0]), "b": torch.tensor([20.0, 21.0, 22.0, 23.0])}
    masks = {"a": torch.tensor([True, False, False, False]), "b": torch.tensor([False, False, True, False])}
    assert apply_claims(anchor, experts, masks).tolist() == [10.0, 1.0, 22.0, 3.0]
    assert apply_claims(anchor, experts, masks, gamma=0.5).tolist() == [5.0, 1.0, 12.0, 3.0]
    overlapping = {"a": torch.tensor([True, False, False, False]), "b": torch.tensor([True, False, False, False])}
    with pytest.raises(ValueError, match="overlaps"):
        apply_claims(anchor, experts, overlapping)


# --------------------------------------------------------------------------- signals


def test_cka_of_a_representation_with_itself_is_one():
    gen = torch.Generator().manual_seed(0)
    for n, d in ((20, 5), (6, 30)):
        x = torch.randn(n, d, generator=gen)
        assert linear_cka(x, x) == pytest.approx(1.0, abs=1e-12)


def test_cka_is_invariant_to_orthogonal_transforms_and_isotropic_scaling():
    gen = torch.Generator().manual_seed(1)
    for n, d in ((25, 6), (5, 12)):
        x = torch.randn(n, d, generator=gen, dtype=torch.float64)
        y = torch.randn(n, d + 2, generator=gen, dtype=torch.float64)
        ref = linear_cka(x, y)
        q = _random_orthogonal(d, gen)
        assert linear_cka(x @ q, y) == pytest.approx(ref, abs=1e-10)
        assert linear_cka(3.7 * x, 0.01 * y) == pytest.approx(ref, abs=1e-10)
        assert linear_cka(x @ q * 5.0, y @ _random_orthogonal(d + 2, gen)) == pytest.approx(ref, abs=1e-10)


def test_cka_is_in_unit_interval():
    gen = torch.Generator().manual_seed(2)
    for _ in range(20):
        n = int(torch.randint(3, 15, (1,), generator=gen))
        x = torch.randn(n, int(torch.randint(1, 10, (1,), generator=gen)), generator=gen)
        y = torch.randn(n, int(torch.randint(1, 10, (1,), generator=gen)), generator=gen)
        assert 0.0 <= linear_cka(x, y) <= 1.0
    assert linear_cka(torch.ones(4, 3), torch.randn(4, 3, generator=gen)) == 0.0  # constant → 0


def test_geometry_signal_is_zero_for_identical_outputs_and_positive_otherwise():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(12, 4, generator=gen)
    assert geometry_signal([x, x, x]) == pytest.approx(0.0, abs=1e-12)
    assert geometry_signal([x, torch.randn(12, 4, generator=gen)]) > 0.0
    assert geometry_signal([x]) == 0.0


def test_direction_signal_is_zero_aligned_half_orthogonal_one_opposite():
    a = torch.tensor([1.0, 2.0, 0.0])
    assert direction_signal([a, 2 * a]) == pytest.approx(0.0, abs=1e-12)
    assert direction_signal([torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])]) == pytest.approx(0.5)
    assert direction_signal([a, -a]) == pytest.approx(1.0)


def test_demand_signal_counts_opposite_signs_on_jointly_demanded_coordinates():
    # fraction 0.5 of 4 → each expert demands 2 coordinates.
    e = torch.tensor([5.0, -4.0, 0.1, 0.1])
    f = torch.tensor([-5.0, -4.0, 0.1, 0.1])
    assert demand_signal([e, f], 0.5) == pytest.approx(0.5)  # {0, 1} in common, 0 opposite
    g = torch.tensor([0.1, 0.1, 3.0, 3.0])
    assert demand_signal([e, g], 0.5) == 0.0  # empty intersection → 0
    assert demand_signal([e, f, g], 0.5) == pytest.approx(0.5 / 3)


def test_normalisation_of_constant_signal_is_zero():
    assert normalise_across_blocks([0.3, 0.3, 0.3]) == [0.0, 0.0, 0.0]
    assert normalise_across_blocks([0.7]) == [0.0]
    assert normalise_across_blocks([1.0, 3.0, 2.0]) == [0.0, 1.0, 0.5]


def test_capacity_is_monotone_non_increasing_in_conflict_score():
    s = [i / 20 for i in range(21)]
    c = capacities(s, 0.02, 0.2)
    assert c[0] == pytest.approx(0.2) and c[-1] == pytest.approx(0.02)
    assert all(a >= b for a, b in zip(c, c[1:]))


def test_raising_one_blocks_signal_never_raises_its_capacity():
    gen = torch.Generator().manual_seed(4)
    for _ in range(200):
        sig = [torch.rand(5, generator=gen).tolist() for _ in range(3)]
        if torch.rand(1, generator=gen) < 0.3:
            sig[0] = [0.4] * 5  # constant signal
        which, block = int(torch.randint(0, 3, (1,), generator=gen)), int(torch.randint(0, 5, (1,), generator=gen))
        before = capacities(conflict_scores(*sig))[block]
        raised = [list(s) for s in sig]
        raised[which][block] += float(torch.rand(1, generator=gen))
        after = capacities(conflict_scores(*raised))[block]
        assert after <= before + 1e-12


def test_raising_one_blocks_geometry_end_to_end_never_raises_its_capacity():
    base, experts, anchor, outputs = _tiny_pool(5)
    best, anchor_dev = {"code": 0.8, "law": 0.7, "math": 0.6}, {"code": 0.6, "law": 0.65, "math": 0.6}
    gen = torch.Generator().manual_seed(9)
    shared = torch.randn(10, 3, generator=gen)
    agreeing = {0: outputs[0], 1: {d: shared for d in experts}}  # block 1: CKA 1, geometry 0
    divergent = {0: outputs[0], 1: {d: torch.randn(10, 3, generator=gen) for d in experts}}
    _, before = sigmerge(base, experts, anchor, BLOCK_OF.get, agreeing, best, anchor_dev)
    _, after = sigmerge(base, experts, anchor, BLOCK_OF.get, divergent, best, anchor_dev)
    assert after["blocks"][1]["signals"]["geometry"] > before["blocks"][1]["signals"]["geometry"]
    assert after["blocks"][1]["C"] <= before["blocks"][1]["C"]
    assert sum(after["admitted"]["1"].values()) <= sum(before["admitted"]["1"].values())


# --------------------------------------------------------------------------- allocation


def test_deficits_shares_and_quotas():
    g = deficits({"a": 0.9, "b": 0.5, "c": 0.7}, {"a": 0.6, "b": 0.6, "c": 0.6})
    assert g == pytest.approx({"a": 0.3, "b": 0.0, "c": 0.1})
    rho = shares(g)
    assert rho == pytest.approx({"a": 0.75, "b": 0.0, "c": 0.25})
    assert shares({"a": 0.0, "b": 0.0}) == {"a": 0.0, "b": 0.0}
    assert quotas(0.2, rho, 100) == {"a": 15, "b": 0, "c": 5}
    assert quota(0.1, 0.5, 200) == 10  # 9.999999999999998 in floats
    assert quota(0.2, 0.25, 99) == 4  # floor(4.95)


# --------------------------------------------------------------------------- the whole method


def test_zero_deficit_everywhere_returns_the_anchor_bit_for_bit():
    base, experts, anchor, outputs = _tiny_pool(1)
    dev = {"code": 0.5, "law": 0.6, "math": 0.7}
    worse = {"code": 0.4, "law": 0.6, "math": 0.1}
    merged, record = sigmerge(base, experts, anchor, BLOCK_OF.get, outputs, worse, dev)
    assert list(merged) == list(anchor)
    for name in anchor:
        assert merged[name].dtype == anchor[name].dtype
        assert torch.equal(merged[name], anchor[name])
    assert record["total_admitted"] == 0


@pytest.mark.parametrize(("c_min", "c_max", "quota_binds"), [(0.3, 0.9, True), (0.9, 1.0, False)])
def test_end_to_end_record_has_documented_keys_and_admits_min_of_quota_and_available(c_min, c_max, quota_binds):
    base, experts, anchor, outputs = _tiny_pool(2)
    best = {"code": 0.9, "law": 0.75, "math": 0.8}
    anchor_dev = {"code": 0.5, "law": 0.5, "math": 0.5}
    opts = SigMergeOptions(c_min=c_min, c_max=c_max)
    availability_bound = False  # some domain runs out of unclaimed nonzero coordinates
    merged, record = sigmerge(base, experts, anchor, BLOCK_OF.get, outputs, best, anchor_dev, opts)

    json.dumps(record)  # JSON-serialisable
    assert {"options", "blocks", "domains", "order", "admitted"} <= set(record)
    assert record["order"] == ["code", "math", "law"]
    for d, info in record["domains"].items():
        assert {"deficit", "share", "source"} <= set(info)
    assert [b["block"] for b in record["blocks"]] == [0, 1]

    names = {0: ["b0.w", "b0.bias"], 1: ["b1.w", "b1.bias"]}
    rho = shares(deficits(best, anchor_dev))
    for br in record["blocks"]:
        assert {"signals", "normalised", "S", "C", "quotas", "admitted", "n_coords"} <= set(br)
        assert set(br["signals"]) == set(br["normalised"]) == {"geometry", "direction", "demand"}
        b = br["block"]
        assert br["n_coords"] == sum(base[n].numel() for n in names[b])
        assert br["C"] == pytest.approx(opts.c_max - (opts.c_max - opts.c_min) * br["S"])
        claimed = torch.zeros(br["n_coords"], dtype=torch.bool)
        theta0 = torch.cat([base[n].flatten() for n in names[b]])
        for d in record["order"]:
            q = math.floor(round(br["C"] * rho[d] * br["n_coords"], 9))
            assert br["quotas"][d] == q
            tau = torch.cat([experts[d][n].flatten() for n in names[b]]) - theta0
            available = int(((tau != 0) & ~claimed).sum())
            assert br["admitted"][d] == min(q, available)
            availability_bound |= available < q
            assert record["admitted"][str(b)][d] == br["admitted"][d]
            # Recover which coordinates d took: those now equal to d's expert and unclaimed before.
            merged_flat = torch.cat([merged[n].flatten() for n in names[b]])
            src = torch.cat([experts[d][n].flatten() for n in names[b]])
            anchor_flat = torch.cat([anchor[n].flatten() for n in names[b]])
            mine = (merged_flat == src) & (merged_flat != anchor_flat) & ~claimed
            claimed |= mine
        assert int(claimed.sum()) <= sum(br["admitted"].values())
        assert sum(br["admitted"].values()) > 0

    for name in ("emb.weight", "norm.weight", "position_ids"):  # outside blocks: anchor's value
        assert torch.equal(merged[name], anchor[name])
    changed = sum(int((merged[n] != anchor[n]).sum()) for n in names[0] + names[1])
    assert 0 < changed <= record["total_admitted"]
    assert availability_bound is not quota_binds  # both cases of the min are exercised


def test_plot_admitted_writes_a_png(tmp_path):
    base, experts, anchor, outputs = _tiny_pool(3)
    best, anchor_dev = {"code": 1.0, "law": 1.0, "math": 1.0}, {"code": 0.5, "law": 0.9, "math": 0.2}
    _, record = sigmerge(base, experts, anchor, BLOCK_OF.get, outputs, best, anchor_dev)
    path = tmp_path / "admitted.png"
    plot_admitted(record, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_options_reject_bad_values():
    with pytest.raises(ValueError):
        SigMergeOptions(c_min=0.3, c_max=0.2)
    with pytest.raises(ValueError):
        SigMergeOptions(gamma=1.5)
    with pytest.raises(ValueError):
        SigMergeOptions(anchor="nope")
    with pytest.raises(ValueError):
        SigMergeOptions(demand_fraction=0.0)
