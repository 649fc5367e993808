"""The planner: what a layout needs before anything runs, and which layouts to run.

- memory.py: bytes per rank (parameters, gradients, optimizer state, activations, buffers), every pipeline
  rank's peak, and what each feature adds (its own folder's planner terms);
- traffic.py: bytes a rank sends per step, by process-group role;
- step_time.py: the step-time estimate layouts are ranked by;
- search.py: `plan --search`'s layouts and the nearest one that fits;
- report.py: what `hpc-train plan` prints.
"""

from hpc_train.planner.memory import (
    GiB,
    MemoryEstimate,
    activation_bytes,
    activation_parts,
    estimate,
    local_copies,
    local_param_count,
    pipeline_buffers,
    plans_memory_copy,
    stage_estimate,
    stage_estimates,
)
from hpc_train.planner.report import (
    feature_lines,
    format_estimate,
    format_fix,
    format_report,
    format_search,
    plan_world,
)
from hpc_train.planner.search import Limits, nearest_fix, search, search_report
from hpc_train.planner.step_time import step_time_estimate
from hpc_train.planner.traffic import dp_traffic_bytes, traffic

__all__ = [
    "GiB", "Limits", "MemoryEstimate", "activation_bytes", "activation_parts", "dp_traffic_bytes", "estimate",
    "feature_lines", "format_estimate", "format_fix", "format_report", "format_search", "local_copies",
    "local_param_count", "nearest_fix", "pipeline_buffers", "plan_world", "plans_memory_copy", "search",
    "search_report", "stage_estimate", "stage_estimates", "step_time_estimate", "traffic",
]  # fmt: skip
