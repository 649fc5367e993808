"""Downstream tasks inside the training loop (`eval.tasks`): global rank 0 runs lm-evaluation-harness (its
tasks' documents, prompts and metrics: train/lm_eval_model.py, imported there alone) and every rank scores.
Rank 0 sends each batch of requests to all ranks; each dp replica scores its share as rows of the training
micro-batch shape through the parallel model's own forward (`row_scores`: every layout's), and the scores
are gathered over dp. The other ranks wait for requests until rank 0 says the evaluation is over; they wait
in collectives, so rank 0's own work (lm-eval's documents and metrics) must stay within parallel.timeout_s."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hpc_train.checkpoint.state import RNGState
from hpc_train.config import ConfigError, DataConfig, JobConfig, TrainConfig
from hpc_train.distributed.agree import raise_together
from hpc_train.distributed.parallelize import ParallelModel, row_scores
from hpc_train.resilience.faults import fault_point
from hpc_train.train.step import rank_micro_batches


class Requests:  # a data.batch.Source of scoring rows
    """Sequences as training-shaped samples: each right-padded to seq_len + 1 tokens with the end-of-document
    token, its last `counted` targets counted (the rest, and the padding, left out of its score)."""

    def __init__(self, sequences: list[list[int]], counted: list[int], seq_len: int, pad_id: int):
        self.sequences, self.counted, self.seq_len, self.pad_id = sequences, counted, seq_len, pad_id

    def __len__(self) -> int:
        return len(self.sequences)

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        tokens = np.full(self.seq_len + 1, self.pad_id, dtype=np.int64)
        mask = np.zeros(self.seq_len, dtype=bool)
        if index < len(self.sequences):  # beyond: an empty row, rounding the last pass up
            sequence = self.sequences[index]
            tokens[: len(sequence)] = sequence
            mask[len(sequence) - 1 - self.counted[index] : len(sequence) - 1] = True
        return tokens, mask

    def samples(self, indices: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        return [self.sample(i) for i in indices.tolist()]

    def documents(self, indices: np.ndarray) -> np.ndarray:
        return np.zeros((len(indices), self.seq_len), dtype=np.int64)  # one document a row

    def identity(self) -> dict:
        return {"requests": len(self.sequences)}

    def identity_notes(self) -> list[str]:
        return []


def score_requests(model: ParallelModel, requests: Requests, t: TrainConfig, data: DataConfig) -> torch.Tensor:
    """(requests, 2): every request's summed loss and missed greedy tokens, on every rank. Each pass scores
    dp x micro_batch_size x grad_accum rows, each dp replica its own in the training micro-batches' shape
    (and `data`'s document options), gathered over dp."""
    dp, dp_rank = model.mesh.size("dp"), model.mesh.rank("dp")
    per_rank = t.micro_batch_size * t.grad_accum
    passes = -(-len(requests) // (dp * per_rank))
    scores = []
    for n in range(passes):
        start = (n * dp + dp_rank) * per_rank
        indices = np.split(np.arange(start, start + per_rank), t.grad_accum)
        mine = row_scores(model, rank_micro_batches(requests, indices, model.device, model.hooks, data))
        if dp == 1:
            scores.append(mine)
            continue
        gathered = [torch.empty_like(mine) for _ in range(dp)]
        dist.all_gather(gathered, mine, group=model.mesh.group("dp"))
        scores += gathered
    return torch.cat(scores)[: len(requests)].cpu()


def score_everywhere(model: ParallelModel, requests: Requests, cfg: JobConfig) -> torch.Tensor:
    """Rank 0's: `requests` sent to every rank (`Downstream._serve` takes them: the same rows everywhere) and
    scored by all of them (`score_requests`)."""
    dist.broadcast_object_list([requests], src=0)
    return score_requests(model, requests, cfg.train, cfg.data)


@contextlib.contextmanager
def kept_rng() -> Iterator[None]:
    """The Python, numpy and torch generators as they were before (lm-eval seeds them): training goes on as if
    no evaluation had run."""
    saved = RNGState().state_dict()
    try:
        yield
    finally:
        RNGState().load_state_dict(saved)


class Downstream:
    """eval.tasks inside the training loop; rank 0 holds lm-eval's task index and the tasks, loaded and
    checked once at the run's start (a problem stops every rank there)."""

    def __init__(self, cfg: JobConfig, rank: int):
        self.cfg, self.rank = cfg, rank
        self.manager, self.tasks, self.tokenizer, problem = None, None, None, None
        if rank == 0:
            from hpc_train.train.lm_eval_model import check_eval

            try:
                self.manager, self.tasks, self.tokenizer = check_eval(cfg)
            except ConfigError as err:
                problem = str(err)
        raise_together(problem, error=ConfigError)

    def due(self, step: int) -> bool:
        interval = self.cfg.eval.task_interval
        return step == self.cfg.train.steps or bool(interval) and step % interval == 0

    def evaluate(self, model: ParallelModel, step: int) -> dict[str, Any]:
        """`downstream/<task>/<metric>` of every task, on every rank (all ranks call it). A failure of lm-eval
        on rank 0 outside the scoring (a task's documents, its metric) does not stop training: the figures
        are then `downstream_error`, the error."""
        model.train(False)
        try:
            with kept_rng():
                figures = self._drive(model, step) if self.rank == 0 else self._serve(model)
        finally:
            model.train(True)
        shared = [figures]
        dist.broadcast_object_list(shared, src=0)
        return shared[0]

    def _drive(self, model: ParallelModel, step: int) -> dict[str, Any]:
        from hpc_train.train.lm_eval_model import LoopLM, accuracies, evaluate, quiet_lm_eval

        e = self.cfg.eval
        try:
            fault_point("downstream", step, 0)  # a failure test's error inside lm-eval (kind `oom`)
            with quiet_lm_eval():
                results = evaluate(LoopLM(self.tokenizer, model, self.cfg), self.tasks, e.limit, self.manager)
        except Exception as err:  # the other ranks wait for requests: they are told it ended
            dist.broadcast_object_list([None], src=0)
            return {"downstream_error": f"{type(err).__name__}: {err}"}
        dist.broadcast_object_list([None], src=0)  # done
        return {f"downstream/{name}": value for name, value in accuracies(results).items()}

    def _serve(self, model: ParallelModel) -> dict[str, Any]:
        while True:
            asked: list[Any] = [None]
            dist.broadcast_object_list(asked, src=0)
            if asked[0] is None:
                return {}
            score_requests(model, asked[0], self.cfg.train, self.cfg.data)
