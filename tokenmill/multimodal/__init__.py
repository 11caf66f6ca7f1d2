"""Image input for vision-language models, the fronts' half: fetching and decoding images under the server's
media policy (media.py), and the model's image processor, which resizes and patchifies them and lays their
placeholder tokens into the prompt (processor.py). The engine's half is step/multimodal.py (the contract) and
worker/multimodal.py (the encoder cache and M-RoPE positions)."""
