"""``python -m kvgov``: the same entry point as the ``kvgov`` console script."""

from kvgov.cli.main import main

if __name__ == "__main__":
    main()
