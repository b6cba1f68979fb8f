"""Integrations at the edge: timm model registration (and Hugging Face, open_clip)."""
