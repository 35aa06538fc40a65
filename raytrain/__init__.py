"""raytrain: data-parallel training of PyTorch image classifiers on Ray."""

__version__ = "0.1.0"
