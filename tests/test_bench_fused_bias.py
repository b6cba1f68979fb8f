"""bench/fused_bias.py: which schemes it compares, and bad --schemes refused before anything runs."""

import pytest

from .scripts import load_script


def test_it_compares_every_bias_scheme_with_per_offset_terms():
    bench = load_script("bench/fused_bias.py")
    assert bench.fusable_schemes() == ["alibi2d", "bam", "irpe", "kerple_log", "kerple_power", "lookhere"]


def test_a_scheme_without_per_offset_terms_is_refused(monkeypatch, capsys):
    bench = load_script("bench/fused_bias.py")
    monkeypatch.setattr("sys.argv", ["bench/fused_bias.py", "--schemes", "fire"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "--schemes: ['fire'] give no per-offset terms" in capsys.readouterr().err
