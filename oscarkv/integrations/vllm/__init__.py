"""OSCAR 2-bit KV cache inside vLLM 0.26.0 (install ``oscar-kv[vllm]``).

The ``vllm.general_plugins`` entry point :func:`register` runs in every vLLM process. It

* refuses any vLLM other than the pinned release (the attention-backend API changes between releases);
* registers :class:`~.backend.OscarAttentionBackend` as vLLM's ``CUSTOM`` backend (on vLLM's CPU platform, which
  ignores ``CUSTOM``, in the ``CPU_ATTN`` slot instead);
* registers the packed page spec and wraps ``Attention.get_kv_cache_spec`` so vLLM sizes its pages in packed
  bytes, and so an ``"oscar"`` config that reaches another backend fails at start-up instead of silently
  serving BF16.

Serve::

    vllm serve MODEL --attention-backend CUSTOM --block-size 64 --no-enable-prefix-caching \\
        --additional-config '{"oscar": {"calibration": "/path/to/artifact"}}'
"""

from __future__ import annotations

from .options import PINNED_VLLM, OscarOptions, OscarVllmError

_REGISTERED = False


def check_vllm_version(version: str) -> None:
    """Raise :class:`OscarVllmError` unless ``version`` is the pinned vLLM release."""
    if version != PINNED_VLLM:
        raise OscarVllmError(
            f"oscar-kv's vLLM plugin supports vllm=={PINNED_VLLM} only (found {version}): install "
            f"'oscar-kv[vllm]' (pins vllm=={PINNED_VLLM}), or disable the plugin with VLLM_PLUGINS=<other plugins>"
        )


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group (idempotent; called once per vLLM process)."""
    global _REGISTERED
    try:
        import vllm
    except ImportError as e:  # pragma: no cover - the entry point only runs inside vLLM
        raise ImportError("the OSCAR vLLM plugin needs vLLM: pip install 'oscar-kv[vllm]'") from e
    check_vllm_version(vllm.__version__)
    if _REGISTERED:
        return
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    path = "oscarkv.integrations.vllm.backend.OscarAttentionBackend"
    register_backend(AttentionBackendEnum.CUSTOM, path)
    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, path)
    _register_spec()
    _wrap_get_kv_cache_spec()
    _REGISTERED = True
    import logging
    import os

    logging.getLogger("vllm.oscarkv").info("oscar-kv vLLM plugin registered in process %d", os.getpid())


def _register_spec() -> None:
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from .backend import OscarAttentionSpec

    KVCacheSpecRegistry._ensure_registered()  # built-ins first: registering ours alone would shadow them
    KVCacheSpecRegistry.register(OscarAttentionSpec, FullAttentionManager, uniform_type_base_spec=FullAttentionSpec)


def _wrap_get_kv_cache_spec() -> None:
    from vllm.model_executor.layers.attention.attention import Attention

    from .backend import OscarAttentionImpl

    original = Attention.get_kv_cache_spec
    if getattr(original, "_oscar", False):
        return

    def get_kv_cache_spec(self, vllm_config):
        impl = getattr(self, "impl", None)
        if isinstance(impl, OscarAttentionImpl):
            return impl.kv_cache_spec(self, vllm_config, original)
        if OscarOptions.from_additional_config(vllm_config.additional_config) is not None:
            raise OscarVllmError(
                f"--additional-config has an \"oscar\" section but layer {self.layer_name} uses the "
                f"{type(impl).__name__} backend: select OSCAR with --attention-backend CUSTOM "
                "(attention_config={'backend': 'CUSTOM'})"
            )
        return original(self, vllm_config)

    get_kv_cache_spec._oscar = True
    Attention.get_kv_cache_spec = get_kv_cache_spec


__all__ = ["register", "check_vllm_version", "OscarVllmError", "OscarOptions"]
