"""headscope: find the attention heads a model's retrieval and reasoning causally depend on."""
__version__ = "0.1.0"

from headscope.heads import Head
from headscope.mask import HeadMask, MaskError

__all__ = ["__version__", "Head", "HeadMask", "MaskError"]
