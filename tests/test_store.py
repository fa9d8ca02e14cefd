"""Per-layer zarr caches: exact round trip, one shard file per array, nothing left half-written."""

from pathlib import Path

import pytest
import torch

from featcal.io.feature_store import read_attrs, read_group, write_group


def test_group_round_trips_with_one_shard_per_array(tmp_path):
    arrays = {"bbc": torch.randn(37, 5, 4), "tweets": torch.randn(16, 3, 4),
              "query/bbc/count": torch.tensor(3.0, dtype=torch.float64), "mask/bbc": torch.ones(37, 5, dtype=torch.bool)}
    write_group(tmp_path / "layer_00.zarr", arrays, {"layer": 0})
    back = read_group(tmp_path / "layer_00.zarr")
    assert set(back) == set(arrays)
    for name, value in arrays.items():
        assert torch.equal(back[name], value), name
    assert read_attrs(tmp_path / "layer_00.zarr") == {"layer": 0}
    chunk_files = [p for p in (tmp_path / "layer_00.zarr").rglob("*") if p.is_file() and p.name != "zarr.json"]
    assert len(chunk_files) == len(arrays)


def test_failed_write_leaves_nothing_behind(tmp_path):
    class Broken:
        def __array__(self, *args, **kwargs):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        write_group(tmp_path / "layer_01.zarr", {"ok": torch.ones(2), "bad": Broken()})
    assert list(Path(tmp_path).iterdir()) == []


def test_missing_group_error_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="layer_09.zarr"):
        read_group(tmp_path / "layer_09.zarr")


def test_rows_written_one_at_a_time_round_trip_a_chunk_file_per_row(tmp_path):
    from featcal.io.feature_store import write_rows

    data = torch.randn(3, 1000, dtype=torch.float64)
    made = []

    def rows():
        for row in data:
            made.append(1)
            yield row.clone()

    write_rows(tmp_path / "L00.zarr", "moments", rows(), tuple(data.shape), {"layer": 0})
    assert len(made) == 3
    assert torch.equal(read_group(tmp_path / "L00.zarr")["moments"], data)
    assert read_attrs(tmp_path / "L00.zarr") == {"layer": 0}
    chunk_files = [p for p in (tmp_path / "L00.zarr").rglob("*") if p.is_file() and p.name != "zarr.json"]
    assert len(chunk_files) == 3


def test_rows_of_the_wrong_count_or_shape_leave_nothing_behind(tmp_path):
    from featcal.io.feature_store import write_rows

    with pytest.raises(ValueError, match="2 rows of 'moments' given, expected 3"):
        write_rows(tmp_path / "a.zarr", "moments", iter(torch.zeros(2, 4)), (3, 4))
    with pytest.raises(ValueError, match="row 1 of 'moments' has shape"):
        write_rows(tmp_path / "b.zarr", "moments", iter([torch.zeros(4), torch.zeros(5)]), (2, 4))
    assert list(Path(tmp_path).iterdir()) == []
