"""The core needs torch and timm only: ``import visionpe`` imports no optional dependency, and the modules that need
one fail on import with an ImportError that names the extra to install.

Each check runs in a fresh interpreter; "missing" extras are simulated by an import hook that refuses their modules.
"""

import subprocess
import sys
import textwrap

import pytest

EXTRA_MODULES = (
    "lightning",
    "pytorch_lightning",
    "torchmetrics",
    "tensorboard",
    "matplotlib",
    "transformers",
    "open_clip",
)

BLOCK_EXTRAS = f"""
import sys


class BlockExtras:
    \"\"\"Refuses the extras' modules as if they were not installed.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {EXTRA_MODULES!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, BlockExtras())
"""


def run_python(code: str, block: bool = True) -> subprocess.CompletedProcess:
    source = (BLOCK_EXTRAS if block else "") + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=300)


def test_import_visionpe_imports_no_extra():
    result = run_python(
        """
        import sys
        import visionpe

        print(sorted(m for m in sys.modules if m.partition(".")[0] in EXTRAS))
        """.replace("EXTRAS", repr(EXTRA_MODULES)),
        block=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_core_works_without_any_extra():
    result = run_python(
        """
        import timm
        import torch

        import visionpe

        model = timm.create_model("visionpe_vit_small_patch16_224", pos_embed="rope_mixed", num_classes=10)
        assert model(torch.randn(1, 3, 224, 224)).shape == (1, 10)
        assert "rope_mixed" in visionpe.list_schemes()
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize(
    "module, extra",
    [
        ("visionpe.training", "train"),
        ("visionpe.integrations.hf", "vlm"),
        ("visionpe.integrations.open_clip", "clip"),
    ],
)
def test_a_feature_without_its_extra_names_it(module, extra):
    result = run_python(
        f"""
        import visionpe

        try:
            import {module}
        except ImportError as err:
            print(err)
        else:
            print("imported")
        """
    )
    assert result.returncode == 0, result.stderr
    assert f'pip install "visionpe[{extra}]"' in result.stdout, result.stdout
