"""GGUF files (llama.cpp's format): reading, model configuration, weights and tokenizer.

- ``reader``: the file's header, metadata and tensor directory, every offset checked.
- ``config``: a ``ModelConfig`` from the metadata (architectures llama and qwen2).
- ``checkpoint``: the tensors under Hugging Face names, dequantized, llama's Q/K un-permuted.
- ``tokenizer``: the embedded BPE tokenizer and chat template.
"""
