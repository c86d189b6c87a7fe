"""The cases of ``scripts/bench_gather.py``, one module per kind; the runner (ranks, report, command line) stays in that script."""
