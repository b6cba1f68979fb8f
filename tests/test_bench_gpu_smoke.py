"""bench/gpu_smoke.sh: its result files go to --out (runs/gpu_results by default), never the published folder, and a
dry run says once that its numbers are a pipeline check."""

import os
import subprocess
import sys

import pytest

from .scripts import ROOT
from .test_bench_results import PUBLISHED, published_untouched, quick_notices


def _run(*args):
    # PYTHON: no set-up (scripts/setup.sh), the interpreter running these tests
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    command = ["bash", str(ROOT / "bench" / "gpu_smoke.sh"), *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "out",
    [str(PUBLISHED), "docs/benchmarks/results/gpu", "docs/benchmarks/../benchmarks/results"],
    ids=["absolute", "inside", "relative"],
)
def test_the_published_folder_is_refused_as_out(out):
    with published_untouched():
        proc = _run("--dry-run", "--part", "smoke", "--out", out)
    assert proc.returncode == 2 and "is the published results folder (docs/benchmarks/results)" in proc.stderr
    assert not (ROOT / "docs" / "benchmarks" / "results" / "gpu").exists()


def test_a_dry_run_writes_its_out_folder_and_says_it_measures_nothing(tmp_path):
    with published_untouched():
        proc = _run("--dry-run", "--part", "smoke", "--out", str(tmp_path / "gpu"))
    assert proc.returncode == 0, proc.stderr
    assert quick_notices(proc.stdout) == ["--dry-run: the numbers of this run are a pipeline check, not a measurement"]
    assert sorted(p.name for p in (tmp_path / "gpu").iterdir()) == ["gpu_smoke.log"]


def test_a_dry_run_of_the_fsdp2_part_shards_over_two_cpu_processes_then_over_the_tokens(tmp_path):
    with published_untouched():
        proc = _run("--dry-run", "--part", "fsdp2", "--out", str(tmp_path / "gpu"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = (tmp_path / "gpu" / "fsdp2.log").read_text()
    assert log.count("FSDP2 checks passed on 2 cpu process(es)") == 2, log
    # then the sequence-parallel check: every case within its tolerance, on 2 ranks
    log = (tmp_path / "gpu" / "sequence_parallel.log").read_text()
    assert "2 ranks (gloo, cpu)" in log and log.rstrip().endswith("ok"), log
    assert quick_notices(proc.stdout) == ["--dry-run: the numbers of this run are a pipeline check, not a measurement"]
