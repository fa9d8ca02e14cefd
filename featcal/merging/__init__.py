"""Merge methods behind one registry.

``merge_state_dicts(method, base, experts, options, context)`` validates and runs a registered
method on backbone state dicts; ``MERGE_METHODS`` maps names to ``MergeMethod`` entries (with the
context each declares it needs); ``register`` adds one. Importing this package registers
the dense methods: average, task_arithmetic, ties, dare;
the data-free per-matrix anchors: tsv_m, iso_c, iso_cts, wudi;
the data anchors (they need a ``MergeContext``): regmean, regmean_plus_plus, adamerging, sigmerge.
"""

from featcal.merging import dense as _dense  # noqa: F401  (registers the dense methods)
from featcal.merging.adamerging import AdaMergingOptions  # registers adamerging
from featcal.merging.dense import AverageOptions, DareOptions, TaskArithmeticOptions, TiesOptions
from featcal.merging.isotropic import IsoCOptions, IsoCTSOptions  # registers iso_c, iso_cts
from featcal.merging.registry import (
    MERGE_METHODS,
    NEEDS,
    MergeContext,
    MergeMethod,
    build_options,
    data_options,
    get_method,
    merge_state_dicts,
    needs_of,
    register,
    split_options,
)
from featcal.merging.regmean import RegMeanOptions  # registers regmean, regmean_plus_plus
from featcal.merging.sigmerge import SigMergeOptions
from featcal.merging.tsv import TsvOptions  # registers tsv_m
from featcal.merging.wudi import WudiOptions  # registers wudi
from featcal.merging import sigmerge_inputs as _signatures  # noqa: F401,E402  (registers sigmerge)

__all__ = [
    "MERGE_METHODS",
    "NEEDS",
    "AdaMergingOptions",
    "AverageOptions",
    "DareOptions",
    "IsoCOptions",
    "IsoCTSOptions",
    "MergeContext",
    "MergeMethod",
    "RegMeanOptions",
    "SigMergeOptions",
    "TaskArithmeticOptions",
    "TiesOptions",
    "TsvOptions",
    "WudiOptions",
    "build_options",
    "data_options",
    "get_method",
    "merge_state_dicts",
    "needs_of",
    "register",
    "split_options",
]
