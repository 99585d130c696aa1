"""All benchmarks in one run, each figure also as a ratio against a ceiling measured in the same run.

Prints JSON lines (one object per figure, each with the machine description and the
1-minute load average) and then a short human summary. Dense and small push+pull are measured
per transport (grpc, tcp, shm: `--transports`), with the bars of issue 8. Ceiling (b) and the dense
figure are taken alternately, `--repeats` times each, and the best of each is used:
on a shared machine the best of a few runs is the least disturbed one.

    python -m bench.run_all [--repeats 3] [--quick]      (make bench)

With TLS on (issue 11): dense and small push+pull are measured again over `--tls-transports` with
mutual TLS (a throw-away CA from `pshard certs`), interleaved with the same figures in clear, and
given as ratios to them. TLS covers the raw TCP path; shared memory needs none (the bytes never
leave the host, its session secret comes over the TLS gRPC channel), so with TLS on it stays the
fastest transport, and the dense bar is taken on it. Dense over TCP+TLS runs a quarter of the
steps: it is several times slower, and `make bench` stays under ~3 minutes.

Every process (servers, workers, ceilings) inherits the environment. With glibc's default
malloc each 4 MiB message (grpc's received bytes, our encoded frames) lands in freshly
mmap'd pages, so every message costs ~1,000 page faults: on the 2-core dev machine that is
about a fifth of the CPU of a dense step, ceilings included. To see the figures without it:

    MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=268435456 make bench
"""

from __future__ import annotations

import argparse
import sys

from bench import ceilings
from bench.admission import admission_memory
from bench.common import DEFAULT_SIZES, emit, load_average, machine, parse_sizes
from bench.coordinator import BAR as COORDINATOR_BAR
from bench.coordinator import coordinator_bench
from bench.dense import dense
from bench.disk_tier import disk_tier
from bench.latency import latency
from bench.narrow_rows import narrow_rows
from bench.replication import replication
from bench.replication import summary as replication_summary
from bench.sparse import memory as sparse_memory
from bench.sparse import throughput as sparse_throughput
from bench.tls import make_pki
from bench.training import BAR as TRAINING_BAR
from bench.training import training

TRANSPORTS = ("grpc", "tcp", "shm")
# Bars of issue 8: dense MB/s as a fraction of a ceiling, and small push+pull p50 per transport.
DENSE_BARS = {"grpc": ("ratio_to_grpc_echo", 0.9), "tcp": ("ratio_to_tcp", 0.9), "shm": ("ratio_to_tcp", 1.5)}
LATENCY_BARS_US = {"tcp": 250.0, "shm": 250.0}
GRPC_LATENCY_BAR = 1.1  # grpc small p50 as a multiple of a bare grpcio round trip
# Bars of issue 11: TLS on, as a fraction of the same figure in clear.
TLS_TRANSPORTS = ("tcp", "shm")
TLS_DENSE_BAR = 0.7  # dense MB/s, on the fastest transport TLS allows
TLS_LATENCY_BAR = 1.3  # small push+pull p50


def _best(runs: list[dict[str, object]]) -> dict[str, object]:
    best = max(runs, key=lambda r: float(r["mb_per_s"]))  # type: ignore[arg-type]
    return {**best, "samples_mb_per_s": [r["mb_per_s"] for r in runs]}


def _ratio(a: object, b: object) -> float:
    return round(float(a) / float(b), 3)  # type: ignore[arg-type]


def _print_tls(dense_figs: dict[str, dict[str, object]], lat_figs: dict[str, dict[str, object]]) -> None:
    """The TLS figures and issue 11's bars: dense on the fastest transport TLS allows, small p50 on each."""
    fastest = max(dense_figs, key=lambda t: float(dense_figs[t]["mb_per_s"]), default=None)  # type: ignore[arg-type]
    for t, fig in dense_figs.items():
        ratio = fig["ratio_to_tls_off"]
        bar = ""
        if t == fastest and ratio is not None:
            ok = "ok" if float(ratio) >= TLS_DENSE_BAR else "below"  # type: ignore[arg-type]
            bar = f" [bar {TLS_DENSE_BAR}x on the fastest transport with TLS: {ok}]"
        print(f"dense push_pull 2x2 over {t:4} with TLS on: {fig['mb_per_s']:>8} MB/s "
              f"(runs {fig['samples_mb_per_s']}) = {ratio}x TLS off{bar}")
    for t, fig in lat_figs.items():
        ratio = fig["ratio_p50_to_tls_off"]
        ok = "ok" if ratio is not None and float(ratio) <= TLS_LATENCY_BAR else "above"  # type: ignore[arg-type]
        print(f"small push_pull over {t:4} with TLS on: p50 {fig['p50_us']} us, p99 {fig['p99_us']} us "
              f"= {ratio}x TLS off [bar {TLS_LATENCY_BAR}x: {ok}]")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.run_all", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="dense model's float32 tensor sizes")
    p.add_argument("--steps", type=int, default=8, help="timed steps of dense and of ceiling (b) (default 8)")
    p.add_argument("--repeats", type=int, default=3,
                   help="alternate runs of the ceilings and dense (default 3)")
    p.add_argument("--iterations", type=int, default=2000, help="timed round trips of the latency figures")
    p.add_argument("--transports", default=",".join(TRANSPORTS),
                   help=f"comma-separated transports to measure (default {','.join(TRANSPORTS)})")
    p.add_argument("--tls-transports", default=",".join(TLS_TRANSPORTS),
                   help="transports measured again with mutual TLS on, as ratios to TLS off "
                        f"(default {','.join(TLS_TRANSPORTS)}; empty: none)")
    p.add_argument("--quick", action="store_true", help="a smoke run: small model, few steps and iterations")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sizes = parse_sizes(args.sizes)
    transports = [t for t in args.transports.split(",") if t]
    tls_transports = [t for t in args.tls_transports.split(",") if t]
    pki = str(make_pki(2)) if tls_transports else None
    steps, iterations, repeats = args.steps, args.iterations, args.repeats
    if args.quick:
        sizes, steps, iterations, repeats = [s // 20 for s in sizes], 2, 200, 1
    model_bytes = 4 * sum(sizes)
    load_before = load_average()

    # Ceilings and every transport's dense figure are taken in turn, `repeats` times: the machine's
    # memory bandwidth drifts by +-20 % over seconds, so only interleaved runs compare.
    tcp_runs: list[dict[str, object]] = []
    echo_runs: list[dict[str, object]] = []
    dense_runs: dict[str, list[dict[str, object]]] = {t: [] for t in transports}
    tls_dense_runs: dict[str, list[dict[str, object]]] = {t: [] for t in tls_transports}
    for _ in range(repeats):
        tcp_runs.append(ceilings.tcp_throughput(rounds=5 if args.quick else 20))
        echo_runs.append(ceilings.grpc_dense(model_bytes, steps=steps))
        for t in transports:
            dense_runs[t].append(dense(sizes, steps=steps, transport=t))
        for t in tls_transports:
            tls_steps = steps if t == "shm" else max(2, steps // 4)
            tls_dense_runs[t].append(dense(sizes, steps=tls_steps, transport=t, pki=pki))
    tcp = emit("ceiling_tcp_single_stream", **_best(tcp_runs))
    echo = emit("ceiling_grpc_dense_echo", **_best(echo_runs))
    dense_figs = {}
    for t in transports:
        best = _best(dense_runs[t])
        dense_figs[t] = emit("dense_push_pull", **best,
                             ratio_to_tcp=_ratio(best["mb_per_s"], tcp["mb_per_s"]),
                             ratio_to_grpc_echo=_ratio(best["mb_per_s"], echo["mb_per_s"]))
    tls_dense = {}
    for t in tls_transports:
        best = _best(tls_dense_runs[t])
        plain = dense_figs.get(t)
        tls_dense[t] = emit("dense_push_pull", **best, ratio_to_tcp=_ratio(best["mb_per_s"], tcp["mb_per_s"]),
                            ratio_to_tls_off=_ratio(best["mb_per_s"], plain["mb_per_s"]) if plain else None)

    small = emit("ceiling_grpc_small_rtt", **ceilings.grpc_small(iterations=iterations))
    lat_figs = {}
    for t in transports:
        lat = latency(iterations=iterations, transport=t)
        lat_figs[t] = emit("latency_small_push_pull", **lat,
                           ratio_p50_to_grpc_rtt=_ratio(lat["p50_us"], small["p50_us"]))
    tls_lat = {}
    for t in tls_transports:
        lat = latency(iterations=iterations, transport=t, pki=pki)
        plain = lat_figs.get(t)
        tls_lat[t] = emit("latency_small_push_pull", **lat,
                          ratio_p50_to_tls_off=_ratio(lat["p50_us"], plain["p50_us"]) if plain else None)

    # Sparse tables (issue 9): rows/s of pull + push of 4,096 ids (uniform, also with the push and the
    # next pull fused, and zipf), over the fast-path sessions (shm here), and the memory overhead.
    sparse_steps = 20 if args.quick else 200
    sparse_figs = [emit("sparse_rows", **sparse_throughput(steps=sparse_steps, zipf=zipf, fused=fused))
                   for zipf, fused in ((False, False), (False, True), (True, False))]
    sparse_mem = emit("sparse_memory", **sparse_memory(rows=1_000_000 if args.quick else 10_000_000))
    # Admission in bounded memory (issue 22): once-seen ids with admit_after=2, the sketch vs an exact record.
    admit = emit("admission_memory", **admission_memory(ids=2_000_000 if args.quick else 20_000_000))
    # 8- and 16-bit rows (issue 22): RSS per row and rows/s by row_dtype, float32 the same-run baseline.
    narrow = emit("narrow_rows", **narrow_rows(rows=250_000 if args.quick else 2_000_000))
    # The disk tier (issue 22): a table 4x its memory_mb, zipf ids, against the same table in RAM.
    tier = emit("disk_tier_rows", **disk_tier(rows=200_000 if args.quick else 1_000_000,
                                              steps=20 if args.quick else 100,
                                              repeats=1 if args.quick else 2))
    # Replication (issue 10): replicas 1 vs 0 on 3 servers, and the failover time after a SIGKILL.
    repl = emit("replication", **replication(sizes, steps=steps))
    # Training (issue 8): the demo CNN with 2 servers, with and without overlap, against local torch.optim.
    train = emit("training_steps", **training(steps=40 if args.quick else 200,
                                              repeats=1 if args.quick else 3))
    # Coordinator-driven training (issue 21): a scheduled no-op's p50/p99, and scheduled training steps/s
    # against the worker-driven loop in the same run (`make bench-coordinator` runs it at full length).
    coord = emit("coordinator", **coordinator_bench(steps=40 if args.quick else 200,
                                                    repeats=1 if args.quick else 2,
                                                    calls=50 if args.quick else 300,
                                                    burst=100 if args.quick else 1000))

    m = machine()
    print(f"\n# pshard bench on {m['cpu']} ({m['cores']} cores), Python {m['python']}, grpcio {m['grpcio']}; "
          f"load {load_before} -> {load_average()}")
    print(f"ceiling (a) single-stream TCP: {tcp['mb_per_s']:>8} MB/s  (runs {tcp['samples_mb_per_s']})")
    print(f"ceiling (b) grpc echo 2x2:     {echo['mb_per_s']:>8} MB/s  (runs {echo['samples_mb_per_s']})")
    for t, fig in dense_figs.items():
        key, bar = DENSE_BARS[t]
        ok = "ok" if float(fig[key]) >= bar else "below"  # type: ignore[arg-type]
        print(f"dense push_pull 2x2 over {t:4}, {sum(sizes) / 1e6:g}M params: {fig['mb_per_s']:>8} MB/s, "
              f"{fig['steps_per_s']} steps/s  (runs {fig['samples_mb_per_s']})")
        print(f"  = {fig['ratio_to_tcp']}x ceiling (a), {fig['ratio_to_grpc_echo']}x ceiling (b) "
              f"[bar {bar}x ({'a' if key == 'ratio_to_tcp' else 'b'}): {ok}]")
    print(f"bare grpcio unary round trip: p50 {small['p50_us']} us")
    for t, fig in lat_figs.items():
        if t in LATENCY_BARS_US:
            ok = "ok" if float(fig["p50_us"]) <= LATENCY_BARS_US[t] else "above"  # type: ignore[arg-type]
            bar_text = f"p50 <= {LATENCY_BARS_US[t]:g} us"
        else:
            ok = "ok" if float(fig["ratio_p50_to_grpc_rtt"]) <= GRPC_LATENCY_BAR else "above"  # type: ignore[arg-type]
            bar_text = f"p50 <= {GRPC_LATENCY_BAR}x grpcio"
        print(f"small push_pull over {t:4} ({fig['numel']} floats): p50 {fig['p50_us']} us, "
              f"p99 {fig['p99_us']} us, {fig['ratio_p50_to_grpc_rtt']}x grpcio [bar {bar_text}: {ok}]")
    _print_tls(tls_dense, tls_lat)
    for fig in sparse_figs:
        ok = "ok" if int(fig["rows_per_s"]) >= int(fig["bar_rows_per_s"]) else "below"  # type: ignore[call-overload]
        variant = f"{fig['variant']}{' fused' if fig['fused'] else ''}"
        print(f"sparse 1M x 64 table, 2x2, {variant:13}: {fig['rows_per_s']:>9} rows/s "
              f"[bar {fig['bar_rows_per_s']}: {ok}]")
    ok = "ok" if float(sparse_mem["overhead"]) <= 0.3 else "above"  # type: ignore[arg-type]
    print("\n".join(replication_summary(repl)))
    print(f"sparse memory, {sparse_mem['rows']} rows of dim {sparse_mem['dim']} (adagrad): overhead "
          f"{sparse_mem['overhead']}x of {sparse_mem['raw_mb']} MB [bar 0.3x: {ok}]")
    ok = "ok" if float(admit["rss_growth_mb"]) <= float(admit["bar_rss_growth_mb"]) else "above"  # type: ignore[arg-type]
    print(f"admission, {admit['ids']} once-seen ids, admit_after=2: +{admit['rss_growth_mb']} MB RSS "
          f"({admit['rows_admitted_early']} rows admitted early), exact record "
          f"+{admit['exact_rss_growth_mb']} MB ({admit['ratio_exact_to_sketch']}x) [bar 16 MiB: {ok}]")
    rss = {rd: narrow[rd]["rss_bytes_per_row"] for rd in ("float32", "float16", "bfloat16", "int8")}  # type: ignore[index]
    ratio = float(narrow["int8"]["rss_ratio_float32_to_this"])  # type: ignore[index]
    slope = float(narrow["int8"]["rss_slope_ratio_float32_to_this"])  # type: ignore[index]
    print(f"rows of dim {narrow['dim']} by row_dtype, RSS bytes per row: {rss} (int8: "
          f"{ratio}x smaller than float32, {slope}x a row more) [bar 3x: {'ok' if ratio >= 3 else 'below'}]")
    print(f"disk tier, {tier['rows']} rows x {tier['dim']} at a quarter in RAM, zipf: "
          f"{tier['rows_per_s_tiered']} rows/s against {tier['rows_per_s_ram']} in RAM ({tier['ratio']}x) "
          f"[bar {tier['bar']}x: {'ok' if tier['passed'] else 'below'}]")
    ratios = [float(train[k]) for k in ("ratio_pstrainer_to_local", "ratio_overlap_to_local")]  # type: ignore[arg-type]
    print(f"training, demo CNN, 1 worker x 2 servers: local {train['local_steps_per_s']} steps/s, PSTrainer "
          f"{train['pstrainer_steps_per_s']} ({train['ratio_pstrainer_to_local']}x), with overlap "
          f"{train['overlap_steps_per_s']} ({train['ratio_overlap_to_local']}x), with priority "
          f"{train['priority_steps_per_s']} ({train['ratio_priority_to_local']}x) "
          f"[bar {TRAINING_BAR}x: {'ok' if max(ratios) >= TRAINING_BAR else 'below'}]")
    noop: dict[str, object] = coord["noop"]  # type: ignore[assignment]
    print(f"coordinator, mlp on 2 serving workers x 2 servers: scheduled no-op p50 {noop['p50_ms']} ms, "
          f"p99 {noop['p99_ms']} ms; {coord['coordinator_steps_per_s']} steps/s against worker-driven "
          f"{coord['worker_driven_steps_per_s']} ({coord['ratio']}x) "
          f"[bar {COORDINATOR_BAR}x: {'ok' if float(coord['ratio']) >= COORDINATOR_BAR else 'below'}]")  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
