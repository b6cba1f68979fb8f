"""What the relative bias schemes share: gather_offsets, the per-offset gather every one runs per block; and, for
the distance-penalty schemes (LookHere, 2D ALiBi), the test-time global slope and the precision of their biases."""

import re

import pytest
import torch

from visionpe.bias.alibi2d import Alibi2D
from visionpe.bias.lookhere import LookHere
from visionpe.bias.offsets import gather_offsets

PENALTIES = {  # 6 heads of 12 channels, 12 blocks; LH-45 leaves -inf outside each view
    "lookhere": lambda slope: LookHere(72, 6, depth=12, variant="45", global_slope=slope),
    "alibi2d": lambda slope: Alibi2D(72, 6, depth=12, global_slope=slope),
}


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("lead", [(), (3,), (2, 3)])
def test_gather_offsets_equals_indexing(dtype, lead):
    torch.manual_seed(0)
    table = torch.randn(*lead, 11)
    index = torch.randint(0, 11, (4, 7), dtype=dtype)
    out = gather_offsets(table, index)
    assert out.shape == (*lead, 4, 7)
    torch.testing.assert_close(out, table[..., index.long()], rtol=0, atol=0)


def test_gather_offsets_integer_table_and_empty_index():
    table = torch.arange(5, dtype=torch.int32) * 10
    index = torch.tensor([[4, 0], [2, 2]], dtype=torch.int32)
    assert gather_offsets(table, index).tolist() == [[40, 0], [20, 20]]
    assert gather_offsets(table, index[:0]).shape == (0, 2)


def test_gather_offsets_gradient_sums_repeated_offsets():
    # the backward of the gather adds the gradient of every pair that reads an offset (as index_add would)
    table = torch.zeros(2, 4, requires_grad=True)
    index = torch.tensor([[0, 3, 3], [1, 3, 0]])
    gather_offsets(table, index).sum().backward()
    assert table.grad.tolist() == [[2.0, 1.0, 0.0, 3.0]] * 2


def test_gather_offsets_out_of_range_raises():
    with pytest.raises((IndexError, RuntimeError)):
        gather_offsets(torch.zeros(3), torch.tensor([[3]]))


@pytest.mark.parametrize("name", sorted(PENALTIES))
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf"), True, "0.95", None])
def test_global_slope_is_validated_on_assignment(name, value):
    # s_g is set on a built model at test time: a bad value must fail there, not turn the biases into NaN or +inf
    scheme = PENALTIES[name](0.8)
    with pytest.raises(
        (TypeError, ValueError), match=rf"global_slope must be a positive finite number, got .*{re.escape(repr(value))}"
    ):
        scheme.global_slope = value
    assert scheme.global_slope == 0.8
    state, q = scheme.prepare((3, 4), 1), torch.zeros(1, 6, 13, 12)
    before = scheme.attn_bias(q, q, state, 1)
    scheme.global_slope = 0.5
    assert scheme.global_slope == 0.5 and isinstance(scheme.global_slope, float)
    after = scheme.attn_bias(q, q, state, 1)
    finite = torch.isfinite(before)
    assert torch.equal(finite, torch.isfinite(after))  # LookHere's field of view does not depend on s_g
    torch.testing.assert_close(after[finite], before[finite] * 0.5 / 0.8)
    assert "global_slope" not in scheme.state_dict()  # a plain attribute: checkpoints load at any s_g


@pytest.mark.parametrize("name", sorted(PENALTIES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_bias_is_the_fp32_bias_rounded_once(name, dtype):
    # the package's precision rule: slope times distance in fp32, one rounding to the activation dtype at the end
    scheme = PENALTIES[name](0.6)
    for grid, rows in (((5, 7), None), ((5, 7), slice(4, 20)), ((40, 40), slice(700, 760))):  # cached / chunked
        state = scheme.prepare(grid, 1)
        n = state.num_tokens
        num_rows = n if rows is None else rows.stop - rows.start
        k32, q32 = torch.zeros(1, 6, n, 12), torch.zeros(1, 6, num_rows, 12)
        for layer in (0, 3, 11):
            expected = scheme.attn_bias(q32, k32, state, layer, rows).to(dtype)
            bias = scheme.attn_bias(q32.to(dtype), k32.to(dtype), state, layer, rows)
            assert bias.dtype == dtype and torch.equal(bias, expected)
            assert torch.isneginf(bias).any() == (name == "lookhere")


@pytest.mark.parametrize("name", sorted(PENALTIES))
def test_slopes_stay_fp32_in_a_half_precision_model(name):
    # model.to(bfloat16) would round the slopes (e.g. s_l = linspace(1.5, 0.5, 12)) before the fp32 product
    reference, scheme = PENALTIES[name](0.6), PENALTIES[name](0.6).to(torch.bfloat16)
    assert all(buf.dtype == torch.float32 for buf in scheme.buffers())
    state = scheme.prepare((5, 7), 1)
    q = torch.zeros(1, 6, 36, 12)
    for layer in (0, 5):
        expected = reference.attn_bias(q, q, state, layer).to(torch.bfloat16)
        assert torch.equal(scheme.attn_bias(q.bfloat16(), q.bfloat16(), state, layer), expected)
    assert all(buf.dtype == torch.float64 for buf in PENALTIES[name](0.6).double().buffers())


@pytest.mark.parametrize(
    "make",
    [
        *(lambda v=v: LookHere(144, 12, depth=2, variant=v) for v in ("180", "90", "45")),  # 8 directed views each
        lambda: Alibi2D(144, 12, depth=2),
    ],
    ids=["lookhere180", "lookhere90", "lookhere45", "alibi2d"],
)
def test_penalty_bias_depends_only_on_offset(make):
    # translation equivariance of the model path (attn_bias over a whole non-square grid), every head
    scheme = make()
    q = torch.zeros(1, 12, 30, 12)
    bias = scheme.attn_bias(q, q, scheme.prepare((5, 6), 0), 1)[0].reshape(12, 5, 6, 5, 6)
    torch.testing.assert_close(bias[:, 1:, 1:, 1:, 1:], bias[:, :-1, :-1, :-1, :-1])
    torch.testing.assert_close(bias[:, 2:, :-1, 2:, :-1], bias[:, :-2, 1:, :-2, 1:])
    assert torch.isfinite(bias[8:]).all()  # undirected (LookHere) and ALiBi heads see every key
