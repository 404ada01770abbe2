"""One module per ``k3`` subcommand; each exposes ``register(app)``."""
