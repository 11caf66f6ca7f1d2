"""Qwen2-VL's image processor (Qwen2.5-VL uses it as is), as transformers' PIL backend computes it: RGB, resize
(bicubic) to the nearest multiple of patch x merge within [min_pixels, max_pixels] (smart_resize); the worker
then rescales to [0, 1], normalizes per channel and patchifies (step/multimodal.patch_values). max_pixels /
min_pixels are the quality/speed dial: an image costs (h/28) x (w/28) tokens.

The prompt names each image with one placeholder token (`<|image_pad|>`, as the chat template writes it);
expand_prompt widens the i-th to the i-th image's token count and records where each image sits.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np

from tokenmill.config import MM_PIXEL_KEYS as PIXEL_KEYS  # mm_processor_kwargs a request or the server may set
from tokenmill.step.multimodal import ImageInput


@dataclass(frozen=True)
class ImageProcessor:
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    image_token_id: int = -1

    @classmethod
    def from_model_dir(cls, model_dir: str, image_token_id: int) -> "ImageProcessor":
        """From the folder's preprocessor_config.json (defaults where it is missing)."""
        path = os.path.join(model_dir, "preprocessor_config.json")
        cfg = {}
        if os.path.isfile(path):
            with open(path) as f:
                cfg = json.load(f)
        size = cfg.get("size") or {}
        fields = {k: cfg[k] for k in ("patch_size", "temporal_patch_size", "merge_size") if k in cfg}
        for key, alias in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            value = cfg.get(key, size.get(alias))
            if value is not None:
                fields[key] = int(value)
        for key in ("image_mean", "image_std"):
            if key in cfg:
                fields[key] = tuple(cfg[key])
        return cls(image_token_id=image_token_id, **fields)

    def with_options(self, options: Optional[dict]) -> "ImageProcessor":
        """This processor with mm_processor_kwargs applied (max_pixels, min_pixels); ValueError for others."""
        if not options:
            return self
        unknown = sorted(set(options) - set(PIXEL_KEYS))
        if unknown:
            raise ValueError(f"unsupported mm_processor_kwargs {', '.join(unknown)}; "
                             f"supported: {', '.join(PIXEL_KEYS)}")
        values = {}
        for key in PIXEL_KEYS:
            if key in options:
                v = options[key]
                if isinstance(v, bool) or not isinstance(v, int) or v < self.unit ** 2:
                    raise ValueError(f"mm_processor_kwargs {key} must be an integer >= {self.unit ** 2} "
                                     f"(one {self.unit}x{self.unit} token), got {v!r}")
                values[key] = v
        out = replace(self, **values)
        if out.min_pixels > out.max_pixels:
            raise ValueError(f"mm_processor_kwargs min_pixels {out.min_pixels} exceeds max_pixels {out.max_pixels}")
        return out

    @property
    def unit(self) -> int:
        """Pixels per side of one merged token."""
        return self.patch_size * self.merge_size

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """Qwen2-VL's smart_resize: multiples of the unit, the pixel count within [min_pixels, max_pixels], the
        aspect ratio kept as closely as that allows."""
        if max(height, width) / min(height, width) > 200:
            raise ValueError(f"the image's aspect ratio {max(height, width) / min(height, width):.0f}:1 is over 200:1")
        u = self.unit
        h, w = round(height / u) * u, round(width / u) * u
        if h * w > self.max_pixels:
            scale = math.sqrt(height * width / self.max_pixels)
            h, w = max(u, math.floor(height / scale / u) * u), max(u, math.floor(width / scale / u) * u)
        elif h * w < self.min_pixels:
            scale = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * scale / u) * u, math.ceil(width * scale / u) * u
        return h, w

    def num_tokens(self, height: int, width: int) -> int:
        h, w = self.target_size(height, width)
        return (h // self.unit) * (w // self.unit)

    def resize(self, image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """A PIL image -> (its RGB pixels resized to the patch grid, uint8 [h * patch, w * patch, 3], grid
        (1, h, w)). The worker normalizes and patchifies them (step/multimodal.patch_values)."""
        from PIL import Image  # the API process's and LLM's only PIL use; a text-only server never imports it

        height, width = self.target_size(image.height, image.width)
        rgb = image.convert("RGB").resize((width, height), resample=Image.Resampling.BICUBIC)
        return np.asarray(rgb, dtype=np.uint8), (1, height // self.patch_size, width // self.patch_size)

    def image_input(self, image, offset: int) -> ImageInput:
        """The engine's record of a PIL image whose placeholder tokens start at prompt index `offset`."""
        pixels, grid = self.resize(image)
        digest = hashlib.blake2b(pixels.tobytes(), digest_size=16)
        digest.update(repr((grid, self.image_mean, self.image_std)).encode())
        return ImageInput(offset, grid[0] * grid[1] * grid[2] // self.merge_size ** 2, grid, pixels.tobytes(),
                          self.image_mean, self.image_std, digest.hexdigest())

    def expand_prompt(self, token_ids: Sequence[int], images: Sequence) -> tuple[list[int], list[ImageInput]]:
        """The prompt with its i-th placeholder widened to image i's tokens, and the images as the engine takes
        them. ValueError when the placeholders and images do not pair up."""
        slots = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if len(slots) != len(images):
            raise ValueError(f"the prompt has {len(slots)} image placeholder tokens but {len(images)} images were "
                             "given; each image needs one (the chat template writes them)")
        out: list[int] = []
        inputs: list[ImageInput] = []
        prev = 0
        for slot, image in zip(slots, images):
            out.extend(token_ids[prev:slot])
            inputs.append(self.image_input(image, len(out)))
            out.extend([self.image_token_id] * inputs[-1].num_tokens)
            prev = slot + 1
        out.extend(token_ids[prev:])
        return out, inputs
