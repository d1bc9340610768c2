"""``python -m streams`` runs the `streams` command line."""

from .cli import main

main()
