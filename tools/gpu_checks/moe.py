"""Check 4, MoE: the routed experts of one layer shaped like configs/moe_qwen3_30b_a3b.yaml (d 2048, 128
experts of width 768, 8 per token, 4096 tokens: 32768 assignments, spread as a router skews them),
forward plus backward, in bf16: one grouped GEMM a projection (`grouped_swiglu`, torch._grouped_mm) against
the per-expert loop (`looped_swiglu`), with parity of the output and every gradient; and what the layer's
own `Experts` module runs on this device (models/common/moe.py `grouped_mm_runs` chooses: on CUDA in bf16,
the grouped GEMM over token groups padded to its alignment), timed too."""

from __future__ import annotations

import torch
import yaml

from hpc_train.models.common.moe import Experts, grouped_mm_runs, grouped_swiglu, looped_swiglu
from tools.bench_moe import counts_for, time_fn
from tools.gpu_checks.common import ROOT, Check, relative_error


def layer_shape(check: Check) -> tuple[int, int, int, int]:
    """(assignments, experts, d_model, expert hidden) of one MoE layer of the Qwen3-30B-A3B config."""
    if check.smoke:
        return 512, 8, 64, 32
    cfg = yaml.safe_load((ROOT / "configs" / "moe_qwen3_30b_a3b.yaml").read_text())
    m = cfg["model"]
    tokens = cfg["train"]["micro_batch_size"] * m["seq_len"]
    return tokens * m["moe"]["top_k"], m["moe"]["num_experts"], m["d_model"], m["moe"]["expert_ffn_hidden"]


def forward_backward(fn, x, counts, weights) -> list[torch.Tensor]:
    """The output and the gradients of x and the three weights (the loss: the output's mean square)."""
    x = x.detach().requires_grad_()
    for w in weights:
        w.grad = None
    out = fn(x, counts, *weights)
    out.float().square().mean().backward()
    return [out.detach(), x.grad, *(w.grad for w in weights)]


def run(check: Check) -> None:
    assignments, experts, d, h = layer_shape(check)
    dtype = torch.float32 if check.smoke else torch.bfloat16
    repeats = 1 if check.smoke else 5
    check.setup(f"{assignments} assignments over {experts} experts (a skewed split), d {d}, expert width {h}, "
                f"{str(dtype).removeprefix('torch.')}; forward + backward, the median of {repeats}")  # fmt: skip
    gen, device = torch.Generator().manual_seed(0), check.device
    counts = counts_for(assignments, experts, gen).to(device)
    x = torch.randn(assignments, d, generator=gen).to(device, dtype)
    weights = [(torch.randn(shape, generator=gen) * 0.02).to(device, dtype).requires_grad_()
               for shape in ((experts, d, h), (experts, d, h), (experts, h, d))]  # fmt: skip
    loop_s = time_fn(looped_swiglu, x, counts, weights, repeats)
    check.row("loop (looped_swiglu)", f"{loop_s * 1e3:.2f} ms", loop_s=loop_s)
    reference = forward_backward(looped_swiglu, x, counts, weights)
    allowed = 1e-5 if dtype == torch.float32 else 2e-2

    try:
        grouped_s = time_fn(grouped_swiglu, x, counts, weights, repeats)
        errors = [relative_error(a, b) for a, b in zip(forward_backward(grouped_swiglu, x, counts, weights),
                                                       reference, strict=True)]  # fmt: skip
    except Exception as err:  # noqa: BLE001 - the kernel refusing these operands is a result to report
        grouped_s, errors = None, None
        problem = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:160]}"
    used = grouped_mm_runs(x, d, h)
    role = "the layer's path here" if used else "not the layer's path here (grouped_mm_runs is False)"
    if grouped_s is None:
        check.row("grouped (torch._grouped_mm)", f"did not run: {problem}", role,
                  "failed: raised" if used else "reported: raised")  # fmt: skip
        if used:
            check.fail(f"the grouped GEMM the layer uses here raised: {problem}")
    else:
        ok = max(errors) <= allowed
        status = "ok" if ok else ("failed: parity" if used else "reported: parity off")
        check.row("grouped (torch._grouped_mm)", f"{grouped_s * 1e3:.2f} ms, error vs loop {max(errors):.1e}",
                  f"{loop_s / grouped_s:.2f}x the loop's speed; {role}", status, grouped_s=grouped_s, errors=errors,
                  allowed=allowed)  # fmt: skip
        if used and not ok:
            check.fail(f"grouped GEMM differs from the loop by {max(errors):.1e} > {allowed:.0e}")

    module = Experts(experts, d, h).to(device, dtype)
    with torch.no_grad():
        for w, value in zip((module.w1, module.w3, module.w2), weights, strict=True):
            w.copy_(value)
    layer = lambda x, counts, *_: module(x, counts)  # time_fn calls it with the weights
    layer_s = time_fn(layer, x, counts, [module.w1, module.w3, module.w2], repeats)
    got = forward_backward(layer, x, counts, [module.w1, module.w3, module.w2])
    errors = [relative_error(a, b) for a, b in zip(got, reference, strict=True)]
    ran = "the grouped GEMM" if used else "the loop"
    ok = max(errors) <= allowed
    check.row(f"Experts module (ran {ran})", f"{layer_s * 1e3:.2f} ms, error vs loop {max(errors):.1e}",
              f"{loop_s / layer_s:.2f}x the loop's speed", "ok" if ok else "failed: parity", layer_s=layer_s,
              ran=ran, errors=errors)  # fmt: skip
    if not ok:
        check.fail(f"the Experts module differs from the loop by {max(errors):.1e}")
