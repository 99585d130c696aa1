"""Ceilings the parameter server's figures are divided by, measured in the same run.

(a) tcp:        single-stream TCP throughput between two plain Python processes on
                127.0.0.1 (sendall / recv_into of 100 MB buffers).
(b) grpc_dense: the dense benchmark's bytes and 2x2 topology through plain grpcio bidi
                streams of raw 4 MiB chunks: each server process echoes back every chunk
                it receives; per step each worker streams its share of the model to every
                server and reads as many bytes back (like a fused push+pull). Same channel
                and server options as common.rpc.options, no parameter-server logic.
(c) grpc_small: round-trip time of one small message on a fresh bidi stream of the
                same kind of server (the floor under a small push+pull).

    python -m bench.ceilings [--only tcp,grpc_dense,grpc_small] [--help]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

from bench.common import (
    DEFAULT_SIZES,
    MB,
    CpuMeter,
    WorkerRun,
    cpu_figures,
    emit,
    parse_sizes,
    run_workers,
    span_s,
    summarize_latencies,
)

ECHO_SERVICE = "bench.v1.Echo"
ECHO_METHOD = f"/{ECHO_SERVICE}/Echo"


# ---- (a) TCP ----

def _tcp_receiver(conn: object, buffer_bytes: int, warm_bytes: int, total_bytes: int) -> None:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as listener:
        conn.send(listener.getsockname()[1])  # type: ignore[attr-defined]
        sock, _ = listener.accept()
    with sock:
        view = memoryview(bytearray(buffer_bytes))
        for want in (warm_bytes, total_bytes):
            got = 0
            while got < want:
                n = sock.recv_into(view[:min(buffer_bytes, want - got)])
                if n == 0:
                    raise ConnectionError(f"tcp ceiling: sender closed after {got} of {want} bytes")
                got += n
            sock.sendall(b"k")


def tcp_throughput(buffer_mb: int = 100, rounds: int = 20, warm_rounds: int = 2) -> dict[str, object]:
    """One-way single-stream MB/s; this process sends, a spawned one receives."""
    import multiprocessing as mp
    import socket

    buffer_bytes = buffer_mb * MB
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_tcp_receiver, args=(child, buffer_bytes, warm_rounds * buffer_bytes,
                                                   rounds * buffer_bytes), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise TimeoutError("tcp ceiling: the receiver did not start")
        port = parent.recv()
        payload = memoryview(bytearray(b"\x5a" * buffer_bytes))
        with socket.create_connection(("127.0.0.1", port)) as sock:
            for _ in range(warm_rounds):
                sock.sendall(payload)
            sock.recv(1)
            start = time.monotonic()
            for _ in range(rounds):
                sock.sendall(payload)
            sock.recv(1)
            elapsed = time.monotonic() - start
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.terminate()
    return {"mb_per_s": round(rounds * buffer_bytes / MB / elapsed, 1), "bytes": rounds * buffer_bytes,
            "seconds": round(elapsed, 3), "buffer_mb": buffer_mb}


# ---- echo server for (b) and (c) ----

def _echo_server(conn: object) -> None:
    """A grpc.aio server, like the parameter server's, whose one method streams every message back."""
    import asyncio

    import grpc
    from pshard.common.rpc.options import server_options

    async def echo(requests: object, context: object) -> object:
        async for message in requests:  # type: ignore[attr-defined]
            yield message

    async def main() -> None:
        server = grpc.aio.server(options=server_options())
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            ECHO_SERVICE, {"Echo": grpc.stream_stream_rpc_method_handler(echo)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        conn.send(port)  # type: ignore[attr-defined]
        # Stop when the parent closes its end of the pipe (or dies).
        await asyncio.get_running_loop().run_in_executor(None, _wait_closed, conn)
        await server.stop(0)

    asyncio.run(main())


def _wait_closed(conn: object) -> None:
    with contextlib.suppress(EOFError):
        conn.recv()  # type: ignore[attr-defined]


class EchoServers:
    """`count` echo server processes; a context manager that stops them."""

    def __init__(self, count: int) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._pipes = []
        self._procs = []
        for _ in range(count):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_echo_server, args=(child,), daemon=True)
            proc.start()
            child.close()
            self._pipes.append(parent)
            self._procs.append(proc)
        self.pids = [p.pid or 0 for p in self._procs]
        self.addresses = []
        for pipe in self._pipes:
            if not pipe.poll(60):
                self.close()
                raise TimeoutError("echo server did not start")
            self.addresses.append(f"127.0.0.1:{pipe.recv()}")

    def close(self) -> None:
        for pipe in self._pipes:
            pipe.close()
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join()

    def __enter__(self) -> EchoServers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- (b) grpc dense ----

def _echo_worker(run: WorkerRun, addresses: list[str], bytes_per_server: int, chunk_bytes: int,
                 warmup: int, steps: int, server_pids: list[int]) -> dict[str, float]:
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from pshard.common.rpc.options import channel_options, identity

    channels = [grpc.insecure_channel(a, options=channel_options()) for a in addresses]
    calls = [c.stream_stream(ECHO_METHOD, request_serializer=identity, response_deserializer=identity)
             for c in channels]
    block = b"\xa5" * chunk_bytes
    chunks = [block] * (bytes_per_server // chunk_bytes)
    if bytes_per_server % chunk_bytes:
        chunks.append(block[:bytes_per_server % chunk_bytes])

    def exchange(server: int) -> int:
        got = 0
        for message in calls[server](iter(chunks), wait_for_ready=True, timeout=120):
            got += len(message)
        if got != bytes_per_server:
            raise RuntimeError(f"echo from {addresses[server]}: got {got} bytes, sent {bytes_per_server}")
        return got

    with ThreadPoolExecutor(len(addresses)) as pool:
        def step() -> None:
            list(pool.map(exchange, range(len(addresses))))

        run.sync()
        for _ in range(warmup):
            step()
        run.sync()
        meter = CpuMeter(server_pids)
        meter.start()
        start = time.monotonic()
        for _ in range(steps):
            step()
        end = time.monotonic()
        meter.stop()
    for c in channels:
        c.close()
    return {"start": start, "end": end, **meter.result()}


def grpc_dense(model_bytes: int, servers: int = 2, workers: int = 2, warmup: int = 2, steps: int = 8,
               chunk_bytes: int | None = None) -> dict[str, object]:
    """Bytes sent plus received by all workers per second, through plain grpcio echo streams."""
    from pshard.common.rpc.options import CHUNK_BYTES

    chunk = chunk_bytes or CHUNK_BYTES
    per_server = model_bytes // servers
    with EchoServers(servers) as echo:
        results = run_workers(_echo_worker, workers, (echo.addresses, per_server, chunk, warmup, steps,
                                                      echo.pids))
    elapsed = span_s(results)
    moved = 2 * per_server * servers * workers * steps
    return {"mb_per_s": round(moved / MB / elapsed, 1), "steps_per_s": round(steps / elapsed, 3),
            "bytes_per_step": moved // steps, "servers": servers, "workers": workers, "steps": steps,
            "chunk_bytes": chunk, **cpu_figures(results, steps, elapsed)}


# ---- (c) grpc small round trip ----

def grpc_small(payload_bytes: int = 4000, iterations: int = 2000, warmup: int = 200) -> dict[str, object]:
    """Round trip of one `payload_bytes` message on a new bidi stream per call, from this process."""
    import grpc
    from pshard.common.rpc.options import channel_options, identity

    message = b"\x01" * payload_bytes
    from bench.latency import cpu_per_call

    samples = []
    with EchoServers(1) as echo, grpc.insecure_channel(echo.addresses[0], options=channel_options()) as ch:
        call = ch.stream_stream(ECHO_METHOD, request_serializer=identity, response_deserializer=identity)
        meter = CpuMeter(echo.pids)
        for i in range(warmup + iterations):
            if i == warmup:
                meter.start()
            t0 = time.perf_counter()
            replies = list(call(iter([message]), wait_for_ready=True, timeout=30))
            if i >= warmup:
                samples.append(time.perf_counter() - t0)
            assert len(replies) == 1 and len(replies[0]) == payload_bytes
        meter.stop()
    return {**summarize_latencies(samples), **cpu_per_call(meter, iterations), "payload_bytes": payload_bytes,
            "iterations": iterations}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.ceilings", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--only", default="tcp,grpc_dense,grpc_small", help="which ceilings (comma list)")
    p.add_argument("--tcp-buffer-mb", type=int, default=100, help="send/recv buffer, MB (default 100)")
    p.add_argument("--tcp-rounds", type=int, default=20, help="buffers timed (default 20)")
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help="the dense model's float32 tensor sizes: the bytes of (b) (default: bench.dense's)")
    p.add_argument("--servers", type=int, default=2, help="echo server processes (default 2)")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps of (b) (default 2)")
    p.add_argument("--steps", type=int, default=8, help="timed steps of (b) (default 8)")
    p.add_argument("--chunk-bytes", type=int, default=0, help="chunk size of (b) "
                   "(default common.rpc.options's)")
    p.add_argument("--small-bytes", type=int, default=4000, help="payload of (c) (default 4000)")
    p.add_argument("--small-iterations", type=int, default=2000, help="round trips of (c) (default 2000)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    only = set(args.only.split(","))
    if "tcp" in only:
        emit("ceiling_tcp_single_stream", **tcp_throughput(args.tcp_buffer_mb, args.tcp_rounds))
    if "grpc_dense" in only:
        model_bytes = 4 * sum(parse_sizes(args.sizes))
        emit("ceiling_grpc_dense_echo", **grpc_dense(model_bytes, args.servers, args.workers, args.warmup,
                                                      args.steps, args.chunk_bytes or None))
    if "grpc_small" in only:
        emit("ceiling_grpc_small_rtt", **grpc_small(args.small_bytes, args.small_iterations))
    return 0


if __name__ == "__main__":
    sys.exit(main())
