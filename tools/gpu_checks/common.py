"""What every check of tools/gpu_check.py shares: the record a check fills (rows, targets, notes), written
to its result file after every row, so that a check stopped by its time budget still reports what it had
measured; the device's description; the shapes read from the configs; and the smoke mode's stand-ins."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import platform
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
NEEDS_CUDA = "skipped: needs CUDA"


class PlantedCrash(RuntimeError):
    """Raised at the end of the check named by gpu_check.py's hidden --plant-crash: the suite's proof that a
    check which raises fails the command."""


@dataclass
class Record:
    """One check's result, as gpu_check.json holds it. `status`: ok | failed (an exception, or a result that
    is wrong: parity) | running (still, or killed) | timeout (set by the driver). A target missed is not a
    failure: it is reported in `targets` with met=false."""

    name: str
    smoke: bool
    status: str = "running"
    reason: str | None = None
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process's CPU time in the check (its own subprocesses' apart)
    env: dict = field(default_factory=dict)
    setup: str = ""  # the shapes and options measured, one line
    rows: list[dict] = field(default_factory=list)
    targets: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class Options:
    """What the command line passes to the checks that take it."""

    micro_batch: int | None = None  # dense and fp8: this micro batch instead of the largest the planner fits
    scratch: str | None = None  # checkpoint: the directory written to (default: the system's temporary one)


class Check:
    """The record a check writes to, saved to `path` after every change."""

    def __init__(self, name: str, smoke: bool, path: Path | None, device: torch.device, options: Options | None = None):
        self.record = Record(name, smoke, env=environment())
        self.path, self.device, self.smoke, self.options = path, device, smoke, options or Options()
        self.start, self.cpu_start = time.perf_counter(), time.process_time()
        self.save()

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def save(self) -> None:
        self.record.seconds = time.perf_counter() - self.start
        self.record.cpu_seconds = time.process_time() - self.cpu_start
        if self.path is not None:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(asdict(self.record), indent=1, default=str))
            tmp.replace(self.path)

    def setup(self, text: str) -> None:
        self.record.setup = text
        self.save()

    def row(self, row: str, measured: str, versus: str = "", status: str = "ok", **figures) -> None:
        """A measured row: `measured` and `versus` (its reference, and the ratio) as the table prints them,
        the raw `figures` for whoever reads the JSON."""
        self.record.rows.append({"row": row, "measured": measured, "versus": versus, "status": status, **figures})
        print(f"  {row}: {measured} {versus} [{status}]", flush=True)
        self.save()

    def skip(self, row: str, reason: str) -> None:
        self.row(row, "", "", reason if reason.startswith("skipped") else f"skipped: {reason}")

    def target(self, what: str, value: str, met: bool | None) -> None:
        """A target of the issue: met is None where it was not measured (smoke, or a row missing)."""
        self.record.targets.append({"target": what, "value": value, "met": met})
        self.save()

    def note(self, text: str) -> None:
        self.record.notes.append(text)
        self.save()

    def fail(self, reason: str) -> None:
        """A wrong result (the check goes on: the other rows are still worth having)."""
        self.record.status = "failed"
        self.record.reason = reason if self.record.reason is None else f"{self.record.reason}; {reason}"
        print(f"  FAILED: {reason}", flush=True)
        self.save()

    def finish(self, error: BaseException | None = None) -> None:
        if error is not None:
            self.fail(f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}")
        elif self.record.status == "running":
            self.record.status = "ok"
        self.save()


def environment() -> dict:
    """The device and the versions the figures were taken with."""
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        env["torchao"] = importlib.metadata.version("torchao")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(device=props.name, capability=f"{props.major}.{props.minor}",
                   memory_gib=round(props.total_memory / 2**30, 1))  # fmt: skip
    else:
        env["device"] = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    return env


def torchao_problem() -> str | None:
    """Why torchao cannot be used here (its float8 linears and NF4 tensor), or None."""
    try:
        import torchao.float8  # noqa: F401
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any import failure means the same: the rows cannot run
        return f"skipped: torchao unavailable ({type(err).__name__}: {str(err).splitlines()[0][:100]})"
    return None


def fp8_problem(device: torch.device) -> str | None:
    """Why float8 cannot run here (torchao missing, or a GPU without float8 tensor cores), or None."""
    from hpc_train.features.float8.linears import capability_problem

    problem = torchao_problem()
    if problem is None and device.type == "cuda":
        found = capability_problem(torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device))
        problem = found and f"skipped: {found.split(':')[0]}"
    return problem


def model_keys(config: str, keys: tuple[str, ...] = ("vocab_size", "n_layers", "n_heads", "n_kv_heads", "d_model",
                                                     "ffn_hidden", "seq_len")) -> list[str]:  # fmt: skip
    """The model shape of configs/<config>.yaml as key=value overrides (only the shape: the layout, recompute
    and batch are each check's own)."""
    model = yaml.safe_load((ROOT / "configs" / f"{config}.yaml").read_text())["model"]
    return [f"model.{k}={model[k]}" for k in keys if k in model]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn, device: torch.device, repeats: int, warmup: int = 1) -> float:
    """The fastest of `repeats` calls of `fn` after `warmup` calls (device work included)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference over the reference's largest magnitude (in fp32)."""
    want = want.float()
    return ((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


@contextlib.contextmanager
def smoke_stand_ins(smoke: bool) -> Iterator[None]:
    """Under --smoke: torch.compile with the aot_eager backend (dynamo traces and AOTAutograd splits forward
    and backward as inductor's path does, without inductor's C++ code generation: tens of seconds for each
    graph on a small CPU), and one intra-op thread however the library sets it (tiny shapes gain nothing
    from more, and on a busy 2-core machine every op of a 2-thread region waits for a descheduled sibling:
    a tiny step measured 0.3 s on one thread, 2 to 11 s on two). Otherwise nothing changes."""
    if not smoke:
        yield
        return
    compile_, set_threads = torch.compile, torch.set_num_threads

    def compile_eagerly(*args, **kwargs):
        kwargs["backend"] = "aot_eager"
        return compile_(*args, **kwargs)

    set_threads(1)
    torch.compile, torch.set_num_threads = compile_eagerly, lambda n: set_threads(1)
    try:
        yield
    finally:
        torch.compile, torch.set_num_threads = compile_, set_threads


def gb(n: float) -> str:
    """Decimal bytes (disk speeds): GB, or MB below one GB (the smoke's)."""
    return f"{n / 1e9:.2f} GB" if abs(n) >= 1e9 else f"{n / 1e6:.2f} MB"


def gib(n: float) -> str:
    """Binary bytes (memory): GiB, or MiB below one GiB (the smoke's)."""
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.2f} MiB"
