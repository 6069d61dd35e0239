"""Lease store backends: each implements the three atomic primitives of ``LeaseProvider``."""
