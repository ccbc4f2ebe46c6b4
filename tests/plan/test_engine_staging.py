"""The planner counts the overlapped sync's staging copy (``rollout.sync.overlap``: ``Knobs.sync_overlap``, the
``--sync-overlap`` flag): the engine's weights twice per GPU, out of its KV pool."""
import contextlib
import io
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _engine(*extra):
    from megatron_s3ac.plan.cli import run

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        run([os.path.join(ROOT, "examples", "hf_configs", "qwen3_30b_a3b"), "--gpus", "16", "--placement", "separate",
             "--prompt-len", "512", "--response-len", "8192", "--engine-tp", "2", "--json", *extra])
    text = buf.getvalue()
    return json.loads(text[text.index("{"):])["engine"]


def test_the_staging_copy_counts_against_the_kv_pool():
    plain, staged = _engine(), _engine("--sync-overlap")
    assert plain["staging_gib_per_gpu"] == 0 and staged["staging_gib_per_gpu"] == staged["weights_gib_per_gpu"] > 0
    assert staged["weights_gib_per_gpu"] == plain["weights_gib_per_gpu"]
    assert staged["capacity_seqs_at_max_len"] < plain["capacity_seqs_at_max_len"]
