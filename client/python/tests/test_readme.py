"""The README's Python example, run as written (the block under "## Python") against a real kvcd
that $KVC_SOCKET names, in a fresh interpreter: so its `kvcd.admin.Admin().status()` after a bare
`import kvcd` is the test that the package imports its admin module (issue 30: it raised
AttributeError until `import kvcd.admin`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import DEADLINE_S

README = os.path.join(os.path.dirname(__file__), "..", "..", "..", "README.md")


def readme_example() -> str:
    with open(README) as f:
        text = f.read()
    section = text[text.index("\n## Python\n") :]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, "no python block in the README's Python section"
    return m.group(1)


def test_the_readme_example_runs_as_written(kvcd_daemon):
    code = readme_example()
    assert len([l for l in code.splitlines() if l.strip()]) <= 12
    env = dict(os.environ, KVC_SOCKET=kvcd_daemon.dir)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=DEADLINE_S)
    assert p.returncode == 0, p.stderr
    session, admin = p.stdout.splitlines()
    kept = int(session.split()[0])
    assert 32 <= kept < 64, p.stdout  # the window policy evicted, within its limit
    plans = int(re.search(r"\bplans=(\d+)", p.stdout).group(1))
    peak = int(re.search(r"peak_tokens=(\d+)", p.stdout).group(1))
    assert plans >= 1 and kept <= peak < 64, p.stdout
    assert int(admin.split()[0]) >= 64, p.stdout  # kvcctl status --json saw the session's 64 steps


def test_import_kvcd_is_enough_for_kvcd_admin():
    p = subprocess.run([sys.executable, "-c", "import kvcd; kvcd.admin.Admin"], capture_output=True, text=True,
                       timeout=DEADLINE_S)
    assert p.returncode == 0, p.stderr
