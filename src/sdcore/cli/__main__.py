"""``python -m sdcore.cli``: the same as the ``sdcore`` console script."""

from sdcore.cli import run

if __name__ == "__main__":
    run()
