"""bench/gpu_checks.py runs on CPU as a dry run, writes its table, and its checks fail when bf16 and fp32 disagree."""

import csv

import pytest

from .scripts import load_script
from .test_bench_results import published_untouched


@pytest.fixture(scope="module")
def checks():
    return load_script("bench/gpu_checks.py")


def test_dry_run_on_cpu(checks):
    passed, detail = checks.check_scheme("rope_axial", "cpu", 32, 0.5, tol=0.05)
    assert passed and "bf16 vs fp32 logits" in detail
    passed, detail = checks.check_irpe_value_term("cpu", 64, tol=0.05)
    assert passed and "at 64 px" in detail
    passed, _ = checks.check_scheme("irpe", "cpu", 32, 0.0, tol=1e-9)  # bf16 is not within 1e-9 of fp32
    assert not passed
    # the memory rows run the forward off CUDA too, with no number to report
    assert checks.forward_memory_mb("visionpe_vit_small_patch16_224", "lookhere", "cpu", 32) is None


def test_refuses_cuda_without_a_device(checks, monkeypatch):
    monkeypatch.setattr(checks.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["gpu_checks.py"])
    with pytest.raises(SystemExit, match="no CUDA device"):
        checks.main()


def test_dry_run_writes_its_table(checks, monkeypatch, tmp_path, capsys):
    """Under runs/bench/gpu_checks of the current folder by default, and the same files in --results."""
    monkeypatch.chdir(tmp_path)
    args = "--device cpu --schemes rope_axial --size 32 --value-size 32 --memory-size 32"
    monkeypatch.setattr("sys.argv", ["bench/gpu_checks.py", *args.split(), "--results", str(tmp_path / "published")])
    with published_untouched(), pytest.raises(SystemExit) as exit_:
        checks.main()
    assert exit_.value.code == 0, capsys.readouterr().out
    out = tmp_path / "runs" / "bench" / "gpu_checks"
    md = (out / "gpu_checks.md").read_text()
    assert md.startswith("Measured ") and f"`python bench/gpu_checks.py {args} --results .../published`" in md
    for name in ("gpu_checks.md", "gpu_checks.csv"):
        assert (tmp_path / "published" / name).read_bytes() == (out / name).read_bytes()
    with open(out / "gpu_checks.csv", newline="") as f:
        table = list(csv.reader(f))
    assert table[0] == ["check", "result", "detail", "peak MB", "ratio to timm"]
    assert [row[:2] for row in table[1:]] == [
        ["rope_axial", "ok"],
        ["rope_axial + patch dropout 0.5", "ok"],
        ["irpe value term (bf16 model)", "ok"],
        ["peak memory: timm vit_small_patch16_224", "n/a"],  # CUDA only
        ["peak memory: rope_axial", "n/a"],
    ]
