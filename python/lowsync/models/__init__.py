"""Model graphs for lowsync: llama-family decoders (`Llama`, `LlamaConfig`).

A model here is numpy weights plus a config; `Llama.build_graph` turns it into one
`lowsync.Graph` per shape bucket, and `lowsync.Session` runs those graphs. Loading from GGUF is
in `lowsync.gguf`, which sits above this package; `Llama.save_gguf` calls down into
`lowsync.gguf_writer`, which knows models only by protocol, so no import goes in a circle.
Nothing here imports the `gguf` package until a file is saved.
"""

from __future__ import annotations

from lowsync.models.llama import BUILTIN_CONFIGS, Llama, LlamaConfig, ModelError

__all__ = ["BUILTIN_CONFIGS", "Llama", "LlamaConfig", "ModelError"]
