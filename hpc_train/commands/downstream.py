"""`hpc-train eval`: downstream tasks through lm-evaluation-harness (the optional extra `.[eval]`) on hpc_train's
own model, with no export: `HpcTrainLM` is an lm-eval `LM` over a loaded checkpoint (any layout, resharded
to one process: convert.py's `load_model`) and the tokenizer the run was trained with. It scores the three
request kinds lm-eval has: a continuation's log-likelihood after a context (and whether it is the greedy
one), a text's rolling log-likelihood in windows of the model's context, and greedy generation up to a stop
string. The results go beside the checkpoint as JSON and are printed as lm-eval's table."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from hpc_train.commands.generate import generate
from hpc_train.data.tokenizer import Tokenizer
from hpc_train.distributed.parallelize import ParallelModel


class HpcTrainLM(TemplateLM):
    """lm-eval's view of a loaded hpc_train model (one process, the whole model) and its tokenizer."""

    def __init__(self, model: ParallelModel, tokenizer: Tokenizer, batch_size: int = 8):
        super().__init__()
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.max_length = model.model_cfg.seq_len  # the longest input scored at once
        self.vocab_size = model.model_cfg.vocab_size
        model.train(False)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eod_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(string).tolist()

    def tok_decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    @torch.no_grad()
    def _log_probs(self, inputs: list[list[int]]) -> list[torch.Tensor]:
        """Each input's next-token log-probabilities (fp32), a batch at a time, right-padded: a causal model's
        positions before the padding do not see it."""
        out = []
        for start in range(0, len(inputs), self.batch_size):
            batch = inputs[start : start + self.batch_size]
            width = max(map(len, batch))
            ids = torch.tensor([seq + [self.eot_token_id] * (width - len(seq)) for seq in batch])
            dtype = self.model.autocast_dtype
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                logits = self.model.chunks[0](ids)[..., : self.vocab_size].float()
            out += [F.log_softmax(logits[i, : len(seq)], dim=-1) for i, seq in enumerate(batch)]
        return out

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple]:
        """(log-likelihood, greedy) of each continuation after its context, the input cut on the left to the
        model's length (lm-eval's rule: the continuation is whole, the context keeps its last tokens)."""
        inputs, spans = [], []
        for _, context, continuation in requests:
            context = context or [self.prefix_token_id]  # a context of spaces alone, moved to the continuation
            whole = (context + continuation)[-(self.max_length + 1) :]
            inputs.append(whole[:-1])
            spans.append((len(whole) - 1 - len(continuation), continuation))
        results = []
        for log_probs, (first, continuation) in zip(self._log_probs(inputs), spans, strict=True):
            scored = log_probs[first:]
            target = torch.tensor(continuation)
            total = float(scored.gather(1, target[:, None]).sum())
            results.append((total, bool((scored.argmax(-1) == target).all())))
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """A whole text's log-likelihood: windows of the model's length, each scored after the one before
        (lm-eval's rolling windows, the first after the end-of-document token)."""
        out = []
        for (text,) in [request.args for request in requests]:
            windows = [make_disjoint_window(window) for window in get_rolling_token_windows(
                self.tok_encode(text), self.prefix_token_id, self.max_length, context_len=1)]  # fmt: skip
            scored = self._loglikelihood_tokens([(None, context, continuation) for context, continuation in windows])
            out.append(sum(total for total, _ in scored))
        return out

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


def evaluate(
    lm: TemplateLM, tasks: list[str], limit: int | None, include_path: str | None, log_samples: bool = False
) -> dict[str, Any]:
    """lm-eval's results of `tasks` (names, or tasks of YAML files under `include_path`) on `lm`; with
    `log_samples`, each request's scores too."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=limit, task_manager=manager, log_samples=log_samples,
                                   bootstrap_iters=0)  # fmt: skip


def accuracies(results: dict[str, Any]) -> dict[str, float]:
    """`<task>/<metric>` of every task's numeric results (lm-eval names them `acc,none`: the filter dropped)."""
    return {f"{task}/{name.split(',')[0]}": value for task, metrics in results["results"].items()
            for name, value in metrics.items() if isinstance(value, int | float) and "_stderr" not in name}  # fmt: skip


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
