"""Image + text prompts through the actor and the critic (vision tower built from the carried ``model.visual.*``
tensors, its embeddings scattered at the image tokens, interleaved mRoPE) against transformers'
Qwen3_5MoeForConditionalGeneration forward, fp32, at TP1 and TP2 x EP2 (4 gloo ranks): logits <= 1e-4,
critic values = the HF model's last hidden state through the same value head <= 1e-4. The mRoPE positions
equal transformers' ``get_rope_index``; the rotary module equals HF's cos/sin."""
import pytest
import torch

from megatron_s3ac.models.multimodal import ImageInputs, concat
from megatron_s3ac.models.parallel import ParallelLayout
from megatron_s3ac.models.tiny_qwen3_5 import VL_TOKENS, save_tiny_qwen3_5_vl_full, tiny_image_prompt

S = 56  # padded micro-batch length (a multiple of tp; the longest row has 49 tokens)


def _rows():
    """Three rows: two images with text between and after them; one image; text only. (ids [s_i], images)."""
    a_ids, a_pix, a_grid = tiny_image_prompt(0, text_before=(5, 6), text_after=(7,))
    b_ids, b_pix, b_grid = tiny_image_prompt(1, text_before=(11, 12, 13), text_after=(14, 15))
    c_ids, c_pix, c_grid = tiny_image_prompt(2, text_before=(20,), text_after=(21, 22, 23, 24))
    g = torch.Generator().manual_seed(3)
    resp = lambda n: torch.randint(0, 88, (n,), generator=g)  # noqa: E731  (text ids below the vision ids)
    row0 = torch.cat([a_ids[0], b_ids[0], resp(5)])
    row1 = torch.cat([c_ids[0], resp(12)])
    row2 = resp(30)
    imgs = [concat([ImageInputs(a_pix, a_grid), ImageInputs(b_pix, b_grid)]), ImageInputs(c_pix, c_grid), None]
    return [row0, row1, row2], imgs


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    from megatron_s3ac.convert import hf_to_mcore

    root = tmp_path_factory.mktemp("q35_vl_fwd")
    hf = save_tiny_qwen3_5_vl_full(str(root / "hf"))
    mcore = str(root / "mcore")
    hf_to_mcore(hf, mcore, progress=False)
    return hf, mcore


@pytest.fixture(scope="module")
def reference(vl):
    """transformers' VL forward of each row alone: logits [s_i, V] and the last hidden state [s_i, H]."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    hf, _ = vl
    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(hf, dtype=torch.float32).eval()
    rows, imgs = _rows()
    out = []
    with torch.no_grad():
        for ids, im in zip(rows, imgs):
            kw = {} if im is None else dict(pixel_values=im.pixel_values, image_grid_thw=im.image_grid_thw,
                                            mm_token_type_ids=(ids[None] == VL_TOKENS["image_token_id"]).long())
            o = model(input_ids=ids[None], output_hidden_states=True, **kw)
            h = model.model(input_ids=ids[None], **kw).last_hidden_state
            out.append((o.logits[0], h[0]))
    return out


def _batch():
    rows, imgs = _rows()
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    return ids, imgs, [len(r) for r in rows]


LAYOUTS = {"tp1": (1, ParallelLayout()), "tp2_ep2": (4, ParallelLayout(tp=2, ep=2, etp=1))}


@pytest.mark.parametrize("name", ["tp1", pytest.param("tp2_ep2", marks=pytest.mark.slow)])
def test_actor_logits_and_critic_values_match_transformers(vl, reference, name):
    from megatron_s3ac.models.gloo_ranks import run_distributed
    from tests.qwen3_5.vl_ranks import vl_actor_critic_outputs

    hf, mcore = vl
    world, layout = LAYOUTS[name]
    ids, imgs, lens = _batch()
    g = torch.Generator().manual_seed(11)
    head_w, head_b = 0.2 * torch.randn(1, 64, generator=g), torch.tensor([0.3])
    outs = run_distributed(vl_actor_critic_outputs, world, hf, mcore, layout, ids, imgs, head_w, head_b)
    logits, values = next(o for o in outs if o is not None)
    worst_l = worst_v = 0.0
    for i, (ref_logits, ref_h) in enumerate(reference):
        n = lens[i]
        got = logits[i, :n, :ref_logits.shape[-1]]
        worst_l = max(worst_l, (got - ref_logits).abs().max().item())
        assert torch.equal(got.argmax(-1), ref_logits.argmax(-1))
        ref_v = ref_h @ head_w[0] + head_b
        worst_v = max(worst_v, (values[i, :n] - ref_v).abs().max().item())
    print(f"{name}: max |logit diff| {worst_l:.2e}, max |value diff| {worst_v:.2e}")
    assert worst_l <= 1e-4 and worst_v <= 1e-4


def test_the_image_reaches_the_logits(vl, reference):
    """Matching the reference at 1e-4 exercises the vision path: row 1 with another image's pixels gives logits
    that differ far more than that after the image tokens (and not before them)."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(vl[0], dtype=torch.float32).eval()
    rows, imgs = _rows()
    _, other_pix, _ = tiny_image_prompt(7)
    ids = rows[1][None]
    with torch.no_grad():
        o = model(input_ids=ids, pixel_values=other_pix, image_grid_thw=imgs[1].image_grid_thw,
                  mm_token_type_ids=(ids == VL_TOKENS["image_token_id"]).long()).logits[0]
    ref = reference[1][0]
    first_img = int((rows[1] == VL_TOKENS["image_token_id"]).nonzero()[0])
    assert torch.allclose(o[:first_img], ref[:first_img], atol=1e-6)
    assert (o[first_img:] - ref[first_img:]).abs().max() > 1e-2


def test_mrope_positions_equal_transformers_get_rope_index():
    from transformers import Qwen3_5MoeConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeModel

    from megatron_s3ac.models.vision import mrope_positions
    from megatron_s3ac.models.tiny_qwen3_5 import TEXT, VISION

    ids, imgs, lens = _batch()
    # a 2 x 2 spatial merge and a non-square grid too: image 8 x 12 pixels, patch 2 -> grid 1 x 4 x 6
    vision = dict(VISION, spatial_merge_size=2)
    grid = torch.tensor([[1, 4, 6]])
    n = 4 * 6 // 4
    t = VL_TOKENS
    extra = torch.tensor([3, t["vision_start_token_id"], *[t["image_token_id"]] * n, t["vision_end_token_id"], 4, 4])
    cfg = Qwen3_5MoeConfig(text_config=dict(TEXT), vision_config=vision, **VL_TOKENS)
    model = Qwen3_5MoeModel.__new__(Qwen3_5MoeModel)
    torch.nn.Module.__init__(model)
    model.config = cfg
    got = mrope_positions(extra[None], [ImageInputs(torch.zeros(24, 12), grid)], t["image_token_id"], 2)
    ref, _ = model.get_rope_index(extra[None], (extra[None] == t["image_token_id"]).long(), image_grid_thw=grid)
    assert torch.equal(got, ref)
    cfg1 = Qwen3_5MoeConfig(text_config=dict(TEXT), vision_config=dict(VISION), **VL_TOKENS)
    model.config = cfg1
    got = mrope_positions(ids, imgs, t["image_token_id"], 1)
    for i in range(len(lens)):
        n = lens[i]
        im = imgs[i]
        kw = {} if im is None else dict(image_grid_thw=im.image_grid_thw)
        ref, _ = model.get_rope_index(ids[i:i + 1, :n], (ids[i:i + 1, :n] == t["image_token_id"]).long(), **kw)
        assert torch.equal(got[:, i:i + 1, :n], ref)
        # right padding continues as text
        assert torch.equal(got[0, i, n:], got[0, i, n - 1] + 1 + torch.arange(S - n))
    assert not torch.equal(got[1, 0], got[0, 0])  # the image rows' H axis differs from T


def test_sampled_image_token_in_a_response_is_text():
    """A response that samples the image-token id: the engine decoded it as text (word embedding, next text
    position via transformers' rope_deltas), so only the prompt's placeholders are image positions; the mRoPE
    positions equal get_rope_index with mm_token_type_ids marking the prompt's image tokens only."""
    from transformers import Qwen3_5MoeConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeModel

    from megatron_s3ac.models.vision import image_positions, mrope_positions
    from megatron_s3ac.models.tiny_qwen3_5 import TEXT, VISION

    t = VL_TOKENS
    p_ids, p_pix, p_grid = tiny_image_prompt(0, text_before=(5, 6), text_after=(7,))
    resp = torch.tensor([8, t["image_token_id"], 9, t["image_token_id"], t["image_token_id"], 3])
    ids = torch.cat([p_ids[0], resp])[None]
    plen = torch.tensor([p_ids.shape[1]])
    mask = image_positions(ids, t["image_token_id"], plen)
    assert int(mask.sum()) == int((p_ids == t["image_token_id"]).sum()) and not mask[0, plen[0]:].any()
    im = [ImageInputs(p_pix, p_grid)]
    with pytest.raises(ValueError, match="image-token runs|placeholder tokens"):  # unmasked: the response's ids
        mrope_positions(ids, im, t["image_token_id"], 1)                         # would be taken as an image
    got = mrope_positions(ids, im, t["image_token_id"], 1, image_mask=mask)
    model = Qwen3_5MoeModel.__new__(Qwen3_5MoeModel)
    torch.nn.Module.__init__(model)
    model.config = Qwen3_5MoeConfig(text_config=dict(TEXT), vision_config=dict(VISION), **VL_TOKENS)
    ref, _ = model.get_rope_index(ids, mask.long(), image_grid_thw=p_grid)
    assert torch.equal(got, ref)
    # and the response continues as text from the prompt's last position (the engine's decode positions)
    n = plen[0]
    assert torch.equal(got[:, 0, n:], got[:, 0, n - 1:n] + 1 + torch.arange(len(resp)))


def test_interleaved_mrope_equals_transformers_rotary():
    """cos / sin of InterleavedMRoPE == Qwen3_5MoeTextRotaryEmbedding's, real model's sections [11, 11, 10]."""
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

    from megatron_s3ac.models.vision import InterleavedMRoPE

    cfg = Qwen3_5MoeTextConfig(head_dim=256, rope_parameters={
        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    hf = Qwen3_5MoeTextRotaryEmbedding(cfg)
    pos = torch.randint(0, 500, (3, 2, 7), generator=torch.Generator().manual_seed(0))
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), pos)  # [b, s, 64]
    emb = InterleavedMRoPE(hf.inv_freq, [11, 11, 10])(pos)  # [s, b, 1, 64]
    assert emb.shape == (7, 2, 1, 64)
    assert torch.allclose(emb[:, :, 0].transpose(0, 1).cos(), cos, atol=1e-6)
    assert torch.allclose(emb[:, :, 0].transpose(0, 1).sin(), sin, atol=1e-6)
    # text positions (three equal axes): 1-D RoPE
    text = torch.arange(7)[None].expand(2, -1)
    one_d = text[..., None].float() * hf.inv_freq
    assert torch.equal(InterleavedMRoPE(hf.inv_freq, [11, 11, 10])(text)[:, :, 0].transpose(0, 1),
                       torch.cat([one_d, one_d], -1))


def test_image_token_count_mismatch_is_refused():
    from megatron_s3ac.models.vision import mrope_positions

    ids, imgs, _ = _batch()
    with pytest.raises(ValueError, match="images but|image-token runs|placeholder"):
        mrope_positions(ids, [imgs[1], imgs[1], None], VL_TOKENS["image_token_id"], 1)


def _samples():
    """Image + text samples (prompt / response split) with behaviour log-probs from transformers' VL forward."""
    rows, imgs = _rows()
    splits = [42, 24, 20]  # prompt lengths: the response starts after the (last) image (row 0: its vision end at 41)
    return [{"prompt_ids": r[:p].tolist(), "response_ids": r[p:].tolist(), "logprobs": [0.0] * (len(r) - p),
             "reward": 1.0, "pid": i, "images": im} for i, (r, im, p) in enumerate(zip(rows, imgs, splits))]


def _hf_response_logp(reference, samples):
    out = []
    for (logits, _), s in zip(reference, samples):
        ids = torch.tensor(s["prompt_ids"] + s["response_ids"])
        lp = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[1:, None])[:, 0]
        out.append(lp[len(s["prompt_ids"]) - 1:])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("trainable", [False, True])
def test_trainer_path_with_images(vl, reference, tmp_path, trainable):
    """build_actor of the VL checkpoint at TP2 (2 ranks), the batch's images carried through collate, DP
    sharding and micro-batches of 1 and 3 rows: response log-probs = transformers' <= 1e-4. A frozen tower is
    neither optimised nor sent; a trainable one gets the same gradients on both TP ranks, changes, is sent as
    model.visual.* into a multimodal CPU engine (its tower then equals the trainer's) and is what a checkpoint
    writes."""
    from megatron_s3ac.models.gloo_ranks import run_distributed
    from tests.qwen3_5.vl_ranks import vl_trainer_path

    hf, mcore = vl
    samples = _samples()
    outs = run_distributed(vl_trainer_path, 2, hf, mcore, str(tmp_path / "run"), 2, 1, trainable, samples)
    o = outs[0]
    ref = _hf_response_logp(reference, samples)
    for mbs in (1, 3):
        for i, r in enumerate(ref):
            got = o["logp"][mbs][i, :len(r)]
            assert (got - r).abs().max() <= 1e-4, (mbs, i, (got - r).abs().max())
            assert o["mask"][i, :len(r)].all() and not o["mask"][i, len(r):].any()
    assert o["lm_changed"]
    visual = {n for n in o["names"] if n.startswith("model.visual.")}
    text = {n for n in o["names"] if not n.startswith("model.visual.")}
    assert text and all(n.startswith("model.language_model.") or n == "lm_head.weight" for n in text)
    if trainable:
        assert o["vision_in_opt"] and o["tower_in_ddp"] and all(o["requires_grad"])
        assert all(o["changed"].values()) and visual == set(o["changed"])
        g0, g1 = outs[0]["grads"], outs[1]["grads"]
        assert g0 and g0.keys() == g1.keys()
        assert all(torch.allclose(g0[k], g1[k], atol=1e-7) for k in g0)  # replicated over TP: same gradients
        assert any(g.abs().sum() > 0 for g in g0.values())
    else:
        assert not o["vision_in_opt"] and not o["tower_in_ddp"] and not any(o["requires_grad"])
        assert not any(o["changed"].values()) and not visual
    assert all(x["blocks_current"] for x in outs)
    # the engine's vision tower after the sync: the trained one, or (frozen) still the checkpoint's
    assert o["synced"] is True


@pytest.fixture(scope="module")
def hf_routes(vl):
    """Routes of transformers' VL forward of each row (every position, image tokens included) [T-1, 8, 2], as an
    engine running that model returns them, and its log-probs of each next token [T-1]."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(vl[0], dtype=torch.float32).eval()
    layers = model.model.language_model.layers
    rows, imgs = _rows()
    out = []
    for ids, im in zip(rows, imgs):
        got = {}
        hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, o, i=i: got.__setitem__(i, o[2]))
                 for i, layer in enumerate(layers)]
        kw = {} if im is None else dict(pixel_values=im.pixel_values, image_grid_thw=im.image_grid_thw,
                                        mm_token_type_ids=(ids[None] == VL_TOKENS["image_token_id"]).long())
        with torch.no_grad():
            logits = model(input_ids=ids[None], **kw).logits[0]
        for h in hooks:
            h.remove()
        r = torch.stack([got[i] for i in range(len(layers))], 1)[:-1].to(torch.uint8).numpy()  # [T-1, L, K]
        lp = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[1:, None])[:, 0]
        out.append((ids.numpy(), r, lp))
    return out


@pytest.mark.slow
def test_r3_replay_covers_image_tokens_tp2(vl, hf_routes):
    """Replaying the VL model's routes at TP2 (+SP): every router of all 8 layers uses exactly the rollout's
    experts at every position of every row, the image tokens' positions included; log-probs = transformers'."""
    from megatron_s3ac.models.gloo_ranks import run_distributed
    from tests.qwen3_5.vl_ranks import vl_r3_replay

    hf, mcore = vl
    ids, imgs, lens = _batch()
    smp = [(t, r) for t, r, _ in hf_routes]
    outs = run_distributed(vl_r3_replay, 2, hf, mcore, ParallelLayout(tp=2), ids, imgs, lens, smp)
    assert sorted({layer for o in outs for layer in o[2]}) == list(range(8))
    n_img = int((ids == VL_TOKENS["image_token_id"]).sum())
    # each rank checks every position of every row (SP: the routers' rows gathered) on all 8 layers
    assert all(o[1] == 8 * sum(n - 1 for n in lens) for o in outs) and n_img == 48
    lp = next(o[0] for o in outs if o[0] is not None)
    for i, (_, _, ref) in enumerate(hf_routes):
        assert (lp[i, :lens[i] - 1] - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("head_dim,section", [(32, [1, 1, 0]), (16, [1, 1, 0]), (64, [2, 3, 1])])
def test_interleaved_mrope_sections_not_summing_to_the_frequencies(head_dim, section):
    """transformers reads only the H and W sections (T elsewhere), so a section list that does not sum to the
    rotary frequencies (the wide tiny model: 4 frequencies, [1, 1, 0]) is served as transformers serves it."""
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

    from megatron_s3ac.models.vision import InterleavedMRoPE

    cfg = Qwen3_5MoeTextConfig(head_dim=head_dim, rope_parameters={
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25,
        "mrope_section": section, "mrope_interleaved": True})
    hf = Qwen3_5MoeTextRotaryEmbedding(cfg)
    pos = torch.randint(0, 50, (3, 2, 5), generator=torch.Generator().manual_seed(1))
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), pos)
    emb = InterleavedMRoPE(hf.inv_freq, section)(pos)
    assert torch.allclose(emb[:, :, 0].transpose(0, 1).cos(), cos, atol=1e-6)
    assert torch.allclose(emb[:, :, 0].transpose(0, 1).sin(), sin, atol=1e-6)
