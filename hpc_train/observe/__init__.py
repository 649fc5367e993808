"""Measuring a run, below everything that is measured: throughput and the metrics log (metrics.py),
exact memory by category (memory.py), and the profiler window and step timings (profiling.py)."""
