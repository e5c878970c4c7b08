"""torch.distributed: sandbox stand-in (gpuhost sandbox lab) for PyTorch 2.9.1's NCCL process
group. Not PyTorch.

One process per GPU, as with the real backend: ``init_process_group("nccl", init_method=
"tcp://HOST:PORT" or "env://", rank=, world_size=, timeout=)`` makes rank 0 listen on HOST:PORT
(where the real TCPStore listens) and the other ranks connect to it. ``all_reduce`` sends each
rank's symbolic tensor content to rank 0, which reduces them and answers every rank, so the
collective really involves every process. What crosses between GPUs over P2P follows the host's
scenario (torch/_sandbox.py, ``peer_transfers.all_reduce``): "intact", "wrong-data" (one rank's
contribution lost) or "hang" (no answer until the group's timeout, then NCCL's watchdog error).

NCCL takes the P2P path between two GPUs, as ncclTopoCheckP2p decides: NCCL_P2P_DISABLE is not
1, the link (nvidia-smi topo -m) is within NCCL_P2P_LEVEL (default SYS, NCCL's default on x86
AMD CPUs), and NVML's P2P read and write status between them is OK.
"""

import datetime as _datetime
import json as _json
import os as _os
import socket as _socket
import time as _time

_group = None


class DistError(RuntimeError):
    pass


class DistBackendError(DistError):
    pass


class DistStoreError(DistError):
    pass


class ReduceOp:
    SUM = "SUM"
    AVG = "AVG"
    PRODUCT = "PRODUCT"
    MIN = "MIN"
    MAX = "MAX"


def is_available():
    return True


def is_nccl_available():
    return True


def is_initialized():
    return _group is not None


def get_rank(group=None):
    return _need()["rank"] if _group else -1


def get_world_size(group=None):
    return _need()["world"] if _group else -1


def _need():
    if _group is None:
        raise ValueError(
            "Default process group has not been initialized, please make sure to call "
            "init_process_group."
        )
    return _group


def _send(sock, obj):
    sock.sendall((_json.dumps(obj) + "\n").encode())


def _recv(sock):
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            raise DistBackendError("sandbox stand-in: a peer process closed its connection")
        data += chunk
    return _json.loads(data)


def _tuple(value):
    return tuple(_tuple(v) for v in value) if isinstance(value, list) else value


def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1,
                       store=None, group_name="", pg_options=None, device_id=None):
    global _group
    if _group is not None:
        raise ValueError("trying to initialize the default process group twice!")
    if backend not in ("nccl", "cuda:nccl"):
        raise RuntimeError("sandbox stand-in: only the nccl backend is emulated")
    timeout = timeout or _datetime.timedelta(minutes=10)
    seconds = timeout.total_seconds()
    init_method = init_method or "env://"
    if init_method.startswith("env://"):
        addr, port = _os.environ["MASTER_ADDR"], int(_os.environ["MASTER_PORT"])
        rank = int(_os.environ.get("RANK", rank))
        world_size = int(_os.environ.get("WORLD_SIZE", world_size))
    elif init_method.startswith("tcp://"):
        addr, port = init_method[len("tcp://"):].rsplit(":", 1)
        port = int(port)
    else:
        raise ValueError(f"sandbox stand-in: unsupported init_method {init_method!r}")
    if rank < 0 or world_size < 1 or rank >= world_size:
        raise ValueError(f"Invalid rank {rank} or world_size {world_size}")
    deadline = _time.monotonic() + seconds
    peers = []
    if rank == 0:
        server = _socket.create_server((addr, port))
        server.settimeout(seconds)
        try:
            while len(peers) < world_size - 1:
                conn, _ = server.accept()
                conn.settimeout(None)
                peers.append(conn)
        except TimeoutError:
            raise DistStoreError(
                f"Timed out after {int(seconds)} seconds waiting for clients. "
                f"{len(peers) + 1}/{world_size} clients joined."
            ) from None
        finally:
            server.close()
    else:
        while True:
            try:
                conn = _socket.create_connection((addr, port), timeout=1)
                conn.settimeout(None)
                peers.append(conn)
                break
            except OSError:
                if _time.monotonic() > deadline:
                    raise DistStoreError(
                        f"The client socket has timed out after {int(seconds)}s while trying "
                        f"to connect to ({addr}, {port})."
                    ) from None
                _time.sleep(0.1)
    _group = {"rank": rank, "world": world_size, "peers": peers, "timeout": seconds, "seq": 0}


def destroy_process_group(group=None):
    global _group
    if _group is not None:
        for conn in _group["peers"]:
            conn.close()
    _group = None


class _Work:
    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


def _reduce(op, contents):
    if all(c[0] == "fill" for c in contents):
        values = [c[1] for c in contents]
        if op == ReduceOp.SUM:
            return ("fill", sum(values))
        if op == ReduceOp.AVG:
            return ("fill", sum(values) / len(values))
        if op == ReduceOp.MIN:
            return ("fill", min(values))
        if op == ReduceOp.MAX:
            return ("fill", max(values))
        product = 1
        for v in values:
            product *= v
        return ("fill", product)
    return ("all_reduce", op, tuple(contents))


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    from torch import _sandbox, cuda

    g = _need()
    if tensor.device.type != "cuda":
        raise RuntimeError("No backend type associated with device type cpu")
    g["seq"] += 1
    gpu = _sandbox.visible_gpus()[tensor.device.index]["index"]
    mine = {"gpu": gpu, "content": tensor._content, "nbytes": tensor.nbytes,
            "p2p_disable": _os.environ.get("NCCL_P2P_DISABLE", ""),
            "p2p_level": _os.environ.get("NCCL_P2P_LEVEL", "")}
    if g["rank"] != 0:
        (conn,) = g["peers"]
        _send(conn, mine)
        conn.settimeout(g["timeout"] + 5)
        try:
            answer = _recv(conn)
        except TimeoutError:
            raise DistBackendError(_watchdog(g)) from None
        if "error" in answer:
            raise DistBackendError(answer["error"])
        tensor._content = _tuple(answer["content"])
        return _Work() if async_op else None
    entries = [mine] + [_recv(conn) for conn in g["peers"]]
    gpus = [e["gpu"] for e in entries]
    p2p = any(
        _nccl_p2p(a, b, mine["p2p_disable"], mine["p2p_level"])
        for a in gpus for b in gpus if a != b
    )
    behaviour = _sandbox.peer_transfers()["all_reduce"] if p2p else "intact"
    contents = [_tuple(e["content"]) for e in entries]
    # A ring all-reduce moves 2(n-1)/n of the buffer through each link.
    rate = _sandbox.PEER_BYTES_PER_S if p2p else _sandbox.STAGED_BYTES_PER_S
    _time.sleep(2 * (len(entries) - 1) / len(entries) * mine["nbytes"] / rate)
    if behaviour == "hang":
        _time.sleep(g["timeout"])
        message = _watchdog(g)
        for conn in g["peers"]:
            _send(conn, {"error": message})
        raise DistBackendError(message)
    if behaviour == "wrong-data":
        result = _reduce(op, contents[:-1])  # the last rank's peer writes never landed
    else:
        result = _reduce(op, contents)
    for conn in g["peers"]:
        _send(conn, {"content": result})
    tensor._content = result
    cuda.synchronize()
    return _Work() if async_op else None


def barrier(group=None, async_op=False, device_ids=None):
    from torch import cuda, ones

    all_reduce(ones(1, device=f"cuda:{cuda.current_device()}"))
    return _Work() if async_op else None


def _watchdog(g):
    return (
        f"[Rank {g['rank']}] Watchdog caught collective operation timeout: "
        f"WorkNCCL(SeqNum={g['seq']}, OpType=ALLREDUCE, NumelIn=?, NumelOut=?, "
        f"Timeout(ms)={int(g['timeout'] * 1000)}) ran for {int(g['timeout'] * 1000)} "
        "milliseconds before timing out."
    )


_LEVELS = {"LOC": 0, "NVL": 1, "PIX": 2, "PXB": 3, "PHB": 4, "SYS": 5}


def _nccl_p2p(a, b, disable, level):
    """Whether NCCL goes peer-to-peer between scenario GPUs a and b (module docstring)."""
    from torch import _sandbox

    if disable.strip() == "1":
        return False
    hw = _sandbox.hardware()
    link = hw["topology"][a][b]
    path = 1 if link.startswith("NV") else _LEVELS.get({"NODE": "PHB"}.get(link, link), 5)
    limit = _LEVELS.get(level.strip().upper(), 5) if level.strip() else 5
    if level.strip().isdigit():
        limit = int(level)
    return path <= limit and hw["p2p"]["r"][a][b] == "OK" and hw["p2p"]["w"][a][b] == "OK"
