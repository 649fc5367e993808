"""lm-evaluation-harness's side (the optional extra `.[eval]`) of scoring hpc_train's own model: `ScoringLM` is
lm-eval's view of a model and its tokenizer, its requests cut to the model's context the way lm-eval's own
models cut them; `hpc-train eval` (commands/downstream.py) scores them in one process and `LoopLM`, rank 0's
inside the training loop, on every rank (train/downstream.py). Also the task index, the check of eval.tasks,
and the figures lm-eval's results give."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from hpc_train.config import ConfigError, EvalConfig, JobConfig
from hpc_train.data.prepare import dataset_tokenizer
from hpc_train.data.tokenizer import Tokenizer, build_tokenizer
from hpc_train.distributed.parallelize import ParallelModel
from hpc_train.train.downstream import Requests, score_everywhere

GENERATES = "generate_until"  # lm-eval's output type of tasks that generate text


class ScoringLM(TemplateLM):
    """lm-eval's `LM` over a model of context `max_length` and its tokenizer: a continuation's log-likelihood
    after its context and whether it is the greedy one, and a text's rolling log-likelihood; `score` (the
    subclass's) scores the requests, each cut on the left to the model's context."""

    def __init__(self, tokenizer: Tokenizer, max_length: int):
        super().__init__()
        self.tokenizer, self.max_length = tokenizer, max_length

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eod_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(string).tolist()

    def tok_decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def score(self, sequences: list[list[int]], counted: list[int]) -> list[tuple[float, bool]]:
        """(log-likelihood, greedy) of the last `counted` tokens of each sequence after the ones before."""
        raise NotImplementedError

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple]:
        """(log-likelihood, greedy) of each continuation after its context, the input cut on the left to the
        model's length (lm-eval's rule: the continuation is whole, the context keeps its last tokens)."""
        sequences, counted = [], []
        for _, context, continuation in requests:
            context = context or [self.prefix_token_id]  # a context of spaces alone, moved to the continuation
            sequences.append((context + continuation)[-(self.max_length + 1) :])
            counted.append(min(len(continuation), len(sequences[-1]) - 1))  # one longer than the model: its end
        return self.score(sequences, counted) if sequences else []

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """A whole text's log-likelihood: windows of the model's length, each scored after the one before
        (lm-eval's rolling windows, the first after the end-of-document token)."""
        windows, owner = [], []
        for i, (text,) in enumerate(request.args for request in requests):
            for window in get_rolling_token_windows(self.tok_encode(text), self.prefix_token_id, self.max_length,
                                                    context_len=1):  # fmt: skip
                windows.append((None, *make_disjoint_window(window)))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (total, _) in zip(owner, self._loglikelihood_tokens(windows), strict=True):
            totals[i] += total
        return totals

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        raise NotImplementedError(f"tasks of output type {GENERATES} are scored by `hpc-train eval`")


def task_manager(tasks: list[str], include_path: str | None) -> TaskManager:
    """lm-eval's task index: `include_path`'s tasks alone where it holds every task asked for (indexing
    lm-eval's thousands of built-in tasks takes seconds), else the built-in ones too."""
    if include_path:
        own = TaskManager(include_path=include_path, include_defaults=False)
        if set(tasks) <= set(own.all_tasks):
            return own
        return TaskManager(include_path=include_path)
    return TaskManager()


def load_tasks(cfg: EvalConfig) -> tuple[TaskManager, list]:
    """eval.tasks known to lm-eval and scored by log-likelihood (none that generates text), loaded with their
    datasets (downloaded once, into the Hugging Face cache the job reads). Returns the task index and the
    tasks (a group as its group; a tag as its name, loaded again at each evaluation)."""
    manager = task_manager(cfg.tasks, cfg.include_path)
    if unknown := [name for name in cfg.tasks if name not in manager.all_tasks]:
        where = f" or under eval.include_path={cfg.include_path}" if cfg.include_path else ""
        raise ConfigError(f"eval.tasks: {', '.join(unknown)} is no lm-eval task{where}: `lm-eval ls tasks` lists "
                          "them; a task of your own is a YAML file in the folder eval.include_path names")  # fmt: skip
    loaded = manager.load(cfg.tasks)
    if generating := sorted(name for name, task in loaded["tasks"].items()
                            if task.get_config("output_type") == GENERATES):  # fmt: skip
        listed = ", ".join(generating)
        raise ConfigError(f"eval.tasks: {listed} generates text, which the training loop does not run; score it on "
                          f"a checkpoint: hpc-train eval RUN_DIR --tasks {listed.replace(', ', ',')}")  # fmt: skip
    return manager, [loaded["groups"].get(name) or loaded["tasks"].get(name) or name for name in cfg.tasks]


def tokenizer_spec(cfg: JobConfig) -> str:
    """The tokenizer the loop's requests are encoded with: eval.tokenizer, else the training data's (its
    first source's that records one)."""
    if cfg.eval.tokenizer:
        return cfg.eval.tokenizer
    for path in [s.path for s in cfg.data.sources] or [cfg.data.train_path]:
        if (spec := dataset_tokenizer(path)) is not None:
            return spec
    raise ConfigError("eval.tasks: the training data records no tokenizer (a Megatron-LM corpus): set eval.tokenizer "
                      "to the tokenizer.json it was prepared with")  # fmt: skip


def check_eval(cfg: JobConfig) -> tuple[TaskManager, list, Tokenizer]:
    """Everything eval.tasks needs, before training: the tasks (`load_tasks`) and the tokenizer, whose ids fit
    the model's vocabulary. Any failure (a dataset that does not download, a task file that does not parse) is
    a ConfigError naming eval.tasks."""
    try:
        manager, tasks = load_tasks(cfg.eval)
        spec = tokenizer_spec(cfg)
        tokenizer = build_tokenizer(spec)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"eval.tasks {cfg.eval.tasks} could not be loaded: {err!r}") from err
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"eval.tasks: tokenizer {spec} has {tokenizer.vocab_size} tokens but model.vocab_size="
                          f"{cfg.model.vocab_size}; set eval.tokenizer to the tokenizer the training data was "
                          "prepared with")  # fmt: skip
    return manager, tasks, tokenizer


def evaluate(lm: TemplateLM, tasks: list, limit: int | None, manager: TaskManager, log_samples: bool = False):
    """lm-eval's results of `tasks` (names, or tasks `load_tasks` loaded) on `lm` (lm-eval's seeds, as its
    command line sets them); with `log_samples`, each request's scores too."""
    import lm_eval

    return lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=limit, task_manager=manager, log_samples=log_samples,
                                   bootstrap_iters=0)  # fmt: skip


def accuracies(results: dict[str, Any]) -> dict[str, float]:
    """`<task>/<metric>` of every task's metrics (lm-eval names them `acc,none`: the filter dropped), without
    their standard errors and example counts."""
    return {f"{task}/{name.split(',')[0]}": value for task, metrics in results["results"].items()
            for name, value in metrics.items()
            if isinstance(value, int | float) and "_stderr" not in name and name != "sample_len"}  # fmt: skip


class LoopLM(ScoringLM):
    """Rank 0's lm-eval model inside the training loop: each batch of requests is scored by every rank
    (train/downstream.py's `score_everywhere`)."""

    def __init__(self, tokenizer: Tokenizer, model: ParallelModel, cfg: JobConfig):
        super().__init__(tokenizer, cfg.model.seq_len)
        self.model, self.cfg = model, cfg

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=True)  # no progress bar in the training log

    def score(self, sequences: list[list[int]], counted: list[int]) -> list[tuple[float, bool]]:
        requests = Requests(sequences, counted, self.cfg.model.seq_len, self.eot_token_id)
        scores = score_everywhere(self.model, requests, self.cfg)
        return [(-loss, missed == 0) for loss, missed in scores.tolist()]


@contextlib.contextmanager
def quiet_lm_eval() -> Iterator[None]:
    """lm-eval's notes (each task's defaults, at every evaluation) kept out of the training log: errors only."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
