"""The experiments of ``train/`` (the bundled digits, the sweeps, the VLM benchmark) are not part of the installed
package: their scripts find them on ``sys.path`` as the folder they run from, and so do these tests."""

import sys
from pathlib import Path

TRAIN = str(Path(__file__).resolve().parents[2] / "train")
if TRAIN not in sys.path:
    sys.path.insert(0, TRAIN)
