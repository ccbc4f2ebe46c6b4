"""A stand-in for sglang.Engine (GPU-only) that speaks its wire format, backed by the CPU engine.

Only the methods SGLangEngine calls exist here; test_sglang_contract.py checks that each of their
signatures is a subset of the real 0.5.23 Engine's (same names, same defaults). Outputs follow
SGLang's format with skip_tokenizer_init: output_ids, meta_info.finish_reason {"type": ...},
output_token_logprobs [(logprob, token_id, None)], routed_experts as base64 of int32.
"""
import base64

from megatron_s3ac.rollout.base import SamplingParams


class FakeSGLangEngine:
    def __init__(self, cpu_engine):
        self.cpu = cpu_engine
        self.calls = []  # (method, kwargs summary) in call order

    def generate(self, input_ids=None, sampling_params=None, return_logprob=False, return_routed_experts=False):
        self.calls.append(("generate", len(input_ids)))
        outputs = []
        for ids, sp in zip(input_ids, sampling_params):
            params = SamplingParams(temperature=sp["temperature"], top_p=sp["top_p"], top_k=sp["top_k"],
                                    max_new_tokens=sp["max_new_tokens"], stop_token_ids=sp.get("stop_token_ids", ()),
                                    stop_strings=sp.get("stop", ()), seed=sp.get("sampling_seed"),
                                    ignore_eos=sp["ignore_eos"])
            s = self.cpu.generate([ids], params, 1, return_routed_experts)[0][0]
            meta = {"finish_reason": {"type": s.finish_reason}, "prompt_tokens": len(ids),
                    "completion_tokens": len(s.response_ids)}
            if return_logprob:
                meta["output_token_logprobs"] = [(float(lp), t, None) for lp, t in zip(s.logprobs, s.response_ids)]
            if return_routed_experts:
                meta["routed_experts"] = base64.b64encode(s.routed_experts.astype("<i4").tobytes()).decode()
            outputs.append({"output_ids": list(s.response_ids), "meta_info": meta})
        return outputs

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update_weights_from_tensor", sum(t.numel() * t.element_size() for _, t in named_tensors)))
        self.cpu.update_weights(named_tensors)

    def flush_cache(self):
        self.calls.append(("flush_cache", None))

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release_memory_occupation", tags))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume_memory_occupation", tags))

    def shutdown(self):
        self.calls.append(("shutdown", None))
