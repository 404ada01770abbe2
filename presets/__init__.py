"""Memory presets shipped with k3 (import name ``k3_presets``): one YAML file each."""
