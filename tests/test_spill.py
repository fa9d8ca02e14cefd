"""The expert input cache's disk spill: blocks past the memory bound read back as they were captured."""

import gc
import os
import subprocess
import sys

import pytest
import torch

from featcal.calibration.calibrate import ExpertInputCache
from featcal.calibration.moments import projected_key
from featcal.calibration.spill import PREFIX, BlockSpill, _host


def captured_block(seed: int = 0) -> dict:
    """Two tasks' batches as `run_capturing` keeps them: one input shared by q, k and v, float64 W x rows."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for task in ("a", "b"):
        out[task] = []
        for _ in range(2):
            shared = torch.randn(3, 5, 8, generator=g)
            out[task].append({"q": shared, "k": shared, "v": shared, "out": torch.randn(3, 5, 16, generator=g),
                              projected_key("out"): torch.randn(3, 5, 8, generator=g, dtype=torch.float64)})
    return out


def test_a_spilled_block_reads_back_as_captured_shared_tensors_shared_and_the_cache_dtype_narrowing_inputs_only(tmp_path):
    block = captured_block()
    exact = BlockSpill(tmp_path / "spill")
    assert not (tmp_path / "spill").exists()   # no folder until a block goes to disk
    assert exact.write((0, torch.float64, None), block)
    assert exact.folder.parent == tmp_path / "spill" and exact.folder.name.startswith("featcal-expert-inputs-")
    assert exact.holds((0, torch.float64, None))
    assert not exact.holds((1, torch.float64, None)) and exact.nbytes > 0
    back = exact.read((0, torch.float64, None))
    assert list(back) == ["a", "b"]
    for task in block:
        for want, got in zip(block[task], back[task]):
            assert list(got) == list(want)
            for name in want:
                assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), (task, name)
            assert got["q"] is got["k"] is got["v"] and got["out"] is not got["q"]

    narrow = BlockSpill(tmp_path, dtype="float16")
    assert narrow.write((0, torch.float64, None), block)
    got = narrow.read((0, torch.float64, None))["a"][0]
    want = block["a"][0]
    assert got["q"].dtype == torch.float32 and torch.equal(got["q"], want["q"].half().float())
    assert not torch.equal(got["q"], want["q"])
    assert torch.equal(got[projected_key("out")], want[projected_key("out")])   # the products stay exact
    assert narrow.nbytes < exact.nbytes
    with pytest.raises(ValueError, match="storage dtype 'int8'"):
        BlockSpill(tmp_path / "refused", dtype="int8")
    assert not (tmp_path / "refused").exists()


def test_the_disk_bound_keeps_what_fits_and_the_folder_goes_with_the_spill(tmp_path):
    first = BlockSpill(tmp_path)
    assert first.write((0, torch.float64, None), captured_block())
    one_block = first.nbytes
    spill = BlockSpill(tmp_path, max_bytes=one_block + one_block // 2)
    cache = ExpertInputCache(max_bytes=1, spill=spill)
    for index in range(3):
        cache.put(index, torch.float64, captured_block(index))
    assert cache.skipped == {1, 2} and cache.holds(0, torch.float64) and not cache.holds(1, torch.float64)
    assert cache.nbytes == 0 and cache.disk_nbytes == one_block and len(list(spill.folder.iterdir())) == 1
    assert torch.equal(cache.get(0, torch.float64)["b"][1]["out"], captured_block(0)["b"][1]["out"])
    assert cache.get(1, torch.float64) is None
    assert cache.for_examples(4).get(0, torch.float64) is None   # another fidelity's walks: not this block
    folders = [first.folder, spill.folder]
    del first, spill, cache
    gc.collect()
    assert not any(f.exists() for f in folders)


def test_a_new_spill_removes_the_folders_of_killed_studies_on_this_host_and_nothing_else(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead_pid = int(gone.stdout)   # that process has exited: its folder is garbage
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        folders = {
            "killed": tmp_path / f"{PREFIX}{_host()}-{dead_pid}-abc123",
            "running": tmp_path / f"{PREFIX}{_host()}-{live.pid}-def456",
            "other host": tmp_path / f"{PREFIX}{_host()}x-{dead_pid}-ghi789",
            "older, unnamed": tmp_path / f"{PREFIX}jkl012",
            "this process": tmp_path / f"{PREFIX}{_host()}-{os.getpid()}-mno345",
        }
        for folder in folders.values():
            (folder / "block-000.zarr").mkdir(parents=True)
        spill = BlockSpill(tmp_path)
        assert all(f.exists() for f in folders.values())   # nothing happens before a block goes to disk
        assert spill.write((0, torch.float64, None), captured_block())
        assert not folders["killed"].exists()
        assert all(folders[k].exists() for k in ("running", "other host", "older, unnamed", "this process"))
        assert spill.folder.name.startswith(f"{PREFIX}{_host()}-{os.getpid()}-")
    finally:
        live.kill()
        live.wait()
