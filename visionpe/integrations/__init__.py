"""Integrations at the edge: timm model registration (imported by ``import visionpe``), and on request Hugging Face
Qwen-VL models (:mod:`visionpe.integrations.hf`, the ``vlm`` extra) and open_clip towers
(:mod:`visionpe.integrations.open_clip`, the ``clip`` extra)."""
