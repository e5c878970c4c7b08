"""Load the host's own SGLang server with sglang's bench_serving at each concurrency level while
nvidia-smi samples every GPU; write the raw outputs into one folder for the controller to fetch.

Runs on the GPU host as root, with the system python3 (standard library only), in a transient
unit of bench.py's (so a dropped link does not stop it half-way):

    python3 bench_run.py --python VENV/bin/python --url http://127.0.0.1:8000 --model glm-5
        --tokenizer /opt/gpuhost/models/... --levels 1,16,64 --input-len 1024
        --output-len 256 --prompts 128 --out /var/lib/gpuhost/bench/run [--api-key-file F]
        [--backend sglang]

Writes into --out: ``links.csv`` (each GPU's PCIe generation and width), ``telemetry.csv``
(``nvidia-smi --query-gpu=<telemetry.QUERY_FIELDS> --format=csv,noheader,nounits -lms 500``),
``dmon.csv`` (``nvidia-smi dmon -s puct -d 1 -o DT --format csv``: PCIe rx/tx), one
``level-<N>.json`` per level (bench_serving's ``--output-file``; its log, tqdm's redraws
but the last left out, in ``level-<N>.log``), ``meta.json`` (each level's
measured run's start and end in nvidia-smi's clock (from bench_serving's "Warmup
completed" line to its result's first line), the command lines, exit statuses, versions, the
packages' metadata summaries), ``gpu-health.prom`` (a copy of the GPU metrics script's last
reading, --gpu-metrics, where the host has one: the bench's GPU verdict) and
``done`` last. Formats: tests/fixtures/h200-device/telemetry/. bench_serving's arguments are
sglang 0.5.9's (its wheel's bench_serving.py): ``--dataset-name random-ids`` needs no download
(``random`` fetches ShareGPT from the Hub), ``--random-range-ratio 1.0`` fixes the lengths. With
``--backend sglang`` (bench_serving's native backend: POST /generate) is for the fleet's router:
smg 1.13.0 answers the ``sglang-oai`` backend's /v1/completions with 400 (operations/
bench_fleet.py says what was seen). With
an API key file the key goes to bench_serving as ``OPENAI_API_KEY`` (its get_auth_headers sends
``Authorization: Bearer``), never on a command line or in the output.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import re
import subprocess
import sys
import time
from datetime import datetime

#: The telemetry sampled (operations/facts/telemetry.py QUERY_FIELDS; kept equal by a unit test).
QUERY_FIELDS = (
    "timestamp,index,power.draw,enforced.power.limit,clocks.sm,clocks.max.sm,clocks.mem,"
    "utilization.gpu,utilization.memory,temperature.gpu,clocks_event_reasons.active,"
    "clocks_event_reasons.applications_clocks_setting,clocks_event_reasons.gpu_idle,"
    "clocks_event_reasons.hw_power_brake_slowdown,clocks_event_reasons.hw_slowdown,"
    "clocks_event_reasons.hw_thermal_slowdown,clocks_event_reasons.sw_power_cap,"
    "clocks_event_reasons.sw_thermal_slowdown,clocks_event_reasons.sync_boost"
)
LINK_FIELDS = "index,pcie.link.gen.max,pcie.link.width.max"
VERSIONS = ("sglang", "torch", "flashinfer-python", "sgl-kernel", "flash-attn")


def _now() -> str:
    """Local time as nvidia-smi's query timestamps write it."""
    return datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]


def _distributions(python: str) -> tuple[dict, dict]:
    """Each of VERSIONS installed in ``python``'s environment: its version, and its metadata's
    Summary (a stand-in says so there: the sandbox's packages end theirs with "(gpuhost sandbox
    stand-in)")."""
    script = ("import importlib.metadata as m, json\nout = {}\n"
              f"for name in {VERSIONS!r}:\n    try: d = m.distribution(name)\n"
              "    except m.PackageNotFoundError: continue\n"
              "    out[name] = [d.version, d.metadata.get('Summary') or '']\n"
              "print(json.dumps(out))")
    result = subprocess.run([python, "-c", script], capture_output=True, text=True)
    try:
        found = json.loads(result.stdout)
    except ValueError:
        found = {}
    return ({name: v[0] for name, v in found.items()},
            {name: v[1] for name, v in found.items()})


def _versions(python: str) -> tuple[dict, dict]:
    """(versions of VERSIONS, the driver, the GPUs' name, compute capability and count; the
    packages' summaries). ``compute_cap`` is nvidia-smi's query field (driver 580's
    --help-query-gpu, tests/fixtures/h200-device/telemetry/help-query-gpu.txt: "The CUDA
    Compute Capability, represented as Major DOT Minor")."""
    versions, summaries = _distributions(python)
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name,compute_cap",
                             "--format=csv,noheader"], capture_output=True, text=True)
    rows = [line.split(", ") for line in driver.stdout.splitlines() if ", " in line]
    if rows:
        versions["driver"], versions["gpu"] = rows[0][0], rows[0][1]
        if len(rows[0]) > 2:
            versions["compute_cap"] = rows[0][2]
        versions["gpu_count"] = str(len(rows))
    return versions, summaries


def bench_command(args: argparse.Namespace, level: int, output: str) -> list[str]:
    return [args.python, "-m", "sglang.bench_serving", "--backend", args.backend,
            "--base-url", args.url, "--model", args.tokenizer,
            "--served-model-name", args.model, "--tokenizer", args.tokenizer,
            "--dataset-name", "random-ids", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--random-range-ratio", "1.0",
            "--num-prompts", str(args.prompts), "--max-concurrency", str(level),
            "--warmup-requests", str(min(level, 4)), "--output-file", output]


#: tqdm's bar as bench_serving 0.5.9 draws it on stderr (``tqdm(total=len(input_requests))``,
#: one update per finished request; tqdm's default format "{l_bar}{bar}| {n_fmt}/{total_fmt}
#: [{elapsed}<{remaining}, {rate_fmt}]", each redraw after a carriage return), e.g.
#: `` 25%|██▌       | 32/128 [00:10<00:30,  3.20it/s]``.
TQDM = re.compile(r"^\s*\d+%\|.*\| (\d+)/(\d+) \[")
#: Seconds between two progress lines of a level (the controller polls every 10 s).
PROGRESS_EVERY = 10


def progress_line(level: int, done: int, total: int, running_s: float, after: list[int]) -> str:
    """``level 1: 5 of 16 prompts done, about 20 s left in this level; levels 4, 16 after it``:
    the time left is the level's own pace so far (seconds per finished prompt) times the
    prompts left; none before the first prompt finishes."""
    line = f"level {level}: {done} of {total} prompts done"
    if 0 < done < total:
        line += f", about {running_s / done * (total - done):.0f} s left in this level"
    if after:
        line += f"; level{'s' if len(after) > 1 else ''} {', '.join(map(str, after))} after it"
    return line


def main() -> int:
    args = _arguments()
    env = _bench_env(args)
    if env is None:
        return 1
    os.makedirs(args.out, exist_ok=True)

    def out(name: str) -> str:
        return os.path.join(args.out, name)

    samplers = _samplers(out)
    versions, summaries = _versions(args.python)
    meta = {"utc_offset_s": time.localtime().tm_gmtoff, "started": _now(),
            "versions": versions, "summaries": summaries, "levels": [],
            "input_len": args.input_len, "output_len": args.output_len,
            "prompts": args.prompts, "backend": args.backend}
    failed = False
    try:
        time.sleep(2)  # idle samples before the first level
        levels = [int(n) for n in args.levels.split(",")]
        for number, level in enumerate(levels):
            meta["levels"].append(_run_level(args, env, out, level, levels[number + 1:]))
            if not _level_passed(out, meta["levels"][-1]):
                failed = True
                break
            time.sleep(1)
    finally:
        time.sleep(1)
        _finish(args, out, samplers, meta, failed)
    return 1 if failed else 0


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("--python", "--url", "--model", "--tokenizer", "--out"):
        parser.add_argument(name, required=True)
    parser.add_argument("--levels", required=True, help="comma-separated concurrency levels")
    for name in ("--input-len", "--output-len", "--prompts"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--api-key-file")
    parser.add_argument("--backend", choices=("sglang-oai", "sglang"), default="sglang-oai")
    parser.add_argument("--ca-file", help="the CA an https:// --url is verified with")
    parser.add_argument("--gpu-metrics", help="the GPU metrics script's textfile, copied at the "
                        "end as gpu-health.prom")
    return parser.parse_args()


def _bench_env(args: argparse.Namespace) -> dict[str, str] | None:
    """bench_serving's environment: the CA it verifies an https:// URL with, the API key;
    None where the key file is not a secret file (said)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.ca_file:
        # bench_serving's aiohttp verifies with ssl.create_default_context(), whose default
        # verify paths are OpenSSL's: SSL_CERT_FILE names the file (OpenSSL's
        # X509_get_default_cert_file_env); its requests calls read REQUESTS_CA_BUNDLE
        # (requests' sessions.py, merge_environment_settings)
        env["SSL_CERT_FILE"] = env["REQUESTS_CA_BUNDLE"] = args.ca_file
    if args.api_key_file:
        from secret_file import SecretFileError, read_secret
        try:
            env["OPENAI_API_KEY"] = read_secret(args.api_key_file, "key file")
        except SecretFileError as exc:
            print(f"bench failed: {exc}", flush=True)
            return None
    return env


def _samplers(out) -> list[subprocess.Popen]:
    """links.csv written, and the telemetry and dmon samplers started (telemetry.csv,
    dmon.csv)."""
    with open(out("links.csv"), "w") as links:
        subprocess.run(["nvidia-smi", f"--query-gpu={LINK_FIELDS}",
                        "--format=csv,noheader,nounits"], stdout=links, check=False)
    return [
        subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY_FIELDS}",
                          "--format=csv,noheader,nounits", "-lms", "500"],
                         stdout=open(out("telemetry.csv"), "w"), stderr=subprocess.STDOUT),
        subprocess.Popen(["nvidia-smi", "dmon", "-s", "puct", "-d", "1", "-o", "DT",
                          "--format", "csv"],
                         stdout=open(out("dmon.csv"), "w"), stderr=subprocess.STDOUT),
    ]


def _run_level(args: argparse.Namespace, env: dict[str, str], out, level: int,
               after: list[int]) -> dict:
    """Run bench_serving at one concurrency ``level`` (``after``: the levels still to run);
    its entry of meta.json's levels: the measured window, the exit status, the command."""
    output = out(f"level-{level}.json")
    command = bench_command(args, level, output)
    print(f"level {level}: {args.prompts} prompts, {level} at a time", flush=True)
    end = None
    start = _now()
    main_run, shown, bar = None, 0.0, None
    with open(out(f"level-{level}.log"), "w") as log:
        # text mode reads tqdm's carriage-return redraws as lines of their own
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, cwd=args.out, text=True)
        for line in proc.stdout:
            drawn = TQDM.match(line)
            if drawn:
                bar = line
                now = time.monotonic()
                done, total = int(drawn.group(1)), int(drawn.group(2))
                if now - shown >= PROGRESS_EVERY or done == total:
                    shown = now
                    print(progress_line(level, done, total, now - (main_run or now), after),
                          flush=True)
                continue
            if bar is not None:
                log.write(bar.rstrip("\n") + "\n")
                bar = None
            log.write(line)
            # The level's window starts with the measured run, after the tokenizer's
            # load and the warm-up (bench_serving's own words).
            if line.startswith("Warmup completed"):
                start, main_run = _now(), time.monotonic()
            # ... and ends when the last request is done, before the tool's report.
            if line.startswith("=" * 12):
                end = end or _now()
        rc = proc.wait()
    end = end or _now()
    return {"concurrency": level, "start": start, "end": end, "rc": rc, "command": command}


def _level_passed(out, entry: dict) -> bool:
    """Whether the level of ``entry`` wrote its result; said either way (a failed level: its
    exit status and its log's last lines)."""
    level = entry["concurrency"]
    with open(out(f"level-{level}.log")) as log:
        tail = log.read().splitlines()[-25:]
    if entry["rc"] != 0 or not os.path.exists(out(f"level-{level}.json")):
        print(f"level {level}: bench_serving exited {entry['rc']}:", flush=True)
        for line in tail:
            print(f"  {line}", flush=True)
        return False
    print(f"level {level}: done in {time.time() - _epoch(entry['start']):.0f} s", flush=True)
    return True


def _finish(args: argparse.Namespace, out, samplers: list[subprocess.Popen], meta: dict,
            failed: bool) -> None:
    """The samplers stopped; gpu-health.prom, meta.json and the ``done`` mark written."""
    for sampler in samplers:
        sampler.terminate()
        sampler.wait()
    meta["ended"] = _now()
    if args.gpu_metrics and os.path.isfile(args.gpu_metrics):
        shutil.copyfile(args.gpu_metrics, out("gpu-health.prom"))
    with open(out("meta.json"), "w") as handle:
        json.dump(meta, handle, indent=1)
    with open(out("done"), "w") as handle:
        handle.write("failed\n" if failed else "ok\n")


def _epoch(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()


if __name__ == "__main__":
    sys.exit(main())
