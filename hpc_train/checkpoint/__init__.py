"""Fault-tolerant sharded checkpoints: what is saved (state.py), how it is committed and verified on disk
(store.py), and the save/resume driver the training loop uses (checkpointer.py)."""
