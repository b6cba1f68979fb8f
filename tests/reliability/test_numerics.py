"""Numerics: rotary angles are fp32 under fp16/bf16 autocast; rotated q/k in bf16/fp16 stay within a documented
tolerance of fp32 at 1024 x 1024 (a 64 x 64 patch grid) and at multimodal positions up to 1,000,000; no scheme
produces NaN or inf at any supported size.

Tolerances (README "Reliability"), relative to max |q|, measured against the fp32 rotation of the same rounded
input: bf16 2^-6 (measured up to 2^-7 on Cayley-STRING), fp16 2^-9 (measured up to 1.2 * 2^-10). Rounding the
angles themselves to bf16 would give 0.1, and bf16 frequencies 0.02: the tolerance tells them apart.
"""

import math

import pytest
import torch

import visionpe
from visionpe.multimodal import (
    MultimodalRotary,
    apply_multimodal_rotary,
    get_multimodal_scheme,
    get_position_ids,
    list_multimodal_schemes,
)
from visionpe.multimodal.v2pe import V2PE_DELTAS
from visionpe.rotary.functional import apply_rotary, rotary_angles, rotary_tables

from ..conftest import FAMILY_REPRESENTATIVES, VIDEO, takes_option
from .helpers import ALL_SCHEMES, ROTARY, perturb_, position_tables, tiny_vit

GRID_1024 = (64, 64)  # 1024 x 1024 pixels, patch 16
RELATIVE_TOLERANCE = {torch.bfloat16: 2**-6, torch.float16: 2**-9}
LOW_PRECISION = list(RELATIVE_TOLERANCE)
MULTIMODAL = list_multimodal_schemes()


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def _rotary(name, grid=GRID_1024, **kwargs):
    torch.manual_seed(0)
    extra = {} if name == "liere" else {"grid_size": grid}  # LieRE takes no training grid
    return perturb_(visionpe.create_pos_embed(name, dim=128, num_heads=2, depth=2, **extra, **kwargs), scale=0.02)


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ROTARY)
def test_rotary_tables_are_fp32_and_identical_under_autocast(name, dtype):
    scheme = _rotary(name)
    coords = scheme.coords(GRID_1024)
    with torch.no_grad():
        ref = position_tables(scheme, coords, 1, GRID_1024, layer=1)
        with torch.autocast("cpu", dtype=dtype):
            got = position_tables(scheme, coords, 1, GRID_1024, layer=1)
    for table, want in zip(got, ref, strict=True):
        assert table.dtype == torch.float32
        assert torch.equal(table, want)


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ROTARY)
def test_low_precision_rotation_within_tolerance_of_fp32_at_1024px(name, dtype):
    scheme = _rotary(name)
    coords = scheme.coords(GRID_1024)
    qk = torch.randn(2, 1, 2, 1 + 64 * 64, 64).to(dtype)  # q and k of one image, as attention stacks them
    with torch.no_grad():
        ref = scheme.apply(qk.float(), scheme.prepare(coords, 1, grid_size=GRID_1024), 1)
        with torch.autocast("cpu", dtype=dtype):
            out = scheme.apply(qk, scheme.prepare(coords, 1, grid_size=GRID_1024), 1)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert _relative_error(out, ref) <= RELATIVE_TOLERANCE[dtype]


def test_tolerance_rejects_bf16_angles_and_bf16_frequencies():
    """The control: the mistakes the fp32 rule prevents exceed the bf16 tolerance."""
    scheme = visionpe.create_pos_embed("rope_axial", dim=128, num_heads=2)
    coords, freqs = scheme.coords(GRID_1024), scheme.frequencies()[0]
    x = torch.randn(2, 2, 64 * 64, 64).bfloat16()
    ref = apply_rotary(x.float(), *rotary_tables(rotary_angles(coords, freqs)))
    bf16_angles = rotary_tables(rotary_angles(coords, freqs).bfloat16().float())
    bf16_freqs = rotary_tables(rotary_angles(coords, freqs.bfloat16().float()))
    assert _relative_error(apply_rotary(x, *bf16_angles), ref) > 4 * RELATIVE_TOLERANCE[torch.bfloat16]
    assert _relative_error(apply_rotary(x, *bf16_freqs), ref) > RELATIVE_TOLERANCE[torch.bfloat16]


def test_fixed_frequencies_stay_fp32_in_a_bf16_model():
    """model.to(bfloat16) casts every floating buffer; RoPE-Axial's fixed frequencies (and the multimodal inverse
    frequencies) are rebuilt in fp32, so a bf16 model rotates exactly as bf16 autocast does. Learned frequencies
    (RoPE-Mixed, STRING, LieRE, ComRoPE) are parameters and become bf16 like every other weight."""
    model = tiny_vit("rope_axial")
    scheme = model.pos_schemes["rope_axial"]
    fp32_freqs = scheme.freqs.clone()
    model.to(torch.bfloat16)
    assert scheme.freqs.dtype == torch.float32 and torch.equal(scheme.freqs, fp32_freqs)
    model.to(torch.float64)  # a wider dtype is kept as it is
    assert scheme.freqs.dtype == torch.float64
    rotary = MultimodalRotary.from_scheme("mrope", 128, base=1e6)
    inv_freq = rotary.inv_freq.clone()
    rotary.to(torch.bfloat16)
    assert rotary.inv_freq.dtype == torch.float32 and torch.equal(rotary.inv_freq, inv_freq)


def _no_nan_or_inf(model, size, dtype):
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        tokens = model.forward_features(torch.randn(1, 3, *size))
    return bool(torch.isfinite(tokens).all())


# The whole model at 1024 x 1024 runs one scheme per implementation family (tests/conftest.py): the model around the
# scheme and the family's code (the rotation applied in attention, the bias gathered per query chunk) are the same for
# every scheme of the family. Every other scheme's own numbers (its tables, bias or embedding) are checked at the same
# grids, dtypes and weights without the model around them.
SIZES_1024 = [((1024, 1024), torch.bfloat16), ((1024, 1024), torch.float16)]
SIZES_1024 += [(size, torch.bfloat16) for size in ((16, 1024), (1024, 16), (16, 16))]


@pytest.mark.parametrize("name", FAMILY_REPRESENTATIVES)
def test_no_nan_or_inf_at_supported_sizes(name):
    """One block at 1024 x 1024 under bf16 and fp16 autocast and as a whole-bf16 model, and at the thinnest grids
    (1 x 64, 64 x 1) and a single patch."""
    torch.manual_seed(0)
    model = perturb_(tiny_vit(name, img_size=224, patch_size=16, dynamic_img_size=True)).eval()
    failed = [case for case in SIZES_1024 if not _no_nan_or_inf(model, *case)]
    model.to(torch.bfloat16)
    with torch.no_grad():
        if not torch.isfinite(model.forward_features(torch.randn(1, 3, 1024, 1024, dtype=torch.bfloat16))).all():
            failed.append("bf16 weights")
    assert not failed, f"{name}: NaN or inf at {failed}"


def _position_terms(scheme, grid, dtype, prefix=0, autocast=True):
    """What ``scheme`` (width 64, two heads) contributes at ``grid`` after ``prefix`` prefix tokens, from input in
    ``dtype`` (under autocast to it, or not: a scheme whose weights are in ``dtype``): rotated q and k, the bias (its
    per-offset tables where it gives them: every pair reads one of their entries, tests/bias/test_fused_bias.py; or q
    and k with the bias's channels), or the tokens with the embedding added."""
    n = prefix + math.prod(grid)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=autocast):
        if scheme.kind == "rotary":
            qk = torch.randn(2, 1, 2, n, 32).to(dtype)
            return scheme.apply(qk, scheme.prepare(scheme.coords(grid), prefix, grid_size=grid), 0)
        if scheme.kind == "bias":
            q = torch.randn(1, 2, n, 32).to(dtype)
            tokens = {"tokens": torch.randn(1, n, 64).to(dtype)} if scheme.needs_tokens else {}
            state = scheme.prepare(grid, prefix)
            if scheme.augments_qk:  # the bias as extra q/k channels
                return torch.cat(scheme.augment_qk(q, q, state, 0, **tokens), -1)
            terms = scheme.fused_bias(q, q, state, 0)
            if terms is not None:
                return torch.cat([term.values.flatten() for term in terms])
            return scheme.attn_bias(q, q, state, 0, **tokens)
        return scheme(torch.randn(1, n, 64).to(dtype), grid, prefix)


@pytest.mark.parametrize("name", [n for n in ALL_SCHEMES if n not in FAMILY_REPRESENTATIVES])
def test_no_nan_or_inf_in_the_position_terms_at_supported_sizes(name):
    """The other schemes of each family, without the model: their own terms at the grids of the test above (a
    64 x 64 grid and a class token, 1 x 64, 64 x 1, a single patch) under bf16 and fp16 autocast and in bf16."""
    torch.manual_seed(0)
    extra = {"grid_size": (14, 14)} if takes_option(name, "grid_size") else {}  # the model's grid at 224 px
    scheme = perturb_(visionpe.create_pos_embed(name, dim=64, num_heads=2, depth=1, **extra)).eval()
    grids = [(tuple(n // 16 for n in size), dtype) for size, dtype in SIZES_1024]
    failed = [case for case in grids if not torch.isfinite(_position_terms(scheme, *case, prefix=1)).all()]
    scheme.to(torch.bfloat16)
    if not torch.isfinite(_position_terms(scheme, (64, 64), torch.bfloat16, prefix=1, autocast=False)).all():
        failed.append("bf16 weights")
    assert not failed, f"{name}: NaN or inf at {failed}"


@pytest.mark.parametrize("name", VIDEO)
def test_no_nan_or_inf_on_video_grids(name):
    """3D (t, y, x) grids of a 32-frame clip at 224 px (16 tubelets of 14 x 14) in bf16."""
    torch.manual_seed(0)
    options = {"ndim": 3} if takes_option(name, "ndim") else {}
    scheme = perturb_(visionpe.create_pos_embed(name, dim=64, num_heads=2, depth=1, **options))
    assert torch.isfinite(_position_terms(scheme, (16, 14, 14), torch.bfloat16)).all()


# -- multimodal: positions up to 1,000,000 -------------------------------------------------------------------------

LONG = 1_000_000


def _long_context_ids(scheme, **kwargs):
    """A million text tokens, then a 4 x 6 image and 16 more tokens: the ids of the last 64 tokens."""
    types = torch.zeros(1, LONG + 40, dtype=torch.long)
    types[0, LONG : LONG + 24] = 1
    pos, _ = get_position_ids(scheme, types, torch.tensor([[1, 8, 12]]), **kwargs)
    return pos[:, :, -64:]


def _multimodal_rotary(scheme):
    extra = {"num_kv_heads": 2} if get_multimodal_scheme(scheme).allocation == "head" else {}  # per-head tables
    return MultimodalRotary.from_scheme(scheme, 128, base=1e6, **extra)


@pytest.mark.parametrize("scheme", MULTIMODAL)
def test_multimodal_long_context_in_bf16_within_tolerance_of_fp32(scheme):
    pos = _long_context_ids(scheme)
    assert pos.max() > LONG
    rotary = _multimodal_rotary(scheme)
    cos, sin = rotary(pos)
    for dtype in LOW_PRECISION:
        with torch.autocast("cpu", dtype=dtype):
            low_cos, low_sin = rotary(pos)
        assert low_cos.dtype == torch.float32 and torch.equal(low_cos, cos) and torch.equal(low_sin, sin)
        q, k = torch.randn(1, 4, 64, 128).to(dtype), torch.randn(1, 2, 64, 128).to(dtype)
        ref_q, ref_k = apply_multimodal_rotary(q.float(), k.float(), cos, sin)
        with torch.autocast("cpu", dtype=dtype):
            out_q, out_k = apply_multimodal_rotary(q, k, low_cos, low_sin)
        assert out_q.dtype == dtype and torch.isfinite(out_q).all() and torch.isfinite(out_k).all()
        assert _relative_error(out_q, ref_q) <= RELATIVE_TOLERANCE[dtype]
        assert _relative_error(out_k, ref_k) <= RELATIVE_TOLERANCE[dtype]


def test_fp32_angles_at_one_million_are_within_0_1_rad_of_exact():
    """fp32 angles (the transformers expression, bit for bit) carry an absolute error that grows with position:
    at 1e6 it is 0.06 rad on the fastest pairs. Documented, not improved on, for integer ids (float64 ids, from the
    fractional designs, get fp64 angles: see the V2PE test below)."""
    pos = _long_context_ids("mrope")
    rotary = _multimodal_rotary("mrope")
    exact = pos.double().permute(1, 2, 0) @ rotary.mix.double().T  # (B, L, pairs) positions per pair
    exact = exact * (1.0 / (1e6 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128)))
    error = (rotary.angles(pos).double() - exact).abs().max().item()
    assert 0.01 < error < 0.1


def test_v2pe_steps_survive_one_million_in_fp64_down_to_one_256th():
    """V2PE's fractional ids are float64 end to end (fp32 would merge its steps above 2^16): at 1e6 every delta
    down to the 1/256 of training gives strictly increasing visual ids (in fp32 steps below ulp(1e6) = 1/16
    collapse), each token gets its own rotation, and the angles, taken in fp64, equal a float64 reference after the
    cast to fp32."""
    rotary = _multimodal_rotary("v2pe")
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    for delta in V2PE_DELTAS:
        pos = _long_context_ids("v2pe", delta=delta)
        assert pos.dtype == torch.float64
        visual = pos[0, 0, 24:48]  # the 24 image tokens, after the text ending at LONG - 1
        assert visual.min() > LONG - 1
        assert (visual[1:] > visual[:-1]).all(), delta
        assert torch.equal(visual[1:] - visual[:-1], torch.full((23,), delta, dtype=torch.float64)), delta
        cos, sin = rotary(pos)
        assert cos.dtype == sin.dtype == torch.float32
        assert (cos[0, 25:48] != cos[0, 24:47]).any(-1).all(), delta  # every token gets its own rotation
        exact = (pos.permute(1, 2, 0) @ rotary.mix.double().T) * inv_freq  # (B, L, pairs), fp64 throughout
        angles = rotary.angles(pos)
        assert angles.dtype == torch.float64
        torch.testing.assert_close(angles, exact, rtol=0, atol=1e-9)
        exact = torch.cat((exact, exact), dim=-1)
        torch.testing.assert_close(cos, exact.cos().float(), rtol=0, atol=1e-6)
        torch.testing.assert_close(sin, exact.sin().float(), rtol=0, atol=1e-6)
    # fp32 would have merged them: 1/256 is below ulp(1e6) = 1/16
    visual = _long_context_ids("v2pe", delta=1 / 256)[0, 0, 24:48].float()
    assert not (visual[1:] > visual[:-1]).all()
    types = torch.tensor([[0] * 2**15 + [1] * 24 + [0]])
    pos, delta = get_position_ids("v2pe", types, torch.tensor([[1, 8, 12]]), delta=1 / 256)
    assert pos.dtype == delta.dtype == torch.float64
    visual = pos[0, 0, 2**15 : 2**15 + 24]
    assert (visual[1:] > visual[:-1]).all()


def test_integer_designs_keep_int64_ids_and_fp32_angles():
    pos = _long_context_ids("mrope")
    assert pos.dtype == torch.long
    assert _multimodal_rotary("mrope").angles(pos).dtype == torch.float32
