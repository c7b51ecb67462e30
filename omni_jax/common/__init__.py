"""The ground floor every package may import: config validation, registries, optional peers,
progress lines, metrics records and figures, TensorBoard events, timing. Imports nothing else
of omni_jax."""
