"""An image in a request, as the front preprocessed it: where its placeholder tokens sit in the prompt and its
resized pixels, which the worker normalizes and cuts into the patches its vision tower encodes (patch_values).
Carried in EngineCoreRequest (API -> engine) and NewRequest (engine -> worker), so both contracts import it
from here. The pixels travel as the resized RGB bytes, not as float32 patches: 8x fewer bytes (4 for the
float, 2 for the temporal patch's copy), held by the engine for as long as the request may be recomputed."""
from __future__ import annotations

from typing import Optional

import msgspec
import numpy as np


class ImageInput(msgspec.Struct, array_like=True, frozen=True):
    offset: int                      # prompt index of its first placeholder token
    num_tokens: int                  # its placeholder tokens (= merged patches, t*h*w / merge^2)
    grid_thw: tuple[int, int, int]   # the patch grid (frames, rows, columns)
    pixels: bytes                    # the resized image, uint8 RGB [rows * patch, columns * patch, 3]
    image_mean: tuple[float, ...]    # per channel, of pixels / 255 (the processor's normalization)
    image_std: tuple[float, ...]
    content_hash: str                # of the pixels, grid and normalization: its prefix-cache key

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


def patch_values(image: ImageInput, p: int, merge: int, temporal: int) -> np.ndarray:
    """The image's patches (p x p pixels) as its processor makes them (transformers' PIL backend, bit for bit):
    normalized float32 [rows * columns, 3 * temporal * p^2] in merge-block order (each merge x merge block's patches together, row
    by row), each patch repeated over the temporal patch."""
    _, gh, gw = image.grid_thw
    x = np.frombuffer(image.pixels, dtype=np.uint8).reshape(gh * p, gw * p, 3)
    x = (x.astype(np.float64) * (1 / 255)).astype(np.float32)
    x = ((x - np.asarray(image.image_mean, np.float32)) / np.asarray(image.image_std, np.float32)).astype(np.float32)
    x = x.transpose(2, 0, 1).reshape(3, gh // merge, merge, p, gw // merge, merge, p).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], temporal, p, p))
    return np.ascontiguousarray(x.reshape(gh * gw, 3 * temporal * p * p))


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
