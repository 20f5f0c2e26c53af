"""Tree-level update with one all_reduce(MAX) across 2 processes on the gloo backend (CPU)."""

import os

import pytest
import torch
import torch.distributed as dist

from fp8ops.testing.distributed import spawn_ranks

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
    res = spawn_ranks(_worker, 2, lambda init, d: (2, init, d))
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


def _crashing_worker(rank: int, out_dir: str, marker_dir: str, mode: str) -> None:
    # mode "once": rank 1 aborts (SIGABRT) in the first run only; "always": in every run; "raise": a
    # Python exception; "exit": exits with status 3 (no signal). Each run counts itself in marker_dir
    # (outside spawn_ranks's folders).
    import signal

    run = len([n for n in os.listdir(marker_dir) if n.startswith(f"rank{rank}.")])
    open(os.path.join(marker_dir, f"rank{rank}.{run}"), "w").close()
    if rank == 1 and mode == "raise":
        raise ValueError("a bad case")
    if rank == 1 and mode == "exit":
        os._exit(3)
    if rank == 1 and (mode == "always" or run == 0):
        os.kill(os.getpid(), signal.SIGABRT)
    torch.save({"rank": rank, "run": run, "dir": out_dir}, os.path.join(out_dir, f"rank{rank}.pt"))


def test_spawn_ranks_runs_again_after_a_crash_and_only_then(tmp_path):
    import torch.multiprocessing as mp

    def spawn(mode: str, sub: str) -> list:
        (tmp_path / sub).mkdir()
        return spawn_ranks(_crashing_worker, 2, lambda init, d: (d, str(tmp_path / sub), mode))

    with pytest.warns(UserWarning, match=r"rank 1 of 2 was killed by SIGABRT; running all ranks again"):
        res = spawn("once", "once")
    # every rank's results, all from the second run: rank 1's second run, and rank 0's last run in
    # the same output folder (rank 0 may have been stopped before it started in the first run)
    assert [r["rank"] for r in res] == [0, 1] and res[1]["run"] == 1 and res[0]["dir"] == res[1]["dir"]
    assert res[0]["run"] == len(list((tmp_path / "once").glob("rank0.*"))) - 1
    with pytest.warns(UserWarning), pytest.raises(mp.ProcessExitedException, match="SIGABRT"):
        spawn("always", "always")
    assert len(list((tmp_path / "always").glob("rank1.*"))) == 2  # one retry, then the crash is raised
    with pytest.raises(mp.ProcessRaisedException, match="a bad case"):
        spawn("raise", "raise")
    assert len(list((tmp_path / "raise").glob("rank1.*"))) == 1  # an exception is not retried
    with pytest.raises(mp.ProcessExitedException, match="exit code 3"):
        spawn("exit", "exit")
    assert len(list((tmp_path / "exit").glob("rank1.*"))) == 1  # nor an exit without a signal
