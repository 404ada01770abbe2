"""Built-in storage backends (import name ``k3_storage``): mmap, direct, unbuffered."""
