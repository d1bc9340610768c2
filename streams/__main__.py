"""``python -m streams`` runs the `streams` command line."""

from .ops.cli import main

main()
