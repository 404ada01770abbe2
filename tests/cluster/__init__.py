"""Expert parallelism on Ray (k3core.cluster)."""
