"""bench/compile_modes.py on the CPU (mode "default"): it compiles, trains, compares with eager and writes its table;
a row fails when the logits leave the tolerance, and the script's status says so."""

import csv

import pytest

from .scripts import load_script
from .test_bench_results import published_untouched

ARGS = "--device cpu --modes default --schemes alibi2d --size 32 --depth 1 --batch 2 --steps 1"


@pytest.fixture(scope="module")
def script():
    return load_script("bench/compile_modes.py")


@pytest.mark.parametrize("tol, code, result", [("0.05", 0, "ok"), ("-1", 1, "FAILED: logits")])
def test_dry_run_on_cpu(script, tmp_path, monkeypatch, capsys, tol, code, result):
    """Under runs/bench/compile_modes of the current folder by default, and the same files in --results."""
    monkeypatch.chdir(tmp_path)
    with published_untouched(), pytest.raises(SystemExit) as exit_:
        script.main([*ARGS.split(), "--tol", tol, "--results", str(tmp_path / "published")])
    assert exit_.value.code == code, capsys.readouterr().out
    out = tmp_path / "runs" / "bench" / "compile_modes"
    with open(out / "compile_modes.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 1 and table[0]["scheme"] == "alibi2d" and table[0]["result"].startswith(result)
    assert table[0]["graphs"] == "1" and table[0]["graph breaks"] == "0"
    assert (out / "compile_modes.md").read_text().startswith("Measured ")
    for name in ("compile_modes.md", "compile_modes.csv"):
        assert (tmp_path / "published" / name).read_bytes() == (out / name).read_bytes()


def test_refuses_what_it_cannot_run(script, monkeypatch):
    monkeypatch.setattr(script.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        script.main([])
    with pytest.raises(SystemExit):
        script.main(["--device", "cpu", "--schemes", "nope_nope"])
