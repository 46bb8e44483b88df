"""``python -m plancache`` runs the CLI."""

from .cli import main

main()
