"""``python -m streams`` runs the `streams` command line."""

from .command import main

main()
