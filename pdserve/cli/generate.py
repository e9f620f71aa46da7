"""``pdserve generate``: one completion, from a local model or from a running server.

With ``--target`` the command only talks to a server, and it sends its request within half a
second of starting (bench/cli_start.py): this module and its parser load grpc, protobuf and
msgspec and nothing heavier; the engine (torch) is imported by ``--model`` runs alone, and what
only the output needs is imported after the request is sent.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from pdserve import environment
from pdserve.cli.secrets import add_secret_option, secret
from pdserve.cli.common import absolute, add_engine_args, from_options, token_ids
from pdserve.rpc.tls import ClientTLS
from pdserve.types.engine_config import EngineConfig
from pdserve.types.sampling_params import SamplingParams

DESCRIPTION = """Generate a completion for one prompt, either with a local model (--model: a
Hugging Face directory or a GGUF file, default the small SmolLM2-135M-Instruct that
scripts/setup.sh fetches; the engine runs in this process) or from a running pdserve server
(--target HOST:PORT, e.g. what `pdserve up` printed). Text streams to the terminal as it is generated;
--json prints one JSON object at the end instead."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    gen = commands.add_parser(
        "generate",
        help="generate a completion, locally or from a server",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = gen.add_mutually_exclusive_group()
    where.add_argument(
        "--model",
        help="a Hugging Face model directory (config.json, *.safetensors, tokenizer.json) or a GGUF file (default: the set-up's SmolLM2-135M-Instruct)",
    )
    where.add_argument("--target", help="a pdserve frontend, HOST:PORT")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--token-ids", type=token_ids, help="prompt as comma-separated token ids, e.g. 1,2,3")
    sampling = SamplingParams()  # the engine's defaults are the command's
    gen.add_argument(
        "--max-tokens", type=int, default=sampling.max_tokens, help="most tokens to generate (default: %(default)s)"
    )
    gen.add_argument(
        "--temperature", type=float, default=sampling.temperature, help="0 for greedy (default: %(default)s)"
    )
    gen.add_argument("--top-p", type=float, default=sampling.top_p, help="nucleus sampling mass (default: %(default)s)")
    gen.add_argument(
        "--top-k", type=int, default=sampling.top_k, help="sample from the k most likely tokens; -1 disables"
    )
    gen.add_argument(
        "--min-p", type=float, default=sampling.min_p, help="drop tokens below min_p x the top probability"
    )
    gen.add_argument("--seed", type=int, default=None, help="per-request seed: same seed, same tokens")
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable); not included in the text")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.add_argument("--model-name", default="", help="--target: the served model (default: the only one)")
    add_secret_option(gen, "--api-key", env="PDSERVE_API_KEY", help="--target: the server's API key")
    gen.add_argument(
        "--timeout", type=float, default=600.0, help="--target: the request's deadline in seconds (default: 600)"
    )
    tls = gen.add_argument_group("--target over TLS (a frontend started with --tls-cert)")
    tls.add_argument("--tls-ca", metavar="FILE", help="connect over TLS, trusting this CA (PEM)")
    tls.add_argument("--tls", action="store_true", help="connect over TLS, trusting the system's roots")
    tls.add_argument("--tls-cert", metavar="FILE", help="client certificate (PEM), for a frontend with --tls-client-ca")
    tls.add_argument("--tls-key", metavar="FILE", help="the client certificate's key (PEM)")
    tls.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="the name the server's certificate must carry (default: the --target host)",
    )
    add_engine_args(gen)  # used with --model only
    gen.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return _remote(args) if args.target else _local(args)


def _print_json(
    token_ids: list[int], text: str, reason: str | None, times: list[float], start: float, **extra: object
) -> None:
    ttft = (times[0] - start) if times else 0.0
    gaps = [b - a for a, b in zip(times, times[1:])]
    print(
        json.dumps(
            {
                "token_ids": token_ids,
                "text": text,
                "finish_reason": reason,
                "ttft_ms": round(ttft * 1e3, 3),
                "itl_ms": round(sum(gaps) / len(gaps) * 1e3, 3) if gaps else 0.0,
                **extra,
            }
        )
    )


def _local(args: argparse.Namespace) -> int:
    import msgspec

    from pdserve.model.default_model import resolve_model
    from pdserve.offline.llm import LLM

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(resolve_model(args.model), **msgspec.structs.asdict(from_options(args, EngineConfig)))
    prompt = args.prompt if args.prompt is not None else args.token_ids
    start = time.perf_counter()
    times: list[float] = []
    final = None
    for chunk in llm.stream(prompt, params):
        times += [time.perf_counter()] * len(chunk.token_ids)
        if not args.json and chunk.text:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        final = chunk.output
    assert final is not None
    if args.json:
        _print_json(
            final.token_ids,
            final.text,
            final.finish_reason,
            times,
            start,
            prompt_tokens=final.num_prompt_tokens,
            total_ms=round((time.perf_counter() - start) * 1e3, 3),
        )
    else:
        print()
    return 0


def _client_tls(args: argparse.Namespace) -> ClientTLS | None:
    """The TLS the ``--tls*`` options ask for, or None for plaintext."""
    if not (args.tls or args.tls_ca or args.tls_cert or args.tls_key):
        return None
    return ClientTLS(
        ca=absolute(args.tls_ca),
        cert=absolute(args.tls_cert),
        key=absolute(args.tls_key),
        server_name=args.tls_server_name,
    )


def _remote(args: argparse.Namespace) -> int:
    import grpc

    from pdserve.v1 import inference_pb2, inference_pb2_grpc

    sampling = inference_pb2.SamplingOptions(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        stop=args.stop or [],
        ignore_eos=args.ignore_eos,
    )
    if args.seed is not None:
        sampling.seed = args.seed
    request = inference_pb2.GenerateRequest(model=args.model_name, sampling=sampling)
    if args.prompt is not None:
        request.text = args.prompt
    else:
        request.token_ids.ids.extend(args.token_ids)
    token_ids: list[int] = []
    times: list[float] = []
    final = None
    start = time.perf_counter()
    tls = _client_tls(args)
    if tls is None:
        channel = grpc.insecure_channel(args.target)
    else:
        channel = grpc.secure_channel(args.target, tls.grpc_credentials(), options=tls.grpc_options())
    with channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        try:
            api_key = secret(args, "api_key", environment.api_key())
            metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
            for response in stub.Generate(request, timeout=args.timeout, metadata=metadata):
                times += [time.perf_counter()] * len(response.token_ids)
                token_ids += response.token_ids
                if not args.json and response.text:
                    sys.stdout.write(response.text)
                    sys.stdout.flush()
                if response.HasField("final"):
                    final = response.final
        except grpc.RpcError as exc:
            print(f"pdserve generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    if final is None:
        print("pdserve generate: the server ended the stream without a final message", file=sys.stderr)
        return 1
    if args.json:
        from google.protobuf.json_format import MessageToDict

        breakdown = MessageToDict(
            final.breakdown, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        breakdown["kv_transfer_bytes"] = int(breakdown.get("kv_transfer_bytes", 0))
        usage = MessageToDict(final.usage, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        _print_json(token_ids, final.text, final.finish_reason, times, start, usage=usage, breakdown=breakdown)
    else:
        print()
    return 0
