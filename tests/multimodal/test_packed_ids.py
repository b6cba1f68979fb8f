"""Packed rows: ``get_position_ids(..., cu_seqlens=...)`` gives every sample its stand-alone ids."""

import pytest
import torch

from visionpe.multimodal import get_position_ids, list_multimodal_schemes

from .helpers import NEEDS_TIME, max_videos

SCHEME_NAMES = list_multimodal_schemes()
# T T <vs> | 2x3 image | <ve> T, always the last sample, so that a visual block sits at a non-zero packed offset
IMAGE_SAMPLE = (torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0]]), torch.tensor([[1, 4, 6]]), None)


def _random_sample(gen, max_images=2, max_videos=1, merge=2):
    """One sample (types (1, L), image grid, video grid): text runs around visual blocks in random order."""

    def randint(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    kinds = [1] * randint(0, max_images) + [2] * randint(0, max_videos)
    row, grids = [0] * randint(1, 5), {1: [], 2: []}
    for idx in torch.randperm(len(kinds), generator=gen).tolist():
        kind = kinds[idx]
        thw = (1 if kind == 1 else randint(1, 3), randint(1, 3) * merge, randint(1, 3) * merge)
        grids[kind].append(thw)
        row += [kind] * (thw[0] * (thw[1] // merge) * (thw[2] // merge)) + [0] * randint(1, 5)
    image, video = (torch.tensor(grids[k], dtype=torch.long) if grids[k] else None for k in (1, 2))
    return torch.tensor([row]), image, video


def _samples(seed, count=4, videos=True):
    """``count`` samples (types (1, L_s), image grid, video grid): random ones (the second text only), then
    ``IMAGE_SAMPLE``."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for s in range(count - 1):
        max_images = 0 if s == 1 else 2
        max_videos = 0 if s == 1 or not videos else 1
        types, image, video = _random_sample(gen, max_images=max_images, max_videos=max_videos)
        samples.append((types, image, video))
    return samples + [IMAGE_SAMPLE]


def _cat_grids(grids):
    grids = [g for g in grids if g is not None]
    return torch.cat(grids) if grids else None


def _pack(samples):
    types = torch.cat([s[0] for s in samples], 1)
    lengths = torch.tensor([s[0].shape[1] for s in samples])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return types, _cat_grids([s[1] for s in samples]), _cat_grids([s[2] for s in samples]), cu


def _time_options(scheme, samples):
    """second_per_grid_ts for the packed row and per sample (one value per video, in order)."""
    if scheme not in NEEDS_TIME:
        return {}, [{} for _ in samples]
    per_sample, values = [], []
    for _, _, video in samples:
        count = 0 if video is None else len(video)
        seconds = [0.5 + 0.5 * (len(values) + k) for k in range(count)]
        values += seconds
        per_sample.append({"second_per_grid_ts": torch.tensor(seconds, dtype=torch.float64)} if count else {})
    return {"second_per_grid_ts": torch.tensor(values, dtype=torch.float64)}, per_sample


@pytest.mark.parametrize("scheme", SCHEME_NAMES)
def test_packed_rows_equal_each_sample_alone(scheme):
    samples = _samples(seed=len(scheme), videos=max_videos(scheme) > 0)
    types, image, video, cu = _pack(samples)
    packed_options, sample_options = _time_options(scheme, samples)
    pos, delta = get_position_ids(scheme, types, image, video, cu_seqlens=cu, **packed_options)
    assert pos.shape == (4, 1, types.shape[1]) and delta.shape == (len(samples), 1)
    restart = [k for sample_types, _, _ in samples for k in range(sample_types.shape[1])]
    assert pos[0, 0].tolist() == restart
    for s, ((sample_types, sample_image, sample_video), options) in enumerate(
        zip(samples, sample_options, strict=True)
    ):
        alone, alone_delta = get_position_ids(scheme, sample_types, sample_image, sample_video, **options)
        assert pos.dtype == alone.dtype
        assert torch.equal(pos[1:, :, cu[s] : cu[s + 1]], alone)
        assert torch.equal(delta[s], alone_delta[0])


def test_single_sample_is_the_unpacked_row_plus_an_arange():
    types, image, video = _random_sample(torch.Generator().manual_seed(3))
    pos, delta = get_position_ids("videorope", types, image, video, cu_seqlens=torch.tensor([0, types.shape[1]]))
    ref, ref_delta = get_position_ids("videorope", types, image, video)
    assert torch.equal(pos[1:], ref) and torch.equal(delta, ref_delta)
    assert pos[0, 0].tolist() == list(range(types.shape[1]))


def test_fractional_schemes_keep_an_integral_restarting_row_zero():
    samples = _samples(seed=5, count=3, videos=False)
    types, image, _, cu = _pack(samples)
    pos, _ = get_position_ids("v2pe", types, image, cu_seqlens=cu.int(), delta=1 / 256)
    assert pos.dtype == torch.float64
    assert torch.equal(pos[0, 0], torch.cat([torch.arange(s[0].shape[1]) for s in samples]).double())
    assert not torch.equal(pos[1, 0], pos[1, 0].round())  # the visual rows are fractional


def test_per_sample_options_take_one_value_per_sample():
    samples = _samples(seed=7, count=3, videos=False)
    types, image, _, cu = _pack(samples)
    deltas = [0.5, 0.25, 1 / 16]
    pos, _ = get_position_ids("v2pe", types, image, cu_seqlens=cu, delta=torch.tensor(deltas))
    per_block = torch.tensor([[d, d / 2] for d in deltas])  # (S, K): one per visual block of each sample
    pos_k, _ = get_position_ids("v2pe", types, image, cu_seqlens=cu, delta=per_block)
    for s, (sample_types, sample_image, _) in enumerate(samples):
        alone, _ = get_position_ids("v2pe", sample_types, sample_image, delta=deltas[s])
        assert torch.equal(pos[1:, :, cu[s] : cu[s + 1]], alone)
        alone_k, _ = get_position_ids("v2pe", sample_types, sample_image, delta=per_block[s : s + 1])
        assert torch.equal(pos_k[1:, :, cu[s] : cu[s + 1]], alone_k)


def test_per_token_options_are_read_at_the_packed_positions():
    """PPE's clusters (with K = 2 representatives: 6 rows) and BiPE's input_ids are (1, L) tensors of the packed row."""
    samples = _samples(seed=11, count=3, videos=False)
    types, image, _, cu = _pack(samples)
    gen = torch.Generator().manual_seed(0)
    clusters = torch.randint(0, 3, types.shape, generator=gen)
    input_ids = torch.randint(0, 6, types.shape, generator=gen)  # separators 3 and 4 below
    pos_ppe, _ = get_position_ids("ppe", types, image, cu_seqlens=cu, clusters=clusters, num_representatives=2)
    pos_bipe, _ = get_position_ids("bipe", types, image, cu_seqlens=cu, input_ids=input_ids, separator_ids=(3, 4))
    assert pos_ppe.shape == (7, 1, types.shape[1])
    for s, (sample_types, sample_image, _) in enumerate(samples):
        part = slice(int(cu[s]), int(cu[s + 1]))
        alone, _ = get_position_ids(
            "ppe", sample_types, sample_image, clusters=clusters[:, part], num_representatives=2
        )
        assert torch.equal(pos_ppe[1:, :, part], alone)
        alone, _ = get_position_ids(
            "bipe", sample_types, sample_image, input_ids=input_ids[:, part], separator_ids=(3, 4)
        )
        assert torch.equal(pos_bipe[1:, :, part], alone)


BAD_CU_SEQLENS = [
    ([0, 4, 10], "list"),  # not a tensor
    (torch.tensor([0.0, 4.0, 10.0]), "float"),
    (torch.tensor([True, True]), "bool"),
    (torch.tensor([[0, 4, 10]]), "2-D"),
    (torch.tensor([0]), "one entry"),
    (torch.tensor([1, 4, 10]), "start"),
    (torch.tensor([0, 4, 4, 10]), "empty sample"),
    (torch.tensor([0, 6, 4, 10]), "decreasing"),
    (torch.tensor([0, 4, 9]), "short"),
    (torch.tensor([0, 4, 11]), "long"),
]


@pytest.mark.parametrize("cu_seqlens", [c for c, _ in BAD_CU_SEQLENS], ids=[i for _, i in BAD_CU_SEQLENS])
def test_bad_cu_seqlens_raise_value_error_naming_it(cu_seqlens):
    types = torch.zeros(1, 10, dtype=torch.long)
    with pytest.raises(ValueError, match="cu_seqlens"):
        get_position_ids("mrope", types, cu_seqlens=cu_seqlens)


def test_other_packed_input_errors():
    types = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0]])
    grid = torch.tensor([[1, 4, 4]])
    with pytest.raises(ValueError, match="straddl|consecutive|sample 1"):  # the image crosses the boundary at 4
        get_position_ids("mrope", types, grid, cu_seqlens=torch.tensor([0, 4, 8]))
    with pytest.raises(ValueError, match=r"\(1, L\)"):
        get_position_ids("mrope", types.expand(2, -1), grid, cu_seqlens=torch.tensor([0, 8]))
    mask = torch.ones_like(types).index_fill(1, torch.tensor([7]), 0)
    with pytest.raises(ValueError, match="attention_mask"):
        get_position_ids("mrope", types, grid, attention_mask=mask, cu_seqlens=torch.tensor([0, 2, 8]))
    ok, _ = get_position_ids(
        "mrope", types, grid, attention_mask=torch.ones_like(types), cu_seqlens=torch.tensor([0, 2, 8])
    )
    assert ok[0, 0].tolist() == [0, 1, 0, 1, 2, 3, 4, 5]


def test_transformers_finds_the_samples_from_row_zero_and_not_from_the_time_row():
    masking_utils = pytest.importorskip("transformers.masking_utils")
    samples = _samples(seed=2, count=3, videos=False)
    types, image, _, cu = _pack(samples)
    pos, _ = get_position_ids("mrope", types, image, cu_seqlens=cu)
    sample_of = torch.repeat_interleave(torch.arange(3), cu.diff())[None]
    assert torch.equal(masking_utils.find_packed_sequence_indices(pos[0]), sample_of)
    # The time row stays constant across an image: read as text ids, it would cut every image into pieces.
    assert int(masking_utils.find_packed_sequence_indices(pos[1])[0, -1]) > 2
