"""The offline API: ``LLM`` runs an engine in this process (and its rank group, if any).

- ``llm``: ``LLM.generate`` and ``LLM.stream``, ``CompletionOutput``;
- ``generation``: a ``generate`` call's requests stepped to completion, dealt over DP ranks;
- ``rank_main``: the program of ranks 1..N-1 of an ``LLM``'s group.
"""
