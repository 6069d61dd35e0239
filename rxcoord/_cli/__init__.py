"""The ``rxcoord`` command line (``main``), the demo and its views, and the bench runner.

Nothing here is public API: the console script ``rxcoord`` and ``python -m rxcoord`` call
:func:`rxcoord._cli.main.main`.
"""
