"""A consumer whose KV lands while a step runs joins that step at a layer boundary: it runs
the layers it missed on its own, then goes on in the batch, and its tokens stay exact. One
boundary a step takes joiners."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from pdserve.engine.engine import LLMEngine
from pdserve.engine.output import RequestOutput
from pdserve.engine.request import KVRole
from pdserve.types.engine_config import EngineConfig
from pdserve.types.sampling_params import SamplingParams
from tests.utils.checkpoints import VOCAB, reference_greedy, write_checkpoint

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _produce(engine: LLMEngine, request_id: str, prompt: list[int]) -> RequestOutput:
    engine.add_request(request_id, prompt, GREEDY, KVRole.PRODUCER, pin_s=30.0)
    while True:
        for output in engine.step().outputs:
            if output.finished:
                return output


def _hand_over(engine: LLMEngine, request_id: str, prompt: list[int]) -> int:
    """Produce ``prompt`` in ``engine`` and admit its consumer there, KV copied in; returns the
    first token, for ``kv_received``."""
    produced = _produce(engine, f"{request_id}-prefill", prompt)
    block_ids, _ = engine.admit_consumer(request_id, prompt, GREEDY)
    engine.kv_cache.data[block_ids] = engine.kv_cache.data[produced.held_block_ids]
    engine.kv_sent(f"{request_id}-prefill")
    return produced.token_ids[0]


def _assert_matches_transformers(hf_model, prompts: dict[str, list[int]], tokens: dict[str, list[int]]) -> None:
    compared = 0
    for request_id, prompt in prompts.items():
        reference, num_clear = reference_greedy(hf_model, prompt, GREEDY.max_tokens)
        assert tokens[request_id][:num_clear] == reference[:num_clear], request_id
        compared += num_clear
    assert compared >= GREEDY.max_tokens * 2, "too many near-ties: the comparison proves little"


def _finish(engine: LLMEngine, tokens: dict[str, list[int]]) -> None:
    while engine.has_unfinished():
        for output in engine.step(mid_step=nullcontext()).outputs:
            tokens[output.request_id] = output.token_ids
    engine.check_idle_integrity()
    assert engine.block_pool.all_free()


def _resume_during(engine: LLMEngine, layer: int, resumes: dict[str, int]) -> None:
    """Resume the consumers ``resumes`` names while the model runs ``layer``'s feed-forward (as
    the admitter thread does while a step runs)."""
    feed_forward = engine.model.layers[layer].feed_forward

    def run(hidden: torch.Tensor) -> torch.Tensor:
        engine.model.layers[layer].feed_forward = feed_forward
        for request_id, first_token in resumes.items():
            assert engine.kv_received(request_id, first_token) is None
        return feed_forward(hidden)

    engine.model.layers[layer].feed_forward = run


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "deepseek_v2_lite"])
def test_consumers_resumed_mid_step_join_the_step_and_match_transformers(checkpoints, arch):
    path, hf_model = checkpoints(arch)
    engine = LLMEngine(str(path), EngineConfig(kv_cache_memory=2**21))
    prompts = {"local": _prompt(1, 21), "c1": _prompt(2, 16), "c2": _prompt(3, 35)}
    firsts = {rid: _hand_over(engine, rid, prompts[rid]) for rid in ("c1", "c2")}
    engine.add_request("local", prompts["local"], GREEDY)
    engine.step()  # local's prompt: it decodes from now on

    _resume_during(engine, 0, firsts)  # the last layer boundary before the model's end is 1
    step = engine.step(mid_step=nullcontext())
    assert {o.request_id: len(o.token_ids) for o in step.outputs} == {"local": 2, "c1": 2, "c2": 2}
    assert step.num_scheduled_tokens == 3 and not engine.scheduler.resumed

    tokens = {o.request_id: o.token_ids for o in step.outputs}
    _finish(engine, tokens)
    _assert_matches_transformers(hf_model, prompts, tokens)


@pytest.mark.slow
def test_joiners_catch_up_several_layers_and_one_boundary_a_step_takes_them(tmp_path):
    """Four layers: consumers resumed during layer 1 catch up on layers 0 and 1 and join at 2;
    one resumed during layer 2 waits for the next step, since this one has had its joiners.
    Their logprobs equal those of the same requests joining the next step instead."""
    hf_model = write_checkpoint(tmp_path, "llama", num_layers=4)
    prompts = {"local": _prompt(1, 21), "c1": _prompt(2, 16), "c2": _prompt(3, 35), "c3": _prompt(4, 9)}

    def run(mid_step: nullcontext[None] | None) -> tuple[list[str], dict[str, RequestOutput]]:
        engine = LLMEngine(str(tmp_path), EngineConfig(kv_cache_memory=2**21))
        firsts = {rid: _hand_over(engine, rid, prompts[rid]) for rid in ("c1", "c2", "c3")}
        engine.add_request("local", prompts["local"], GREEDY)
        engine.step()
        _resume_during(engine, 1, {"c1": firsts["c1"], "c2": firsts["c2"]})
        _resume_during(engine, 2, {"c3": firsts["c3"]})
        stepped = sorted(o.request_id for o in engine.step(mid_step=mid_step).outputs)
        finals: dict[str, RequestOutput] = {}
        while engine.has_unfinished():
            finals |= {o.request_id: o for o in engine.step(mid_step=mid_step).outputs if o.finished}
        engine.check_idle_integrity()
        assert engine.block_pool.all_free()
        return stepped, finals

    stepped, joined = run(nullcontext())
    assert stepped == ["c1", "c2", "local"]  # c3 came after the step's joiners
    stepped, waited = run(None)
    assert stepped == ["local"]
    _assert_matches_transformers(hf_model, prompts, {rid: out.token_ids for rid, out in joined.items()})
    for request_id, output in joined.items():
        assert output.token_ids == waited[request_id].token_ids, request_id
        ours = [lp.token_logprob for lp in output.logprobs if lp is not None]
        theirs = [lp.token_logprob for lp in waited[request_id].logprobs if lp is not None]
        assert len(ours) == GREEDY.max_tokens - (request_id != "local")  # a consumer's first is the producer's
        assert ours == pytest.approx(theirs, abs=1e-5), request_id


def test_without_mid_step_a_consumer_resumed_during_a_step_waits_for_the_next(checkpoints):
    path, _ = checkpoints("llama")
    engine = LLMEngine(str(path), EngineConfig(kv_cache_memory=2**21))
    first = _hand_over(engine, "c", _prompt(2, 16))
    engine.add_request("local", _prompt(1, 21), GREEDY)
    engine.step()
    _resume_during(engine, 0, {"c": first})
    assert [o.request_id for o in engine.step().outputs] == ["local"]
    assert [o.request_id for o in engine.step().outputs] == ["local", "c"]


def test_a_joiner_short_of_blocks_waits_for_the_next_schedule(checkpoints):
    """A 16-token prompt fills its block: the first token needs a new one, and none is free."""
    path, _ = checkpoints("llama")
    probe = LLMEngine(str(path), EngineConfig(kv_cache_memory=2**21))
    block_bytes = probe.kv_cache_spec.bytes_per_block
    engine = LLMEngine(str(path), EngineConfig(kv_cache_memory=4 * block_bytes))
    first = _hand_over(engine, "c", _prompt(2, 16))
    engine.add_request("local", _prompt(1, 40), GREEDY)  # 3 blocks: the pool is now full
    engine.step()
    assert engine.block_pool.num_free_blocks == 0
    _resume_during(engine, 0, {"c": first})
    assert [o.request_id for o in engine.step(mid_step=nullcontext()).outputs] == ["local"]
    assert not engine.scheduler.resumed  # left to the schedule, which preempts for it
    while engine.has_unfinished():
        engine.step(mid_step=nullcontext())
    engine.check_idle_integrity()
    assert engine.block_pool.all_free()
