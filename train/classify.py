"""Train or evaluate an image classifier with any visionpe position encoding (LightningCLI).

    python train/classify.py fit --config configs/demo/digits.yaml
    python train/classify.py fit --config configs/imagenet/deit_small.yaml --config configs/imagenet/rope_mixed.yaml \
        --data.root /path/to/imagenet
    python train/classify.py fit --config configs/demo/digits.yaml --ckpt_path runs/.../last.ckpt   # resume

Every option of the model (``--model.pos_embed rope_axial``), the data module and the Trainer is a flag or a YAML
key; ``--print_config`` shows them all.
"""

from experiments.cli import run_cli

if __name__ == "__main__":
    run_cli()
