"""Mixture-of-experts layer: route → dispatch → expert compute → combine.

The four stages are separate calls so that expert parallelism can replace ``dispatch`` and
``combine`` (an all-to-all to the ranks owning the experts and back) without touching the
routing, the expert maths or the model files.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.engine.models.layers import DenseMLP
from pdserve.engine.weights import Checkpoint
from pdserve.kernels.backend import Backend, MoERouting


class MoE:
    """Routed experts (stacked per layer) plus optional always-on shared experts."""

    def __init__(
        self,
        ckpt: Checkpoint,
        backend: Backend,
        *,
        router_name: str,
        expert_names: tuple[str, str, str],  # templates for gate, up, down with {e}
        num_experts: int,
        hidden: int,
        intermediate: int,
        router: MoERouting,
        correction_bias_name: str | None = None,
        shared: DenseMLP | None = None,
    ) -> None:
        self.backend = backend
        self.num_experts = num_experts
        self.router = router
        self.gate = ckpt.get(router_name, (num_experts, hidden))
        self.correction_bias = (
            ckpt.get(correction_bias_name, (num_experts,), dtype=torch.float32) if correction_bias_name else None
        )
        gate_name, up_name, down_name = expert_names
        # w13 [E, 2I, H] stacks gate over up so one GEMM computes both; w2 [E, H, I].
        self.w13 = torch.stack(
            [
                torch.cat(
                    (
                        ckpt.get(gate_name.format(e=e), (intermediate, hidden)),
                        ckpt.get(up_name.format(e=e), (intermediate, hidden)),
                    )
                )
                for e in range(num_experts)
            ]
        )
        self.w2 = torch.stack([ckpt.get(down_name.format(e=e), (hidden, intermediate)) for e in range(num_experts)])
        self.shared = shared

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Router logits in float32, as the reference implementations compute them.
        router_logits = F.linear(x.float(), self.gate.float())
        weights, expert_ids = self.backend.route(router_logits, self.router, self.correction_bias)
        tokens = self.backend.dispatch(x, weights, expert_ids, self.num_experts)
        expert_out = self.backend.expert_mlp(tokens, self.w13, self.w2)
        out = self.backend.combine(expert_out, tokens, x.shape[0])
        if self.shared is not None:
            out = out + self.shared(x)
        return out
