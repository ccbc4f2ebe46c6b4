"""Every example config's layout fits its cluster: section, by the planner, with the knobs its comment names."""
import json
import os

import pytest
import yaml

from megatron_s3ac.plan import cli
from tests._examples import EXAMPLES

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


@pytest.mark.parametrize("path,hf", EXAMPLES)
def test_example_layout_fits(capsys, path, hf):
    path = os.path.join(ROOT, path)
    with open(path) as f:
        cfg = yaml.safe_load(f)
    assert set(cfg["cluster"]) == {"gpus", "gpus_per_node", "gpu_mem_gib", "host_mem_gib"}
    assert cli.run([os.path.join(ROOT, "examples", "hf_configs", hf), "--config", path, "--recompute", "full",
                    "--offload-idle", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["fits"], d["problems"]
    lay = {k: v for k, v in cfg["actor_layout"].items()}
    assert {k: d["layout"][k] for k in lay} == lay  # the config's own layout was planned
    assert d["train_gpus"] == cfg["cluster"]["gpus"]
