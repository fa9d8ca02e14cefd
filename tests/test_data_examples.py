"""The example task in data/examples loads and splits as the data README says."""

from pathlib import Path

from featcal.data.tasks import TaskSpec, load_task_frame, split_task

EXAMPLE = Path(__file__).resolve().parents[1] / "data" / "examples" / "product_reviews.csv"


def test_the_example_file_task_loads_and_splits_without_overlap():
    spec = TaskSpec.from_mapping("reviews", {"source": f"file:{EXAMPLE}", "max_train": 16, "n_dev": 4, "n_test": 4})
    frame = load_task_frame(spec)
    assert len(frame) == 24 and frame.attrs["classes"] == ["negative", "positive"]
    splits = split_task(frame, spec, seed=0)
    assert {k: len(v) for k, v in splits.items()} == {"train": 16, "dev": 4, "test": 4}
    texts = [set(v["text"]) for v in splits.values()]
    assert not (texts[0] & texts[1] or texts[0] & texts[2] or texts[1] & texts[2])
    for part in splits.values():   # stratified: both classes in every split
        assert set(part["label"]) == {0, 1}
