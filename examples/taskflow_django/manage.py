"""TaskFlow's ``manage.py`` (``DJANGO_SETTINGS_MODULE=taskflow_django.settings``)."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "taskflow_django.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
