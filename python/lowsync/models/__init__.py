"""Model graphs for lowsync: llama-family decoders (`Llama`, `LlamaConfig`).

A model here is numpy weights plus a config; `Llama.build_graph` turns it into one
`lowsync.Graph` per shape bucket, and `lowsync.Session` runs those graphs. Loading from GGUF is
in `lowsync.gguf`; nothing in this package imports the `gguf` package until a file is saved.
"""

from __future__ import annotations

from lowsync.models.llama import BUILTIN_CONFIGS, Llama, LlamaConfig

__all__ = ["BUILTIN_CONFIGS", "Llama", "LlamaConfig"]
