"""The model code, in torch modules that call a kernel ``Backend`` for their heavy ops.

- ``base``: ``DecoderModel``, embedding, decoder layers, final norm and LM head, late joiners;
- ``layers``: linear layers (plain, merged, gated SwiGLU, FP8 block), RMSNorm, rotary tables;
- ``llama``: Llama, Qwen2, Qwen3, Mixtral and Qwen3-MoE;
- ``deepseek``: DeepSeek V2 and V3 (MLA attention, shared and routed experts);
- ``moe``: the routed experts, local or spread over expert-parallel ranks;
- ``expert_placement`` and ``eplb``: which rank holds which expert, and rebalancing it;
- ``kv_quant``: per-layer scales of an FP8 KV cache;
- ``tensor_parallel``: how weights split over tensor-parallel ranks.
"""
