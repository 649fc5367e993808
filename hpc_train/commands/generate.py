"""`hpc-train generate`: text from a checkpoint (any layout; LoRA and QLoRA as trained) or a Hugging Face
folder, greedy or nucleus (top-p) sampling, to see that an imported or fine-tuned model speaks. One
process, no KV cache: each new token re-runs the context (at most model.seq_len tokens)."""

from __future__ import annotations

import torch

from hpc_train.commands.convert import source_tokenizer
from hpc_train.data.tokenizer import Tokenizer, build_tokenizer
from hpc_train.distributed.parallelize import ParallelModel


def pick_tokenizer(source: str, tokenizer: str | None) -> Tokenizer:
    """`tokenizer` if given, else the one the source was trained with (convert.py's `source_tokenizer`: a
    folder's tokenizer.json, a run's record, its data's), else byte-level."""
    return build_tokenizer(tokenizer or source_tokenizer(source) or "byte")


@torch.no_grad()
def generate(
    model: ParallelModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_id: int | None = None,
) -> list[int]:
    """New token ids after `prompt_ids`: the most likely one each time (temperature 0), or sampled from the
    smallest set of most likely tokens whose probability reaches `top_p`, at `temperature`."""
    model.train(False)
    chunk, cfg = model.chunks[0], model.model_cfg
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-cfg.seq_len :]])
        with torch.autocast("cpu", dtype=model.autocast_dtype, enabled=model.autocast_dtype is not None):
            logits = chunk(context)[0, -1, : cfg.vocab_size].float()
        if temperature == 0:
            token = int(logits.argmax())
        else:
            probs, order = torch.softmax(logits / temperature, -1).sort(descending=True)
            keep = probs.cumsum(0) - probs < top_p  # the nucleus: always the most likely token
            probs = probs * keep
            token = int(order[torch.multinomial(probs / probs.sum(), 1, generator=generator)])
        ids.append(token)
        if token == stop_id:
            break
    return ids[len(prompt_ids) :]
