"""petctl: elastic PyTorch training on AWS."""

__version__ = "0.1.0"
