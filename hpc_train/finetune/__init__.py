"""Fine-tuning transforms of a built model: LoRA adapters and QLoRA's NF4 base (lora.py)."""
