"""kv_transfer_params: what a request may carry for disaggregated prefill/decode, and whom a decode instance pulls
from.

The keys (vLLM's names): a prefill request carries {"do_remote_decode": true}; a prefill instance's finished
request returns {"do_remote_prefill": true, "remote_engine_id", "remote_host", "remote_port", "remote_request_id",
"remote_block_ids", "num_tokens", "kv_fingerprint", "first_token_id"} (p2p_scheduler.py), which the router hands
to the decode instance. vLLM's proxy also sends some of them as null: null is the same as absent. Anything else,
or a value of the wrong type or range, is refused (a 400 at the API, a rejected request in the engine).

A decode instance connects to remote_host:remote_port and sends a pull request there. Those come in the request,
so a client that could choose them could aim the server at any port it can reach (SSRF). A consumer therefore
pulls only from the prefill instances its operator listed: kv_connector_extra_config.allowed_peers in its
--kv-transfer-config (`tokenmill serve --disaggregate` lists the prefill instances it launches). Without the
list it pulls from nobody: a pull target in a request is refused, never tried.
"""
from __future__ import annotations

import socket
from typing import Annotated, Any, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tokenmill.config import KVTransferConfig, peer_address

_U31 = Annotated[int, Field(ge=0, le=2**31 - 1)]
_Text = Annotated[str, Field(min_length=1, max_length=256)]
MAX_REMOTE_BLOCKS = 2**20  # a 1M-token context in blocks of 1; the request body's size bound applies first
PULL_KEYS = ("remote_host", "remote_port", "remote_request_id", "remote_block_ids", "kv_fingerprint")


class KVTransferParams(BaseModel):
    """Every key tokenmill reads; strict: no "5" for 5, no true for 1."""
    model_config = ConfigDict(extra="forbid", strict=True)

    do_remote_decode: Optional[bool] = None
    do_remote_prefill: Optional[bool] = None
    remote_engine_id: Optional[_Text] = None
    remote_host: Optional[Annotated[str, Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9.:_%\-]+$")]] = None
    remote_port: Optional[Annotated[int, Field(ge=1, le=65535)]] = None
    remote_request_id: Optional[_Text] = None
    remote_block_ids: Optional[Annotated[list[_U31], Field(max_length=MAX_REMOTE_BLOCKS)]] = None
    num_tokens: Optional[_U31] = None
    kv_fingerprint: Optional[Annotated[str, Field(max_length=128, pattern=r"^[0-9a-f]*$")]] = None
    first_token_id: Optional[_U31] = None

    @model_validator(mode="after")
    def _pull_names_its_source(self) -> "KVTransferParams":
        missing = [k for k in PULL_KEYS if getattr(self, k) is None] if self.do_remote_prefill else []
        if missing:
            raise ValueError(f"do_remote_prefill needs {', '.join(missing)} (the prefill instance's answer "
                             "carries them)")
        return self


def as_dict(params: KVTransferParams) -> dict[str, Any]:
    """What travels to the engine: the keys that were set, nulls dropped."""
    return params.model_dump(exclude_none=True)


def validated(params: Any) -> KVTransferParams:
    """params as KVTransferParams; ValueError with a one-line message naming the first bad key."""
    try:
        return KVTransferParams.model_validate(params)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        msg = str(err.get("msg")).removeprefix("Value error, ")
        raise ValueError(f"kv_transfer_params{'.' + where if where else ''}: {msg}") from None


def check_pull_source(params: KVTransferParams, cfg: Optional[KVTransferConfig]) -> None:
    """ValueError unless a pull these params ask for (if any) comes from a peer this consumer's operator listed.
    An instance that is not a consumer never pulls: its params are ignored, as before."""
    if not (params.do_remote_prefill and cfg is not None and cfg.is_consumer):
        return
    if (params.remote_host, params.remote_port) not in cfg.allowed_peers:
        listed = ", ".join(sorted(peer_address(h, p) for h, p in cfg.allowed_peers)) or "none"
        raise ValueError(f"kv_transfer_params: {peer_address(params.remote_host, params.remote_port)} is not a "
                         f"prefill instance this server pulls KV from (its --kv-transfer-config "
                         f"kv_connector_extra_config.allowed_peers: {listed})")


def check_request_params(params: Optional[dict], cfg: Optional[KVTransferConfig]) -> None:
    """Both checks on a request's raw kv_transfer_params (None: nothing to check)."""
    if params is not None:
        check_pull_source(validated(params), cfg)


def advertised_host(bind_host: str) -> str:
    """The address a decode instance should pull from: the bind address, or for a wildcard bind (0.0.0.0, ::)
    this machine's address on its default route (no packet is sent: a UDP socket only picks the route)."""
    if bind_host not in ("0.0.0.0", "::", ""):
        return bind_host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: never routed anywhere, only chosen a route for
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())
