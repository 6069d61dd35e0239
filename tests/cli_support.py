"""Running the command line in a fresh interpreter, and what its errors must look like."""

from __future__ import annotations

import subprocess
import sys


def rxcoord_cli(
    *args: str, timeout: float = 120, code: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the command line in a fresh interpreter (``code`` runs first, e.g. to hide a module)."""
    command = ["-m", "rxcoord", *args]
    if code is not None:
        command = [
            "-c",
            f"{code}\nimport sys\nfrom rxcoord._cli.main import main\n"
            f"sys.exit(main({list(args)!r}))",
        ]
    return subprocess.run(
        [sys.executable, *command], capture_output=True, text=True, timeout=timeout
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str] | tuple[int, str]) -> str:
    """Exit status 2, exactly one line on stderr, no traceback; returns the line."""
    rc, stderr = (proc.returncode, proc.stderr) if not isinstance(proc, tuple) else proc
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert rc == 2, stderr
    assert "error: " in lines[0]
    return lines[0]
