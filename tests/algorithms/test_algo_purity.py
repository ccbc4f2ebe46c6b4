"""algorithms/ must stay pure torch: no Megatron import, statically or at import time."""
import pathlib
import re
import subprocess
import sys

import megatron_s3ac.algorithms as alg

PKG = pathlib.Path(alg.__file__).parent


def test_no_megatron_import_in_source():
    pat = re.compile(r"^\s*(import|from)\s+megatron(\.|\s|$)", re.M)
    offenders = [p.name for p in PKG.glob("*.py") if pat.search(p.read_text())]
    assert offenders == []


def test_import_does_not_load_megatron():
    code = (
        "import sys, megatron_s3ac.algorithms as a; "
        "bad = [m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')]; "
        "assert not bad, bad; assert len(a.__all__) >= 30"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_api_exported():
    for name in alg.__all__:
        assert hasattr(alg, name), name
