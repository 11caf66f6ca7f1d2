"""Images named by a request (OpenAI `image_url` parts), fetched and decoded under the server's media policy.

A request must not make the server read or connect anywhere the operator did not allow:
- `data:` URIs (base64) are always accepted;
- `file://` paths only inside --allowed-local-media-path (resolved, symlinks included, before the check);
- `http(s)://` URLs only to hosts in --allowed-media-domains (none by default: every remote URL is refused),
  with a byte limit while reading and one deadline for the whole fetch; a redirect is followed only to the
  same host (a redirect elsewhere is refused, never followed).
Every image is limited in bytes (--max-image-bytes) and in pixels (--max-image-pixels, checked from the header
before anything is decoded). Errors are ValueErrors with a one-line message: the server answers 400.
"""
from __future__ import annotations

import base64
import binascii
import io
import os
import time
from dataclasses import dataclass
from typing import Optional
from urllib.parse import unquote, urljoin, urlsplit

MAX_REDIRECTS = 3


@dataclass(frozen=True)
class MediaPolicy:
    allowed_local_media_path: Optional[str] = None  # file:// only inside this folder
    allowed_media_domains: tuple[str, ...] = ()      # http(s) hosts a request may name
    max_image_bytes: int = 20 << 20
    max_image_pixels: int = 64 << 20                 # decoded width x height (a decompression bomb's size)
    fetch_timeout_s: float = 10.0                    # the whole http(s) fetch, redirects included


def load_image(url: str, policy: MediaPolicy):
    """The PIL image (RGB) at url, or ValueError saying why not."""
    scheme = urlsplit(url).scheme.lower()
    if scheme == "data":
        data = _data_uri(url, policy)
    elif scheme == "file":
        data = _local_file(url, policy)
    elif scheme in ("http", "https"):
        data = _fetch(url, policy)
    else:
        raise ValueError(f"image_url must be a data:, file:// or http(s):// URL, got {url[:40]!r}")
    return decode_image(data, policy)


def decode_image(data: bytes, policy: MediaPolicy):
    from PIL import Image, UnidentifiedImageError  # imported where images are used: a text server never loads PIL

    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"the image cannot be decoded ({type(e).__name__}); send a PNG, JPEG, WebP or GIF") from None
    pixels = image.width * image.height
    if pixels > policy.max_image_pixels:
        raise ValueError(f"the image has {image.width}x{image.height} = {pixels} pixels, over this server's limit "
                         f"of {policy.max_image_pixels} (--max-image-pixels)")
    try:
        return image.convert("RGB")
    except (OSError, ValueError) as e:
        raise ValueError(f"the image cannot be decoded: {e}") from None


def _too_big(n: int, policy: MediaPolicy) -> ValueError:
    return ValueError(f"the image is {n} bytes or more, over this server's limit of {policy.max_image_bytes} bytes "
                      "(--max-image-bytes)")


def _data_uri(url: str, policy: MediaPolicy) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.lower().endswith(";base64"):
        raise ValueError("a data: image_url must be base64, as data:image/png;base64,<data>")
    if len(payload) * 3 // 4 > policy.max_image_bytes:
        raise _too_big(len(payload) * 3 // 4, policy)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the data: image_url is not valid base64") from None


def _local_file(url: str, policy: MediaPolicy) -> bytes:
    root = policy.allowed_local_media_path
    if root is None:
        raise ValueError("file:// image URLs are not allowed on this server (start it with "
                         "--allowed-local-media-path to allow a folder)")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ValueError("a file:// image URL must name a local path (file:///path)")
    path = os.path.realpath(unquote(parts.path))
    base = os.path.realpath(root)
    if os.path.commonpath([path, base]) != base:
        raise ValueError(f"file:// image URLs must lie inside {root} (--allowed-local-media-path)")
    try:
        size = os.path.getsize(path)
        if size > policy.max_image_bytes:
            raise _too_big(size, policy)
        with open(path, "rb") as f:
            return f.read(policy.max_image_bytes + 1)
    except OSError as e:
        raise ValueError(f"cannot read the image file: {e.strerror}") from None


def _check_host(url: str, policy: MediaPolicy) -> str:
    host = (urlsplit(url).hostname or "").lower()
    if not policy.allowed_media_domains:
        raise ValueError("remote image URLs are not allowed on this server (start it with --allowed-media-domains "
                         "to allow hosts); send the image as a data: URI")
    if host not in policy.allowed_media_domains:
        raise ValueError(f"image URL host {host!r} is not in this server's --allowed-media-domains")
    return host


def _fetch(url: str, policy: MediaPolicy) -> bytes:
    import httpx  # only for remote images, which a server allows explicitly

    host = _check_host(url, policy)
    deadline = time.monotonic() + policy.fetch_timeout_s
    with httpx.Client(follow_redirects=False, trust_env=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            left = deadline - time.monotonic()
            try:
                with client.stream("GET", url, timeout=max(left, 0.001)) as resp:
                    if resp.is_redirect:
                        url = urljoin(url, resp.headers.get("location", ""))
                        if urlsplit(url).scheme not in ("http", "https") or \
                                (urlsplit(url).hostname or "").lower() != host:
                            raise ValueError("the image URL redirects to another host; it is not followed")
                        continue
                    if resp.status_code != 200:
                        raise ValueError(f"fetching the image URL returned HTTP {resp.status_code}")
                    return _read_limited(resp, policy, deadline)
            except httpx.HTTPError as e:
                raise ValueError(f"cannot fetch the image URL: {type(e).__name__}") from None
    raise ValueError(f"the image URL redirects more than {MAX_REDIRECTS} times")


def _read_limited(resp, policy: MediaPolicy, deadline: float) -> bytes:
    declared = resp.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > policy.max_image_bytes:
        raise _too_big(int(declared), policy)
    buf = bytearray()
    for chunk in resp.iter_bytes():
        buf += chunk
        if len(buf) > policy.max_image_bytes:
            raise _too_big(len(buf), policy)
        if time.monotonic() > deadline:
            raise ValueError(f"fetching the image took over {policy.fetch_timeout_s:g} s")
    return bytes(buf)
