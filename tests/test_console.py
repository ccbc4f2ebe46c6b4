"""Quiet console (megatron_s3ac/console.py): each known library warning is filtered and nothing else; a real
CLI subprocess prints none of them, while the same command with S3AC_SHOW_WARNINGS=1 shows them (so
the filters, not luck, keep stderr clean)."""
import os
import subprocess
import sys
import warnings

import pytest

from megatron_s3ac.console import KNOWN, SHOW_ENV, silence_known_warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _emitted(message, category, module):
    with warnings.catch_warnings(record=True) as rec:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        silence_known_warnings()
        warnings.warn_explicit(message, category, "somefile.py", 1, module=module)
    return len(rec)


def test_known_warnings_are_filtered_and_nothing_else(monkeypatch):
    monkeypatch.delenv(SHOW_ENV, raising=False)
    monkeypatch.setenv("PYTHONWARNINGS", "")
    for k in KNOWN:
        for module in k.modules or ("megatron.core.anything",):
            assert _emitted(k.message + " (rest of the text)", k.category, module) == 0, k.message
        if k.modules:  # scoped: the same text from our own code still shows
            assert _emitted(k.message, k.category, "megatron_s3ac.trainer.step.trainer") == 1, k.message
        assert _emitted(k.message, DeprecationWarning, k.modules[0] if k.modules else "m") == 1  # category matters
    assert _emitted("something new happened", UserWarning, "megatron.core.x") == 1
    assert all("," not in k.message for k in KNOWN)  # PYTHONWARNINGS is comma-separated
    opts = os.environ["PYTHONWARNINGS"].split(",")  # exported for child processes, once each
    assert len(opts) == len(set(opts)) == sum(len(k.modules) or 1 for k in KNOWN)
    monkeypatch.setenv(SHOW_ENV, "1")
    assert _emitted(KNOWN[0].message, KNOWN[0].category, "x") == 1


@pytest.mark.slow  # three CLI subprocesses (convert, then verify quiet and loud): ~1-2 min on 2 busy cores
def test_cli_subprocess_stderr_has_no_known_warning(tmp_path):
    from megatron_s3ac.models.tiny_models import save_tiny_hf

    hf = save_tiny_hf("qwen3_moe", str(tmp_path / "hf"))
    env = {k: v for k, v in os.environ.items() if k not in (SHOW_ENV, "PYTHONWARNINGS")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")

    def run(*args, **extra):
        r = subprocess.run([sys.executable, "-m", "checkpoints_convert", *args], cwd=ROOT, env={**env, **extra},
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stderr

    mcore = str(tmp_path / "mcore")
    run("hf-to-mcore", "--hf", hf, "--out", mcore)
    # verify builds the megatron model and runs it: megatron's import-time and config warnings
    quiet = run("verify", "--hf", hf, "--mcore", mcore)
    assert not [k.message for k in KNOWN if k.message in quiet], quiet[-3000:]
    loud = run("verify", "--hf", hf, "--mcore", mcore, **{SHOW_ENV: "1"})
    assert [k.message for k in KNOWN if k.message in loud], loud[-3000:]  # the control: the CLI does trigger them
