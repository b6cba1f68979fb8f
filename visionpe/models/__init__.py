"""The timm ViT with pluggable position encodings, and state-dict conversion."""
