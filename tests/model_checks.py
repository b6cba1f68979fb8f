"""Checks shared by the scheme tests: a scheme inside the timm model."""

import timm
import torch


def check_forward_backward(name: str, size: tuple[int, int]) -> None:
    """Depth-2 tiny ViT with ``name``: finite outputs and non-zero finite gradients on every position parameter,
    in fp32 and under bf16 autocast at every size."""
    model = timm.create_model(
        "visionpe_vit_tiny_patch16_224", pos_embed=name, depth=2, embed_dim=64, num_heads=2, dynamic_img_size=True
    )
    images = torch.randn(1, 3, *size)
    for autocast in (False, True):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(images)
        assert out.shape == (1, 1000) and torch.isfinite(out).all()
        out.float().sum().backward()
        for pname, param in model.pos_schemes.named_parameters():
            if param.requires_grad:
                assert param.grad is not None and torch.isfinite(param.grad).all(), pname
                assert param.grad.abs().sum() > 0, pname


def random_keep(batch: int = 3, num_patches: int = 15, count: int = 7) -> torch.Tensor:
    """Patch dropout's kept-token indices (batch, 1 + count) into a sequence of one prefix token and
    ``num_patches`` patches: the prefix, then ``count`` patches drawn per sample from the global RNG."""
    rows = [torch.cat((torch.zeros(1), torch.randperm(num_patches)[:count] + 1)) for _ in range(batch)]
    return torch.stack(rows).long()
