"""The independent reference of the image-prompt engine tests: transformers' VL forward, teacher-forced."""
import torch

from megatron_s3ac.models.tiny_qwen3_5 import VL_TOKENS

IMG = VL_TOKENS["image_token_id"]


def reference(model, routers, prompt, response, images, temperature):
    """(log-probs [R], {layer: top-k ids [P+R-1, k]}) of one unpadded teacher-forced forward."""
    full = torch.tensor([prompt + response])
    kw = dict(input_ids=full)
    if images is not None:
        mm = torch.zeros_like(full, dtype=torch.int)
        mm[0, :len(prompt)] = (full[0, :len(prompt)] == IMG).int()  # the prompt's placeholders only
        kw.update(pixel_values=images.pixel_values, image_grid_thw=images.image_grid_thw, mm_token_type_ids=mm)
        if IMG in response:  # a sampled image token is text: transformers' mask would count it as a placeholder
            inner = model.model
            emb = inner.get_input_embeddings()(full)
            feats = torch.cat(inner.get_image_features(images.pixel_values, images.image_grid_thw).pooler_output)
            emb[0, mm[0].bool()] = feats
            vis, _ = inner.get_rope_index(full, mm, image_grid_thw=images.image_grid_thw)
            kw = dict(inputs_embeds=emb, position_ids=torch.cat([torch.arange(full.shape[1])[None, None], vis]))
    got = {}
    hooks = [m.register_forward_hook(lambda mod, i, o, layer=layer: got.__setitem__(layer, o[-1].reshape(len(full[0]), -1)))
             for layer, m in routers.items()]
    try:
        with torch.no_grad():
            logits = model(**kw).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    P, R = len(prompt), len(response)
    lp = torch.log_softmax(logits / (temperature or 1.0), -1)[P - 1:P + R - 1]
    lp = lp.gather(-1, torch.tensor(response)[:, None])[:, 0].numpy()
    return lp, {layer: ids[:P + R - 1].numpy() for layer, ids in got.items()}
