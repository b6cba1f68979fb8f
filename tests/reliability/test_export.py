"""torch.export and ONNX export of a visionpe ViT at a fixed image size (dynamic batch): the exported program, and
for ONNX onnxruntime, reproduce eager PyTorch."""

import io

import pytest
import torch

import visionpe
from visionpe.rotary import expm

from ..conftest import BIAS, FAMILY_REPRESENTATIVES, ONNX_FAILS
from .helpers import ALL_SCHEMES, LIE, perturb_, tiny_vit


def _model(pos_embed):
    torch.manual_seed(0)
    return perturb_(tiny_vit(pos_embed)).eval()


def _batch_dim():
    return {"x": {0: torch.export.Dim("batch", min=1, max=64)}}


def _check_batches(program, model):
    """The exported ``program`` reproduces eager ``model`` at batch sizes 1, 2 and 5 (one dynamic batch axis)."""
    for batch in (1, 2, 5):
        images = torch.randn(batch, 3, 32, 32)
        torch.testing.assert_close(program.module()(images), model(images), rtol=1e-5, atol=1e-5)


# LieRE and ComRoPE are exported once, by test_exported_lie_exponentials_follow_the_weights below, which checks the
# same batch sizes before it changes the weights (their export takes 20-80 s a scheme on one core)
@pytest.mark.parametrize("name", [n for n in ALL_SCHEMES if n not in LIE])
def test_torch_export_matches_eager(name):
    model = _model(name)
    _check_batches(torch.export.export(model, (torch.randn(2, 3, 32, 32),), dynamic_shapes=_batch_dim()), model)


def test_exported_program_saves_and_loads():
    """A .pt2 archive runs elsewhere without visionpe's Python code paths: same logits after a save/load."""
    model = _model(["learned", "rope_mixed", "irpe"])
    images = torch.randn(3, 3, 32, 32)
    buffer = io.BytesIO()
    torch.export.save(torch.export.export(model, (images,), dynamic_shapes=_batch_dim()), buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer).module()
    torch.testing.assert_close(loaded(images), model(images), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loaded(images[:1]), model(images[:1]), rtol=1e-5, atol=1e-5)


def _onnx_logits(model, images_list):
    ort = pytest.importorskip("onnxruntime")
    program = torch.onnx.export(model, (images_list[0],), dynamo=True, dynamic_shapes=_batch_dim(), verbose=False)
    runner = ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    name = runner.get_inputs()[0].name
    return [torch.from_numpy(runner.run(None, {name: images.numpy()})[0]) for images in images_list]


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(reason=ONNX_FAILS[n], strict=True)) if n in ONNX_FAILS else n
        for n in sorted({*FAMILY_REPRESENTATIVES, *(n for n in ONNX_FAILS if n not in BIAS)})
    ],
)
def test_onnx_export_runs_in_onnxruntime(name):
    """The rotary apply takes its real cos/sin form under ONNX export (no complex ops); batch is a dynamic axis.

    One scheme per implementation family (``FAMILY_REPRESENTATIVES``: the export path is the family's code), and the
    rotary schemes known to fail for reasons of their own; expected failures are strict xfails, so that a fix shows.
    torch.export above runs every scheme."""
    model = _model(name)
    images = [torch.randn(2, 3, 32, 32), torch.randn(1, 3, 32, 32), torch.randn(4, 3, 32, 32)]
    for got, x in zip(_onnx_logits(model, images), images, strict=True):
        torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-5)


def test_onnx_export_of_folded_cayley_string():
    """The export-friendly path for Cayley-STRING: fold P into the q/k projections, then export plain RoPE."""
    model = visionpe.fold_string_(_model("string_cayley"))
    images = [torch.randn(2, 3, 32, 32), torch.randn(3, 3, 32, 32)]
    for got, x in zip(_onnx_logits(model, images), images, strict=True):
        torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", LIE)
def test_exported_lie_exponentials_follow_the_weights(name, monkeypatch):
    """The squaring count of the exponentials depends on the generators: the exported graph computes it when it
    runs (one torch.cond per possible squaring), so larger generators loaded after export still match eager. The
    export has a dynamic batch axis and first reproduces eager at every batch size, as test_torch_export_matches_eager
    checks for the other schemes."""
    counts, eager_count = [], expm._eager_squaring_count

    def count(norm2):
        counts.append(eager_count(norm2))
        return counts[-1]

    monkeypatch.setattr(expm, "_eager_squaring_count", count)
    model = _model(name)
    images = torch.randn(2, 3, 32, 32)
    program = torch.export.export(model, (images,), dynamic_shapes=_batch_dim())
    _check_batches(program, model)
    exported = program.module()
    for scale in (1.0, 6.0):
        with torch.no_grad():
            for holder in (model, exported):
                for key, param in holder.named_parameters():
                    if key.startswith(f"pos_schemes.{name}.") and scale != 1.0:
                        param.mul_(scale)
        counts.clear()
        torch.testing.assert_close(exported(images), model(images), rtol=1e-4, atol=1e-5)
        if scale == 1.0:
            small = max(counts)
    assert max(counts) > small, f"scaling the generators did not change the squaring count: {small} -> {counts}"
