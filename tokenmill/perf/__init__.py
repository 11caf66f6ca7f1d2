"""The cost model's leaves, imported by the engine, the dashboard and the tools alike and importing nothing of
tokenmill's above them: the hardware catalog and this machine's measured figures (hardware.py)."""
