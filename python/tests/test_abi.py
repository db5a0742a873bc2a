"""The ctypes mirrors of the public structs match the C compiler's layout, and the
binding's lists (stats keys, page types, statuses) match the header's X-macros."""

import ctypes
import json
import os
import subprocess

import pytest

from conftest import build_tool
from kvpool import _lib


@pytest.fixture(scope="module")
def c_layout():
    tool = build_tool("kvpool-pyabi")
    if not os.path.exists(tool):
        pytest.skip(f"{tool} not built (make pylib)")
    return json.loads(subprocess.run([tool], check=True, capture_output=True, text=True).stdout)


@pytest.mark.parametrize("name", sorted(_lib.STRUCTS))
def test_struct_layout(c_layout, name):
    cls = _lib.STRUCTS[name]
    want = c_layout[name]
    assert ctypes.sizeof(cls) == want["size"], f"{name}: ctypes size {ctypes.sizeof(cls)} != C {want['size']}"
    got = {f[0]: getattr(cls, f[0]).offset for f in cls._fields_}
    assert got == want["fields"]


def test_lists(c_layout):
    kinds = {"GAUGE": "G", "COUNTER": "C", "VALUE": "V"}
    assert [(kinds[k], f, key) for k, f, key in c_layout["stats_keys"]] == list(_lib.STATS_FIELDS)
    assert c_layout["page_types"] == list(_lib.PAGE_TYPES)
    assert [tuple(s) for s in c_layout["status"]] == list(_lib.STATUS)


def test_error_classes_cover_every_status():
    import kvpool
    from kvpool.errors import BY_STATUS
    for name, value in _lib.STATUS[1:]:
        cls = BY_STATUS[value]
        assert issubclass(cls, kvpool.Error)
        e = cls("detail", "kvp_x")
        assert e.name == "KVP_" + name and e.status == value
        assert str(e) == f"kvp_x: KVP_{name}: detail"
