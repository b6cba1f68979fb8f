"""gather_offsets: the per-offset gather every relative bias scheme runs per block."""

import pytest
import torch

from visionpe.bias.offsets import gather_offsets


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
