"""The README's Python quickstart runs as written and prints what the README shows."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_readme_quickstart_prints_what_the_readme_shows():
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Python quickstart"):]
    code, shown = re.search(r"```python\n(.*?)```\s*```\n(.*?)```", section, re.S).groups()
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    # trailing spaces of pandas' header row are not the README's to keep
    strip = lambda s: [line.rstrip() for line in s.strip().splitlines()]  # noqa: E731
    assert strip(res.stdout) == strip(shown)
