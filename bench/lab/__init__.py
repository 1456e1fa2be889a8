"""Lab code shared by the scripts in bench/: not part of the splitspec package.

A script run as ``python bench/<script>.py`` has bench/ as ``sys.path[0]``, so it imports ``lab.<module>``; the tests
reach the same modules through pytest's ``pythonpath = ["bench"]`` (pyproject.toml)."""
