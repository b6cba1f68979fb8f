"""Train or evaluate a video classifier (tubelet ViT, 3D coordinates) with LightningCLI.

    python train/video.py fit --config configs/demo/moving_digits.yaml
    python train/video.py fit --config configs/video/ssv2_small.yaml --data.root /path/to/ssv2_frames

Clips are (B, C, T, H, W); position schemes must support 3D grids (``none``, ``rope_axial``, ``rope_mixed``...).
"""

from experiments.cli import run_cli

if __name__ == "__main__":
    run_cli()
