"""hpc_train: Slurm-native pretraining of GPT-style models with Megatron-style parallelism."""

__version__ = "0.1.0"
