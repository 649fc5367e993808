"""LoRA's section, `finetune`: which parameters train."""

from __future__ import annotations

from dataclasses import dataclass, field

from hpc_train.config import choice, fraction, positive


@dataclass
class FinetuneConfig:
    """Which parameters train: all of them, or low-rank adapters on frozen base weights (LoRA; QLoRA keeps
    the frozen base in 4-bit NF4)."""

    method: str = choice("full", "lora", "qlora")
    lora_rank: int = positive(8)
    lora_alpha: float = positive(16.0)  # the adapter's output is scaled by lora_alpha / lora_rank
    lora_dropout: float = fraction(0.0)  # on the adapter's input
    lora_targets: list[str] = field(default_factory=lambda: ["wq", "wv"])  # projections (e.g. wq wk wv wo w1 w2 w3)

    @property
    def adapters(self) -> bool:
        """Only low-rank adapters train (LoRA or QLoRA); the base model is frozen."""
        return self.method != "full"

    @property
    def quantized_base(self) -> bool:
        """The frozen base's projections are held in NF4 (QLoRA)."""
        return self.method == "qlora"
