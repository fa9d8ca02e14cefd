"""Reading and writing: model folders, lazily read checkpoints, per-layer zarr caches, atomic writes."""
