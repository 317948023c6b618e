"""`python -m launcher` is the `launch` console script."""

from launcher.cli import main

main()
