"""Check 5, the planner against the measured peak on one GPU: tools/validate_planner.py's measurement (two
real training steps, step 2's peak: on CUDA the caching allocator's max allocated over the step) for six
layouts of the configs/gpt_1_3b.yaml shape in bf16 with ZeRO-1, at the dense check's micro batch (the largest
the planner fits without recompute: the planner is tested where memory is tight, and the compiled layout
meets inductor's cache of the dense check's graphs): eager and compiled without recompute, selective and
full recompute, ZeRO-1 with the optimizer offloaded to the host, and fp8 (tensorwise, eager). On CUDA the
planned device total is compared (host bytes apart)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hpc_train.data.prepare import prepare_data, stdlib_sources
from tools.gpu_checks.common import Check, fp8_problem, gib
from tools.gpu_checks.dense import SMOKE_MODEL, dense_keys
from tools.validate_planner import MODEL, measure, planned_peak

LAYOUTS = {
    "eager": (1, []),
    "compiled": (1, ["train.compile=true"]),
    "selective recompute": (1, ["model.recompute=selective"]),
    "full recompute": (1, ["model.recompute=full"]),
    "ZeRO-1 + offload": (1, ["optim.offload=cpu"]),
    "fp8 tensorwise": (1, ["train.fp8=tensorwise"]),
}
BASE = ["train.precision=bf16", "optim.zero_stage=1"]
TOLERANCE = 0.05


def run(check: Check) -> None:
    model = [*MODEL, *SMOKE_MODEL] if check.smoke else dense_keys(check, check.options.micro_batch)
    layouts = dict(LAYOUTS)
    problem = fp8_problem(check.device)
    if problem is not None:
        del layouts["fp8 tensorwise"]
    shape = " ".join(f"{k.split('.', 1)[1]}={v}" for k, v in dict(k.split("=", 1) for k in model).items()
                     if k.startswith(("model.", "train.micro")))  # fmt: skip
    check.setup(f"{shape}; bf16, ZeRO-1; step 2's peak against the planner's {'device ' if check.cuda else ''}"
                "total")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        corpus = str(Path(tmp) / "corpus")
        prepare_data(stdlib_sources()[:40], corpus, progress=False)
        results = measure(corpus, Path(tmp), [*BASE, f"train.device={check.device.type}"], layouts, model)
    for name in LAYOUTS:
        if name not in results:
            check.skip(name, problem)
            continue
        cfg, got, want = results[name]
        planned, peak = planned_peak(cfg, want), got["step_peak"]
        error = planned / peak - 1
        host = f" (+{gib(want['host'])} host)" if want["host"] else ""
        check.row(name, f"measured {gib(peak)}, planned {gib(planned)}{host}", f"{error:+.1%}", planned_bytes=planned,
                  measured_bytes=peak, error=error, host_planned=want["host"],
                  allocator_max=got.get("device_max_allocated"))  # fmt: skip
        measured = check.cuda
        check.target(f"planner within {TOLERANCE:.0%}: {name}", f"{error:+.1%}",
                     abs(error) <= TOLERANCE if measured else None)  # fmt: skip
