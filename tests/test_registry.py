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
    with pytest.raises(TypeError, match="dim must be an int"):
        visionpe.create_pos_embed("rope_axial", dim="64", num_heads=2)
