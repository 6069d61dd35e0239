"""Helpers shared by the test suites (servers, ...); not library code."""
