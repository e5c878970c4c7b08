"""The sglang 0.5.9 server, stand-in: the real command line, a small part of the HTTP API.

Endpoints (as the real server answers them): GET /health and /health_generate (200, empty;
503 while starting), GET /v1/models, GET /get_model_info and /model_info, GET /get_server_info
and /server_info (the server args as JSON), POST /v1/chat/completions (stream or not),
POST /v1/completions, POST /generate, GET /metrics (with --enable-metrics). --api-key is
enforced as the real server does (401 {"error": "Unauthorized"}; /health* and /metrics open).

Answers are canned and deterministic. It refuses to start when torch (the torch stand-in,
reading the host's scenario) sees fewer GPUs than the parallelism asks for, and, as the real
server, when the user it runs as cannot read the model's files (read_model).

Behaviour modes, comma-separated in SANDBOX_SGLANG_MODE (default "normal"):
  slow-start        keep the port closed for SANDBOX_SGLANG_STARTUP_SECONDS (default 30) while
                    "loading weights", as the real server does for minutes
  crash-on-start    die while loading weights (exit 1)
  crash-on-request  die on the first generation request, the server's own warmup included
                    (the decode NaN crash)
  degenerate        answer with "!!!!..." (what NaN logits decode to)
Startup takes SANDBOX_SGLANG_STARTUP_SECONDS (default 0.5) in every mode. The host's scenario
(serving.backend_modes, sandbox/scenarios.py) adds crash-on-start or degenerate for a given
--moe-runner-backend.

Under load: a streamed /v1/completions (what sglang.bench_serving --backend sglang-oai sends)
or /generate (--backend sglang) yields max_tokens (max_new_tokens) tokens when ignore_eos is
set, at the rate the scenario sets for the --moe-runner-backend and the number of generations
running (serving.output_tokens_per_s: all streams' output tokens per second, log-linear between
its levels); the number running is kept in /dev/shm/gpuhost-sandbox-serving-load.json for the
nvidia-smi stand-in (readable by every user: where a real GPU's load is the driver's, which no
sandboxing of the server's unit hides, /dev/shm is what its ProtectSystem=strict leaves
writable, operations/plans/unit_sandbox.py).

On a scenario whose P2P corrupts data (peer_transfers "wrong-data"), the answers are degenerate
as well when the tensor parallel group's all-reduce would go peer-to-peer: NCCL's, as the torch
stand-in decides it from NCCL_P2P_DISABLE and NCCL_P2P_LEVEL, or SGLang's custom all-reduce (CUDA
IPC between the GPUs), unless --disable-custom-all-reduce.
"""

import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from sglang._standin import nodes
from sglang._standin.metrics import METRICS
from sglang._standin.args import build_parser, load_spec, server_args
from sglang.version import __version__

logger = logging.getLogger("sglang.srt.entrypoints.http_server")
MODES = ("normal", "slow-start", "crash-on-start", "crash-on-request", "degenerate")
ANSWER = "This is a canned answer from the sglang {version} sandbox stand-in serving {model}."
REASONING = "The sandbox stand-in has no weights, so it does not think."
DEFAULT_CONTEXT_LEN = 131072


HARDWARE = os.environ.get("GPUHOST_SANDBOX_HARDWARE", "/etc/gpuhost-sandbox/hardware.json")
LOAD_FILE = os.environ.get("GPUHOST_SANDBOX_LOAD", "/dev/shm/gpuhost-sandbox-serving-load.json")


def serving_scenario():
    try:
        with open(HARDWARE) as fh:
            return json.load(fh).get("serving") or {}
    except (OSError, ValueError):
        return {}


def rate_at(table, n):
    """Output tokens per second of all streams at n concurrent (log-linear between levels)."""
    import math

    points = sorted((int(k), float(v)) for k, v in table.items())
    if n <= points[0][0]:
        return points[0][1] * n / points[0][0]
    if n >= points[-1][0]:
        return points[-1][1]
    for (a, ra), (b, rb) in zip(points, points[1:]):
        if a <= n <= b:
            w = (math.log(n) - math.log(a)) / (math.log(b) - math.log(a)) if b > a else 0
            return ra + (rb - ra) * w
    return points[-1][1]


class Load:
    """Generations running now, written for the nvidia-smi stand-in at each change, with the
    count and time of the last moment any ran (``busy``, ``busy_time``): a utilisation sample
    covers a past period, not an instant (nvidia-smi's stand-in reads both)."""

    def __init__(self):
        self.active, self.busy, self.lock = 0, 0, threading.Lock()

    def change(self, delta):
        with self.lock:
            if self.active > 0:
                self.busy = self.active
            self.active += delta
            now = time.time()
            try:
                os.makedirs(os.path.dirname(LOAD_FILE), exist_ok=True)
                with open(LOAD_FILE + ".tmp", "w") as fh:
                    os.fchmod(fh.fileno(), 0o644)
                    json.dump({"active": self.active, "time": now, "busy": self.busy,
                               "busy_time": now}, fh)
                os.replace(LOAD_FILE + ".tmp", LOAD_FILE)
            except OSError:
                pass


LOAD = Load()


class State:
    def __init__(self, args, modes):
        self.args, self.modes = args, modes
        self.status = "Starting"
        self.crash_armed = "crash-on-request" in modes


def configure_logging(args):
    """sglang's log format: "[2026-11-29 10:00:00] msg", "[2026-11-29 10:00:00 TP0] msg"."""
    logging.basicConfig(
        level=getattr(logging, str(args.get("log_level") or "info").upper(), logging.INFO),
        format="[%(asctime)s%(rank)s] %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(_default_rank)


def _default_rank(record):
    if not hasattr(record, "rank"):
        record.rank = ""
    return True


def tp_log(rank, msg, *args, level=logging.INFO):
    logger.log(level, msg, *args, extra={"rank": f" TP{rank}"})


def modes_from_env():
    modes = [
        m.strip() for m in os.environ.get("SANDBOX_SGLANG_MODE", "normal").split(",") if m.strip()
    ]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(
            f"SANDBOX_SGLANG_MODE: unknown mode(s) {', '.join(unknown)}; known: {', '.join(MODES)}"
        )
    return set(modes) or {"normal"}


def gpus_needed(args):
    """GPUs this node runs: tp x pp (x dp) / nnodes (sglang 0.5.9's tp_size_per_node)."""
    tp, pp = args.get("tp_size") or 1, args.get("pp_size") or 1
    dp = 1 if args.get("enable_dp_attention") else (args.get("dp_size") or 1)
    return tp * pp * dp // max(args.get("nnodes") or 1, 1)


def check_gpus(args):
    """None, or why the server cannot start on this host's GPUs."""
    import torch

    need = gpus_needed(args) + (args.get("base_gpu_id") or 0)
    if not torch.cuda.is_available():
        return (
            "CUDA is not available (torch.cuda.is_available() is False): no usable NVIDIA "
            f"driver or GPU; --tp-size {args.get('tp_size')} needs {need} GPU(s)"
        )
    count = torch.cuda.device_count()
    if count < need:
        return (
            f"not enough GPUs: --tp-size {args.get('tp_size')} (with pp/dp) needs {need} "
            f"GPU(s), torch.cuda.device_count() is {count}"
        )
    return None


def corrupting_all_reduce(args):
    """None, or which all-reduce of the tensor parallel group would corrupt activations: one that
    goes peer-to-peer on a scenario whose peer transfers arrive wrong (module docstring)."""
    from torch import _sandbox
    from torch.distributed import _nccl_p2p

    visible = _sandbox.visible_gpus()[: args.get("tp_size") or 1]
    pairs = [(a, b) for a in range(len(visible)) for b in range(len(visible)) if a != b]
    if not pairs or "wrong-data" not in _sandbox.peer_transfers().values():
        return None
    if not args.get("disable_custom_all_reduce") and any(_sandbox.peer_access(a, b)
                                                        for a, b in pairs):
        return "the custom all-reduce (CUDA IPC between the GPUs)"
    disable = os.environ.get("NCCL_P2P_DISABLE", "")
    level = os.environ.get("NCCL_P2P_LEVEL", "")
    if any(_nccl_p2p(visible[a]["index"], visible[b]["index"], disable, level)
           for a, b in pairs):
        return "NCCL's all-reduce (via P2P)"
    return None


def check_speculative(args):
    """What the real server does with --speculative-algorithm NEXTN, as far as the stand-in can
    tell without weights: sglang 0.5.9 turns NEXTN into EAGLE (server_args.py); without
    SGLANG_ENABLE_SPEC_V2=True (environ.py: EnvBool, "true"/"1") it loads the model a second
    time as the draft, out of memory on these GPUs, and a checkpoint whose weight index lacks
    the MTP layer (model.layers.<num_hidden_layers>.*, deepseek_weight_loader.py) fails to load
    (voipmonitor/rtx6kpro models/glm5.md, Error 7). The messages are the stand-in's. None
    when it serves."""
    if args.get("speculative_algorithm") is None:
        return None
    if os.environ.get("SGLANG_ENABLE_SPEC_V2", "").lower() not in ("1", "true"):
        return ("Scheduler hit an exception: torch.OutOfMemoryError: CUDA out of memory "
                "(sandbox stand-in: NEXTN without SGLANG_ENABLE_SPEC_V2=True loads the model "
                "a second time as its EAGLE draft)")
    model = args["model_path"]
    try:
        with open(os.path.join(model, "config.json")) as fh:
            config = json.load(fh)
        with open(os.path.join(model, "model.safetensors.index.json")) as fh:
            names = json.load(fh).get("weight_map") or {}
    except (OSError, ValueError):
        return None  # a model folder the stand-in cannot read: the weights' own check says it
    layers = config.get("num_hidden_layers") or 0
    layer = 0 if layers == 1 else layers
    if not any(n.startswith(f"model.layers.{layer}.") for n in names):
        return (f"Scheduler hit an exception: ValueError: MTP speculative decoding layer "
                f"{layer} weights missing from checkpoint.")
    logger.info("speculative decoding: NEXTN as EAGLE with spec v2 (steps %s, topk %s, draft "
                "tokens %s)", args.get("speculative_num_steps"),
                args.get("speculative_eagle_topk"), args.get("speculative_num_draft_tokens"))
    return None


def read_model(model):
    """None, or the error the real server stops with where it cannot read the model's files as
    the user it runs as: transformers reads config.json and the tokenizer's files at start,
    the weight loader every shard (safetensors' header first); the message is Python's own
    PermissionError. A folder's files the stand-in does not know are not read."""
    if not os.path.isdir(model):
        return None
    try:
        names = sorted(os.listdir(model))
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    wanted = [n for n in names if n.endswith((".json", ".safetensors"))]
    for name in wanted:
        try:
            with open(os.path.join(model, name), "rb") as fh:
                fh.read(8)
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"
    return None


#: The kernel caches the server's JIT compilers write at start (flashinfer's JIT and cubins,
#: Triton's kernels, torch inductor's and extensions' builds), by the variables that place
#: them (operations/stages/kernel_cache.py CACHE_VARIABLES); each falls back to the home or /tmp.
KERNEL_CACHE_VARIABLES = ("FLASHINFER_WORKSPACE_BASE", "TRITON_CACHE_DIR",
                          "TORCHINDUCTOR_CACHE_DIR", "TORCH_EXTENSIONS_DIR")


def write_kernel_caches():
    """None, or the error the real server stops with where a kernel cache is not writable by
    the user it runs as (a JIT compile's PermissionError, while it captures CUDA graphs): one
    file written into each cache the environment names, as the compilers would."""
    for name in KERNEL_CACHE_VARIABLES:
        folder = os.environ.get(name)
        if not folder:
            continue
        try:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "sandbox-standin-kernel.tmp"), "w") as fh:
                fh.write("a compiled kernel (sandbox stand-in)\n")
            os.replace(os.path.join(folder, "sandbox-standin-kernel.tmp"),
                       os.path.join(folder, "sandbox-standin-kernel"))
        except OSError as exc:
            return f"{type(exc).__name__}: {exc} ({name})"
    return None


def main(argv):
    spec = load_spec()
    parser = build_parser(spec)
    namespace = parser.parse_args(argv)  # unknown flags: exit 2, as the real parser
    args = server_args(namespace)
    configure_logging(args)
    modes = modes_from_env()
    backend = args.get("moe_runner_backend") or "auto"
    scenario_mode = (serving_scenario().get("backend_modes") or {}).get(backend)
    if scenario_mode:
        modes = modes | {scenario_mode}
    logger.info("server_args=ServerArgs(%s)", ", ".join(f"{k}={v!r}" for k, v in args.items()))
    logger.info("sandbox stand-in of sglang %s (modes: %s)", __version__, ",".join(sorted(modes)))

    model = args["model_path"]
    if model.startswith("/") and not os.path.exists(model):
        logger.error(
            "OSError: %s is not a local folder and is not a valid model identifier "
            "listed on 'https://huggingface.co/models'",
            model,
        )
        return 1
    problem = read_model(model) or write_kernel_caches()
    if problem:
        logger.error(problem)
        return 1
    problem = check_gpus(args)
    if problem:
        logger.error("Refusing to start: %s", problem)
        return 1
    problem = check_speculative(args)
    if problem:
        logger.error(problem)
        return 1

    startup = float(
        os.environ.get("SANDBOX_SGLANG_STARTUP_SECONDS", "30" if "slow-start" in modes else "0.5")
    )
    tp = args.get("tp_size") or 1
    nnodes, node_rank = args.get("nnodes") or 1, args.get("node_rank") or 0
    if nnodes > 1:
        from torch.distributed import DistError

        try:
            nodes.watch(nodes.rendezvous(args, tp_log), node_rank)
        except DistError as exc:
            tp_log(0, "Scheduler hit an exception: torch.distributed.DistStoreError: %s", exc,
                   level=logging.ERROR)
            return 1
    else:
        for rank in range(tp):
            tp_log(rank, "Init torch distributed begin.")
    corrupting = corrupting_all_reduce(args)
    if corrupting:
        # The real server would load and serve; its logits turn NaN. The log line is the stand-in's.
        logger.warning("sandbox stand-in: %s goes peer-to-peer on a host whose P2P corrupts "
                       "data: answers will be degenerate", corrupting)
        modes = modes | {"degenerate"}
    tp_log(0, "Load weight begin. avail mem=94.50 GB")
    if "crash-on-start" in modes:
        time.sleep(min(startup, 1.0))
        tp_log(
            0,
            "Scheduler hit an exception: Traceback (most recent call last):\n"
            "RuntimeError: CUDA error: an illegal memory access was encountered "
            "(sandbox stand-in: crash-on-start mode)",
            level=logging.ERROR,
        )
        logger.info("Received sigquit from a child process. It usually means the child failed.")
        return 1
    time.sleep(startup)
    tp_log(
        0,
        "Load weight end. type=StandIn, dtype=torch.bfloat16, avail mem=60.00 GB, "
        "mem usage=34.50 GB.",
    )
    tp_log(
        0,
        "max_total_num_tokens=%d, chunked_prefill_size=%s, max_running_requests=%s, context_len=%d",
        1048576,
        args.get("chunked_prefill_size"),
        args.get("max_running_requests"),
        args.get("context_length") or DEFAULT_CONTEXT_LEN,
    )

    host, port = args.get("host") or "127.0.0.1", int(args.get("port") or 30000)
    if node_rank >= 1:
        return nodes.serve_dummy_health(host, port)
    state = State(args, modes)
    Handler.state = state
    try:
        server_class = ThreadingHTTPServerV6 if ":" in host else Server
        httpd = server_class((host, port), Handler)
    except OSError as exc:
        logger.error(
            "[Errno %s] error while attempting to bind on address (%r, %d): %s",
            exc.errno,
            host,
            port,
            exc.strerror,
        )
        return 1
    httpd.daemon_threads = True
    logger.info("INFO:     Started server process [%d]", os.getpid())
    logger.info("INFO:     Waiting for application startup.")
    logger.info("INFO:     Application startup complete.")
    logger.info("INFO:     Uvicorn running on http://%s:%d (Press CTRL+C to quit)", host, port)
    threading.Thread(target=warmup, args=(state, host, port), daemon=True).start()
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


def warmup(state, host, port):
    """As the real server: ask itself for one token, then declare itself ready."""
    args = state.args
    if not args.get("skip_server_warmup"):
        target = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
        url = f"http://{target}:{port}"
        headers = {"Content-Type": "application/json"}
        if args.get("api_key"):
            headers["Authorization"] = f"Bearer {args['api_key']}"
        try:
            urllib.request.urlopen(
                urllib.request.Request(url + "/get_model_info", headers=headers), timeout=30
            ).read()
            body = json.dumps(
                {
                    "text": "The capital city of France is",
                    "sampling_params": {"temperature": 0, "max_new_tokens": 8},
                }
            ).encode()
            urllib.request.urlopen(
                urllib.request.Request(url + "/generate", data=body, headers=headers), timeout=30
            ).read()
        except Exception:  # noqa: BLE001 (the real server logs the traceback and dies)
            logger.error("Initialization failed. warmup error: %s", traceback.format_exc())
            os._exit(1)
    state.status = "Up"
    logger.info("The server is fired up and ready to roll!")


def count_tokens(text):
    return len(str(text).split())


def answer_tokens(state, max_tokens):
    """The canned answer as tokens ("".join gives the text) and the finish reason."""
    if "degenerate" in state.modes:
        return ["!"] * (max_tokens or 16), "length"
    words = ANSWER.format(version=__version__, model=state.args["served_model_name"]).split()
    tokens = [w if i == 0 else " " + w for i, w in enumerate(words)]
    if max_tokens is not None and max_tokens < len(tokens):
        return tokens[:max_tokens], "length"
    return tokens, "stop"


class Handler(BaseHTTPRequestHandler):
    state = None
    protocol_version = "HTTP/1.1"

    def version_string(self):
        return "uvicorn"

    def log_message(self, fmt, *a):  # uvicorn's access log
        pass

    def log_request(self, code="-", size="-"):
        phrase = self.responses.get(int(code), ("",))[0] if str(code).isdigit() else ""
        logger.info(
            'INFO:     %s:%d - "%s %s %s" %s %s',
            self.client_address[0],
            self.client_address[1],
            self.command,
            self.path,
            self.request_version,
            code,
            phrase,
        )

    # --- plumbing ---------------------------------------------------------------------------
    def _send(self, code, body=b"", content_type="application/json"):
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
        self.send_response(code)
        if body or content_type:
            self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json_body(self):
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            return json.loads(raw or b"{}")
        except ValueError:
            return None

    def _authorized(self):
        key = self.state.args.get("api_key")
        if not key or self.path.startswith("/health") or self.path.startswith("/metrics"):
            return True
        auth = self.headers.get("Authorization") or ""
        parts = auth.split(" ", 1)
        return len(parts) == 2 and parts[0].lower() == "bearer" and parts[1] == key

    def _route(self, method):
        path = self.path.split("?", 1)[0]
        if not self._authorized():
            return self._send(401, {"error": "Unauthorized"})
        routes = GET_ROUTES if method == "GET" else POST_ROUTES
        if path in routes:
            return routes[path](self)
        if path in GET_ROUTES or path in POST_ROUTES:
            return self._send(405, {"detail": "Method Not Allowed"})
        return self._send(404, {"detail": "Not Found"})

    def do_GET(self):
        self._route("GET")

    def do_POST(self):
        self._route("POST")

    # --- endpoints --------------------------------------------------------------------------
    def health(self):
        self._send(503 if self.state.status != "Up" else 200, b"", content_type=None)

    def models(self):
        name = self.state.args["served_model_name"]
        self._send(
            200,
            {
                "object": "list",
                "data": [
                    {
                        "id": name,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "sglang",
                        "root": name,
                        "parent": None,
                        "max_model_len": self.state.args.get("context_length")
                        or DEFAULT_CONTEXT_LEN,
                    }
                ],
            },
        )

    def model_info(self):
        a = self.state.args
        self._send(
            200,
            {
                "model_path": a["model_path"],
                "tokenizer_path": a.get("tokenizer_path"),
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": None,
                "architectures": None,
            },
        )

    def server_info(self):
        if self.path.startswith("/get_server_info"):
            logger.warning(
                "Endpoint '/get_server_info' is deprecated and will be removed in a "
                "future version. Please use '/server_info' instead."
            )
        info = dict(self.state.args)
        info.update(
            {
                "max_total_num_tokens": 1048576,
                "version": __version__,
                "internal_states": [{"status": self.state.status, "sandbox_standin": True}],
            }
        )
        self._send(200, info)

    def metrics(self):
        if not self.state.args.get("enable_metrics"):
            return self._send(404, {"detail": "Not Found"})
        text = METRICS.render(self.state.args)
        self._send(200, text.encode(), content_type="text/plain; version=0.0.4; charset=utf-8")

    def _generation_allowed(self):
        if self.state.crash_armed:
            tp_log(
                0,
                "Scheduler hit an exception: Traceback (most recent call last):\n"
                "ValueError: Detected errors during sampling! NaN in the logits. "
                "(sandbox stand-in: crash-on-request mode)",
                level=logging.ERROR,
            )
            logger.info("Received sigquit from a child process. It usually means the child failed.")
            sys.stderr.flush()
            os._exit(1)

    def chat_completions(self):
        req = self._json_body()
        if not isinstance(req, dict) or not isinstance(req.get("messages"), list):
            return self._send(
                400,
                {
                    "object": "error",
                    "message": "messages: Field required",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                },
            )
        self._generation_allowed()
        max_tokens = req.get("max_completion_tokens") or req.get("max_tokens")
        tokens, finish = answer_tokens(self.state, max_tokens)
        prompt_tokens = sum(
            count_tokens(m.get("content") or "") for m in req["messages"] if isinstance(m, dict)
        )
        thinks = self.state.args.get("reasoning_parser") and "degenerate" not in self.state.modes
        reasoning = REASONING if thinks else None
        rid, created, model = (
            uuid.uuid4().hex,
            int(time.time()),
            self.state.args["served_model_name"],
        )
        usage = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + len(tokens),
            "completion_tokens": len(tokens),
            "prompt_tokens_details": None,
            "reasoning_tokens": count_tokens(reasoning or ""),
        }
        METRICS.served(prompt_tokens, len(tokens))
        if req.get("stream"):
            return self._stream_chat(
                rid,
                created,
                model,
                tokens,
                finish,
                reasoning,
                usage,
                (req.get("stream_options") or {}).get("include_usage"),
            )
        self._send(
            200,
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": "".join(tokens),
                            "reasoning_content": reasoning,
                            "tool_calls": None,
                        },
                        "logprobs": None,
                        "finish_reason": finish,
                        "matched_stop": None,
                    }
                ],
                "usage": usage,
                "metadata": {"weight_version": "default"},
            },
        )

    def _stream_chat(self, rid, created, model, tokens, finish, reasoning, usage, include_usage):
        self.send_response(200)
        self.send_header("content-type", "text/event-stream; charset=utf-8")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

        def chunk(delta, finish_reason=None, usage_=None):
            body = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": []
                if usage_
                else [
                    {
                        "index": 0,
                        "delta": delta,
                        "logprobs": None,
                        "finish_reason": finish_reason,
                        "matched_stop": None,
                    }
                ],
                "usage": usage_,
            }
            self.wfile.write(b"data: " + json.dumps(body).encode() + b"\n\n")

        chunk({"role": "assistant", "content": ""})
        if reasoning:
            chunk({"reasoning_content": reasoning})
        for token in tokens:
            chunk({"content": token})
        chunk({}, finish_reason=finish)
        if include_usage:
            chunk(None, usage_=usage)
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def completions(self):
        req = self._json_body()
        if not isinstance(req, dict) or "prompt" not in req:
            return self._send(
                400,
                {
                    "object": "error",
                    "message": "prompt: Field required",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                },
            )
        self._generation_allowed()
        tokens, finish = answer_tokens(self.state, req.get("max_tokens"))
        prompt_tokens = count_tokens(req["prompt"]) if isinstance(req["prompt"], str) \
            else len(req["prompt"])
        if req.get("stream"):
            return self._stream_completion(req, tokens, finish, prompt_tokens)
        METRICS.served(prompt_tokens, len(tokens))
        self._send(
            200,
            {
                "id": uuid.uuid4().hex,
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.state.args["served_model_name"],
                "choices": [
                    {
                        "index": 0,
                        "text": "".join(tokens),
                        "logprobs": None,
                        "finish_reason": finish,
                        "matched_stop": None,
                    }
                ],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "total_tokens": prompt_tokens + len(tokens),
                    "completion_tokens": len(tokens),
                    "prompt_tokens_details": None,
                },
            },
        )

    def _stream_completion(self, req, tokens, finish, prompt_tokens):
        """SSE chunks of an OpenAI text completion, paced by the scenario's rate."""
        max_tokens = req.get("max_tokens") or len(tokens)
        if req.get("ignore_eos") and len(tokens) < max_tokens:
            words = (tokens * (max_tokens // max(len(tokens), 1) + 1))[:max_tokens]
            tokens, finish = words, "length"
        rates = serving_scenario().get("output_tokens_per_s") or {}
        table = rates.get(self.state.args.get("moe_runner_backend") or "auto") \
            or rates.get("default")
        rid, created = uuid.uuid4().hex, int(time.time())
        model = self.state.args["served_model_name"]
        self.send_response(200)
        self.send_header("content-type", "text/event-stream; charset=utf-8")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

        def chunk(text, finish_reason=None, usage=None):
            body = {"id": rid, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": 0, "text": text, "logprobs": None,
                                 "finish_reason": finish_reason, "matched_stop": None}],
                    "usage": usage}
            self.wfile.write(b"data: " + json.dumps(body).encode() + b"\n\n")
            self.wfile.flush()

        LOAD.change(+1)
        measured = METRICS.request(prompt_tokens)
        try:
            for i, token in enumerate(tokens):
                if table:
                    time.sleep(max(LOAD.active, 1) / rate_at(table, max(LOAD.active, 1)))
                chunk(token, finish if i == len(tokens) - 1 else None,
                      {"prompt_tokens": prompt_tokens, "completion_tokens": i + 1,
                       "total_tokens": prompt_tokens + i + 1})
                measured.token()
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except OSError:
            pass
        finally:
            measured.finish()
            LOAD.change(-1)

    def generate(self):
        req = self._json_body() or {}
        self._generation_allowed()
        params = req.get("sampling_params") or {}
        tokens, finish = answer_tokens(self.state, params.get("max_new_tokens"))
        ids = req.get("input_ids")
        prompt_tokens = len(ids) if isinstance(ids, list) else count_tokens(req.get("text") or "")
        if req.get("stream"):
            return self._stream_generate(params, tokens, finish, prompt_tokens)
        METRICS.served(prompt_tokens, len(tokens))
        self._send(
            200,
            {
                "text": "".join(tokens),
                "output_ids": list(range(len(tokens))),
                "meta_info": {
                    "id": uuid.uuid4().hex,
                    "finish_reason": {"type": finish}
                    if finish == "stop"
                    else {"type": "length", "length": len(tokens)},
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": len(tokens),
                    "cached_tokens": 0,
                    "weight_version": "default",
                    "e2e_latency": 0.01,
                },
            },
        )


    def _stream_generate(self, params, tokens, finish, prompt_tokens):
        """SSE chunks of /generate as sglang 0.5.9 streams them (http_server.py generate_request,
        tokenizer_manager.py: each chunk's text and output_ids are all so far, its
        finish_reason None until the last; then ``data: [DONE]``), paced by the scenario's
        rate as a streamed completion."""
        max_new = params.get("max_new_tokens") or len(tokens)
        if params.get("ignore_eos") and len(tokens) < max_new:
            tokens = (tokens * (max_new // max(len(tokens), 1) + 1))[:max_new]
            finish = "length"
        rates = serving_scenario().get("output_tokens_per_s") or {}
        table = rates.get(self.state.args.get("moe_runner_backend") or "auto") \
            or rates.get("default")
        rid = uuid.uuid4().hex
        self.send_response(200)
        self.send_header("content-type", "text/event-stream; charset=utf-8")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        LOAD.change(+1)
        measured = METRICS.request(prompt_tokens)
        try:
            for i in range(len(tokens)):
                if table:
                    time.sleep(max(LOAD.active, 1) / rate_at(table, max(LOAD.active, 1)))
                last = i == len(tokens) - 1
                reason = None if not last else ({"type": "stop"} if finish == "stop" else
                                                {"type": "length", "length": len(tokens)})
                body = {"text": "".join(tokens[:i + 1]), "output_ids": list(range(i + 1)),
                        "meta_info": {"id": rid, "finish_reason": reason,
                                      "prompt_tokens": prompt_tokens,
                                      "completion_tokens": i + 1, "cached_tokens": 0,
                                      "weight_version": "default"}}
                self.wfile.write(b"data: " + json.dumps(body).encode() + b"\n\n")
                self.wfile.flush()
                measured.token()
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except OSError:
            pass
        finally:
            measured.finish()
            LOAD.change(-1)


GET_ROUTES = {
    "/health": Handler.health,
    "/health_generate": Handler.health,
    "/v1/models": Handler.models,
    "/get_model_info": Handler.model_info,
    "/model_info": Handler.model_info,
    "/get_server_info": Handler.server_info,
    "/server_info": Handler.server_info,
    "/metrics": Handler.metrics,
}
POST_ROUTES = {
    "/v1/chat/completions": Handler.chat_completions,
    "/v1/completions": Handler.completions,
    "/generate": Handler.generate,
}


class Server(ThreadingHTTPServer):
    """The real server's listen backlog: uvicorn's default, 2048 (uvicorn/config.py, Config's
    ``backlog: int = 2048``; sglang 0.5.9 serves its HTTP API with uvicorn). socketserver's own, 5, reset connections of a bench at 16
    concurrent requests on a busy machine ("Connection reset by peer": 3 of 16 failed)."""

    request_queue_size = 2048


class ThreadingHTTPServerV6(Server):
    """For an IPv6 --host (ThreadingHTTPServer binds IPv4 only)."""

    address_family = socket.AF_INET6
