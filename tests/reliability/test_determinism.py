"""Determinism on CPU: the same seed gives bit-identical weights after a few training steps, for every scheme.

(Resuming a Lightning run from a checkpoint, and DDP, are tested in tests/training/test_cli.py.)
"""

import pytest
import torch

from .helpers import ALL_SCHEMES, tiny_vit


def _train(name: str, seed: int, steps: int = 3, deterministic: bool = False, autocast: bool = False) -> dict:
    """A one-block ViT with dropout, drop path and a register token, AdamW on random data; its final weights. The
    patch tokens are pooled: a bias scheme's cls row is zero, so in one block only they carry its gradient."""
    torch.manual_seed(seed)
    model = tiny_vit(
        name, drop_rate=0.1, drop_path_rate=0.1, reg_tokens=1, dynamic_img_size=True, global_pool="avg"
    ).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(seed)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        for step in range(steps):
            size = (32, 48) if step % 2 else (32, 32)  # non-square and a second grid: tables are rebuilt
            images = torch.randn(4, 3, *size, generator=data)
            labels = torch.randint(0, 3, (4,), generator=data)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = torch.nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.use_deterministic_algorithms(previous)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _init(name: str, seed: int) -> dict:
    torch.manual_seed(seed)
    model = tiny_vit(name, drop_rate=0.1, drop_path_rate=0.1, reg_tokens=1, dynamic_img_size=True, global_pool="avg")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _differs(a: dict, b: dict) -> list[str]:
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("name", ALL_SCHEMES)
def test_same_seed_same_weights(name):
    first = _train(name, seed=1)
    # torch's deterministic mode changes nothing on CPU: the default kernels already are deterministic
    assert not _differs(first, _train(name, seed=1, deterministic=True))
    other = _train(name, seed=2)
    assert _differs(first, other), "different seeds gave identical weights: the test would not notice anything"
    # and training really ran: every position parameter moved away from its init
    moved = [k for k in _differs(_init(name, seed=1), first) if k.startswith("pos_schemes.")]
    model = tiny_vit(name)
    trainable = [k for k, p in model.named_parameters() if k.startswith("pos_schemes.")]
    buffers = {k for k, _ in model.named_buffers()}  # running statistics (LOOPE's batch norm) move too
    assert set(trainable) <= set(moved) and set(moved) - set(trainable) <= buffers


@pytest.mark.parametrize("name", ALL_SCHEMES)
def test_same_seed_same_weights_under_bf16_autocast(name):
    assert not _differs(_train(name, seed=3, autocast=True), _train(name, seed=3, autocast=True))
