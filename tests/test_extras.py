"""The core needs torch and timm only: ``import visionpe`` imports no optional dependency, and the modules that need
one fail on import with an ImportError that says how to install the extra from a clone (``pip install -e ".[x]"``:
visionpe is not on PyPI).

Each check runs in a fresh interpreter; "missing" extras are simulated by an import hook that refuses their modules.
"""

import builtins
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
    "diffusers",
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


def test_import_visionpe_makes_every_name_of_all_available():
    # a plain `import visionpe` gives every subpackage __all__ lists, e.g. visionpe.multimodal.get_position_ids (a
    # fresh interpreter: in this one another test may have imported them already), with no extra installed
    result = run_python(
        """
        import visionpe

        missing = [name for name in visionpe.__all__ if not hasattr(visionpe, name)]
        assert not missing, missing
        import torch

        # text, a 2x2 image, text: the image's rows (t, h, w) start after the text, the text continues after it
        types = torch.tensor([[0, 1, 1, 1, 1, 0]])
        ids, _ = visionpe.multimodal.get_position_ids("mrope", types, torch.tensor([[1, 2, 2]]), spatial_merge_size=1)
        print(ids[:, 0].tolist())
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[[0, 1, 1, 1, 1, 3], [0, 1, 1, 2, 2, 3], [0, 1, 2, 1, 2, 3]]"


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
        ("visionpe.integrations.diffusers", "diffusion"),
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
    assert f'"{extra}" extra' in result.stdout and f'pip install -e ".[{extra}]"' in result.stdout, result.stdout


def test_plots_without_matplotlib_say_how_to_install_it(monkeypatch):
    # the training extra is installed here; matplotlib alone goes missing (its import is deferred to the first plot)
    from visionpe.training import evaluate

    real_import = builtins.__import__

    def without_matplotlib(name, *args, **kwargs):
        if name.partition(".")[0] == "matplotlib":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_matplotlib)
    with pytest.raises(ImportError, match=r'"train" extra; from a clone of visionpe: pip install -e "\.\[train\]"'):
        evaluate._matplotlib()
