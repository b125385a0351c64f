"""The ``segkv`` command: ``generate``, ``chat`` interactively, or ``serve`` a model directory."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import segkv.settings as settings

# the module docstring is for readers of the code; argparse shows this one (no reST markup)
DESCRIPTION = "segkv: generate text, chat interactively, or serve a model over an OpenAI-compatible HTTP API."

CHAT_HELP = """commands:
  /fork            continue in a new branch of this conversation (the old one is kept)
  /branches        list branches;  /switch N  go to branch N
  /undo            go back to before the last turn
  /save PATH       save the conversation to a snapshot file
  /load PATH       load a conversation from a snapshot file (becomes a new branch)
  /stats           pages and bytes in use, bytes copied by compaction, the last turn's cost,
                   segments, attention route
  /help, /quit"""

CUDA_GRAPHS = {"off": False, "auto": "auto", "on": True}
CUDA_GRAPHS_HELP = ("replay decode steps from CUDA graphs: off, auto (the default: on a CUDA device with the "
                    "Triton backend), on (error if not available)")
PAGE_SIZE_HELP = "rows per KV cache page (default: 32 on CUDA, 16 elsewhere)"
MODEL_HELP = ("Hugging Face model directory, a Hugging Face id (org/name) already in the local Hugging Face cache "
              "(HF_HUB_CACHE / HF_HOME; never downloaded), or a built-in model: 'default' (GQA) or "
              "'default-mla' (MLA)")
DTYPES = ["auto", "float32", "bfloat16", "float16"]
DTYPE_HELP = "weights and KV cache dtype; auto (the default): the checkpoint's torch_dtype on CUDA, float32 on the CPU"
QUANTIZATIONS = ["fp8"]
QUANTIZATION_HELP = ("quantize the checkpoint's linear projections at load: fp8 (e4m3 weights with per-output-channel "
                     "scales; activations stay in --dtype). Default: the checkpoint as stored (FP8 checkpoints load "
                     "as FP8 either way)")
KV_CACHE_DTYPES = ["auto", "fp8"]  # config.KV_CACHE_DTYPES (no torch import here)
KV_CACHE_DTYPE_HELP = ("KV cache storage: auto (the default: --dtype) or fp8 (float8 e4m3 with float32 scales per "
                       "layer and KV head, the checkpoint's k_scale/v_scale where it has them, else 1.0; twice the "
                       "tokens per byte of bf16)")
DEVICE_HELP = "torch device: auto (the default: CUDA when available, else cpu), cpu, cuda, cuda:N"
TENSOR_PARALLEL_HELP = ("shard the model over this many ranks, processes on this host (today: the CPU, over "
                        "gloo; grouped-query decoders: Llama, Mistral, Qwen2, Qwen3)")
GPU_MEMORY_HELP = ("fraction of the GPU's memory segkv may use, in (0, 1]: the KV cache gets what is left after the "
                   "weights and a profiling forward of the largest step (default: %(default)s; CUDA only)")
KV_CACHE_MEMORY_HELP = ("KV cache size in GiB, overriding --gpu-memory-utilization (default: sized by "
                        "--gpu-memory-utilization on CUDA, 1 GiB on the CPU)")
SPECULATIVE_CONFIG_HELP = ("speculative decoding, a JSON object of vLLM's keys: method (mtp, ngram, "
                           "draft_model, eagle3 or none), num_speculative_tokens, prompt_lookup_min, "
                           "prompt_lookup_max, model, disable_by_batch_size, topk, num_draft_tokens; "
                           "e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 3}' (default: off)")
API_KEY_ENV = "SEGKV_API_KEY"  # as vLLM reads VLLM_API_KEY
SHUTTING_DOWN = "the server is shutting down"
TOOL_CALL_PARSERS = ["deepseek_v3", "hermes", "llama3_json", "mistral"]  # segkv.server.tool_parsers.PARSERS


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _utilization(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:  # NaN too
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _add_memory_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu-memory-utilization", type=_utilization, default=0.9, help=GPU_MEMORY_HELP)
    parser.add_argument("--kv-cache-memory", type=_positive_float, default=None, metavar="GIB",
                        help=KV_CACHE_MEMORY_HELP)
    parser.add_argument("--kv-offload-host-gib", type=_non_negative_float, default=0.0, metavar="GIB",
                        help="host memory for KV rows of idle sessions and cached prefixes, moved there "
                             "when KV pages run short and brought back instead of recomputed (0: off)")
    parser.add_argument("--kv-offload-dir", default=None, help="directory of the disk tier below host memory")
    parser.add_argument("--kv-offload-disk-gib", type=_non_negative_float, default=0.0, metavar="GIB",
                        help="the disk tier's size (with --kv-offload-dir)")


def _kv_cache_bytes(args) -> int | None:
    return None if args.kv_cache_memory is None else int(args.kv_cache_memory * (1 << 30))


def _kv_offload(args) -> dict:
    """The LLM's KV tier arguments from the command line."""
    return {"kv_offload_host_gib": args.kv_offload_host_gib, "kv_offload_dir": args.kv_offload_dir,
            "kv_offload_disk_gib": args.kv_offload_disk_gib}


def _speculative_config(text: str):
    """``--speculative-config``: a SpeculativeConfig, or None (off); bad JSON or keys stop the
    command before the model loads (exit code 2)."""
    from segkv.spec.config import SpeculativeConfig

    try:
        return SpeculativeConfig.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help=MODEL_HELP)
    parser.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)
    parser.add_argument("--quantization", default=None, choices=QUANTIZATIONS, help=QUANTIZATION_HELP)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help=KV_CACHE_DTYPE_HELP)
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help=TENSOR_PARALLEL_HELP)
    parser.add_argument("--page-size", type=int, default=None, help=PAGE_SIZE_HELP)
    parser.add_argument("--max-model-len", type=int, default=None)
    _add_memory_args(parser)
    parser.add_argument("--route", default=None, choices=["single", "split", "segments", "cascade"],
                        help="force an attention route (default: the planner decides)")
    parser.add_argument("--cuda-graphs", default="auto", choices=list(CUDA_GRAPHS), help=CUDA_GRAPHS_HELP)
    parser.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON",
                        help=SPECULATIVE_CONFIG_HELP)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="segkv", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    _add_model_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    chat = sub.add_parser("chat", help="interactive chat with forks, undo, snapshots and statistics")
    _add_model_args(chat)
    chat.add_argument("--system", default=None)
    bench = sub.add_parser("bench", help="benchmarks: 'segkv bench serve --help'")
    bench.add_argument("which", choices=["serve"], help="serve: load generator against a running server")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("--model", default="default", help=MODEL_HELP)
    serve.add_argument("--snapshot-dir", default=None, help="directory where sessions may be saved")
    serve.add_argument("--session-ttl", type=float, default=3600.0, help="idle seconds before a session expires")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    serve.add_argument("--device", default="auto", help=DEVICE_HELP)
    serve.add_argument("--quantization", default=None, choices=QUANTIZATIONS, help=QUANTIZATION_HELP)
    serve.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help=KV_CACHE_DTYPE_HELP)
    serve.add_argument("--tensor-parallel-size", type=int, default=1, help=TENSOR_PARALLEL_HELP)
    serve.add_argument("--page-size", type=int, default=None, help=PAGE_SIZE_HELP)
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--max-num-seqs", type=int, default=64)
    serve.add_argument("--max-num-batched-tokens", type=int, default=2048)
    _add_memory_args(serve)
    serve.add_argument("--route", default=None, choices=["single", "split", "segments", "cascade"])
    serve.add_argument("--cuda-graphs", default="auto", choices=list(CUDA_GRAPHS), help=CUDA_GRAPHS_HELP)
    serve.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON",
                       help=SPECULATIVE_CONFIG_HELP)
    serve.add_argument("--shutdown-timeout", type=_non_negative_float, default=10.0,
                       help="on SIGTERM / Ctrl-C, new requests get 503 and requests in flight get this many "
                            "seconds to finish; then those left are ended (a stream gets an error event and "
                            "[DONE]) and the server exits (default: %(default)s)")
    serve.add_argument("--api-key", default=None,
                       help=f"require 'Authorization: Bearer KEY' on the API (default: the {API_KEY_ENV} "
                            "environment variable; unset: no key)")
    serve.add_argument("--max-request-bytes", type=_positive_int, default=None,
                       help="largest request body accepted, in bytes (default: 16 MiB)")
    serve.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                       help="how the model writes tool calls (vLLM's names; default: the model family's)")
    return parser


def run_serve(args) -> int:
    """Listen at once (503 while loading), load the model in the background, then serve until a
    signal; 1 if the model fails to load (the server then stops), else 0."""
    import threading

    import uvicorn

    from segkv.server.lifecycle import FINAL_GRACE_SECONDS, GracefulServer
    from segkv.server.loading import LoadingGate

    # bad settings stop the command before the (long) load
    snapshot_dir = prepare_snapshot_dir(args.snapshot_dir)
    api_key = resolve_api_key(args.api_key)
    gate = LoadingGate()
    engines: list = []
    failures: list[Exception] = []

    def stop_admitting() -> None:
        gate.drain()
        for engine in engines:
            engine.stop_admitting()

    def abort_all() -> int:
        from segkv.engine import EngineStopped

        return sum(engine.abort_all(EngineStopped(SHUTTING_DOWN)) for engine in engines)

    config = uvicorn.Config(gate, host=args.host, port=args.port, log_level="info", lifespan="off",
                            timeout_graceful_shutdown=FINAL_GRACE_SECONDS)
    server = GracefulServer(config, drain_timeout=args.shutdown_timeout, stop_admitting=stop_admitting,
                            abort_all=abort_all)

    def load() -> None:
        try:
            _load_and_serve(args, gate, engines, server, snapshot_dir, api_key)
        except Exception as exc:  # the server stops; run_serve returns 1
            failures.append(exc)
            gate.failed(str(exc))
            print(f"segkv: error: the model failed to load: {exc}", file=sys.stderr, flush=True)
            server.should_exit = True

    threading.Thread(target=load, name="segkv-load", daemon=True).start()
    try:
        server.run()
    finally:
        for engine in engines:
            engine.shutdown()
    return 1 if failures else 0


def _load_and_serve(args, gate, engines: list, server, snapshot_dir: Path | None,
                    api_key: str | None) -> None:
    """Load the model, warm it up, and install the app behind ``gate`` (the load thread's work)."""
    from segkv.engine import LLM, AsyncEngine, SchedulerConfig
    from segkv.models.default_models import is_default_name, is_hub_name, resolve_model_dir
    from segkv.server import app as app_module

    llm = LLM(resolve_model_dir(args.model), dtype=args.dtype, device=args.device, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tensor_parallel_size,
              page_size=args.page_size, max_model_len=args.max_model_len, route=args.route,
              kv_cache_bytes=_kv_cache_bytes(args), gpu_memory_utilization=args.gpu_memory_utilization, **_kv_offload(args),
              max_num_batched_tokens=args.max_num_batched_tokens,
              cuda_graphs=CUDA_GRAPHS[args.cuda_graphs], speculative_config=args.speculative_config,
              progress=True)
    print(llm.describe_summary(), flush=True)
    if llm.ranks is not None:  # a lost rank ends the server: it cannot serve a step without it
        llm.ranks.on_failure = _exit_on_rank_failure(llm.ranks)
    # kernels compiled and graphs captured before ready, for the shapes this server's scheduler
    # runs (its batch and its largest forward): the first requests wait for neither
    info = llm.warm_up(max_batch=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       progress=True)
    print(f"segkv: warmed up in {info['seconds']:.1f} s, using {_mib(info['bytes'])}", flush=True)
    if server.should_exit:  # a signal came while loading: nothing to serve
        return
    engine = AsyncEngine(llm, SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                              max_num_batched_tokens=args.max_num_batched_tokens))
    engines.append(engine)
    if gate.draining:  # the drain began between the check above and the append
        engine.stop_admitting()
    # a built-in or Hugging Face name is served as given (a cache snapshot's folder is a hash)
    named = is_default_name(args.model) or is_hub_name(args.model)
    name = args.served_model_name or (args.model if named else llm.model_dir.name)
    options = _app_options(app_module, api_key=api_key, max_request_bytes=args.max_request_bytes)
    options["tool_call_parser"] = args.tool_call_parser
    gate.ready(app_module.create_app(engine, model_name=name, snapshot_dir=snapshot_dir,
                                     session_ttl=args.session_ttl, **options))
    print(f"segkv: serving {name} on http://{args.host}:{args.port}", flush=True)


def resolve_api_key(flag: str | None) -> str | None:
    """The key the API asks for: ``--api-key``, else ``$SEGKV_API_KEY`` (empty: unset), else none."""
    if flag is not None:
        if not flag:
            raise ValueError("--api-key must not be empty (leave it out to serve without a key)")
        return flag
    return settings.SETTINGS.api_key or None


def _app_options(app_module, *, api_key: str | None, max_request_bytes: int | None) -> dict:
    """``api_key`` and ``max_request_bytes`` for ``create_app`` (the app's default size when omitted)."""
    return {"api_key": api_key, "max_request_bytes": max_request_bytes or app_module.DEFAULT_MAX_REQUEST_BYTES}


def prepare_snapshot_dir(path: str | None) -> Path | None:
    """Create ``--snapshot-dir`` (and its parents) now, so a path that cannot hold snapshots
    stops the server before the model loads (ValueError, exit code 2)."""
    if path is None:
        return None
    directory = Path(path).expanduser()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ValueError(f"--snapshot-dir {path}: a file, not a directory, is in its place") from None
    except OSError as exc:
        reason = exc.strerror or exc
        raise ValueError(f"--snapshot-dir {path}: cannot create the directory: {reason}") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"--snapshot-dir {path}: the directory is not writable")
    return directory


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):,.1f} MiB"


def _follows_rank_zero(args) -> bool:
    """Under torchrun, every rank but 0 of ``serve``/``generate``/``chat`` follows rank 0's steps
    (its shard of ``--model``) instead of running the command; True once it has."""
    from segkv.engine.tensor_parallel import follow_as_launched_rank, launched_rank

    launched = launched_rank()
    if launched is None or launched[0] == 0 or args.command not in ("serve", "generate", "chat"):
        return False
    if args.tensor_parallel_size != launched[1]:
        raise ValueError(f"torchrun started {launched[1]} ranks: --tensor-parallel-size must be {launched[1]}, "
                         f"not {args.tensor_parallel_size}")
    follow_as_launched_rank(args.model, dtype=args.dtype, device=args.device)
    return True


def _exit_on_rank_failure(ranks):
    def exit_now(why: str) -> None:
        print(f"error: {why}; the server stops", file=sys.stderr, flush=True)
        ranks.kill()
        os._exit(1)  # the engine thread may be blocked in a collective: no orderly shutdown

    return exit_now


def _load(args):
    from segkv.engine import LLM
    from segkv.models.default_models import resolve_model_dir
    from segkv.sampling_params import SamplingParams

    llm = LLM(resolve_model_dir(args.model), dtype=args.dtype, device=args.device, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tensor_parallel_size,
              page_size=args.page_size, max_model_len=args.max_model_len, route=args.route,
              cuda_graphs=CUDA_GRAPHS[args.cuda_graphs],
              kv_cache_bytes=_kv_cache_bytes(args), gpu_memory_utilization=args.gpu_memory_utilization, **_kv_offload(args),
              speculative_config=args.speculative_config, progress=True)
    print(llm.describe_summary(), file=sys.stderr, flush=True)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens)
    return llm, params


def run_bench(args) -> int:
    from segkv.bench.serve import main as bench_serve

    return bench_serve(args.rest)


def run_generate(args) -> int:
    llm, params = _load(args)
    if args.chat:
        prompt = [llm.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])]
    else:
        prompt = [args.prompt]
    print(llm.generate(prompt, params)[0].outputs[0].text)
    return 0


class ChatSession:
    """The interactive loop's state: branches of one conversation and the undo history."""

    def __init__(self, llm, params, system: str | None, write: Callable[[str], None]) -> None:
        self.llm, self.params, self.write = llm, params, write
        self.branches = [llm.conversation(system=system)]
        self.current = 0
        self.undo: dict[int, list] = {0: []}

    @property
    def conv(self):
        return self.branches[self.current]

    def handle(self, line: str) -> bool:
        """Process one input line; False ends the session."""
        line = line.strip()
        if not line:
            return True
        if not line.startswith("/"):
            self.undo[self.current].append(self.conv.snapshot())
            turn = self.conv.say(line, self.params)
            self.write(turn.text)
            return True
        command, _, arg = line.partition(" ")
        handler = {
            "/fork": self._fork, "/branches": self._branches, "/switch": self._switch, "/undo": self._undo,
            "/save": self._save, "/load": self._load, "/stats": self._stats,
            "/help": lambda _: self.write(CHAT_HELP),
        }.get(command)
        if command in ("/quit", "/exit"):
            return False
        if handler is None:
            self.write(f"unknown command {command}; /help lists the commands")
            return True
        try:
            handler(arg.strip())
        except (ValueError, OSError) as exc:
            self.write(f"error: {exc}")
        return True

    def _fork(self, _arg: str) -> None:
        self.branches.append(self.conv.fork())
        self.current = len(self.branches) - 1
        self.undo[self.current] = []
        self.write(f"now on branch {self.current} (forked; nothing copied)")

    def _branches(self, _arg: str) -> None:
        for i, conv in enumerate(self.branches):
            mark = "*" if i == self.current else " "
            self.write(f"{mark} {i}: {len(conv.messages)} messages, {conv.num_tokens} cached tokens")

    def _switch(self, arg: str) -> None:
        if not arg.isdigit() or int(arg) >= len(self.branches):
            raise ValueError(f"no branch {arg!r}; /branches lists them")
        self.current = int(arg)
        self.write(f"now on branch {self.current}")

    def _undo(self, _arg: str) -> None:
        history = self.undo[self.current]
        if not history:
            raise ValueError("nothing to undo on this branch")
        snap = history.pop()
        self.conv.restore(snap)
        snap.release()
        self.write(f"undone; {len(self.conv.messages)} messages")

    def _save(self, arg: str) -> None:
        if not arg:
            raise ValueError("/save needs a file path")
        self.conv.save(arg)
        self.write(f"saved to {arg}")

    def _load(self, arg: str) -> None:
        if not arg:
            raise ValueError("/load needs a file path")
        self.branches.append(self.llm.load_conversation(arg))
        self.current = len(self.branches) - 1
        self.undo[self.current] = []
        self.write(f"loaded into branch {self.current}")

    def _stats(self, _arg: str) -> None:
        s = self.llm.cache.stats()
        # the pool's copies are all compaction (merging a chain's small trailing segments after a
        # turn): forks, undo, save and load share references and copy nothing
        self.write(f"pages in use {s['pages_in_use']}/{s['num_pages']}, bytes in use {s['bytes_in_use']:,} "
                   f"(peak {s['peak_bytes_in_use']:,}), bytes copied by compaction {s['bytes_copied']:,} "
                   f"(forks, undo and snapshots copy nothing)")
        last = self.conv.last_stats  # restored by /undo: the turn that is last now
        if last is None:
            self.write("last turn: none on this branch")
        else:
            self.write(f"last turn: {last.new_tokens} new prompt tokens ({last.cached_tokens} cached), "
                       f"{last.generated_tokens} generated, {last.bytes_added:,} bytes added, "
                       f"{last.bytes_copied:,} bytes copied by compaction, routes {last.routes}")
        plan = self.llm.runner.last_plan
        self.write(f"segments in this conversation {self.conv.chain.num_segments}; "
                   f"last route {plan.route.value if plan else '-'}")


def run_chat(args, lines: Iterable[str] | None = None, write: Callable[[str], None] = print) -> int:
    llm, params = _load(args)
    session = ChatSession(llm, params, args.system, write)
    write("segkv chat: type a message, or /help")
    source = lines if lines is not None else _stdin_lines()
    for line in source:
        if not session.handle(line):
            break
    return 0


def _stdin_lines():
    while True:
        try:
            yield input("> ")
        except EOFError:
            return


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if _follows_rank_zero(args):
            return 0
        handlers = {"generate": run_generate, "chat": run_chat, "serve": run_serve, "bench": run_bench}
        return handlers[args.command](args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"segkv: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
