"""bench/saved_memory.py: the count of memory kept for the backward."""

import torch

from .scripts import load_script

saved_memory = load_script("bench/saved_memory.py")


def test_saved_bytes_counts_each_storage_once():
    x = torch.randn(64, 64, requires_grad=True)
    # x * x saves x twice: one storage; (x * x).exp() saves its own 16 KB output on top
    assert saved_memory.saved_bytes(lambda t: t * t, x) == 64 * 64 * 4
    assert saved_memory.saved_bytes(lambda t: (t * t).exp(), x) == 2 * 64 * 64 * 4
    assert saved_memory.saved_bytes(lambda t: t.detach() + 1, x) == 0
