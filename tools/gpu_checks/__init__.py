"""The checks tools/gpu_check.py runs, a module each with `run(check)`: what it measures, at which shapes,
and against what, is in each module's docstring; common.py holds what they share."""
