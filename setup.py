"""Packages found, not listed: each top folder maps into the one `lmcockpit` import package
(core/ → lmcockpit.core, tui/ → lmcockpit.tui, ...), and every package under it comes along, so a
wheel cannot lack a module that the tree has. Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

ROOTS = {"lmcockpit": "lmcockpit", "lmcockpit.core": "core", "lmcockpit.tui": "tui", "lmcockpit.presets": "presets"}

setup(
    package_dir=ROOTS,
    packages=[f"{name}.{sub}" if sub else name
              for name, folder in ROOTS.items() for sub in ("", *find_packages(folder))],
)
