"""Subcommands of the ``kverr`` command, one module each, each with ``register(subparsers)``."""
