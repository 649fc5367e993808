"""A model ladder (OLMo-core's ladder, Chinchilla's scaling fits): train a few small shapes of one family, each on
a token budget proportional to its size, fit their final losses against training compute as a power law with an
irreducible term, and read the fit at a larger target size before paying for it. Everything here is a pure
function of configs and run folders; the CLI launches the runs and prints what these return."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpc_train.config import ConfigError, ModelConfig
from hpc_train.job import JobConfig, load_config
from hpc_train.models import get_spec
from hpc_train.models.common.decoder import count_params
from hpc_train.models.spec import ModelSpec
from hpc_train.observe.metrics import read_records

SUFFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9}
SIZE_PATTERN = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(e[+-]?\d+)?([kmb]?)", re.IGNORECASE)
MAX_HEADS = 1024  # beyond any model a ladder extrapolates to (the widest build takes about a second on meta)
MAX_SIZE_ERROR = 0.5  # a ladder rung further than this (relative) from its size is not that size
# alpha's first grid and its refinement: log-spaced, each round zooming on the best value's neighbours
ALPHA_RANGE = (1e-3, 5.0)
ALPHA_GRID = 512
ALPHA_ZOOM = 64
ALPHA_ROUNDS = 6


def parse_sizes(text: str) -> list[float]:
    """Parameter counts as people write them ("1M,3M,10M", "2.5e6", "500K", "1B"; K, M, B in any case), so the
    CLI takes a ladder in one argument. Every entry must parse: a typo silently dropped would change the fit."""
    sizes = []
    for entry in text.split(","):
        match = SIZE_PATTERN.fullmatch(entry.strip())
        if match is None:
            raise ConfigError(f"size {entry.strip()!r} in {text!r} is not a number with an optional K/M/B suffix; "
                              "write e.g. 500K,1M,2.5e6,1B")  # fmt: skip
        number, exponent, suffix = match.groups()
        sizes.append(float(number + (exponent or "")) * SUFFIXES[suffix.lower()])
    return sizes


def size_label(params: float) -> str:
    """A rung's label from its parameter count, as sizes are written: `0.16M`, `1.2M`, `7B`."""
    for suffix, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if params >= scale:
            return f"{params / scale:.3g}{suffix}"
    return f"{params:.3g}"


def _count(spec: ModelSpec, model: ModelConfig, counted: dict[tuple, int]) -> int:
    """Total parameters of `model` as a run reports them (built on meta: nothing allocated), remembered in
    `counted` by shape since the search asks for the same shapes again."""
    key = (model.n_layers, model.d_model, model.n_heads, model.n_kv_heads)
    if key not in counted:
        with torch.device("meta"):
            counted[key] = count_params(spec.build_stage(model))
    return counted[key]


def _family_rule(base: ModelConfig) -> tuple[int, float, int]:
    """The config's own head width, width per layer and query heads per key/value head: what every rung keeps,
    so the ladder is one family and a tiny config's rungs stay tiny."""
    if base.d_model % base.n_heads:
        raise ConfigError(
            f"model.d_model={base.d_model} is not divisible by model.n_heads={base.n_heads}; the ladder keeps the "
            "config's head width d_model/n_heads, so pick n_heads dividing d_model"
        )
    kv_heads = base.n_kv_heads or base.n_heads
    group = base.n_heads // kv_heads if base.n_heads % kv_heads == 0 else 1
    return base.d_model // base.n_heads, base.d_model / base.n_layers, group


def _shapes_at(base: ModelConfig, heads: int) -> list[ModelConfig]:
    """The candidate shapes with `heads` query heads: width heads x head width, and the layer counts on either
    side of the config's width-per-layer ratio (at least one)."""
    head_dim, aspect, group = _family_rule(base)
    d_model = heads * head_dim
    kv_heads = heads // group if heads % group == 0 else heads
    layers = sorted({max(1, math.floor(d_model / aspect)), max(1, math.ceil(d_model / aspect))})
    return [
        dataclasses.replace(base, n_layers=n, d_model=d_model, n_heads=heads, n_kv_heads=kv_heads, ffn_hidden=None)
        for n in layers
    ]


def nearest_shape(base: ModelConfig, size: float, counted: dict[tuple, int] | None = None) -> tuple[ModelConfig, int]:
    """The family rule's shape whose parameter count is nearest `size` (relative error), and that count. Parameters
    grow with the head count along the rule, so a doubling then a bisection finds the first head count reaching
    `size`, and its neighbours are compared; each count is a meta-device build, so the search stays short."""
    spec, counted = get_spec(base.arch), {} if counted is None else counted
    reach = lambda heads: _count(spec, _shapes_at(base, heads)[-1], counted)  # the deeper of its shapes
    high = 1
    while reach(high) < size:
        if high >= MAX_HEADS:
            raise ConfigError(f"size {size:.4g} is beyond {MAX_HEADS} heads of the family rule; check its suffix")
        high *= 2
    low = high // 2  # reach(low) < size, or low = 0
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if reach(middle) < size else (low, middle)
    _, aspect, _ = _family_rule(base)
    candidates, refusal = [], None
    for heads in range(max(1, high - 2), high + 3):
        for shape in _shapes_at(base, heads):
            try:
                spec.validate(shape, 1)
            except ConfigError as e:
                refusal = e
                continue
            error = abs(_count(spec, shape, counted) - size) / size
            candidates.append((error, abs(shape.d_model / shape.n_layers - aspect), shape))
    if not candidates:
        raise ConfigError(f"no valid shape near size {size:.4g} keeps the config's head width: {refusal}")
    shape = min(candidates, key=lambda c: c[:2])[2]
    return shape, _count(spec, shape, counted)


def ladder_shapes(cfg: JobConfig, sizes: list[float], tokens_per_param: float, dp: int) -> list[dict[str, Any]]:
    """For each target size (total parameters, as count_params reports), the family rule's nearest shape and a
    token budget of `tokens_per_param` per actual parameter, as the config overrides that train it: one ladder
    rung each. `dp` is the data-parallel size the rungs will run at, which the steps are counted in. Sizes are
    refused that are not positive, that land on the same shape (two runs of one rung add no point to the fit),
    or that no shape comes within half of (a suffix typo)."""
    problems = [f"size {size:.4g} is not positive; every size must be > 0" for size in sizes if not size > 0]
    if not tokens_per_param > 0:
        problems.append(f"tokens_per_param={tokens_per_param} is not positive; Chinchilla's is 20")
    if dp < 1:
        problems.append(f"dp={dp} must be at least 1")
    if not sizes:
        problems.append("no sizes given; give at least one, e.g. 1M,3M,10M")
    if problems:
        raise ConfigError("\n".join(problems))
    train = cfg.train
    tokens_per_step = dp * train.micro_batch_size * train.grad_accum * cfg.model.seq_len
    rungs, seen, counted = [], {}, {}
    for size in sizes:
        shape, params = nearest_shape(cfg.model, size, counted)
        key = (shape.n_layers, shape.d_model, shape.n_heads, shape.n_kv_heads)
        if key in seen:
            raise ConfigError(f"sizes {seen[key]:.4g} and {size:.4g} give the same shape ({shape.n_layers} layers, "
                              f"d_model {shape.d_model}, {params:,} params); drop one or space the sizes further "
                              "apart")  # fmt: skip
        if abs(params - size) / size > MAX_SIZE_ERROR:
            raise ConfigError(
                f"size {size:.4g}: the nearest shape of the family rule has {params:,} params; pick a size near "
                f"what the rule can build (head width {shape.d_model // shape.n_heads})"
            )
        seen[key] = size
        steps = max(1, math.ceil(tokens_per_param * params / tokens_per_step))
        overrides = {
            "model.n_layers": shape.n_layers,
            "model.d_model": shape.d_model,
            "model.n_heads": shape.n_heads,
            "model.n_kv_heads": shape.n_kv_heads,
            "train.steps": steps,
        }
        if cfg.model.ffn_hidden is not None:  # the family's width rule, not the config's fixed one
            overrides["model.ffn_hidden"] = None
        rungs.append({"size": size, "params": params, "tokens": steps * tokens_per_step, "overrides": overrides})
    return rungs


@dataclass(frozen=True)
class Fit:
    """L(C) = E + A * C**-alpha, with C the training FLOPs: E the loss no compute removes, alpha how fast the
    rest falls. `points` are the fitted (compute, loss) in the order given, `residuals` loss - fitted."""

    E: float
    A: float
    alpha: float
    points: list[tuple[float, float]]
    residuals: list[float]

    def predict(self, compute: float) -> float:
        return self.E + self.A * compute**-self.alpha


def _solve(basis: np.ndarray, losses: np.ndarray) -> tuple[float, float, float]:
    """(E, A', squared error) of the least-squares line losses ~ E + A' * basis with E >= 0 (E = 0 and A' alone
    where the free fit goes negative); A' <= 0 comes back as an infinite error, since loss must fall."""
    design = np.stack([np.ones_like(basis), basis], axis=1)
    (e, a), *_ = np.linalg.lstsq(design, losses, rcond=None)
    if e < 0:
        e, a = 0.0, float(basis @ losses / (basis @ basis))
    if not a > 0:
        return e, a, math.inf
    return float(e), float(a), float(np.sum((e + a * basis - losses) ** 2))


def fit_power_law(points: list[tuple[float, float]]) -> Fit:
    """Fit (compute, loss) points with L(C) = E + A * C**-alpha, E >= 0, A > 0, alpha > 0 (numpy only). For
    fixed alpha the model is linear in (E, A), so alpha is searched on a log grid refined around its best value
    and E, A solved by least squares at each. Alpha is chosen by the squared error in plain loss, the quantity
    that inner solve minimizes, so the whole fit minimizes one objective. Compute is divided by its smallest
    value first, keeping C**-alpha near 1 whatever the FLOPs' magnitude; A is scaled back at the end."""
    compute = np.array([c for c, _ in points], dtype=float)
    losses = np.array([loss for _, loss in points], dtype=float)
    if not (np.all(np.isfinite(compute)) and np.all(compute > 0) and np.all(np.isfinite(losses))):
        raise ConfigError("every point needs a positive, finite compute and a finite loss; drop the runs that diverged")
    if len(np.unique(compute)) < 3:
        raise ConfigError(f"a power law with an irreducible term has 3 parameters: it needs at least 3 points of "
                          f"distinct compute, got {len(points)} with {len(np.unique(compute))} distinct; train "
                          "more ladder sizes")  # fmt: skip
    scale = float(compute.min())
    x = compute / scale
    alphas = np.geomspace(*ALPHA_RANGE, ALPHA_GRID)
    for _ in range(ALPHA_ROUNDS):
        errors = [_solve(x**-alpha, losses)[2] for alpha in alphas]
        best = int(np.argmin(errors))
        if not math.isfinite(errors[best]):
            raise ConfigError("loss does not fall with compute in these runs, so no power law fits; check that the "
                              "runs finished and that larger sizes trained on more tokens")  # fmt: skip
        alphas = np.geomspace(alphas[max(0, best - 1)], alphas[min(len(alphas) - 1, best + 1)], ALPHA_ZOOM)
    alpha = float(alphas[int(np.argmin([_solve(x**-a, losses)[2] for a in alphas]))])
    e, a_scaled, _ = _solve(x**-alpha, losses)
    fitted = e + a_scaled * x**-alpha
    return Fit(
        E=e,
        A=a_scaled * scale**alpha,
        alpha=alpha,
        points=[(float(c), float(v)) for c, v in zip(compute, losses, strict=True)],
        residuals=[float(r) for r in losses - fitted],
    )


def _sci(value: float) -> str:
    """1.23e15 rather than Python's 1.23e+15: how FLOPs are written in scaling papers."""
    mantissa, exponent = f"{value:.2e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def format_fit(fit: Fit, names: list[str]) -> str:
    """The fitted law, each point against it, and the worst miss: what to look at before trusting a prediction."""
    if len(names) != len(fit.points):
        raise ValueError(f"{len(names)} names for {len(fit.points)} points")
    width = max([len("run"), *map(len, names)])
    lines = [f"L(C) = {fit.E:.4f} + {fit.A:.4g} * C^-{fit.alpha:.4f}   (C in FLOPs)",
             f"{'run':<{width}}  {'compute':>9}  {'loss':>8}  {'fitted':>8}  {'residual':>9}"]  # fmt: skip
    for name, (compute, loss), residual in zip(names, fit.points, fit.residuals, strict=True):
        lines.append(f"{name:<{width}}  {_sci(compute):>9}  {loss:8.4f}  {fit.predict(compute):8.4f}  {residual:+9.4f}")
    lines.append(f"max |residual| {max(abs(r) for r in fit.residuals):.4f}")
    return "\n".join(lines)


def ladder_points(run_dirs: list[Path]) -> tuple[list[tuple[str, float, float]], list[str]]:
    """(name, training FLOPs, final loss) of each finished run, and why each other folder was skipped. Compute is
    the family's FLOPs per token x tokens trained (the samples read x seq_len); the final loss is the last
    eval_loss where the run evaluated, else the mean train loss of its last 5 steps (one step's loss is noisy)."""
    points, skipped = [], []
    for run_dir in run_dirs:
        config, metrics = run_dir / "config.yaml", run_dir / "metrics.jsonl"
        missing = [p.name for p in (config, metrics) if not p.is_file()]
        if missing:
            skipped.append(f"{run_dir}: no {' or '.join(missing)}")
            continue
        cfg, records = load_config(saved=config.read_text()), read_records(run_dir)
        last = records[-1] if records else None
        if last is None or last["step"] < cfg.train.steps:
            skipped.append(f"{run_dir}: unfinished (step {last['step'] if last else 0} of {cfg.train.steps})")
            continue
        tokens = last["consumed_samples"] * cfg.model.seq_len  # the samples the run read (its data position)
        compute = float(get_spec(cfg.model.arch).flops_per_token(cfg.model) * tokens)
        evals = [r["eval_loss"] for r in records if "eval_loss" in r]
        losses = [r["loss"] for r in records if "loss" in r][-5:]
        if not evals and not losses:
            skipped.append(f"{run_dir}: metrics.jsonl records no loss")
            continue
        points.append((run_dir.name, compute, float(evals[-1] if evals else sum(losses) / len(losses))))
    return points, skipped


def plot_fit(fit: Fit, names: list[str], out: Path, target: float | None = None) -> Path:
    """The points and the fitted curve against compute (log x), and the prediction at `target` (compute in FLOPs,
    as predict_target returns it) where given, as a PNG at `out`: the extrapolation's distance is seen at once."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    compute = [c for c, _ in fit.points]
    low, high = min(compute), max([*compute, target or 0.0])
    curve = np.geomspace(low / 2, high * 2, 200)
    figure, axes = plt.subplots(figsize=(7, 4.5))
    axes.plot(curve, [fit.predict(c) for c in curve], color="tab:blue",
              label=f"{fit.E:.3f} + {fit.A:.3g} C^-{fit.alpha:.3f}")  # fmt: skip
    axes.scatter(compute, [loss for _, loss in fit.points], color="black", zorder=3, label="runs")
    for name, (c, loss) in zip(names, fit.points, strict=True):
        axes.annotate(name, (c, loss), textcoords="offset points", xytext=(4, 4), fontsize=8)
    if target is not None:
        predicted = fit.predict(target)
        axes.scatter([target], [predicted], color="tab:red", marker="*", s=120, zorder=3,
                     label=f"target {_sci(target)}: {predicted:.3f}")  # fmt: skip
    axes.set_xscale("log")
    axes.set_xlabel("training compute (FLOPs)")
    axes.set_ylabel("final loss")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return out


def predict_target(fit: Fit, cfg: JobConfig, target_params: float, tokens_per_param: float) -> tuple[float, float]:
    """(compute, predicted loss) of training the ladder rule's shape at `target_params` on `tokens_per_param` per
    parameter: the same rule and budget as the rungs, so the prediction extends the fitted line and nothing else."""
    if not (target_params > 0 and tokens_per_param > 0):
        raise ConfigError(f"target size {target_params:.4g} and tokens_per_param {tokens_per_param} must be > 0")
    shape, params = nearest_shape(cfg.model, target_params)
    compute = float(get_spec(shape.arch).flops_per_token(shape) * tokens_per_param * params)
    return compute, fit.predict(compute)
