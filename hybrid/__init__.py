"""hybrid: head-level full-attention / Gated DeltaNet hybrids built from a head mask."""
__all__: list[str] = []
