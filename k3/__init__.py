"""k3: run Kimi K3 from its released checkpoint layout, bit-exactly, at any memory budget.

This package is k3's public Python face. Plugins import from :mod:`k3.plugin` and
:mod:`k3.testing`; everything under ``k3core`` is internal and may move between releases.
"""

from k3core import __version__
from k3core.api.errors import K3Error

__all__ = ["K3Error", "__version__"]
