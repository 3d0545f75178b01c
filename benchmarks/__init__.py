"""Benchmarks of torchmetrics_gradpatch, each run as a script (see run_all.py); a package so that the tests can
import the workload they share (``benchmarks.soak_workload``)."""
