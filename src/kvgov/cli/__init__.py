"""The ``kvgov`` command line: a thin layer over the same services the REST API uses."""
