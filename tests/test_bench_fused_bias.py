"""bench/fused_bias.py: which schemes it compares, and bad --schemes refused before anything runs."""

import pytest

from .scripts import load_script
from .test_bench_results import published_untouched


def test_it_compares_every_bias_scheme_with_per_offset_terms():
    bench = load_script("bench/fused_bias.py")
    assert bench.fusable_schemes() == ["alibi2d", "bam", "irpe", "kerple_log", "kerple_power", "lookhere"]


def test_a_scheme_without_per_offset_terms_is_refused(monkeypatch, capsys):
    bench = load_script("bench/fused_bias.py")
    monkeypatch.setattr("sys.argv", ["bench/fused_bias.py", "--schemes", "fire"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "--schemes: ['fire'] give no per-offset terms" in capsys.readouterr().err


def test_writes_under_runs_by_default_and_the_published_folder_only_with_results(monkeypatch, tmp_path):
    """Where the table goes (the subprocess measurements replaced by fixed numbers: a real one compiles
    FlexAttention for tens of seconds): runs/bench/fused_bias of the current folder, and --results."""
    bench = load_script("bench/fused_bias.py")
    monkeypatch.setattr(bench, "measure", lambda scheme, backend, args: {"growth_mb": 8.0, "seconds": 0.5})
    monkeypatch.chdir(tmp_path)
    argv = ["bench/fused_bias.py", "--size", "32", "--schemes", "alibi2d", "--results", str(tmp_path / "published")]
    monkeypatch.setattr("sys.argv", argv)
    with published_untouched():
        bench.main()
    out = tmp_path / "runs" / "bench" / "fused_bias"
    assert sorted(p.name for p in out.iterdir()) == ["fused_bias.csv", "fused_bias.md"]
    for name in ("fused_bias.md", "fused_bias.csv"):
        assert (tmp_path / "published" / name).read_bytes() == (out / name).read_bytes()
    assert "alibi2d,8,8,1.00,0.5,0.5,1.00" in (out / "fused_bias.csv").read_text()
