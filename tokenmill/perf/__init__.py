"""The cost model: hardware figures, memory, roofline and parallel arithmetic (hardware.py, memory.py,
roofline.py, parallel.py, gguf_bytes.py). The engine, the dashboard and the tools share it; it imports nothing
of tokenmill's above it (tests/test_layering.py)."""
