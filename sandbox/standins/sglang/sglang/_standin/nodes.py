"""sglang 0.5.9 across nodes (--nnodes > 1), stand-in: a real TCP rendezvous between the hosts.

What the real server does (read from the 0.5.9 wheel): each node launches tp x pp / nnodes
scheduler processes (sglang/srt/entrypoints/engine.py, ``_launch_scheduler_processes``), and
each joins torch.distributed at ``tcp://<--dist-init-addr>`` (sglang/srt/model_executor/
model_runner.py: ``dist_init_method = f"tcp://{self.server_args.dist_init_addr}"``) with
``timeout=--dist-timeout`` (None by default: torch's own, 10 minutes for NCCL,
``kProcessGroupNCCLDefaultTimeout`` in torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp);
rank 0's TCPStore listens there and waits for every rank. Nodes of rank >= 1 then run no
tokenizer or HTTP API, only a dummy /health, /health_generate and /ping server on --host:--port
(sglang/srt/utils/common.py, ``launch_dummy_health_check_server``), and wait on their schedulers.

Here one process per node joins the torch stand-in's process group (torch/distributed: rank 0
listens at the address, the others connect, a missing rank times out with the TCPStore's words)
as node rank i of nnodes. Afterwards every node watches its connections: a peer that goes away
(its server killed or stopped) ends this node's server too, exit 1, with NCCL's words for a
remote peer that closed the connection, as a collective on a dead peer fails with
ncclRemoteError and the scheduler's death ends launch_server ("Received sigquit from a child
process").
"""

import datetime
import logging
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

logger = logging.getLogger("sglang.srt.nodes")


def rendezvous(args, tp_log):
    """Join the group: returns the peers' connections (rank 0: one per other node; others:
    the one to rank 0). Raises the torch stand-in's DistStoreError on a timeout."""
    import torch.distributed as dist

    nnodes, rank = args["nnodes"], args["node_rank"]
    seconds = args.get("dist_timeout")
    timeout = datetime.timedelta(seconds=seconds) if seconds else None
    tp_log(0, "Init torch distributed begin. node_rank=%d nnodes=%d dist_init_addr=%s",
           rank, nnodes, args["dist_init_addr"])
    dist.init_process_group("nccl", init_method=f"tcp://{args['dist_init_addr']}",
                            world_size=nnodes, rank=rank, timeout=timeout)
    tp_log(0, "Init torch distributed ends. node_rank=%d of %d joined", rank, nnodes)
    return list(dist._group["peers"])


def watch(peers, rank):
    """End this process (exit 1) as soon as a peer's connection closes."""

    def follow(conn, index):
        try:
            while conn.recv(4096):
                pass
        except OSError:
            pass
        who = "node rank 0" if rank else f"node rank {index + 1}"
        logger.error("[node rank %d] NCCL error: remote process exited or there was a network "
                     "error: %s closed the connection (ncclRemoteError)", rank, who)
        logger.error("Received sigquit from a child process. It usually means the child "
                     "failed.")
        logging.shutdown()
        os._exit(1)

    for index, conn in enumerate(peers):
        threading.Thread(target=follow, args=(conn, index), daemon=True).start()


class _DummyHealth(BaseHTTPRequestHandler):
    def do_GET(self):
        code = 200 if self.path.split("?")[0] in ("/health", "/health_generate", "/ping") \
            else 404
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def serve_dummy_health(host, port):
    """A rank >= 1's HTTP: the dummy health server, until the process ends."""
    httpd = ThreadingHTTPServer((host, port), _DummyHealth)
    httpd.daemon_threads = True
    logger.info("node rank >= 1: dummy health check server on http://%s:%d", host, port)
    httpd.serve_forever()
    return 0
