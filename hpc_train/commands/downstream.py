"""`hpc-train eval`: downstream tasks through lm-evaluation-harness (the optional extra `.[eval]`) on hpc_train's
own model, with no export: `HpcTrainLM` is train/lm_eval_model.py's `ScoringLM` over a loaded checkpoint (any
layout, resharded to one process: convert.py's `load_model`) and the tokenizer the run was trained with. It
scores the three request kinds lm-eval has: a continuation's log-likelihood after a context (and whether it
is the greedy one), a text's rolling log-likelihood in windows of the model's context, and greedy generation
up to a stop string. The results go beside the checkpoint as JSON and are printed as lm-eval's table."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hpc_train.commands.generate import generate
from hpc_train.data.tokenizer import Tokenizer
from hpc_train.distributed.parallelize import ParallelModel
from hpc_train.train.lm_eval_model import ScoringLM


class HpcTrainLM(ScoringLM):
    """lm-eval's view of a loaded hpc_train model (one process, the whole model) and its tokenizer."""

    def __init__(self, model: ParallelModel, tokenizer: Tokenizer, batch_size: int = 8):
        super().__init__(tokenizer, model.model_cfg.seq_len)
        self.model, self.batch_size = model, batch_size
        self.vocab_size = model.model_cfg.vocab_size
        model.train(False)

    @torch.no_grad()
    def score(self, sequences: list[list[int]], counted: list[int]) -> list[tuple[float, bool]]:
        """A batch at a time, right-padded: a causal model's positions before the padding do not see it."""
        results = []
        for start in range(0, len(sequences), self.batch_size):
            batch = sequences[start : start + self.batch_size]
            width = max(map(len, batch)) - 1
            ids = torch.tensor([seq[:-1] + [self.eot_token_id] * (width + 1 - len(seq)) for seq in batch])
            dtype = self.model.autocast_dtype
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                logits = self.model.chunks[0](ids)[..., : self.vocab_size].float()
            for row, seq, n in zip(logits, batch, counted[start : start + self.batch_size], strict=True):
                scored = F.log_softmax(row[len(seq) - 1 - n : len(seq) - 1], dim=-1)
                target = torch.tensor(seq[-n:])
                greedy = bool((scored.argmax(-1) == target).all())
                results.append((float(scored.gather(1, target[:, None]).sum()), greedy))
        return results

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy text after each context, up to `max_gen_toks` tokens and cut at the first of `until`."""
        out = []
        for context, options in [request.args for request in requests]:
            until = options.get("until") or [self.tok_decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else list(until)
            ids = generate(self.model, self.tok_encode(context), options.get("max_gen_toks", 256),
                           stop_id=self.eot_token_id)  # fmt: skip
            text = self.tok_decode(ids)
            for stop in until:
                text = text.split(stop)[0]
            out.append(text)
        return out


def write_results(results: dict[str, Any], where: Path, step: int) -> Path:
    """The results as JSON beside the checkpoint (`<checkpoints>/eval/step_<N>.json`), written whole; with each
    request's scores where they were logged (`samples`: per task, each document's filtered responses)."""
    out = where / "eval" / f"step_{step:07d}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_name(f".{out.name}.{os.getpid()}")
    samples = {task: [{"doc_id": sample["doc_id"], "scores": sample["filtered_resps"]} for sample in done]
               for task, done in results.get("samples", {}).items()}  # fmt: skip
    temporary.write_text(json.dumps({"step": step, "results": results["results"], "config": results.get("config", {}),
                                     **({"samples": samples} if samples else {})}, indent=1, default=str))  # fmt: skip
    os.replace(temporary, out)
    return out
