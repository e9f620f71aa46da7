"""pdserve: disaggregated prefill/decode LLM serving.

Subpackages, in README's Layout order (each imports only those below it):

- ``cli``: the ``pdserve`` command line, one module per command group;
- ``launch``: ``pdserve up``: the registry, frontend and workers of one machine, supervised;
- ``operator``: the Kubernetes operator: PDServeDeployment → pods and status;
- ``planner``: the SLO planner: observe -> forecast -> decide -> act, and its scaling connectors;
- ``frontend``: the public gRPC and OpenAI HTTP APIs, request validation, the router and the request flow;
- ``worker``: the engine behind a gRPC service, in the prefill or the decode role;
- ``offline``: the offline API: ``LLM`` (generate, stream) in this process and its rank group;
- ``kvtransfer``: paged KV blocks moved between workers with NIXL: agents, layouts, pulls, notices;
- ``observability``: Prometheus metrics, and the latency statistics frontends publish;
- ``discovery``: everything pdserve keeps in etcd (registry, knobs, SLOs) and the client that reaches it;
- ``rpc``: what every gRPC server and client shares: server set-up, TLS, wire conversions;
- ``engine``: the step core: ``LLMEngine``, its scheduler, block pool, model runner and sampler;
- ``text``: tokenizers, the incremental detokenizer and chat templates;
- ``model``: checkpoints (HF, GGUF, FP8) to ``ModelConfig`` and a model, and the paged KV cache;
- ``distributed``: rank groups: a worker's processes and the collectives between them;
- ``kernels``: the ``Backend`` interface, its torch reference, the Triton kernels and the CPU backend;
- ``types``: light types other processes import (``EngineConfig``, ``SamplingParams``...), msgspec only;
- ``v1``: the generated protobuf and gRPC code of ``proto/pdserve/v1``.

Modules every component may use:

- ``__main__``: ``python -m pdserve``, the ``pdserve`` command (``pdserve.cli.main``);
- ``cache``: ``cache_root``, pdserve's per-user cache directory (compiled CPU kernels, the default model);
- ``environment``: the one reader of each ``PDSERVE_*`` environment variable;
- ``extras``: ``missing_extra``, a missing optional extra's package as an error naming the install command;
- ``lifecycle``: a server process's life: stack dumps on SIGUSR1, dying with its parent, ``cancel_and_wait``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.offline.llm import LLM, CompletionOutput
    from pdserve.types.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Imported on first use, so that commands that never run a model (the operator CLI, the
    # frontend) do not pay torch's import time.
    if name in ("LLM", "CompletionOutput"):
        from pdserve.offline import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from pdserve.types.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
