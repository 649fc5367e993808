"""What every model family shares: the decoder skeleton (decoder.py), its tensor-parallel plan (tp_plan.py)
and cost formulas (costs.py), the Hugging Face adapter protocol and the engine that runs it (hf.py),
`decoder_spec` (family.py), which makes a family's `ModelSpec` from its `Architecture`, and the
differentiable all-to-all that MoE's and context parallelism's exchanges use (all_to_all.py)."""
