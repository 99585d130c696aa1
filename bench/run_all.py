"""All benchmarks in one run, each figure also as a ratio against a ceiling measured in the same run.

Prints JSON lines (one object per figure, each with the machine description and the
1-minute load average) and then a short human summary. Ceiling (b) and the dense
figure are taken alternately, `--repeats` times each, and the best of each is used:
on a shared machine the best of a few runs is the least disturbed one.

    python -m bench.run_all [--repeats 3] [--quick]      (make bench)

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
from bench.common import DEFAULT_SIZES, emit, load_average, machine, parse_sizes
from bench.dense import dense
from bench.latency import latency

DENSE_BAR = 0.9  # dense MB/s as a fraction of ceiling (b)
LATENCY_BAR_US = 1000.0  # small push+pull p50


def _best(runs: list[dict[str, object]]) -> dict[str, object]:
    best = max(runs, key=lambda r: float(r["mb_per_s"]))  # type: ignore[arg-type]
    return {**best, "samples_mb_per_s": [r["mb_per_s"] for r in runs]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.run_all", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="dense model's float32 tensor sizes")
    p.add_argument("--steps", type=int, default=8, help="timed steps of dense and of ceiling (b) (default 8)")
    p.add_argument("--repeats", type=int, default=3, help="alternate runs of (b) and dense (default 3)")
    p.add_argument("--iterations", type=int, default=2000, help="timed round trips of the latency figures")
    p.add_argument("--quick", action="store_true", help="a smoke run: small model, few steps and iterations")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sizes = parse_sizes(args.sizes)
    steps, iterations, repeats = args.steps, args.iterations, args.repeats
    if args.quick:
        sizes, steps, iterations, repeats = [s // 20 for s in sizes], 2, 200, 1
    model_bytes = 4 * sum(sizes)
    load_before = load_average()

    tcp = emit("ceiling_tcp_single_stream", **ceilings.tcp_throughput(rounds=5 if args.quick else 20))
    echo_runs, dense_runs = [], []
    for _ in range(repeats):
        echo_runs.append(ceilings.grpc_dense(model_bytes, steps=steps))
        dense_runs.append(dense(sizes, steps=steps))
    echo = emit("ceiling_grpc_dense_echo", **_best(echo_runs))
    best = _best(dense_runs)
    dense_fig = emit("dense_push_pull", **best,
                     ratio_to_tcp=round(float(best["mb_per_s"]) / float(tcp["mb_per_s"]), 3),  # type: ignore[arg-type]
                     ratio_to_grpc_echo=round(float(best["mb_per_s"]) / float(echo["mb_per_s"]), 3))  # type: ignore[arg-type]

    small = emit("ceiling_grpc_small_rtt", **ceilings.grpc_small(iterations=iterations))
    lat = latency(iterations=iterations)
    lat_fig = emit("latency_small_push_pull", **lat,
                   ratio_p50_to_grpc_rtt=round(float(lat["p50_us"]) / float(small["p50_us"]), 3))  # type: ignore[arg-type]

    m = machine()
    print(f"\n# pshard bench on {m['cpu']} ({m['cores']} cores), Python {m['python']}, grpcio {m['grpcio']}; "
          f"load {load_before} -> {load_average()}")
    print(f"ceiling (a) single-stream TCP: {tcp['mb_per_s']:>8} MB/s")
    print(f"ceiling (b) grpc echo 2x2:     {echo['mb_per_s']:>8} MB/s  (runs {echo['samples_mb_per_s']})")
    ok = "ok" if float(dense_fig["ratio_to_grpc_echo"]) >= DENSE_BAR else "below"  # type: ignore[arg-type]
    print(f"dense push_pull 2x2, {sum(sizes) / 1e6:g}M params: {dense_fig['mb_per_s']:>8} MB/s, "
          f"{dense_fig['steps_per_s']} steps/s  (runs {dense_fig['samples_mb_per_s']})")
    print(f"  = {dense_fig['ratio_to_tcp']}x ceiling (a), {dense_fig['ratio_to_grpc_echo']}x ceiling (b) "
          f"[bar {DENSE_BAR}x (b): {ok}]")
    ok = "ok" if float(lat_fig["p50_us"]) < LATENCY_BAR_US else "above"  # type: ignore[arg-type]
    print(f"small push_pull ({lat['numel']} floats): p50 {lat_fig['p50_us']} us, p99 {lat_fig['p99_us']} us "
          f"[bar p50 < {LATENCY_BAR_US:g} us: {ok}]")
    print(f"  = {lat_fig['ratio_p50_to_grpc_rtt']}x the p50 of a bare grpc bidi round trip "
          f"({small['p50_us']} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
