"""TaskFlow: the sdcore reference service (tasks, status notifications, a nightly job).

Start with :func:`taskflow.app.create_app` and :class:`taskflow.settings.Settings`. This package
imports nothing heavy on purpose, so that ``python -m taskflow.token`` stays instant.
"""
