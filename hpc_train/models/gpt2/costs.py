"""What the GPT-2 family's LayerNorm keeps for backward (`Architecture.norm_saved_bytes`), for the
skeleton's activation formula (common/costs.py)."""

from __future__ import annotations


def layer_norm_saved_bytes(
    tokens: int, width: int, element_bytes: int, trainable: bool = True, compiled: bool = False
) -> int:
    """LayerNorm keeps its input, and a mean and rstd per token, in the activation dtype (also frozen, and
    compiled)."""
    return tokens * width * element_bytes + 2 * tokens * element_bytes
