"""Diagnostics for the classic failures of hybrid-parallel jobs: broken data parallelism, hangs, stragglers."""
