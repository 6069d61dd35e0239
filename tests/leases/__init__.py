"""Tests of rxcoord.leases (a package so helper modules import relatively)."""
