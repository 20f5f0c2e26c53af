"""Helpers for testing training with fp8ops under ``torch.distributed`` (gloo on the CPU, NCCL).

- :class:`OpModule`: one pure op's parameters as a module (the functional form of an fp8ops.nn
  module, for ``fully_shard`` or DDP); :class:`Chain`: such modules in sequence.
- :class:`TPLayer`: a tensor- and sequence-parallel :func:`fp8ops.transformer_layer` shard as a
  module (for data parallelism over another mesh dimension).
- :func:`count_all_reduces`: counts ``torch.distributed.all_reduce`` calls (e.g. the one batched
  all-reduce of ``fp8ops.update(..., group=)``).
- :func:`spawn_ranks`: runs a worker on N spawned ranks and returns what each rank saved.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

import fp8ops

__all__ = ["Chain", "OpModule", "TPLayer", "count_all_reduces", "spawn_ranks"]


class OpModule(torch.nn.Module):
    """Holds one pure op's parameters; ``forward(x, state, probe) -> (y, new_state)`` calls
    ``op(params, x, state, probe)``, the state staying outside (docs/parallel.md)."""

    def __init__(self, op: Callable[..., Any], params: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.op, self.names = op, list(params)
        self.p = torch.nn.ParameterList([torch.nn.Parameter(v.detach().clone()) for v in params.values()])

    def forward(self, x: torch.Tensor, state: Any, probe: Any) -> Any:
        return self.op(dict(zip(self.names, self.p)), x, state, probe)


class Chain(torch.nn.Module):
    """:class:`OpModule` s in sequence, a state and a probe per op; ``forward(x, states, probes)
    -> (y, new_states)``."""

    def __init__(self, ops: list[OpModule]) -> None:
        super().__init__()
        self.ops = torch.nn.ModuleList(ops)

    def forward(self, x: torch.Tensor, states: list[Any], probes: list[Any]) -> tuple[torch.Tensor, list[Any]]:
        new = []
        for op, state, probe in zip(self.ops, states, probes):
            x, state = op(x, state, probe)
            new.append(state)
        return x, new


class TPLayer(torch.nn.Module):
    """A TP+SP :func:`fp8ops.transformer_layer` shard (from :func:`fp8ops.shard_transformer_params`)
    as a module: ``forward(x, state, probes) -> (y, new_state)``, the state staying outside."""

    def __init__(self, shard: dict[str, torch.Tensor], cfg: Any, recipe: Any, tp_group: Any) -> None:
        super().__init__()
        self.cfg, self.recipe, self.tp_group, self.names = cfg, recipe, tp_group, list(shard)
        self.p = torch.nn.ParameterList([torch.nn.Parameter(v.detach().clone()) for v in shard.values()])

    def forward(self, x: torch.Tensor, state: Any, probes: Any) -> Any:
        return fp8ops.transformer_layer(dict(zip(self.names, self.p)), x, state, config=self.cfg,
                                        recipe=self.recipe, probes=probes, tp_group=self.tp_group,
                                        sequence_parallel=True)


@contextlib.contextmanager
def count_all_reduces() -> Iterator[list[int]]:
    """Inside, every ``torch.distributed.all_reduce`` call appends 1 to the yielded list."""
    import torch.distributed as dist

    calls: list[int] = []
    orig = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return orig(*args, **kwargs)

    dist.all_reduce = counting
    try:
        yield calls
    finally:
        dist.all_reduce = orig


def spawn_ranks(worker: Callable[..., None], nprocs: int, args: Callable[[str, str], tuple[Any, ...]],
                retries: int = 1) -> list[Any]:
    """Runs ``worker(rank, *args(init_file, out_dir))`` on ``nprocs`` spawned processes
    (``torch.multiprocessing.spawn``) and returns ``torch.load(out_dir/rank{r}.pt)`` for each rank.

    ``init_file`` is a fresh rendezvous file for ``init_method=f"file://{init_file}"`` and
    ``out_dir`` a fresh folder where each rank saves ``rank{r}.pt`` (say, the mismatches it found).
    A run in which a rank was killed by a signal (a crash inside the process, not a Python
    exception) is started again from scratch up to ``retries`` times, with a warning naming the
    signal; a rank that raises fails at once, as does a crash in the last attempt.
    """
    import torch.multiprocessing as mp

    for attempt in range(retries + 1):
        with tempfile.TemporaryDirectory() as d:
            try:
                mp.spawn(worker, args=args(os.path.join(d, "init"), d), nprocs=nprocs, join=True)
            except mp.ProcessExitedException as e:
                if not e.signal_name or attempt == retries:
                    raise
                warnings.warn(f"spawn_ranks: rank {e.error_index} of {nprocs} was killed by {e.signal_name}; "
                              f"running all ranks again (attempt {attempt + 2} of {retries + 1})", stacklevel=2)
                continue
            return [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(nprocs)]
    raise AssertionError("unreachable")
