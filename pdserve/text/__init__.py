"""Text: token ids to and from strings, and chat messages to a prompt.

- ``tokenizer``: ``Tokenizer`` (a Hugging Face ``tokenizer.json`` or a GGUF file's) and
  ``find_tokenizer``, the one dispatch between the two;
- ``gguf_tokenizer``: the byte-level BPE a GGUF file embeds, rebuilt, and its chat template;
- ``detokenizer``: incremental detokenization for streams, stop strings held back;
- ``chat_template``: a model's Jinja chat template, rendered as transformers renders it;
- ``tool_calls``: a model family's tool-call format, recognised from its chat template, and parsed;
- ``grammar``: structured outputs (JSON schema, regex, choice, grammar) checked and compiled on
  llguidance, once per distinct spec.

Only ``gguf_tokenizer`` imports torch (through the GGUF reader), and only for GGUF models.
"""
