"""lmcockpit: pretrain language models from scratch from a terminal cockpit."""

__version__ = "0.1.0"
