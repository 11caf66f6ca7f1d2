"""Image content parts of chat messages, as both fronts read them (serve/images.py, LLM.chat): OpenAI's
`{"type": "image_url", "image_url": {"url": ...}}` (or vLLM's `{"type": "image", "image": url}`). The chat
template sees each as `{"type": "image"}` and writes the model's placeholder for it; the URLs are loaded
afterwards, in the order the template wrote them (conversation order)."""
from __future__ import annotations

from typing import Any, Optional, Union

IMAGE_PART_TYPES = ("image_url", "image")


def part_url(part: dict) -> Optional[str]:
    """The URL of an image part, or None when it names none."""
    value = part.get("image_url", part.get("image"))
    url = value.get("url") if isinstance(value, dict) else value
    return url if isinstance(url, str) and url else None


def template_content(content: Any) -> tuple[Any, list[str]]:
    """A message's content for the template (images as {"type": "image"}; text-only lists joined into one
    string, as before images) and its image URLs. ValueError for an image part without a URL."""
    if not isinstance(content, list):
        return content, []
    parts: list[dict] = []
    urls: list[str] = []
    for part in content:
        if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
            url = part_url(part)
            if url is None:
                raise ValueError("an image_url part needs image_url.url (a data:, file:// or http(s) URL)")
            urls.append(url)
            parts.append({"type": "image"})
        else:
            parts.append(part)
    if urls:
        return parts, urls
    return _joined(parts), urls


def _joined(parts: list) -> Union[str, list]:
    texts = [p.get("text") for p in parts if isinstance(p, dict)]
    return "\n".join(texts) if len(texts) == len(parts) and all(isinstance(t, str) for t in texts) else parts
