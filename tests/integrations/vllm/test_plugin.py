"""The plugin's registration with vLLM 0.26.0 (imports vLLM, starts no engine; skipped without vLLM)."""

import types

import pytest
import torch

vllm = pytest.importorskip("vllm")

from oscarkv.integrations import vllm as plugin  # noqa: E402
from oscarkv.integrations.vllm.options import OscarVllmError  # noqa: E402


def test_other_vllm_versions_are_refused(monkeypatch):
    with pytest.raises(OscarVllmError, match=r"vllm==0\.26\.0 only \(found 0\.27\.0\)"):
        plugin.check_vllm_version("0.27.0")
    monkeypatch.setattr(vllm, "__version__", "0.25.1")
    with pytest.raises(OscarVllmError, match="found 0.25.1"):
        plugin.register()


def test_register_backend_spec_and_spec_wrapper():
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from oscarkv.integrations.vllm.backend import OscarAttentionBackend, OscarAttentionSpec

    plugin.register()
    plugin.register()  # idempotent
    assert AttentionBackendEnum.CUSTOM.get_class() is OscarAttentionBackend
    if current_platform.is_cpu():
        assert AttentionBackendEnum.CPU_ATTN.get_class() is OscarAttentionBackend
    assert getattr(Attention.get_kv_cache_spec, "_oscar", False)
    spec = OscarAttentionSpec(block_size=64, num_kv_heads=8, head_size=128, dtype=torch.uint8,
                              oscar_page_bytes=36864)
    assert spec.page_size_bytes == 36864 and OscarAttentionSpec.merge([spec, spec]) == spec
    other = OscarAttentionSpec(block_size=64, num_kv_heads=8, head_size=128, dtype=torch.uint8,
                               oscar_page_bytes=53248)
    with pytest.raises(AssertionError):  # vLLM's signal to keep one page size per layer (UniformTypeKVCacheSpecs)
        OscarAttentionSpec.merge([spec, other])
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    groups = get_kv_cache_groups(types.SimpleNamespace(scheduler_config=types.SimpleNamespace(
        disable_hybrid_kv_cache_manager=False)), {"a": spec, "b": other})
    assert len(groups) == 1 and isinstance(groups[0].kv_cache_spec, UniformTypeKVCacheSpecs)
    assert groups[0].kv_cache_spec.page_size_bytes == 36864 + 53248
    bf16 = FullAttentionSpec(block_size=64, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    assert bf16.page_size_bytes / spec.page_size_bytes == 4096 / 576  # 7.1x more tokens per byte
    assert KVCacheSpecRegistry.get_manager_class(spec) is FullAttentionManager
    assert KVCacheSpecRegistry.get_uniform_type_base_spec(spec) is FullAttentionSpec


def test_oscar_config_reaching_another_backend_fails_instead_of_serving_bf16():
    from vllm.model_executor.layers.attention.attention import Attention

    plugin.register()
    layer = types.SimpleNamespace(impl=object(), layer_name="model.layers.0.self_attn.attn")
    cfg = types.SimpleNamespace(additional_config={"oscar": {"method": "bf16"}})
    with pytest.raises(OscarVllmError, match="--attention-backend CUSTOM"):
        Attention.get_kv_cache_spec(layer, cfg)


def test_kv_cache_shape_is_block_major():
    from oscarkv.integrations.vllm.backend import OscarAttentionBackend

    assert OscarAttentionBackend.get_kv_cache_shape(10, 64, 8, 128) == (10, -1)
    assert OscarAttentionBackend.get_kv_cache_block_dim(64, 8, 128) == 0
