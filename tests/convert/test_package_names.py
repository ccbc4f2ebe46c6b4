"""``from megatron_s3ac.convert import hf_to_mcore`` is the function whatever was imported before it
(the package exports functions named like their submodules; a fresh interpreter sees the import order)."""
import subprocess
import sys

import pytest

ORDERS = ["import megatron_s3ac.convert.mcore_to_hf", "import megatron_s3ac.convert.hf_to_mcore",
          "from megatron_s3ac.convert import mcore_to_hf", "import megatron_s3ac.convert.export"]


@pytest.mark.parametrize("first", ORDERS)
def test_same_named_exports_are_the_functions(first):
    code = (f"{first}\nimport importlib, types\nfrom megatron_s3ac.convert import hf_to_mcore, mcore_to_hf\n"
            "assert isinstance(hf_to_mcore, types.FunctionType), hf_to_mcore\n"
            "assert isinstance(mcore_to_hf, types.FunctionType), mcore_to_hf\n"
            "m = importlib.import_module('megatron_s3ac.convert.hf_to_mcore')\n"
            "assert isinstance(m, types.ModuleType) and m.hf_to_mcore is hf_to_mcore\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
