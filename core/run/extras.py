"""The optional packages a run's config asks for, checked before a run folder exists.

A logger whose package is missing would otherwise be found out in the engine, after the data and
the model are ready, and only switched off there: a run the user believes is logged, that is not.
`find_spec` looks for a package without importing it, so the front-end stays light.
"""

from __future__ import annotations

import importlib.util

from ..config import Config, ConfigError

# [logging] key → (the package it imports, the extra that installs it)
LOGGER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


def require_logger_packages(cfg: Config) -> None:
    for key, (package, extra) in LOGGER_PACKAGES.items():
        value = getattr(cfg.logging, key)
        if value and importlib.util.find_spec(package) is None:
            shown, off = ("true", "false") if isinstance(value, bool) else (repr(value), '""')
            raise ConfigError(f"logging.{key} = {shown} needs the {package} package, which is not installed: "
                              f"pip install 'lmcockpit[{extra}]' (or turn it off: logging.{key} = {off})")
