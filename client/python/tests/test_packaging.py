"""`pip install ./client/python` works: the package builds into a wheel with the pinned setuptools
of the test venv (offline: no build isolation, no index), installs into a directory of its own,
and that copy, alone on the path, finds libkvc and works. Built from a copy of the sources so the
tree is left as it was."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

from conftest import DEADLINE_S

SRC = os.path.join(os.path.dirname(__file__), "..")
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]


def test_the_package_builds_a_wheel_and_installs_offline(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(SRC, src, ignore=shutil.ignore_patterns("tests", "build", "*.egg-info", "__pycache__"))
    wheels = tmp_path / "wheels"
    subprocess.run(PIP + ["wheel", "--no-build-isolation", "--no-deps", "--no-index", "-q", "-w", str(wheels), str(src)],
                   check=True, timeout=120)
    (whl,) = wheels.iterdir()
    assert whl.name.startswith("kvcd-0.3.0-py3-none-any")
    names = set(zipfile.ZipFile(whl).namelist())
    for f in ("__init__.py", "_lib.py", "client.py", "errors.py", "admin.py", "py.typed"):
        assert f"kvcd/{f}" in names
    site = tmp_path / "site"
    subprocess.run(PIP + ["install", "--no-deps", "--no-index", "-q", "--target", str(site), str(whl)], check=True,
                   timeout=120)
    code = ("import kvcd, numpy as np; print(kvcd.__file__); "
            "print(kvcd.summarize(np.array([0.0, 5.0, 1.0], np.float32)).top1)")
    env = dict(os.environ, PYTHONPATH=str(site))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=DEADLINE_S)
    assert p.returncode == 0, p.stderr
    where, top1 = p.stdout.split()
    assert where.startswith(str(site)) and top1 == "1"
