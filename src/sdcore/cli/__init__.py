"""The ``sdcore`` command line: print or apply the schema, list, release and prune job runs.

``main(argv) -> int`` runs one command in-process and returns its exit status; ``run()`` is the
console-script entry point. See ``docs/cli.md``.
"""

from sdcore.cli._main import main, run

__all__ = ["main", "run"]
