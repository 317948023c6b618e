"""`python -m launcher` is the `launch` console script."""

from launcher.cli.main import main

main()
