"""Benchmarks of torchmetrics_gradpatch (see run_all.py); a package so spawned ranks can import them."""
