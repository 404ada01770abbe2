"""k3: runs Kimi K3 from its released checkpoint layout, bit-exactly, at any memory budget."""

__version__ = "0.1.0"
