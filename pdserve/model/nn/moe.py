"""Mixture-of-experts layer: route → dispatch → expert compute → combine.

Three ways to run it, by the rank group's shape:
- one rank, or tensor parallelism alone: every rank holds every expert, with a slice of each
  expert's intermediate size; the partial outputs are summed by the one all-reduce of the MLP;
- expert parallelism over tensor-parallel ranks (Mixtral with TP and EP): the ranks see the
  same tokens and hold different experts; each computes its experts' share, and the same one
  all-reduce sums them;
- expert parallelism over data-parallel ranks (DeepSeek with DP attention): each rank has its
  own tokens; an all-to-all sends each (token, expert) pair to the rank holding a replica of
  the expert and another brings the results back. Shared experts stay local. With tensor
  parallelism inside each data-parallel rank, its ranks hold the same tokens: each sends its
  own share of them, and the MLP's one all-reduce puts the shares together.

Each layer counts its tokens per expert (``load``) for the expert-parallel load balancer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.distributed.parallel_state import SINGLE_RANK, ParallelState
from pdserve.kernels.backend import Backend, MoERouting
from pdserve.model.nn.expert_placement import ExpertPlacement
from pdserve.model.nn.layers import DenseMLP
from pdserve.model.nn.tensor_parallel import split
from pdserve.model.weights import Checkpoint


class MoE:
    """Routed experts (stacked per layer) plus optional always-on shared experts."""

    def __init__(
        self,
        ckpt: Checkpoint,
        backend: Backend,
        *,
        router_name: str,
        expert_names: tuple[str, ...],  # templates for gate, up, down with {e}
        num_experts: int,
        hidden: int,
        intermediate: int,
        router: MoERouting,
        correction_bias_name: str | None = None,
        shared: DenseMLP | None = None,
        parallel: ParallelState = SINGLE_RANK,
    ) -> None:
        self.backend = backend
        self.num_experts = num_experts
        self.router = router
        self.parallel = parallel
        self.gate = ckpt.get(router_name, (num_experts, hidden))
        self.correction_bias = (
            ckpt.get(correction_bias_name, (num_experts,), dtype=torch.float32) if correction_bias_name else None
        )
        self.expert_names = expert_names
        self.hidden, self.intermediate = hidden, intermediate
        self.expert_parallel = parallel.ep_size > 1
        # Without expert parallelism a tensor-parallel rank keeps a slice of every expert.
        self.rows = split(intermediate, parallel, "moe intermediate size") if not self.expert_parallel else None
        self.placement = ExpertPlacement.balanced(num_experts, parallel.ep_size, parallel.config.num_redundant_experts)
        self.shared = shared
        # Routed tokens per expert since the last rebalance (expert-parallel load balancing).
        self.load = torch.zeros(num_experts, dtype=torch.int64, device=self.gate.device)
        self.place(self.placement, self.load_experts(ckpt, self.placement.rank_slots(parallel.ep_rank)))

    def load_experts(self, ckpt: Checkpoint, experts: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13 [n, 2I, H], w2 [n, H, I])`` of ``experts`` from the checkpoint: w13 stacks
        gate over up so one GEMM computes both (each a slice of I with tensor parallelism)."""
        gate_name, up_name, down_name = self.expert_names
        h, i, rows = self.hidden, self.intermediate, self.rows

        def part(name: str, e: int) -> torch.Tensor:
            weight = ckpt.get(name.format(e=e), (i, h))
            return weight if rows is None or rows == slice(0, i) else weight[rows]

        def down(e: int) -> torch.Tensor:
            weight = ckpt.get(down_name.format(e=e), (h, i))
            return weight if rows is None or rows == slice(0, i) else weight[:, rows]

        w13 = torch.stack([torch.cat((part(gate_name, e), part(up_name, e))) for e in experts])
        w2 = torch.stack([down(e) for e in experts]).contiguous()
        return w13, w2

    def place(self, placement: ExpertPlacement, weights: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Hold ``weights`` (w13, w2 of this rank's slots) for ``placement`` from the next call on."""
        self.placement = placement
        self.w13, self.w2 = weights
        self.replicas, self.num_replicas = placement.replica_table()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Router logits in float32, as the reference implementations compute them.
        router_logits = F.linear(x.float(), self.gate.float())
        weights, expert_ids = self.backend.route(router_logits, self.router, self.correction_bias)
        # Tensor-parallel ranks count the same tokens: a common factor the placement ignores.
        self.load += torch.bincount(expert_ids.flatten(), minlength=self.num_experts)
        if not self.expert_parallel:
            tokens = self.backend.dispatch(x, weights, expert_ids, self.num_experts)
            out = self.backend.combine(self.backend.expert_mlp(tokens, self.w13, self.w2), tokens, x.shape[0])
        elif self.parallel.dp_size == 1:
            out = self._local_experts(x, weights, expert_ids)
        else:
            out = self._all_to_all(x, weights, expert_ids)
        if self.shared is not None:
            out = out + self.shared.partial(x)
        return self.parallel.tp_all_reduce(out)

    def idle(self) -> None:
        """A data-parallel rank without tokens this step: its peers may send it pairs all the same."""
        if self.expert_parallel and self.parallel.dp_size > 1:
            self._all_to_all(
                torch.empty((0, self.hidden), dtype=self.w13.dtype, device=self.w13.device),
                torch.empty((0, self.router.top_k)),
                torch.empty((0, self.router.top_k), dtype=torch.int64),
            )

    def _slots(self, expert_ids: torch.Tensor) -> torch.Tensor:
        """The physical slot of each (token, expert) pair: replicas taken in turn by token index."""
        ids = expert_ids.cpu()
        token = torch.arange(ids.shape[0]).unsqueeze(1)
        return self.replicas[ids, token % self.num_replicas[ids]]

    def _run_rows(self, rows: torch.Tensor, local_slots: torch.Tensor) -> torch.Tensor:
        """Each row through the local expert in its slot (weight 1): [N, H]."""
        n = rows.shape[0]
        if n == 0:
            return rows
        ones = torch.ones((n, 1), dtype=torch.float32, device=rows.device)
        tokens = self.backend.dispatch(
            rows, ones, local_slots.view(n, 1).to(rows.device), self.placement.slots_per_rank
        )
        return self.backend.combine(self.backend.expert_mlp(tokens, self.w13, self.w2), tokens, n)

    def _local_experts(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Tokens are the same on every rank: compute the pairs whose slot is here."""
        slots = self._slots(expert_ids).flatten()
        s = self.placement.slots_per_rank
        mine = (slots // s == self.parallel.ep_rank).nonzero().squeeze(1)
        token = mine // expert_ids.shape[1]
        rows = self._run_rows(x[token.to(x.device)], slots[mine] % s)
        weight = weights.flatten()[mine.to(weights.device)].float().unsqueeze(1)
        out = torch.zeros((x.shape[0], x.shape[1]), dtype=torch.float32, device=x.device)
        out.index_add_(0, token.to(x.device), rows.float() * weight)
        return out.to(x.dtype)

    def _all_to_all(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """This rank's tokens through their experts, wherever those are; with tensor-parallel
        peers, this rank's share of them only (zero rows elsewhere, which the all-reduce fills)."""
        tp, r = self.parallel.tp_size, self.parallel.tp_rank
        if tp == 1:
            return self._exchange(x, weights, expert_ids)
        lo, hi = x.shape[0] * r // tp, x.shape[0] * (r + 1) // tp
        out = torch.zeros_like(x)
        out[lo:hi] = self._exchange(x[lo:hi], weights[lo:hi], expert_ids[lo:hi])
        return out

    def _exchange(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Send each pair to its slot's rank, run it there, and bring the result back."""
        top_k = expert_ids.shape[1]
        slots = self._slots(expert_ids).flatten()
        s, ranks = self.placement.slots_per_rank, self.parallel.ep_size
        order = torch.argsort(slots // s, stable=True)
        send_counts = torch.bincount(slots // s, minlength=ranks).tolist()
        token = order // top_k
        par = self.parallel
        rows, recv_counts = par.ep_all_to_all(x[token.to(x.device)], send_counts)
        local_slots, _ = par.ep_all_to_all((slots[order] % s).unsqueeze(1).to(x.device), send_counts, recv_counts)
        done = par.ep_all_to_all_back(self._run_rows(rows, local_slots.squeeze(1)), recv_counts, send_counts)
        weight = weights.flatten()[order.to(weights.device)].float().unsqueeze(1)
        out = torch.zeros((x.shape[0], x.shape[1]), dtype=torch.float32, device=x.device)
        out.index_add_(0, token.to(x.device), done.float() * weight)
        return out.to(x.dtype)
