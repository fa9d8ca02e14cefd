"""Wall time and peak resident memory of one step inside a running process, and where a
calibration's time goes (`phase` marks the work, `phase_times` records it)."""

from __future__ import annotations

import ctypes
import functools
import threading
import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


def rss_mib() -> float:
    """Current resident set size of this process (Linux /proc)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * 4096 / 2**20


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim (from the symbols already loaded), or None where the C library has none."""
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None


def trim_heap() -> None:
    """Hand the heap's free pages back to the OS.

    glibc keeps freed blocks below its (self-raising, up to 32 MiB) mmap threshold in the heap, so
    memory a process freed still counts in its RSS and stacks up under what it allocates next. The
    calibrate-layer stage trims around its block's solve and between writing its outputs. Not for
    hot loops: the pages it returns fault back in when reused (three trims a block cost an in-process
    calibration of the demo ~5% of its time)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


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


# --- where the time of a calibration goes ---------------------------------------------------------------

_PHASE_TOTALS: ContextVar[dict[str, float] | None] = ContextVar("featcal_phase_totals", default=None)


@contextmanager
def phase(name: str):
    """Add the block's wall time to phase `name` while `phase_times()` records; else a no-op."""
    totals = _PHASE_TOTALS.get()
    if totals is None:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        totals[name] = totals.get(name, 0.0) + time.perf_counter() - start


@contextmanager
def phase_times():
    """Record `phase` timings inside the block: yields {phase: seconds}, filled as the work runs."""
    totals: dict[str, float] = {}
    token = _PHASE_TOTALS.set(totals)
    try:
        yield totals
    finally:
        _PHASE_TOTALS.reset(token)
