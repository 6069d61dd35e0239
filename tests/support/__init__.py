"""Test helpers shared by the suite (imported as ``support.*``: ``tests/`` is on the path)."""
