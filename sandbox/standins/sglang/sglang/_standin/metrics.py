"""GET /metrics of the sglang 0.5.9 stand-in, in Prometheus' text format (0.0.4).

The names, label names, help texts and histogram buckets are the real server's, read from the
0.5.9 wheel (``pip download sglang==0.5.9 --no-deps``):

- sglang/srt/metrics/collector.py SchedulerMetricsCollector: the gauges ``sglang:num_running_reqs``,
  ``num_used_tokens``, ``token_usage``, ``gen_throughput``, ``num_queue_reqs``,
  ``cache_hit_rate``, ``max_total_num_tokens``, labelled as
  sglang/srt/managers/scheduler_metrics_mixin.py does (model_name, engine_type, tp_rank, pp_rank,
  moe_ep_rank; only tensor parallel rank 0 reports without --enable-metrics-for-all-schedulers);
- the same file's TokenizerMetricsCollector: the counters ``sglang:prompt_tokens_total``,
  ``generation_tokens_total``, ``num_requests_total`` and the histograms
  ``sglang:time_to_first_token_seconds``, ``inter_token_latency_seconds``,
  ``e2e_request_latency_seconds`` with their default buckets, labelled model_name
  (tokenizer_manager.py init_metric_collector_watchdog).

sglang runs prometheus_client in multiprocess mode (PROMETHEUS_MULTIPROC_DIR), which writes no
``_created`` samples; neither does this. The figures are the stand-in's own requests: what it
served, when, and how many run now (the scheduler's queue is what runs beyond
--max-running-requests).
"""

import threading
import time

#: collector.py's default buckets (bucket_time_to_first_token, bucket_inter_token_latency,
#: bucket_e2e_request_latency when the server args give none).
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040,
               0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000,
               8.000)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600,
               1200, 1800, 2400)
#: What the stand-in reports as its KV cache's size (its /server_info says the same).
MAX_TOTAL_NUM_TOKENS = 1048576
#: The window of sglang's gen_throughput (the scheduler logs it per decode log interval, 40
#: decode steps by default; a few seconds here).
THROUGHPUT_WINDOW_S = 5.0


class Histogram:
    def __init__(self, buckets):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.count, self.sum = 0, 0.0

    def observe(self, value):
        self.count += 1
        self.sum += value
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1


class Request:
    """One generation: ``token()`` at each output token, ``finish()`` once at the end."""

    def __init__(self, metrics, prompt_tokens):
        self.metrics, self.prompt_tokens = metrics, prompt_tokens
        self.start = self.last = time.monotonic()
        self.output_tokens = 0

    def token(self, n=1):
        now = time.monotonic()
        with self.metrics.lock:
            if self.output_tokens == 0:
                self.metrics.ttft.observe(now - self.start)
            else:
                self.metrics.itl.observe((now - self.last) / n)
            self.output_tokens += n
            self.metrics.generated.append((now, n))
            self.metrics.generation_tokens += n
        self.last = now

    def finish(self):
        with self.metrics.lock:
            self.metrics.running.discard(self)
            self.metrics.e2e.observe(time.monotonic() - self.start)
            self.metrics.requests += 1


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.ttft, self.itl, self.e2e = (Histogram(TTFT_BUCKETS), Histogram(ITL_BUCKETS),
                                         Histogram(E2E_BUCKETS))
        self.prompt_tokens = self.generation_tokens = self.requests = 0
        self.running = set()
        self.generated = []  # (monotonic time, tokens) within THROUGHPUT_WINDOW_S

    def request(self, prompt_tokens):
        req = Request(self, prompt_tokens)
        with self.lock:
            self.running.add(req)
            self.prompt_tokens += prompt_tokens
        return req

    def served(self, prompt_tokens, output_tokens):
        """A request answered whole (not streamed): its tokens at once."""
        req = self.request(prompt_tokens)
        if output_tokens:
            req.token(output_tokens)
        req.finish()

    def render(self, args):
        """The exposition text, labelled from the server args (a dict of ServerArgs fields)."""
        name = args["served_model_name"]
        max_running = args.get("max_running_requests") or 0
        now = time.monotonic()
        with self.lock:
            self.generated = [(t, n) for t, n in self.generated if now - t <= THROUGHPUT_WINDOW_S]
            throughput = sum(n for _, n in self.generated) / THROUGHPUT_WINDOW_S
            active = len(self.running)
            used = sum(r.prompt_tokens + r.output_tokens for r in self.running)
            running = min(active, max_running) if max_running else active
            sched = (f'engine_type="unified",model_name="{name}",moe_ep_rank="0",pp_rank="0",'
                     'tp_rank="0"')
            tok = f'model_name="{name}"'
            lines = []

            def metric(metric_name, kind, doc, samples):
                lines.append(f"# HELP {metric_name} {doc}")
                lines.append(f"# TYPE {metric_name.removesuffix('_total')} {kind}"
                             if kind == "counter" else f"# TYPE {metric_name} {kind}")
                lines.extend(samples)

            gauges = [
                ("sglang:num_running_reqs", "The number of running requests.", running),
                ("sglang:num_used_tokens", "The number of used tokens.", used),
                ("sglang:token_usage", "The token usage.", round(used / MAX_TOTAL_NUM_TOKENS, 4)),
                ("sglang:gen_throughput", "The generation throughput (token/s).", throughput),
                ("sglang:num_queue_reqs", "The number of requests in the waiting queue.",
                 active - running),
                ("sglang:cache_hit_rate", "The prefix cache hit rate.", 0.0),
                ("sglang:max_total_num_tokens",
                 "Maximum total number of tokens in the KV cache pool.", MAX_TOTAL_NUM_TOKENS),
            ]
            for metric_name, doc, value in gauges:
                metric(metric_name, "gauge", doc, [f"{metric_name}{{{sched}}} {float(value)}"])
            counters = [
                ("sglang:prompt_tokens_total", "Number of prefill tokens processed.",
                 self.prompt_tokens),
                ("sglang:generation_tokens_total", "Number of generation tokens processed.",
                 self.generation_tokens),
                ("sglang:num_requests_total", "Number of requests processed.", self.requests),
            ]
            for metric_name, doc, value in counters:
                metric(metric_name, "counter", doc, [f"{metric_name}{{{tok}}} {float(value)}"])
            histograms = [
                ("sglang:time_to_first_token_seconds",
                 "Histogram of time to first token in seconds.", self.ttft),
                ("sglang:inter_token_latency_seconds",
                 "Histogram of inter-token latency in seconds.", self.itl),
                ("sglang:e2e_request_latency_seconds",
                 "Histogram of End-to-end request latency in seconds", self.e2e),
            ]
            for metric_name, doc, hist in histograms:
                samples = [f'{metric_name}_bucket{{le="{float(b)}",{tok}}} {float(c)}'
                           for b, c in zip(hist.buckets, hist.counts)]
                samples += [f'{metric_name}_bucket{{le="+Inf",{tok}}} {float(hist.count)}',
                            f"{metric_name}_count{{{tok}}} {float(hist.count)}",
                            f"{metric_name}_sum{{{tok}}} {hist.sum}"]
                metric(metric_name, "histogram", doc, samples)
        return "\n".join(lines) + "\n"


METRICS = Metrics()
