"""The complete Qwen3.5-MoE VL checkpoint both ways: HF (vision tower, LM, MTP layer, processor files) ->
hf-to-mcore -> the trainer's actor at TP2 x EP2 on 4 gloo ranks (build_actor from the converted checkpoint,
save_checkpoint) -> mcore-to-hf of the training checkpoint: every tensor bit-equal, side files identical,
transformers loads it as Qwen3_5MoeForConditionalGeneration and greedy generation on an image prompt equals
the original's token for token. The training checkpoint reloads at another layout (EP2 on 2 ranks) and
carries the tensors again; the weight sync's export never sends them."""
import filecmp
import os

import pytest
import torch
from safetensors.torch import load_file

from megatron_s3ac.convert import build_plan, hf_to_mcore, mcore_to_hf
from megatron_s3ac.models.registry import model_info
from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.models.tiny_qwen3_5 import VL_TOKENS, save_tiny_qwen3_5_vl_full, tiny_image_prompt
from tests.qwen3_5.ranks import carried_through_training

CARRIED = ("model.visual.", "mtp.")


def _tensors(d):
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


def _assert_same_tensors(a_dir, b_dir):
    a, b = _tensors(a_dir), _tensors(b_dir)
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    return a


def _side_files(d):
    return sorted(f for f in os.listdir(d) if not f.endswith((".safetensors", ".index.json")))


@pytest.fixture(scope="module", autouse=True)
def small_blocks():
    """Carried tensors in 2 KiB row blocks: most are split into several, spread over the ranks."""
    from megatron_s3ac.convert import plan

    old, plan.CARRIED_BLOCK_BYTES = plan.CARRIED_BLOCK_BYTES, 2048
    yield
    plan.CARRIED_BLOCK_BYTES = old


@pytest.fixture(scope="module")
def vl_full(tmp_path_factory, small_blocks):
    root = tmp_path_factory.mktemp("q35_vl_full")
    hf = save_tiny_qwen3_5_vl_full(str(root / "hf"))
    mcore = str(root / "mcore")
    hf_to_mcore(hf, mcore, progress=False)
    return hf, mcore


def _generate(d, image_seed=0, steps=8):
    from transformers import Qwen3_5MoeForConditionalGeneration

    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    assert type(model) is Qwen3_5MoeForConditionalGeneration
    ids, pix, grid = tiny_image_prompt(image_seed)
    mm = (ids == VL_TOKENS["image_token_id"]).long()  # what the processor returns: 1 at image tokens
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pix,
                             image_grid_thw=grid, mm_token_type_ids=mm, max_new_tokens=steps, do_sample=False)
        logits = model(input_ids=ids, pixel_values=pix, image_grid_thw=grid, mm_token_type_ids=mm).logits[0, -1]
    return out[0, ids.shape[1]:].tolist(), logits


def test_converted_checkpoint_round_trip(vl_full, tmp_path):
    hf, mcore = vl_full
    out = str(tmp_path / "back")
    mcore_to_hf(mcore, out, progress=False)
    src = _assert_same_tensors(hf, out)
    assert any(k.startswith("model.visual.") for k in src) and any(k.startswith("mtp.") for k in src)
    assert {src[k].dtype for k in src if k.startswith("mtp.")} == {torch.bfloat16}  # dtypes kept per tensor
    assert _side_files(out) == _side_files(hf) and "preprocessor_config.json" in _side_files(out)
    assert all(filecmp.cmp(os.path.join(hf, f), os.path.join(out, f), shallow=False) for f in _side_files(hf))
    from megatron_s3ac.convert.dcp_io import DistcpCheckpoint

    ck = DistcpCheckpoint(mcore)
    blocks = {k: len(md.chunks) for k, md in ck.md.state_dict_metadata.items() if k.startswith("s3ac_carried.")}
    ck.close()
    assert blocks["s3ac_carried.mtp.fc.weight"] == 8  # [64, 128] bf16 = 16 KiB in 2 KiB row blocks
    # the weight sync walks the plan without the carried tensors
    plan = build_plan(model_info(hf))
    assert not any(n.startswith(CARRIED) for n in plan.hf_shapes)


@pytest.mark.slow  # > 60 s under load; the fast suite's 20-minute budget (CI)
def test_training_checkpoint_carries_vision_and_mtp_at_tp2_ep2(vl_full, tmp_path):
    hf, mcore = vl_full
    outs = run_distributed(carried_through_training, 4, hf, mcore, str(tmp_path / "run"), 2, 2)
    shares = [o[0] for o in outs]
    src = _tensors(hf)
    carried_bytes = sum(t.numel() * t.element_size() for k, t in src.items() if k.startswith(CARRIED))
    assert sum(shares) == carried_bytes and all(s > 0 for s in shares)  # split over the ranks, not replicated
    step_dir = outs[0][1]
    exported = {n for o in outs for n in o[2]}
    text = {n for n in src if not n.startswith(CARRIED)}
    assert exported == text  # the weight sync never sends the vision tower or the MTP layer

    back = str(tmp_path / "hf_from_training")
    mcore_to_hf(os.path.join(step_dir, "actor"), back, hf_config=hf, progress=False)
    _assert_same_tensors(hf, back)
    assert _side_files(back) == _side_files(hf)
    assert all(filecmp.cmp(os.path.join(hf, f), os.path.join(back, f), shallow=False) for f in _side_files(hf))

    tokens, logits = _generate(hf)
    tokens_back, logits_back = _generate(back)
    # (the same weights give last-bit differences between two loads in transformers' CPU forward)
    assert tokens_back == tokens and torch.allclose(logits_back, logits, rtol=0, atol=1e-6)
    _, other = _generate(hf, image_seed=1)
    assert not torch.allclose(other, logits)  # the image reaches the logits: the vision tower is exercised

    # the training checkpoint is an actor_init at another layout (EP2 on 2 ranks): carried again
    outs2 = run_distributed(carried_through_training, 2, hf, os.path.join(step_dir, "actor"),
                            str(tmp_path / "run2"), 1, 2)
    assert sum(o[0] for o in outs2) == carried_bytes
    back2 = str(tmp_path / "hf_from_training2")
    mcore_to_hf(os.path.join(outs2[0][1], "actor"), back2, hf_config=hf, progress=False)
    _assert_same_tensors(hf, back2)


def test_vl_config_without_carried_vision_writes_text_and_warns(vl_full, tmp_path, capfd):
    """A VL config whose checkpoint has no vision tower (an actor trained from a random init): the LM only,
    and a warning naming what is missing."""
    hf = str(tmp_path / "plain")
    from megatron_s3ac.models.tiny_qwen3_5 import save_tiny_qwen3_5

    save_tiny_qwen3_5(hf, "vl")
    src = _tensors(hf)
    for f in os.listdir(hf):
        if f.endswith(".safetensors"):
            from safetensors.torch import save_file

            keep = {k: v for k, v in load_file(os.path.join(hf, f)).items() if not k.startswith(CARRIED)}
            save_file(keep, os.path.join(hf, f), metadata={"format": "pt"})
    idx = os.path.join(hf, "model.safetensors.index.json")
    if os.path.exists(idx):
        os.remove(idx)
    hf_to_mcore(hf, str(tmp_path / "m"), progress=False)
    mcore_to_hf(str(tmp_path / "m"), str(tmp_path / "back"), progress=False)
    assert "carries no vision tower" in capfd.readouterr().err
    assert set(_tensors(str(tmp_path / "back"))) == {k for k in src if not k.startswith(CARRIED)}


def test_carried_blocks_and_refusals(vl_full):
    from megatron_s3ac.convert import ConversionError
    from megatron_s3ac.convert.carried import assign
    from megatron_s3ac.convert.plan import carried_chunks, with_carried

    chunks = carried_chunks("mtp.x", (6, 256), 4)  # 1 KiB rows, 2 KiB blocks: 3 blocks of 2 rows
    assert [(c.offset, c.shape) for c in chunks] == [((0, 0), (2, 256)), ((2, 0), (2, 256)), ((4, 0), (2, 256))]
    assert len(carried_chunks("mtp.y", (5, 256), 4)) == 5  # 5 rows: no divisor gives 2 KiB blocks but 1
    with pytest.raises(ConversionError, match="scalar"):
        carried_chunks("mtp.s", (), 4)
    plan = build_plan(model_info(vl_full[0]))
    with pytest.raises(ConversionError, match="model.language_model.foo"):
        with_carried(plan, {"model.language_model.foo": ((2,), 4)})
    # every block goes to exactly one rank, the largest first to the least loaded
    shares = assign([("a", (0,), (1,), 10), ("a", (1,), (1,), 10), ("b", (0,), (1,), 5)], 2)
    assert sorted(i for s in shares for i in s) == [0, 1, 2] and shares == [[0, 2], [1]]


def test_complete_checkpoint_streams_like_the_text_model(vl_full, tmp_path, monkeypatch):
    """The carried tensors take the text model's streaming path (docs/convert.md "Why it is fast and small"): both
    CLI directions on the complete VL checkpoint run without importing torch / numpy / megatron / safetensors /
    transformers and round-trip bit-exact with the side files; through a 97-byte copy buffer (no kernel copies;
    carried rows cut at odd places in 2 KiB blocks) the checkpoint is byte for byte the default one. (Peak RSS on
    the 35B's real vision tower and MTP shapes: bench/bench_convert.py --arch qwen3_5_vl.)"""
    from tests.convert.test_torch_free import assert_tiny_buffer_is_default, round_trip_without_torch

    hf, _ = vl_full
    _, back = round_trip_without_torch(hf, tmp_path)
    src = _assert_same_tensors(hf, back)
    assert any(k.startswith("model.visual.") for k in src) and any(k.startswith("mtp.") for k in src)
    assert _side_files(back) == _side_files(hf)
    assert all(filecmp.cmp(os.path.join(hf, f), os.path.join(back, f), shallow=False) for f in _side_files(hf))
    assert_tiny_buffer_is_default(hf, tmp_path / "buf", monkeypatch)
