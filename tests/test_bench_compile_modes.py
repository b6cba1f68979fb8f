"""bench/compile_modes.py on the CPU (mode "default"): it compiles, trains, compares with eager and writes its table;
a row fails when the logits leave the tolerance, and the script's status says so."""

import csv

import pytest

from .scripts import load_script

ARGS = "--device cpu --modes default --schemes alibi2d --size 32 --depth 1 --batch 2 --steps 1"


@pytest.fixture(scope="module")
def script():
    return load_script("bench/compile_modes.py")


@pytest.mark.parametrize("tol, code, result", [("0.05", 0, "ok"), ("-1", 1, "FAILED: logits")])
def test_dry_run_on_cpu(script, tmp_path, capsys, tol, code, result):
    with pytest.raises(SystemExit) as exit_:
        script.main([*ARGS.split(), "--tol", tol, "--out", str(tmp_path)])
    assert exit_.value.code == code, capsys.readouterr().out
    with open(tmp_path / "compile_modes.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 1 and table[0]["scheme"] == "alibi2d" and table[0]["result"].startswith(result)
    assert table[0]["graphs"] == "1" and table[0]["graph breaks"] == "0"
    assert (tmp_path / "compile_modes.md").read_text().startswith("Measured ")


def test_refuses_what_it_cannot_run(script, monkeypatch):
    monkeypatch.setattr(script.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        script.main([])
    with pytest.raises(SystemExit):
        script.main(["--device", "cpu", "--schemes", "nope_nope"])
