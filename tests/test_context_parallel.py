"""Context parallelism's attention exchange alone, on 2 gloo ranks: ring (zig-zag shards) and Ulysses
(contiguous shards) give each rank exactly its rows of one process's causal attention and of its
gradients, with grouped-query k, v: one kv head (Ulysses sends it repeated: it does not split over cp) and
two (sent as they are); causal alone and with packed documents (every rank's attention masks the keys it
gets by their global documents and positions). The differentiable all-to-all under Ulysses and expert parallelism is
torch.distributed.nn.functional.all_to_all_single's, also with uneven splits, and that one is deprecated.
The whole-model parity of every cp layout is tests/test_parallel.py's."""

import functools
import types
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_autograd

from hpc_train.bootstrap import RankEnv, distributed
from hpc_train.data.batch import SequenceShard
from hpc_train.errors import UserError
from hpc_train.features.context_parallel.attention import split_attention
from hpc_train.features.context_parallel.exchange import _ring_tiles, ring_attention, ulysses_attention
from hpc_train.features.context_parallel.options import ContextParallelOptions
from hpc_train.launch.local import launch_local
from hpc_train.models.common.all_to_all import all_to_all
from hpc_train.models.common.document_attention import document_mask

TOL = 1e-5


def _all_to_all_is_torchs_deprecated_one(rank: int, world: int) -> None:
    """Uneven splits (rank i sends 1 + i + 2 j rows to rank j): the same rows and the same gradients as torch's
    differentiable all_to_all_single, which warns on each call that it is deprecated."""
    sent = [[1 + i + 2 * j for j in range(world)] for i in range(world)]
    send, recv = sent[rank], [sent[i][rank] for i in range(world)]
    gen = torch.Generator().manual_seed(rank)
    rows, weights = torch.randn(sum(send), 3, generator=gen), torch.randn(sum(recv), 3, generator=gen)
    ours_in, theirs_in = rows.clone().requires_grad_(), rows.clone().requires_grad_()
    ours = all_to_all(ours_in, recv, send, dist.group.WORLD)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        theirs = dist_autograd.all_to_all_single(rows.new_empty(sum(recv), 3), theirs_in, recv, send)
    assert any(w.category is FutureWarning and "deprecated" in str(w.message) for w in caught), caught
    assert torch.equal(ours, theirs)
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    assert torch.equal(ours_in.grad, theirs_in.grad)


def packed_documents(seq: int) -> torch.Tensor:
    """Each token's document, (2, seq): a document longer than a shard, one of a single token, some crossing
    shard boundaries, and (second row) 3-token documents, so that some ring blocks see no key at all."""
    lengths = [seq // 2 + 3, 1, 5, seq]
    first = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[:seq]
    return torch.stack([first, torch.arange(seq) // 3])


def _check(rank_env: RankEnv) -> None:
    with distributed(rank_env, torch.device("cpu"), "gloo", 60):
        cp, rank = dist.get_world_size(), dist.get_rank()
        _all_to_all_is_torchs_deprecated_one(rank, cp)
        for kv_heads, documents in ((1, None), (2, None), (1, packed_documents(32)), (2, packed_documents(32))):
            gen = torch.Generator().manual_seed(kv_heads)
            q, dout = torch.randn(2, 4, 32, 8, generator=gen), torch.randn(2, 4, 32, 8, generator=gen)
            k, v = torch.randn(2, kv_heads, 32, 8, generator=gen), torch.randn(2, kv_heads, 32, 8, generator=gen)
            whole = [t.clone().requires_grad_() for t in (q, k, v)]
            repeat = 4 // kv_heads
            mask = None if documents is None else document_mask(documents)
            ref = torch.nn.functional.scaled_dot_product_attention(
                whole[0], whole[1].repeat_interleave(repeat, 1), whole[2].repeat_interleave(repeat, 1),
                attn_mask=mask, is_causal=mask is None,
            )  # fmt: skip
            ref.backward(dout)
            tiled_ring = functools.partial(ring_attention, tile_rows=3)  # several tiles per block, some skipped
            for core, zigzag in ((ring_attention, True), (tiled_ring, True), (ulysses_attention, False)):
                at = SequenceShard(cp, rank, zigzag).positions(32 // cp)
                mine = [t[:, :, at].clone().requires_grad_() for t in (q, k, v)]
                out = core(*mine, group=dist.group.WORLD, documents=documents)
                out.backward(dout[:, :, at])
                case = (getattr(core, "keywords", None), zigzag, kv_heads, documents is not None)
                assert (out - ref[:, :, at]).abs().max() <= TOL, case
                for got, full in zip(mine, whole, strict=True):
                    assert (got.grad - full.grad[:, :, at]).abs().max() <= TOL, case
        _ring_transfers_overlap_compute(cp, rank)


def _ring_transfers_overlap_compute(cp: int, rank: int) -> None:
    """From the ring's timeline: in forward every step's next key-value block is in flight while the current
    block computes, and in backward each block's key-value gradient, sent on after its step, is in flight
    while the next block's backward computes (it is waited for only to add that block's share)."""
    timeline: list = []
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    out = ring_attention(q, k, v, group=dist.group.WORLD, timeline=timeline)
    forward = {(event, step): t for event, step, t in timeline}
    out.sum().backward()
    backward = {(event, step): t for event, step, t in timeline[len(forward) :]}
    for step in range(cp - 1):
        assert forward["kv start", step] <= forward["forward start", step], (rank, step)
        assert forward["forward end", step] <= forward["kv end", step], (rank, step)
    for step in range(1, cp):
        assert backward["grads start", step - 1] <= backward["backward start", step], (rank, step)
        assert backward["backward end", step] <= backward["grads end", step - 1], (rank, step)


def test_ring_and_ulysses_match_one_process_with_grouped_query_heads():
    launch_local(_check, 2)


def test_zigzag_shards_cover_the_sequence_once_with_equal_causal_work():
    shards = [SequenceShard(4, r, zigzag=True).positions(8) for r in range(4)]
    assert sorted(torch.cat(shards).tolist()) == list(range(32))
    assert len({int((s + 1).sum()) for s in shards}) == 1  # keys attended under the causal mask, per rank


def test_the_ring_is_refused_on_cuda_until_its_gpu_check_passes():
    """The ring's CUDA backward failed its parity check on the one GPU run: a cp layout with
    parallel.cp_mode=ring on a CUDA device stops at the transform, naming Ulysses (the CPU's ring is
    tests/test_parallel.py's)."""
    ring = ContextParallelOptions(cp_mode="ring")
    with pytest.raises(UserError, match="parallel.cp_mode=ring on CUDA.*use parallel.cp_mode=ulysses"):
        split_attention(None, types.SimpleNamespace(device=torch.device("cuda")), parallel=ring)


def test_a_ring_block_where_no_query_sees_a_key_is_skipped():
    """With packed documents each ring step's block is tiled and masked by the global positions and
    documents of its queries and keys; a block that no query may see gives no tile: it is not computed."""
    ring = lambda rank: types.SimpleNamespace(size=2, rank=rank)
    tiles = lambda rank, documents: list(_ring_tiles(ring(rank), 1, 8, documents, torch.float32))
    # zig-zag at cp2, seq 16: rank 0 holds 0-3 and 12-15, rank 1 holds 4-11
    separate = torch.arange(16).div(4, rounding_mode="floor").unsqueeze(0)  # a document per chunk
    assert tiles(0, separate) == [] and tiles(1, separate) == []  # the other rank's keys: none of our documents
    one = torch.zeros(1, 16, dtype=torch.long)
    (tile,) = tiles(1, one)  # rank 0's first chunk: seen by all of ours
    assert tile.rows == slice(0, 8) and tile.keys == slice(0, 4) and bool((tile.bias == 0).all())
    (tile,) = tiles(0, one)  # rank 1's block: seen from our second chunk
    assert tile.rows == slice(4, 8) and tile.keys == slice(0, 8) and bool((tile.bias == 0).all())
    (tile,) = tiles(0, None)  # causal only: no bias, never skipped
    assert tile.bias is None and not tile.causal
