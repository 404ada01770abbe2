"""Built-in expert-cache policies (import name ``k3_caches``)."""
