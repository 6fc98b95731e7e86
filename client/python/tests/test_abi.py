"""kvcd/_lib.py's ctypes structures against kvc.h as the C compiler lays them out: every field's
offset and every structure's size. A field added to kvc.h (or moved) without the same change in
_lib.py fails here, not as a corrupted call."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import pytest

from kvcd import _lib

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")
STRUCTS = {
    "kvc_options": _lib.Options,
    "kvc_geometry": _lib.CGeometry,
    "kvc_param": _lib.Param,
    "kvc_session_config": _lib.SessionConfig,
    "kvc_session_stats": _lib.CSessionStats,
    "kvc_handoff": _lib.CHandoff,
    "kvc_layer_view": _lib.CLayerView,
    "kvc_summary": _lib.CSummary,
}


@pytest.mark.skipif(not shutil.which(os.environ.get("CC", "cc")), reason="no C compiler")
def test_the_ctypes_structures_match_kvc_h(tmp_path):
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "kvc.h"', "int main(void) {"]
    for name, cls in STRUCTS.items():
        lines.append(f'printf("{name} %zu\\n", sizeof(struct {name}));')
        for field, _ in cls._fields_:
            lines.append(f'printf("{name}.{field} %zu\\n", offsetof(struct {name}, {field}));')
    lines.append("return 0; }")
    src = tmp_path / "abi.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "abi"
    subprocess.run([os.environ.get("CC", "cc"), "-I", os.path.join(ROOT, "client", "lib"), str(src), "-o", str(exe)],
                   check=True, timeout=120)
    c = dict(line.split() for line in subprocess.run([str(exe)], capture_output=True, text=True,
                                                     check=True).stdout.splitlines())
    py = {}
    for name, cls in STRUCTS.items():
        py[name] = str(ctypes.sizeof(cls))
        for field, _ in cls._fields_:
            py[f"{name}.{field}"] = str(getattr(cls, field).offset)
    assert py == c
