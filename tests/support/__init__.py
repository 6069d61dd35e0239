"""Test helpers shared by the suites (import as ``from support.rates import ...``)."""
