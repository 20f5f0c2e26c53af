"""Tree-level update with one all_reduce(MAX) across 2 processes on the gloo backend (CPU)."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
]


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import fp8ops
    from fp8ops import DelayedScaling, FakeQuantState
    from fp8ops.testing.distributed import count_all_reduces

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        r = DelayedScaling(amax_history_len=3)
        st = {"a": FakeQuantState.init(r), "b": r.init(role="forward")}
        # rank-specific observations: the merged result must be their max on every rank
        st["a"] = st["a"].replace(input=st["a"].input.observe(torch.tensor(2.0 + 5.0 * rank)))
        st["b"] = st["b"].observe(torch.tensor([float("nan"), 3.0][rank]))
        grads = {"a": torch.tensor([8.0, 1.0][rank]), "b": None}
        with count_all_reduces() as calls:
            new = fp8ops.update(st, recipe=r, grad_amax=grads, group=dist.group.WORLD)
        torch.save(
            {
                "calls": len(calls),
                "a_in_hist": new["a"].input.amax_history,
                "a_in_scale": new["a"].input.scale,
                "a_grad_hist": new["a"].grad_output.amax_history,
                "b_hist": new["b"].amax_history,
                "b_scale": new["b"].scale,
            },
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def test_update_all_reduces_max_across_two_ranks():
    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "init")
        mp.spawn(_worker, args=(2, init_file, d), nprocs=2, join=True)
        res = [torch.load(os.path.join(d, f"rank{i}.pt")) for i in range(2)]
    for r in res:
        assert r["calls"] == 1  # one batched collective for every state of the model
        assert r["a_in_hist"].tolist() == [7.0, 0.0, 0.0]  # max(2, 7)
        assert r["a_in_scale"].item() == 64.0
        assert r["a_grad_hist"].tolist() == [8.0, 0.0, 0.0]  # max(8, 1)
        # a NaN on one rank drops the observation on every rank; the scale is kept
        assert r["b_hist"].tolist() == [0.0, 0.0, 0.0] and r["b_scale"].item() == 1.0
    for k in res[0]:
        if k != "calls":
            assert torch.equal(res[0][k], res[1][k])
