"""zero_stage 3: parameters, gradients and optimizer state sharded over dp by FSDP2 (features/fsdp).

FSDP2 all-gathers each block's parameters for its forward and backward and reduce-scatters its gradients
(the mean over dp, in fp32) as backward leaves the block, once per micro-batch (pipeline stages: once per
step, as torch's schedules drive it). What is left to the optimizer is the update rule on the sharded fp32
parameters (they are the master weights: every rank updates only its shard; a rule that needs whole
matrices gets them gathered over dp and tp) and, with tied embeddings across pipeline stages, summing the
two copies' gradient shards. With optim.offload=cpu (FSDP2's CPUOffloadPolicy) the shards, their gradients
and the rule's state are in host memory and the update runs there; whatever meets a collective on the way
(the norm's partial sums, the fp16 flag, the tied sum, Muon's whole matrices) is moved to the device first.
"""

from __future__ import annotations

import math

from torch.distributed.fsdp import FSDPModule

from hpc_train.config import OptimConfig
from hpc_train.distributed.parallelize import ParallelModel
from hpc_train.optim.data_parallel import DataParallelOptimizer, build_rule


class FullyShardedOptimizer(DataParallelOptimizer):
    """The update rule over FSDP2's sharded parameters (in host memory with offload: the update runs there).
    Shares zero_stage 0's per-parameter rule state (step, state bytes, checkpoints), not its bucketed
    reduction: every method that would use one is overridden."""

    master_weights = False  # the sharded parameters stay fp32; FSDP's policy gathers them in the compute dtype
    shards_state = True
    shards_params = True
    takes_grads_in_backward = True  # FSDP2 reduce-scatters each block's gradients in its backward

    def __init__(self, model: ParallelModel, cfg: OptimConfig):
        if not all(isinstance(chunk, FSDPModule) for chunk in model.chunks):
            raise TypeError("zero_stage 3 needs a model parallelized with optim.zero_stage=3 (FSDP2 units)")
        self.model, self.params = model, model.trainable_parameters
        self.rule = build_rule(model, self.params, cfg)
        # FSDP2's CPUOffloadPolicy: the shards, their gradients and so the rule's state live in host memory
        self.offloaded = ("params", "grads", "optimizer") if cfg.offload == "cpu" else ()

    @staticmethod
    def planned_bytes(params: int, dp: int, param_bytes: int, overlap: bool) -> tuple[int, int, int]:
        """fp32 gradient shards; the shards are the master weights; the rule's state per owned element."""
        shard = math.ceil(params / dp)
        return 4 * shard, 0, shard

    def begin_step(self, micro_batches: int) -> None:
        pass  # FSDP's own backward hooks reduce

    def reduce_gradients(self) -> None:
        """FSDP reduce-scattered every gradient in backward; a tied embedding's pipeline copies are summed."""
        self.model.finalize_grads(self.params)
