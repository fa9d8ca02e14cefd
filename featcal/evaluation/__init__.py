"""Measuring models: accuracy and drift, the method comparison harness, plots."""
