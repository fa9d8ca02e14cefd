"""Wall time and peak resident memory of one step inside a running process."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass


def rss_mib() -> float:
    """Current resident set size of this process (Linux /proc)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * 4096 / 2**20


@dataclass
class Measurement:
    wall_s: float = 0.0
    peak_rss_mib: float = 0.0   # highest RSS seen during the step
    added_rss_mib: float = 0.0  # that peak minus the RSS when the step began

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 2) for k, v in self.__dict__.items()}


@contextmanager
def measure(interval_s: float = 0.005):
    """Sample RSS in a background thread while the block runs; fill a Measurement on exit."""
    result = Measurement()
    start_rss = rss_mib()
    peak = [start_rss]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_mib())
            stop.wait(interval_s)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start = time.perf_counter()
    try:
        yield result
    finally:
        result.wall_s = time.perf_counter() - start
        stop.set()
        thread.join()
        peak[0] = max(peak[0], rss_mib())
        result.peak_rss_mib = peak[0]
        result.added_rss_mib = peak[0] - start_rss
