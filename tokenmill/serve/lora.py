"""The server's LoRA adapters (--enable-lora): served under their own model names, `--lora-modules name=path` at
start and `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` at run time (vLLM's endpoints). A request
selects one with its `model`; /v1/models lists them with the base model as parent.

Each load checks the folder's adapter_config.json here (tokenmill/lora.py reads nothing else: a path that is
not a directory holding one is a 400), then gives it a fresh lora_int_id: the engine loads the weights by path
at the adapter's first request and keys its prefix cache by that id, so an adapter unloaded and loaded again
never meets the old one's cached KV. Requests already running on an unloaded adapter finish on it.
"""
from __future__ import annotations

import itertools
from typing import Optional

from tokenmill.config import LoRAConfig
from tokenmill.http.errors import APIError, bad_request
from tokenmill.lora import LoRARequest, read_adapter_config


def parse_lora_modules(values: Optional[list[str]]) -> list[tuple[str, str]]:
    """--lora-modules name=path ... as (name, path) pairs."""
    pairs = []
    for value in values or []:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path, got {value!r}")
        pairs.append((name, path))
    return pairs


class LoRAAdapters:
    """Adapters by served name. base_name: the base model's, which no adapter may take."""

    def __init__(self, config: Optional[LoRAConfig], base_name: str) -> None:
        self.config, self.base_name = config, base_name
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def get(self, name: str) -> Optional[LoRARequest]:
        return self.adapters.get(name)

    def load(self, name: str, path: str) -> LoRARequest:
        """APIError 400 for LoRA off, a taken name or an adapter that is not a valid one within the limits."""
        if self.config is None:
            raise bad_request("LoRA adapters need the server started with --enable-lora", "lora_name")
        if not isinstance(name, str) or not name or name == self.base_name or name in self.adapters:
            raise bad_request(f"LoRA adapter name {name!r} is empty, the base model's or already loaded "
                              "(unload it first)", "lora_name")
        try:
            read_adapter_config(path, self.config.max_lora_rank)
        except ValueError as e:
            raise bad_request(str(e), "lora_path") from None
        lora = LoRARequest(name, next(self._ids), path)
        self.adapters[name] = lora
        return lora

    def unload(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise APIError(404, f"The LoRA adapter `{name}` is not loaded.", param="lora_name",
                           code="model_not_found")

    def cards(self, created: int) -> list[dict]:
        """/v1/models entries, one per adapter."""
        return [{"id": name, "object": "model", "created": created, "owned_by": "tokenmill", "root": lora.lora_path,
                 "parent": self.base_name, "permission": []} for name, lora in self.adapters.items()]
