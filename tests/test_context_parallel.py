"""Context parallelism's attention exchange alone, on 2 gloo ranks: ring (zig-zag shards) and Ulysses
(contiguous shards) give each rank exactly its rows of one process's causal attention and of its
gradients, with grouped-query k, v: one kv head (Ulysses sends it repeated: it does not split over cp) and
two (sent as they are). The whole-model parity of every cp layout is tests/test_parallel.py's."""

import torch
import torch.distributed as dist

from hpc_train.bootstrap import RankEnv, distributed
from hpc_train.data.batch import SequenceShard
from hpc_train.features.context_parallel.exchange import ring_attention, ulysses_attention
from hpc_train.launch.local import launch_local

TOL = 1e-5


def _check(rank_env: RankEnv) -> None:
    with distributed(rank_env, torch.device("cpu"), "gloo", 60):
        cp, rank = dist.get_world_size(), dist.get_rank()
        for kv_heads in (1, 2):
            gen = torch.Generator().manual_seed(kv_heads)
            q, dout = torch.randn(2, 4, 32, 8, generator=gen), torch.randn(2, 4, 32, 8, generator=gen)
            k, v = torch.randn(2, kv_heads, 32, 8, generator=gen), torch.randn(2, kv_heads, 32, 8, generator=gen)
            whole = [t.clone().requires_grad_() for t in (q, k, v)]
            repeat = 4 // kv_heads
            ref = torch.nn.functional.scaled_dot_product_attention(
                whole[0], whole[1].repeat_interleave(repeat, 1), whole[2].repeat_interleave(repeat, 1), is_causal=True
            )
            ref.backward(dout)
            for core, zigzag in ((ring_attention, True), (ulysses_attention, False)):
                at = SequenceShard(cp, rank, zigzag).positions(32 // cp)
                mine = [t[:, :, at].clone().requires_grad_() for t in (q, k, v)]
                out = core(*mine, group=dist.group.WORLD)
                out.backward(dout[:, :, at])
                assert (out - ref[:, :, at]).abs().max() <= TOL, (core.__name__, kv_heads)
                for got, full in zip(mine, whole, strict=True):
                    assert (got.grad - full.grad[:, :, at]).abs().max() <= TOL, (core.__name__, kv_heads)


def test_ring_and_ulysses_match_one_process_with_grouped_query_heads():
    launch_local(_check, 2)


def test_zigzag_shards_cover_the_sequence_once_with_equal_causal_work():
    shards = [SequenceShard(4, r, zigzag=True).positions(8) for r in range(4)]
    assert sorted(torch.cat(shards).tolist()) == list(range(32))
    assert len({int((s + 1).sum()) for s in shards}) == 1  # keys attended under the causal mask, per rank
