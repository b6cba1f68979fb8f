"""bench/fused_bias.py: which schemes it compares, and bad --schemes refused before anything runs."""

import pytest

import visionpe
from visionpe.registry import get_scheme_class

from .scripts import load_script
from .test_bench_results import published_untouched


def test_it_compares_every_bias_scheme_with_per_offset_terms():
    """The bench finds them by building each bias scheme; the classes declare them (FlexAttention in
    ``attention_backends``, which tests/bias/test_fused_bias.py checks against the terms each scheme gives)."""
    bench = load_script("bench/fused_bias.py")
    declared = [n for n in visionpe.list_schemes("bias") if "flex" in get_scheme_class(n).attention_backends]
    assert declared and bench.fusable_schemes() == declared


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
