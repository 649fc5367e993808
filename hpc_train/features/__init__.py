"""Features, one folder each: what a run can add to the core (config, mesh, model family, optimizer, loop)
and everything about it beside its code: its config keys, its checks, what it adds to the planner's memory,
traffic and step time, its steps in parallelizing a stage, and its part in every training step
(feature.py says how a feature declares these). hpc_train/job.py registers them."""
