"""Running a test body in two gloo processes on the CPU, and comparing a sharded run with the unsharded one."""

from __future__ import annotations

import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def _worker(rank: int, body, out: str) -> None:
    torch.set_num_threads(1)
    # a file rendezvous in the test's own folder: no port to race for with tests running beside it
    dist.init_process_group(
        "gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    try:
        checked = body(rank)
        Path(out, f"rank{rank}.txt").write_text("\n".join(checked))
    except BaseException:
        Path(out, f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_on_two_ranks(body, tmp_path: Path) -> list[str]:
    """``body(rank)`` in two spawned gloo processes; returns the names of the cases rank 0 checked (each rank's
    list must be the same). A failure on either rank fails the test with that rank's traceback."""
    try:
        mp.spawn(_worker, args=(body, str(tmp_path)), nprocs=WORLD, join=True)
    except Exception as error:  # the child's traceback, not only "process 1 terminated with exit code 1"
        messages = [p.read_text() for p in sorted(tmp_path.glob("rank*.error"))]
        raise AssertionError("\n".join(messages) or str(error)) from error
    checked = [(tmp_path / f"rank{r}.txt").read_text().splitlines() for r in range(WORLD)]
    assert checked[0] == checked[1]
    return checked[0]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, **TOLERANCE, msg=lambda m: f"{what}: {m}")


def averaged(grad: torch.Tensor) -> torch.Tensor:
    """The mean over the ranks of ``grad`` (what DDP over the sequence ranks does)."""
    grad = grad.clone()
    dist.all_reduce(grad)
    return grad / dist.get_world_size()
