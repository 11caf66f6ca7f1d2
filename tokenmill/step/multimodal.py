"""An image in a request, as the front preprocessed it: where its placeholder tokens sit in the prompt and the
patches the worker's vision tower encodes. Carried in EngineCoreRequest (API -> engine) and NewRequest
(engine -> worker), so both contracts import it from here."""
from __future__ import annotations

from typing import Optional

import msgspec


class ImageInput(msgspec.Struct, array_like=True, frozen=True):
    offset: int                      # prompt index of its first placeholder token
    num_tokens: int                  # its placeholder tokens (= merged patches, t*h*w / merge^2)
    grid_thw: tuple[int, int, int]   # the patch grid (frames, rows, columns)
    pixel_values: bytes              # float32 [t*h*w, channels * temporal_patch * patch^2], native byte order
    content_hash: str                # of the preprocessed pixels and grid: its prefix-cache key

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


def image_cache_key(images: list[ImageInput], start: int, end: int) -> str:
    """The prefix-cache key part of the prompt tokens [start, end): the hashes of the images placed there (two
    requests with the same placeholder token ids and different images must not share KV)."""
    return ",".join(i.content_hash for i in images if i.offset < end and i.end > start)


def check_images(prompt_token_ids: list[int], images: list[ImageInput], image_token_id: Optional[int]) -> None:
    """ValueError unless the images sit on the prompt's placeholder tokens, in order, covering every one (a
    model without images takes none): the worker scatters their tokens over exactly those rows."""
    if not images:
        if image_token_id is not None and image_token_id in prompt_token_ids:
            raise ValueError("the prompt holds image placeholder tokens but no image was given")
        return
    if image_token_id is None:
        raise ValueError("this model is not a vision-language model; it takes no images")
    end = 0
    for img in images:
        if img.offset < end or img.end > len(prompt_token_ids) or \
                any(t != image_token_id for t in prompt_token_ids[img.offset:img.end]):
            raise ValueError(f"an image's {img.num_tokens} tokens at prompt index {img.offset} are not its "
                             "placeholder tokens")
        end = img.end
    if prompt_token_ids.count(image_token_id) != sum(i.num_tokens for i in images):
        raise ValueError("the prompt holds image placeholder tokens no image fills")
