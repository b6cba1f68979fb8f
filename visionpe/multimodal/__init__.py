"""Multimodal (VLM) position ids and rotary frequency allocation."""
