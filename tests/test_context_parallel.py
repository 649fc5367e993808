"""Context parallelism's attention exchange alone, on 2 gloo ranks: ring (zig-zag shards) and Ulysses
(contiguous shards) give each rank exactly its rows of one process's causal attention and of its
gradients, with grouped-query k, v: one kv head (Ulysses sends it repeated: it does not split over cp) and
two (sent as they are). The differentiable all-to-all under Ulysses and expert parallelism is
torch.distributed.nn.functional.all_to_all_single's, also with uneven splits, and that one is deprecated.
The whole-model parity of every cp layout is tests/test_parallel.py's."""

import types
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_autograd

from hpc_train.bootstrap import RankEnv, distributed
from hpc_train.config import ConfigError
from hpc_train.data.batch import SequenceShard
from hpc_train.errors import UserError
from hpc_train.features.context_parallel.attention import split_attention
from hpc_train.features.context_parallel.exchange import ring_attention, ulysses_attention
from hpc_train.features.context_parallel.options import ContextParallelOptions
from hpc_train.job import load_config
from hpc_train.launch.local import launch_local
from hpc_train.models.common.all_to_all import all_to_all
from hpc_train.models.common.decoder import Attention
from hpc_train.models.llama.model import ARCH

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


def _check(rank_env: RankEnv) -> None:
    with distributed(rank_env, torch.device("cpu"), "gloo", 60):
        cp, rank = dist.get_world_size(), dist.get_rank()
        _all_to_all_is_torchs_deprecated_one(rank, cp)
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


def test_the_ring_is_refused_on_cuda_until_its_gpu_check_passes():
    """The ring's CUDA backward failed its parity check on the one GPU run: a cp layout with
    parallel.cp_mode=ring on a CUDA device stops at the transform, naming Ulysses (the CPU's ring is
    tests/test_parallel.py's)."""
    ring = ContextParallelOptions(cp_mode="ring")
    with pytest.raises(UserError, match="parallel.cp_mode=ring on CUDA.*use parallel.cp_mode=ulysses"):
        split_attention(None, types.SimpleNamespace(device=torch.device("cuda")), parallel=ring)


def test_a_mask_reaching_an_exchanging_attention_is_an_error_not_local_attention():
    """A document mask that reached an attention whose core exchanges keys and values over cp (today two
    config checks keep it from happening) stops with an error naming the combination: swapped for local
    attention, each rank would attend only to its own shard, silently."""
    cfg = load_config(None, ["model.n_heads=2", "model.d_model=8"]).model
    attention = Attention(cfg, ARCH)
    x, mask = torch.randn(1, 4, 8), torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    assert attention(x, None, None, mask=mask).shape == x.shape  # the local core takes the mask
    attention.core = ulysses_attention
    with pytest.raises(ConfigError, match=r"data.document_mask(.|\n)*parallel.cp > 1(.|\n)*data.document_mask=false"):
        attention(x, None, None, mask=mask)
