"""Merge methods behind one registry.

``merge_state_dicts(method, base, experts, options)`` validates and runs a registered method on
backbone state dicts; ``MERGE_METHODS`` maps names to ``MergeMethod`` entries; ``register`` adds one.
Importing this package registers the dense methods: average, task_arithmetic, ties, dare,
and the data-free per-matrix anchors: tsv_m, iso_c, iso_cts, wudi.
"""

from featcal.merging import dense as _dense  # noqa: F401  (registers the dense methods)
from featcal.merging.dense import AverageOptions, DareOptions, TaskArithmeticOptions, TiesOptions
from featcal.merging.isotropic import IsoCOptions, IsoCTSOptions  # registers iso_c, iso_cts
from featcal.merging.registry import (
    MERGE_METHODS,
    MergeMethod,
    build_options,
    get_method,
    merge_state_dicts,
    register,
)
from featcal.merging.tsv import TsvOptions  # registers tsv_m
from featcal.merging.wudi import WudiOptions  # registers wudi

__all__ = [
    "MERGE_METHODS",
    "AverageOptions",
    "DareOptions",
    "IsoCOptions",
    "IsoCTSOptions",
    "MergeMethod",
    "TaskArithmeticOptions",
    "TiesOptions",
    "TsvOptions",
    "WudiOptions",
    "build_options",
    "get_method",
    "merge_state_dicts",
    "register",
]
