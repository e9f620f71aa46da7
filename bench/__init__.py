"""pdserve's benchmarks, each a module run from the repository root as ``python -m bench.NAME``
(``--help`` on each; README.md's Benchmarks and bench/RESULTS.md say what they measure):

- ``all_to_all``: the expert-parallel dispatch and combine over a group of ranks (``torchrun -m``).
- ``cli_start``: process start to the request at a server, for ``pdserve generate --target``.
- ``chaos``: a soak under steady load while workers are killed and paused and etcd restarts.
- ``cpu_attention`` / ``cpu_linear``: the CPU attention and linear kernels, against another build.
- ``decode_profile``: a batch-1 decode step's device time against its wall time, and kernels per token (GPU).
- ``default_model``: the default model's load time and ``pdserve generate``, end to end.
- ``gpu_check`` (run as ``bench/gpu_check.sh``): every GPU check in one run, for a short lease; ``--dry`` on CPU.
- ``group_start``: a worker group's start, its loss of a rank or of its leader, and its restart.
- ``hosts``: a KV pull and a small gloo all_reduce between two hosts (network namespaces) against within one.
- ``kernels``: the GPU kernels against the device's roofline.
- ``kv_transfer``: NIXL transfer bandwidth of the KV layouts.
- ``migration``: a decode worker SIGKILLed under streams of ``pdserve up``.
- ``offline`` (and ``offline_peer``, its vLLM child): offline throughput against transformers and vLLM-CPU.
- ``planner_sim``: the SLO planner in the cluster simulator.
- ``serve`` (and ``serve_report``): online serving, disaggregated against colocated.
- ``serve_peer`` (``serve_peer_deploy``, ``serve_peer_proxy``): pdserve and vLLM-CPU with vLLM's client.
- ``lib``: what the benches share: deployments, load, the machine, report helpers.
"""
