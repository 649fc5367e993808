"""What the Llama family's RMSNorm keeps for backward (`Architecture.norm_saved_bytes`), for the
skeleton's activation formula (common/costs.py)."""

from __future__ import annotations


def rms_norm_saved_bytes(
    tokens: int, width: int, element_bytes: int, trainable: bool = True, compiled: bool = False
) -> int:
    """RMSNorm keeps its input in fp32 and an fp32 rstd per token, and for its weight's gradient the
    normalized output in fp32 (compiled, inductor recomputes it from the two)."""
    return (2 if trainable and not compiled else 1) * tokens * width * 4 + tokens * 4
