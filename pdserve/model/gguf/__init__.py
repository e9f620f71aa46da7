"""GGUF files (llama.cpp's format): reading, model configuration and weights.

- ``reader``: the file's header, metadata and tensor directory, every offset checked.
- ``dequant``: ggml block types to torch tensors.
- ``config``: a ``ModelConfig`` from the metadata (architectures llama and qwen2).
- ``checkpoint``: the tensors under Hugging Face names, dequantized, llama's Q/K un-permuted.

The embedded tokenizer and chat template are read by ``pdserve.text.gguf_tokenizer``.
"""
