import pytest

import visionpe


def test_core_schemes_listed_by_kind():
    assert {"none", "learned", "sincos"} <= set(visionpe.list_schemes("absolute"))
    assert {"rope_axial", "rope_mixed"} <= set(visionpe.list_schemes("rotary"))


def test_unknown_scheme_lists_valid_names():
    with pytest.raises(ValueError, match="unknown position scheme 'bogus'.*rope_axial"):
        visionpe.create_pos_embed("bogus", dim=64, num_heads=2)


def test_unknown_option_and_bad_dims():
    with pytest.raises(ValueError, match="unknown option"):
        visionpe.create_pos_embed("rope_axial", dim=64, num_heads=2, temprature=10)
    with pytest.raises(ValueError, match="divisible by num_heads"):
        visionpe.create_pos_embed("rope_axial", dim=64, num_heads=3)
    with pytest.raises(TypeError, match=r"dim must be a positive int, got str \('64'\)"):
        visionpe.create_pos_embed("rope_axial", dim="64", num_heads=2)
    with pytest.raises(ValueError, match="depth must be a positive int, got 0"):
        visionpe.create_pos_embed("rope_axial", dim=64, num_heads=2, depth=0)
