"""The typed interfaces between attention and the schemes that act inside it: what a forward's position state gives
each block. Attention talks to schemes through these only; scheme folders implement them."""

from .bias import BiasState, LayerBias, SchemeBias

__all__ = ["BiasState", "LayerBias", "SchemeBias"]
