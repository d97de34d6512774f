"""Adapters to external serving frameworks. Each subpackage imports its framework lazily and names the extra to
install when it is missing (``oscar-kv[vllm]`` for :mod:`oscarkv.integrations.vllm`)."""
