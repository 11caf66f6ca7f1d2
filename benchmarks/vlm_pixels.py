"""max_pixels, the image quality/speed dial: tokens per image and TTFT of one chat request with one image, at
several max_pixels, against one `tokenmill serve` of a random Qwen2.5-VL (`tokenmill bench serve --dataset
random-mm --endpoint chat`, the request's mm_processor_kwargs setting max_pixels).

No Qwen2.5-VL checkpoint ships offline, so the model is random with a small decoder and a vision tower of
--vision-depth blocks of --vision-hidden (the real 3B/7B tower: 32 blocks of 1280, window attention but in
blocks 7, 15, 23, 31): tokens per image are exactly the real model's (the processor is the same), TTFT is this
model's on this machine (vision tower plus a prefill of the image's tokens). Requests run one at a time, each
with a new image (no prefix-cache hit), a 32-token text and 8 output tokens. Prints a JSON result and one
summary line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from tokenmill.engine.prestart import openmp_wait_env  # noqa: E402  (light: no torch)

os.environ.update(openmp_wait_env())  # the OpenMP waiting the server's engine process gets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from models import build_vlm  # noqa: E402
from server_utils import ServerProc  # noqa: E402

from tokenmill.bench.serve import ServeConfig, run_benchmark  # noqa: E402
from tokenmill.multimodal.processor import ImageProcessor  # noqa: E402

DIAL = [28 * 28 * 1280, 28 * 28 * 512, 28 * 28 * 256, 28 * 28 * 128, 28 * 28 * 64]  # the default first


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--image-size", default="1024x768", help="WxH of every image")
    p.add_argument("--num-prompts", type=int, default=4, help="requests per max_pixels")
    p.add_argument("--vision-depth", type=int, default=8)
    p.add_argument("--vision-hidden", type=int, default=640)
    p.add_argument("--quick", action="store_true", help="3 requests, a 4-block tower")
    a = p.parse_args()
    depth = 4 if a.quick else a.vision_depth
    path = build_vlm(tempfile.mkdtemp(prefix="tokenmill-vlm-bench-"),
                     text_sizes=dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                                     num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192,
                                     rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                      "mrope_section": [8, 12, 12]}),
                     vision_sizes=dict(depth=depth, hidden_size=a.vision_hidden, num_heads=a.vision_hidden // 80,
                                       intermediate_size=a.vision_hidden * 27 // 10, window_size=112,
                                       fullatt_block_indexes=list(range(7, depth, 8)) or [depth - 1]),
                     max_pixels=DIAL[0])
    w, h = (int(v) for v in a.image_size.split("x"))
    proc = ImageProcessor.from_model_dir(path, 0)
    server = ServerProc(path, "--max-model-len", "8192", "--kv-cache-memory-bytes", "512MiB")
    rows = []
    try:
        for max_pixels in DIAL:
            cfg = ServeConfig(base_url=server.url, endpoint="chat", dataset="random-mm", mm_image_size=a.image_size,
                              input_len=32, output_len=8, num_prompts=3 if a.quick else a.num_prompts,
                              max_concurrency=1, warmup=1, progress=False,
                              extra_body={"mm_processor_kwargs": {"max_pixels": max_pixels}})
            s = run_benchmark(cfg)["summary"]
            rows.append({"max_pixels": max_pixels, "image_tokens": proc.with_options({"max_pixels": max_pixels})
                         .num_tokens(h, w), "prompt_tokens": s["total_input_tokens"] / max(1, s["completed"]),
                         "ttft_ms_p50": s["ttft_ms"]["median"], "ttft_ms_p90": s["ttft_ms"]["p90"],
                         "failed": s["failed"]})
    finally:
        server.stop()
    result = {"benchmark": "vlm_pixels", "image": a.image_size, "vision_depth": depth,
              "vision_hidden": a.vision_hidden, "rows": rows}
    print(json.dumps(result, indent=1))
    print("vlm_pixels: " + "; ".join(f"max_pixels {r['max_pixels']}: {r['image_tokens']} tokens/image, TTFT p50 "
                                     f"{r['ttft_ms_p50']:.0f} ms" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
