"""Contract test: every sglang name our wrapper uses exists, with that name, in the pinned wheel, and the
behaviours the CPU stand-in (fake_sglang.py) reproduces are still what the wheel's source does.

The wheel (GPU-only dependencies) is read with `ast` / as text from a local copy; nothing from it is imported and
nothing is downloaded at test time. Without a local wheel the tests skip, naming the command that fetches it:
    pip download sglang==0.5.23 --no-deps -d ~/.cache/megatron_s3ac
(or point S3AC_SGLANG_WHEEL at the .whl file).
"""
import ast
import inspect
import os
import zipfile
from pathlib import Path

import pytest

from megatron_s3ac.rollout.engines.sglang import engine as wrapper

from fake_sglang import FakeSGLangEngine

CACHE = Path.home() / ".cache" / "megatron_s3ac"
PKG = "sglang/srt/"
FETCH = f"pip download sglang=={wrapper.SGLANG_VERSION} --no-deps -d {CACHE}"


def _find_wheel() -> Path:
    env = os.environ.get("S3AC_SGLANG_WHEEL")
    if env:
        if not Path(env).is_file():
            pytest.fail(f"S3AC_SGLANG_WHEEL={env} is not a file")
        return Path(env)
    found = sorted(CACHE.glob(f"sglang-{wrapper.SGLANG_VERSION}-*.whl"))
    if not found:
        pytest.skip(f"no sglang=={wrapper.SGLANG_VERSION} wheel in {CACHE}; fetch it once with: {FETCH}")
    return found[0]


class WheelSource:
    def __init__(self, path: Path):
        self.zip = zipfile.ZipFile(path)

    def text(self, name: str) -> str:
        return self.zip.read(name).decode()

    def tree(self, name: str) -> ast.Module:
        return ast.parse(self.text(name))

    def class_def(self, module: str, cls: str) -> ast.ClassDef:
        for node in self.tree(module).body:
            if isinstance(node, ast.ClassDef) and node.name == cls:
                return node
        raise AssertionError(f"class {cls} not found in {module}")


@pytest.fixture(scope="module")
def wheel():
    return WheelSource(_find_wheel())


def annotated_fields(cls: ast.ClassDef) -> set[str]:
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def server_args_fields(wheel: WheelSource) -> set[str]:
    """ServerArgs is msgspec.defstruct-ed from the namespaces listed in _INPUT_NAMESPACES."""
    tree = wheel.tree(PKG + "server_args.py")
    imported_from = {alias.asname or alias.name: node.module
                     for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
                     for alias in node.names}
    namespaces = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                      and any(isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES" for t in node.targets))
    fields = set()
    for elt in namespaces.elts:
        module = imported_from[elt.id].replace(".", "/") + ".py"
        fields |= annotated_fields(wheel.class_def(module, elt.id))
    return fields


def engine_methods(wheel: WheelSource) -> dict[str, ast.FunctionDef]:
    cls = wheel.class_def(PKG + "entrypoints/engine.py", "Engine")
    return {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def params_with_defaults(fn: ast.FunctionDef) -> dict[str, object]:
    """Parameter name -> default (a literal, or `...` when it has none / is not a literal)."""
    args = fn.args
    out = {a.arg: ... for a in args.posonlyargs + args.args + args.kwonlyargs}
    positional = args.posonlyargs + args.args
    for a, d in zip(positional[len(positional) - len(args.defaults):], args.defaults):
        out[a.arg] = _literal(d)
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        if d is not None:
            out[a.arg] = _literal(d)
    out.pop("self", None)
    return out


def _literal(node):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ...


def test_wheel_is_the_pinned_version(wheel):
    meta = wheel.text(f"sglang-{wrapper.SGLANG_VERSION}.dist-info/METADATA")
    assert f"\nVersion: {wrapper.SGLANG_VERSION}\n" in meta


def test_server_args_fields_exist(wheel):
    fields = server_args_fields(wheel)
    assert len(fields) > 300  # sanity: the parse found the real field set
    missing = [name for name in wrapper.SERVER_ARGS_USED if name not in fields]
    assert not missing, f"ServerArgs fields missing in sglang {wrapper.SGLANG_VERSION}: {missing}"
    # the config's launch kwargs use only declared names (extra is the caller's explicit escape hatch)
    assert set(wrapper.SGLangConfig(model_path="m").server_args()) <= set(wrapper.SERVER_ARGS_USED)


def test_attention_dp_uses_the_new_field(wheel):
    assert "attn_dp_size" in wrapper.SERVER_ARGS_USED
    assert "enable_dp_attention" not in wrapper.SERVER_ARGS_USED  # deprecated in 0.5.23
    assert "attn_dp_size" in server_args_fields(wheel)


def test_engine_methods_and_kwargs_exist(wheel):
    methods = engine_methods(wheel)
    for method, kwargs in wrapper.ENGINE_CALLS_USED.items():
        assert method in methods, f"sglang.Engine.{method} missing"
        params = params_with_defaults(methods[method])
        missing = [k for k in kwargs if k not in params]
        assert not missing, f"sglang.Engine.{method} has no parameter(s) {missing}"


def test_wrapper_declares_every_engine_call():
    """Parse SGLangEngine: each self.engine.<method>(kw=...) and each checked call
    self._call_checked("<method>", what, kw=...) must be declared in ENGINE_CALLS_USED."""
    cls = next(n for n in ast.parse(inspect.getsource(wrapper)).body
               if isinstance(n, ast.ClassDef) and n.name == "SGLangEngine")
    seen = set()
    for node in ast.walk(cls):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "engine":
            method, args = node.func.attr, node.args
        elif node.func.attr == "_call_checked" and isinstance(node.args[0], ast.Constant):
            method, args = node.args[0].value, node.args[2:]
        else:
            continue
        seen.add(method)
        assert method in wrapper.ENGINE_CALLS_USED, f"undeclared Engine method {method}"
        assert not args, f"Engine.{method} called positionally: pass keywords so they are checked"
        for kw in node.keywords:
            assert kw.arg in wrapper.ENGINE_CALLS_USED[method], f"undeclared kwarg {method}({kw.arg}=)"
    assert seen == set(wrapper.ENGINE_CALLS_USED)


def test_sampling_keys_exist(wheel):
    fields = annotated_fields(wheel.class_def(PKG + "sampling/sampling_params.py", "SamplingParams"))
    missing = [k for k in wrapper.SAMPLING_KEYS_USED if k not in fields]
    assert not missing, f"sglang SamplingParams has no {missing}"
    # and the converter emits only declared keys
    from megatron_s3ac.rollout.base import SamplingParams

    full = SamplingParams(top_k=5, stop_token_ids=(1,), stop_strings=("x",), seed=3)
    assert set(wrapper.to_sglang_sampling_params(full)) <= set(wrapper.SAMPLING_KEYS_USED)


def test_meta_info_keys_and_memory_tags_exist(wheel):
    literals = {n.value for n in ast.walk(wheel.tree(PKG + "managers/tokenizer_manager.py"))
                if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert set(wrapper.META_INFO_KEYS_USED) <= literals
    tags = {n.value.value for n in wheel.tree(PKG + "constants.py").body
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}
    assert set(wrapper.MEMORY_TAGS) <= tags


def test_routed_experts_wire_format_is_base64_int32(wheel):
    src = wheel.text(PKG + "managers/tokenizer_manager.py")
    assert 'meta_info["routed_experts"]' in src and "b64encode" in src
    capturer = wheel.text(PKG + "state_capturer/routed_experts.py")
    assert "int32" in capturer


def test_fake_engine_signatures_match_the_real_engine(wheel):
    methods = engine_methods(wheel)
    for name, fn in inspect.getmembers(FakeSGLangEngine, inspect.isfunction):
        if name.startswith("_") or name in FakeSGLangEngine.TEST_HOOKS:
            continue
        assert name in wrapper.ENGINE_CALLS_USED, f"fake has a method the wrapper does not use: {name}"
        real = params_with_defaults(methods[name])
        for p in list(inspect.signature(fn).parameters.values())[1:]:
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                continue
            assert p.name in real, f"fake {name}({p.name}) is not a real parameter"
            if p.default is not inspect.Parameter.empty and real[p.name] is not ...:
                assert p.default == real[p.name], f"fake {name}({p.name}={p.default!r}) vs real {real[p.name]!r}"


# (file under sglang/srt/, text that must be in it): the 0.5.23 behaviours fake_sglang.py reproduces.
BEHAVIOUR_FACTS = [
    ("managers/scheduler_components/weight_updater.py", '"update_weights_from_tensor must run between "'),
    ("managers/scheduler_components/weight_updater.py", '"update_weights_from_distributed must run between "'),
    ("managers/scheduler_components/weight_updater.py", '"begin_weight_update() and end_weight_update()"'),
    ("managers/scheduler_components/weight_updater.py", "a weight-update session is already open"),
    ("managers/scheduler_components/weight_updater.py", "no weight-update session is open"),
    ("managers/scheduler_components/weight_updater.py", "self.offload_tags.remove(tag)"),
    ("managers/scheduler_components/weight_updater.py", "tags = GPU_MEMORY_ALL_TYPES"),
    ("managers/scheduler_components/weight_updater.py", "Weights were updated, but the cache was not flushed"),
    ("managers/scheduler.py", "Cache not flushed because there are pending requests"),
    ("managers/scheduler.py", "parent_process.send_signal(signal.SIGQUIT)"),
    ("managers/scheduler_components/flush_wrapper.py", "return FlushCacheReqOutput(success=self._flush_cache())"),
    ("managers/tokenizer_control_mixin.py", "return FanOutCommunicator.merge_results(results)"),
    ("sampling/sampling_batch_info.py", "else 42"),
    ("models/qwen3_moe.py", "is_layer_sparse = True"),
    ("models/qwen3_moe.py", "if name not in params_dict:\n                        continue"),
    # Qwen3.5-MoE (VL) loader: fused experts taken (is_fused_expert sticks for the call), per-expert names too
    ("models/qwen3_5.py", '("experts.w13_weight", "experts.gate_up_proj", 0, "w1"),'),
    ("models/qwen3_5.py", 'if name.endswith("experts.gate_up_proj") or name.endswith(\n'
                          '                    "experts.down_proj"\n                ):\n'
                          '                    is_fused_expert = True'),
    ("models/qwen3_5.py", 'name = name.replace(r"model.language_model.", r"model.")'),
    ("models/qwen3_5.py", "loaded_weight = loaded_weight.chunk(2, dim=-2)"),
    ("models/qwen3_5.py", 'logger.warning(f"Parameter {name} not found in params_dict")'),
    ("layers/moe/fused_moe_triton/layer.py", 'f"experts.{expert_id}.{weight_name}.",'),
    ("managers/tokenizer_manager.py", "is longer than the "),
    ("managers/tokenizer_manager.py", "Requested token count exceeds the model's maximum context length"),
    ("weight_sync/tensor_bucket.py", "def empty(cls, names, dtypes, shapes, device)"),
    ("model_executor/model_runner_components/weight_updater.py", "rank = rank_offset + self.tp_rank"),
    ("utils/common.py", "_world.pg_group_ranks[pg] = {i: i for i in range(world_size)}"),
    ("constants.py", 'GPU_MEMORY_TYPE_WEIGHTS = "weights"'),
    # pause / continue (fake_sglang.py item 10; rollout/partial.py)
    ("entrypoints/http_server.py", '"Generation paused successfully."'),
    ("entrypoints/http_server.py", '"Generation continued successfully."'),
    ("managers/io_struct.py", 'mode: Literal["abort", "retract", "in_place"] = "abort"'),
    ("managers/tokenizer_manager.py", "self.abort_request(abort_all=True)"),
    ("managers/tokenizer_manager.py", "await self.is_pause_cond.wait_for(lambda: not self.is_pause)"),
    ("managers/scheduler.py", "req.to_finish = FINISH_ABORT()"),
    ("managers/schedule_batch.py", 'self.message = message or "Aborted"'),
]


def test_pause_runs_through_the_engines_tokenizer_manager(wheel):
    """sglang.Engine has no pause_generation method, but holds the TokenizerManager whose coroutines the server's
    /pause_generation awaits and the event loop its generate drives: what SGLangEngine.pause_generation uses."""
    assert "pause_generation" not in engine_methods(wheel)
    assert '@app.post("/pause_generation")' in wheel.text(PKG + "entrypoints/http_server.py")
    eng = wheel.text(PKG + "entrypoints/engine.py")
    for text in ("self.tokenizer_manager = tokenizer_manager", "self.loop = self._ensure_event_loop()",
                 "ret = self.loop.run_until_complete(generator.__anext__())"):
        assert text in eng, text
    tm = wheel.text(PKG + "managers/tokenizer_manager.py")
    for text in ("async def pause_generation(self, obj: PauseGenerationReqInput):",
                 "async def continue_generation(self, obj: ContinueGenerationReqInput):",
                 "async with self.model_update_lock.reader_lock:", "is_locked = await self.model_update_lock.is_locked()",
                 "await asyncio.sleep(1.0)"):
        assert text in tm, text
    assert "self._readers = 0" in wheel.text(PKG + "utils/aio_rwlock.py")
    assert "torch_empty_cache: bool = True" in wheel.text(PKG + "managers/io_struct.py")


@pytest.mark.parametrize("module,text", BEHAVIOUR_FACTS, ids=[f"{m}:{t[:30]}" for m, t in BEHAVIOUR_FACTS])
def test_stand_in_behaviour_is_the_wheels(wheel, module, text):
    assert text in wheel.text(PKG + module), f"sglang {wrapper.SGLANG_VERSION} {module} no longer contains {text!r}"


def test_abort_outputs_carry_no_routed_experts(wheel):
    src = wheel.text(PKG + "managers/tokenizer_manager.py")
    body = src[src.index("    def _handle_abort_req("):]
    body = body[:body.index("\n    def ", 10)]
    assert '"type": "abort"' in body and "routed_experts" not in body
