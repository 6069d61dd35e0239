"""``rxcoord demo`` against a PostgreSQL that refuses the connection: one line, exit 2.

Here, beside the lease fixtures, so the throwaway PostgreSQL server the lease suite starts is
the one refusing (a wrong role, a missing database): the check runs in every CI run.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import pytest
from cli_support import assert_one_line_error, rxcoord_cli


@pytest.mark.backend
@pytest.mark.parametrize("what", ["wrong role", "missing database"])
def test_postgres_refusing_the_connection_is_one_line(what: str, postgres_url: str) -> None:
    parts = urlsplit(postgres_url)
    host = parts.netloc.rsplit("@", 1)[-1]
    if what == "wrong role":
        url = urlunsplit(parts._replace(netloc=f"rxcoord_no_such_role@{host}"))
    else:
        url = urlunsplit(parts._replace(path="/rxcoord_no_such_database"))
    line = assert_one_line_error(rxcoord_cli("demo", "--json", "--url", url))
    assert "lease store" in line
