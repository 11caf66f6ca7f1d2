"""Chat image parts (`{"type": "image_url", "image_url": {"url": ...}}`) for a vision-language model: the chat
template sees each as an image part (it writes the model's placeholder), and after rendering the images are
fetched under the server's media policy (multimodal/media.py), preprocessed, and laid into the prompt
(engine/frontend.prepare_images). Every refusal is a 400, and the count and the model are checked before
anything is fetched."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from tokenmill.engine.frontend import prepare_images
from tokenmill.http.errors import bad_request
from tokenmill.multimodal.chat import IMAGE_PART_TYPES, part_url
from tokenmill.multimodal.media import load_image
from tokenmill.serve.serving import Prompt, off_loop

if TYPE_CHECKING:
    from tokenmill.serve.api_server import ServerState

def image_url(part: dict, where: str) -> str:
    """The URL of an image content part (multimodal/chat.py), else a 400 naming the part."""
    url = part_url(part)
    if url is None:
        raise bad_request(f"{where}: an image_url part needs image_url.url (a data:, file:// or http(s) URL)",
                          "messages")
    return url


def image_urls(messages) -> list[tuple[str, str]]:
    """Every image part's (URL, the content it is in), in conversation order (the order the template writes the
    placeholders)."""
    return [(image_url(part, f"messages[{i}].content[{j}]"), f"messages[{i}].content")
            for i, m in enumerate(messages) if isinstance(m.content, list)
            for j, part in enumerate(m.content) if part.get("type") in IMAGE_PART_TYPES]


async def attach_images(state: "ServerState", prompt: Prompt, parts: list[tuple[str, str]],
                        options: Optional[dict[str, Any]]) -> Prompt:
    """The rendered prompt with its images (in a worker thread: fetching, decoding and resizing take long).
    A refusal names the content of the first image's message."""
    if not parts:
        return prompt
    urls = [url for url, _ in parts]
    try:
        if state.image_processor is None:
            raise ValueError(f"the model `{state.model_name}` is not a vision-language model; it takes no images")
        limit = state.config.model.max_images_per_prompt
        if len(urls) > limit:
            raise ValueError(f"{len(urls)} images in one prompt; at most {limit} are allowed (--limit-mm-per-prompt)")
        state.image_processor.with_options(options)  # a bad mm_processor_kwargs before any fetch
        ids, mm = await off_loop(_load_and_prepare, state, prompt.token_ids, urls, options)
    except ValueError as e:
        raise bad_request(str(e), parts[0][1]) from None
    return Prompt(prompt.text, ids, mm)


def _load_and_prepare(state: "ServerState", ids: list[int], urls: list[str], options):
    images = [load_image(u, state.media) for u in urls]
    return prepare_images(ids, images, state.image_processor, state.config, options)
