"""Causal attention inside packed documents (data.document_mask) without an S x S mask.

A (batch, 1, S, S) mask is O(S²): 1 GiB per sample at S = 32k, kept by SDPA for backward, and no flash
kernel takes it. Two paths avoid it, and `document_mask` stays only as the tests' reference:

- CUDA: FlexAttention (torch.compile'd) with a block mask built from the document ids, as torchtitan does:
  blocks no query sees are skipped, the others masked inside the kernel.
- CPU (FlexAttention has no CPU backward): query tiles of `TILE_ROWS` rows, each attending by the flash
  kernel to the keys from the first token of its earliest document to its last query, with a bias from
  the document ids built for that tile alone and again in backward. Nothing S x S lives at any time; the
  largest transient is one tile's bias, (batch, 1, TILE_ROWS, S).

Both assume what packing makes: each document a contiguous run of tokens in its sample.
The same per-block kernels (`block_forward`, `block_backward`) run context parallelism's ring.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

Triple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

# query rows per tile of the CPU path: its transient bias is (batch, 1, TILE_ROWS, keys) in the compute dtype
TILE_ROWS = 256

# a bias where a query may not look: finite, so that a row seeing no key of a block gets a weight of
# exp(-1e30) when blocks merge, never NaN (the kernels give such a row an undefined log-sum-exp with -inf)
MASKED = -1e30


def masked_value(dtype: torch.dtype) -> float:
    """`MASKED` within the compute dtype's range (fp16's ends at -65504)."""
    return max(MASKED, torch.finfo(dtype).min)


def block_forward(q, k, v, causal: bool, scale: float, bias: torch.Tensor | None = None):
    """One block's attention output and log-sum-exp (fp32), by the device's flash kernel; `bias`: added to
    the scores (packed documents: `masked_value` where a query may not look)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias,
                                                                              scale=scale)  # fmt: skip
        return out, lse.float()
    bias = None if bias is None else bias.expand(-1, q.shape[1], -1, -1)  # the CUDA kernel takes every head's
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal,
                                                                             scale=scale)  # fmt: skip
    return out, lse[..., : q.shape[2]].float()


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, bias: torch.Tensor | None = None) -> Triple:
    """One block's dq, dk, dv given the output and log-sum-exp over all its queries' keys (so that a block's
    share of a merged attention is exact)."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
        )
    seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)
    bias = None if bias is None else bias.expand(-1, q.shape[1], -1, -1)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, bias, out, lse.contiguous(), seed, offset, 0.0, [True, True, True, False], causal, scale=scale
    )
    return dq, dk, dv


def _document_starts(documents: torch.Tensor) -> torch.Tensor:
    """Each token's index of its document's first token, (batch, seq)."""
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    first = torch.ones_like(documents, dtype=torch.bool)
    first[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return torch.where(first, index, 0).cummax(dim=1).values


def document_tile(batch: int, queries: int, keys: int) -> int:
    """Elements of the largest tile's bias over `queries` and `keys` (the planner's transient)."""
    return batch * min(TILE_ROWS, queries) * keys


class Tile(NamedTuple):
    """Query rows attending to a range of keys: causally (`causal`, no documents), or by `bias`, (batch, 1,
    rows, keys): 0 where a query may look (inside its document, not ahead), else `masked_value`."""

    rows: slice
    keys: slice
    bias: torch.Tensor | None
    causal: bool = False


def document_tiles(
    documents: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor, dtype: torch.dtype, tile_rows: int = TILE_ROWS
) -> Iterator[Tile]:
    """Tiles of `tile_rows` of the `queries` (their positions in the sample, increasing) over the `keys`
    (positions, increasing), with `documents` the whole sample's: each tile's keys run from its earliest
    document's first token to its last query; a tile no query of which sees a key is left out. Lazily, so
    that one tile's bias lives at a time: (batch, rows, keys) in `dtype` and one boolean of its size."""
    starts = _document_starts(documents)
    for start in range(0, len(queries), tile_rows):
        rows = slice(start, min(start + tile_rows, len(queries)))
        positions = queries[rows]
        first = int(torch.searchsorted(keys, starts[:, positions].min()))
        stop = int(torch.searchsorted(keys, positions[-1], right=True))
        theirs = keys[first:stop]
        seen = documents[:, positions, None] == documents[:, None, theirs]
        seen &= positions[:, None] >= theirs[None, :]
        if not seen.any():
            continue
        # its rows padded to 16 elements: CUDA's efficient-attention kernel takes only aligned bias strides
        # (the ring's blocks on CUDA), which SDPA would pad itself but the kernel called directly does not
        batch, rows_count, keys_count = seen.shape
        padded = -(-keys_count // 16) * 16
        bias = torch.full((batch, rows_count, padded), masked_value(dtype), dtype=dtype, device=seen.device)
        bias = bias[..., :keys_count].masked_fill_(seen, 0)
        del seen
        yield Tile(rows, slice(first, stop), bias.unsqueeze(1))


def _tiles(documents: torch.Tensor, tile_rows: int, dtype: torch.dtype) -> Iterator[Tile]:
    """The tiles of a whole sample attending to itself (every query sees itself: no tile is left out)."""
    positions = torch.arange(documents.shape[1], device=documents.device)
    return document_tiles(documents, positions, positions, dtype, tile_rows)


class _TiledDocumentAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, documents: torch.Tensor, tile_rows: int):
        scale = q.shape[-1] ** -0.5
        batch, heads, seq, head_dim = q.shape
        # in the layout SDPA returns, (batch, seq, heads, head_dim): the output projection reads it as a view
        out = torch.empty(batch, seq, heads, head_dim, dtype=q.dtype, device=q.device).transpose(1, 2)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        for tile in _tiles(documents, tile_rows, q.dtype):
            rows, keys = tile.rows, tile.keys
            out[:, :, rows], lse[:, :, rows] = block_forward(q[:, :, rows], k[:, :, keys], v[:, :, keys], False,
                                                             scale, tile.bias)  # fmt: skip
        ctx.scale, ctx.documents, ctx.tile_rows = scale, documents, tile_rows
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        dq = torch.empty_like(q)
        dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (k, v))
        for tile in _tiles(ctx.documents, ctx.tile_rows, q.dtype):
            rows, keys = tile.rows, tile.keys
            part = [t[:, :, rows].contiguous() for t in (dout, q, out, lse)]
            a, b, c = block_backward(part[0], part[1], k[:, :, keys].contiguous(), v[:, :, keys].contiguous(),
                                     part[2], part[3], False, ctx.scale, tile.bias)  # fmt: skip
            dq[:, :, rows] = a
            dk[:, :, keys] += b
            dv[:, :, keys] += c
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) boolean SDPA mask from each token's document, (batch, seq): causal and inside one
    document. O(S²): the tests' reference for `causal_attention`'s document paths, which never build it."""
    seq = documents.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=documents.device).tril()
    return ((documents.unsqueeze(2) == documents.unsqueeze(1)) & causal).unsqueeze(1)


def document_block_mask(documents: torch.Tensor, compiled: bool = True) -> BlockMask:
    """FlexAttention's block mask of causal attention inside each packed document. `compiled`: built by a
    compiled kernel block by block (eager, `create_block_mask` first builds the whole S x S mask: the CPU
    tests' forward only)."""

    def inside_document(b, h, query, key):
        return (query >= key) & (documents[b, query] == documents[b, key])

    batch, seq = documents.shape
    return create_block_mask(inside_document, batch, None, seq, seq, device=documents.device, _compile=compiled)


@functools.cache
def compiled_flex_attention():
    """FlexAttention compiled, once per process on first use (eager, it materializes the scores; torch.compile
    is not called at import: it loads inductor, seconds on a CPU)."""
    return torch.compile(flex_attention)


def flex_document_attention(q, k, v, documents: torch.Tensor, kernel=None) -> torch.Tensor:
    """Causal attention inside documents by FlexAttention (`kernel`: the compiled one unless given; the CPU
    tests give eager `flex_attention` and run its forward only)."""
    compiled = kernel is None
    if kernel is None:  # inside a compiled block (train.compile) the block's graph compiles it
        kernel = flex_attention if torch.compiler.is_compiling() else compiled_flex_attention()
    mask = document_block_mask(documents, compiled)
    return kernel(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


@torch.compiler.disable  # inside compiled blocks (train.compile) the tiles run eagerly, one graph break each
def tiled_document_attention(q, k, v, documents: torch.Tensor, tile_rows: int = TILE_ROWS) -> torch.Tensor:
    """Causal attention inside documents, by query tiles (the CPU path); k, v with q's head count."""
    return _TiledDocumentAttention.apply(q, k, v, documents, tile_rows)
