"""Shipped presets: one TOML file per GPU class, plus `cpu` (the embedded default) and `debug`."""
