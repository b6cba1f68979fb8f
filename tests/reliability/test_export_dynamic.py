"""One exported model for every image size: a visionpe ViT built with ``dynamic_img_size=True`` and exported once with
dynamic batch, height and width (multiples of the patch) runs at the export size, a non-square size and twice the
size, matching eager, as a ``torch.export`` program and in onnxruntime.

The sizes are those of a ViT at 224 px (224x224, 320x192, 448x448 with 16 px patches: 14x14, 20x12 and 28x28
patches) scaled down by 4 with 8 px patches: 7x7, 10x6 and 14x14 patches. Average pooling, so that the logits read
every patch token (a depth-1 model pooling the class token would not see the prefix-free biases at all). Exported
and run under ``torch.no_grad()``, as for inference, with attention's bias chunks made small: eager attention then
runs the bias schemes in chunks of query rows at every size, the exported graph in one piece.

One export per scheme serves both tests. onnxruntime runs a subset (see ``ONNX_SCHEMES``): a torch.onnx conversion
costs about as much as the export itself, and the file stays within about a minute on one core. iRPE's ONNX
conversion fails at any size, dynamic or fixed (``tests/conftest.py``'s ``ONNX_FAILS``, a strict xfail in
``test_export.py``); its torch.export program runs at every size here.
"""

import functools

import pytest
import torch

from visionpe.attention import PosAttention
from visionpe.bias.offsets import full_offset_index, offset_state

from .helpers import perturb_, tiny_vit

#: the schemes an exported graph runs at any image size (docs/reliability.md, "Exporting at any image size")
SCHEMES = ["none", "learned", "sincos", "rope_axial", "rope_mixed", "cpe", "alibi2d", "lookhere", "irpe"]
#: onnxruntime runs a subset: the in-graph resampling of a learned table (ONNX Resize, antialiased bicubic), rotary
#: tables of a per-layer frequency matrix (rope_axial builds its tables through the same LinearRotary code), and the
#: offset index of the relative biases with LookHere's views (alibi2d's distance table is LookHere's without them)
ONNX_SCHEMES = ["learned", "rope_mixed", "lookhere"]
PATCH, BASE = 8, 56
SIZES = ((56, 56), (80, 48), (112, 112))  # (H, W): base, non-square, 2x
BATCHES = (2, 1, 3)
#: bytes of one chunk of attention's bias: a few query rows at these sizes, so eager attention runs in chunks
CHUNK_BYTES = 16 * 2**10


@pytest.fixture(scope="module", autouse=True)
def _small_bias_chunks():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PosAttention, "bias_chunk_bytes", CHUNK_BYTES)
        yield


@functools.cache
def _exported(name: str) -> tuple[torch.nn.Module, torch.export.ExportedProgram]:
    """The eager model and its program, exported once at 56x56 with dynamic batch, height and width."""
    torch.manual_seed(0)
    model = tiny_vit(name, img_size=BASE, patch_size=PATCH, dynamic_img_size=True, global_pool="avg")
    model = perturb_(model).eval()
    height, width = torch.export.Dim("height", min=2, max=32), torch.export.Dim("width", min=2, max=32)
    dims = {"x": {0: torch.export.Dim("batch", min=1, max=64), 2: PATCH * height, 3: PATCH * width}}
    with torch.no_grad():
        program = torch.export.export(model, (torch.randn(2, 3, BASE, BASE),), dynamic_shapes=dims)
    return model, program


def _images() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(b, 3, h, w, generator=gen) for b, (h, w) in zip(BATCHES, SIZES, strict=True)]


@pytest.mark.parametrize("name", SCHEMES)
def test_torch_export_runs_at_any_image_size(name):
    model, program = _exported(name)
    exported = program.module()
    with torch.no_grad():
        for images in _images():
            torch.testing.assert_close(exported(images), model(images), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ONNX_SCHEMES)
def test_onnx_runs_at_any_image_size(name):
    """The same program converted to ONNX (``torch.onnx.export`` of the ExportedProgram, dynamo) in onnxruntime."""
    ort = pytest.importorskip("onnxruntime")
    model, program = _exported(name)
    onnx_program = torch.onnx.export(program, dynamo=True, verbose=False)
    runner = ort.InferenceSession(onnx_program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    input_name = runner.get_inputs()[0].name
    with torch.no_grad():
        for images in _images():
            got = torch.from_numpy(runner.run(None, {input_name: images.numpy()})[0])
            torch.testing.assert_close(got, model(images), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("grid", [(3, 5), (1, 4), (6, 2)])
@pytest.mark.parametrize("prefix", [0, 1, 4])
def test_full_offset_index_is_the_eager_index(grid, prefix):
    """The offset index an exported graph builds from symbolic sizes is the eager state's, entry for entry:
    ((y_i - y_j + H - 1)(2W - 1) + x_i - x_j + W - 1 for patch pairs, K = (2H - 1)(2W - 1) for prefix pairs)."""
    height, width = grid
    eager = offset_state(grid, prefix, None, full_state_max_tokens=0)
    every = range(eager.num_tokens)
    index = full_offset_index(grid, prefix)
    assert index.dtype == torch.int32
    torch.testing.assert_close(index, eager.offset_index(every, every), rtol=0, atol=0)
    y, x = torch.arange(height * width) // width, torch.arange(height * width) % width
    naive = (y[:, None] - y[None, :] + height - 1) * (2 * width - 1) + x[:, None] - x[None, :] + width - 1
    assert torch.equal(index[prefix:, prefix:].long(), naive)
    assert (index[:prefix] == (2 * height - 1) * (2 * width - 1)).all()
    assert (index[:, :prefix] == (2 * height - 1) * (2 * width - 1)).all()
