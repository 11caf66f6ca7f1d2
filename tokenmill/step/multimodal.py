"""An image in a request, as the front preprocessed it: where its placeholder tokens sit in the prompt and the
patches the worker's vision tower encodes. Carried in EngineCoreRequest (API -> engine) and NewRequest
(engine -> worker), so both contracts import it from here."""
from __future__ import annotations

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
