"""How ``pdserve up`` gives CPU cores to the engines it starts (CPU backend only)."""

from __future__ import annotations

import os

CPU_LAYOUTS = ("auto", "shared", "split")
DEFAULT_CPU_LAYOUT = "auto"

# Why ``auto`` is ``split`` wherever there are two cores or more, measured on 2 cores
# (AVX-512, fp32, SmolLM2-135M) with the former ``bench/serve_mix.py`` (now ``pdserve bench
# compare``) under an open-loop chat mix
# (70 % ~80-token prompts x 96 tokens, 30 % ~1,200 x 16), 40 requests per rate, both
# layouts with ``--disagg auto``, in one run beside one aggregated ``vllm serve``:
#   rate      shared: TTFT p50 / ITL p99 / done    split: TTFT p50 / ITL p99 / done
#   0.5 /s    0.68 s / 1.05 s / 0.33 /s            0.53 s / 0.46 s / 0.37 /s
#   1.0 /s    1.44 s / 9.5 s  / 0.35 /s            0.95 s / 7.6 s  / 0.52 /s
#   1.5 /s    7.3 s  / 11.4 s / 0.45 /s            3.5 s  / 8.8 s  / 0.57 /s
# Sharing lets one engine take both cores while the other idles (a lone 500-token
# prompt's TTFT 1.15 s shared vs 2.04 s split), but under load both engines run their
# OpenMP threads on the same cores and each step waits for the other's: goodput
# (SLOs 3x the aggregated engine's unloaded TTFT/TPOT) was 0.21/0.00/0.00 req/s shared
# vs 0.32/0.08/0.01 split. A server is sized for load, so ``auto`` splits.
#
# Engine granularity, measured (``bench/results/compare-epyc-planner``: AMD EPYC with
# AVX512_BF16, bf16, chat mix 70 % ~80 x 96 / 30 % ~1,200 x 16, 40 requests per rate, one
# run): aggregated, one engine on both cores (``vllm-tuned``) against two single-core
# engines behind pdserve's router (``--num-prefill 0 --num-decode 2 --disagg never``):
#   rate      one 2-core engine: req/s / TTFT p50 / ITL p99     two 1-core: the same
#   0.5 /s    0.484 / 0.11 s / 261 ms                           0.481 / 0.17 s / 167 ms
#   1.0 /s    0.938 / 0.45 s / 534 ms                           0.901 / 1.04 s / 778 ms
#   2.0 /s    1.518 / 1.13 s / 946 ms                           1.407 / 1.73 s / 1348 ms
# One engine on both cores serves more and sooner: two engines halve each prompt's
# compute threads, and a long prompt then holds one core alone. So where roles allow,
# fewer engines with more cores are better; ``pdserve up`` needs one engine per role
# (and the planner flips roles between engines), so ``auto`` still gives each engine its
# own cores, and an aggregated deployment on one small machine is best served by one
# engine (``--num-prefill 0 --num-decode 1``: it gets every core).



def resolve_layout(layout: str) -> str:
    """``auto`` → the layout measured best under load for this machine's core count."""
    if layout != "auto":
        return layout
    return "split" if len(os.sched_getaffinity(0)) >= 2 else "shared"


def core_sets(num_prefill: int, num_decode: int, layout: str) -> tuple[list[str], list[str]]:
    """Cores for each engine's compute threads (CPU backend only).

    ``shared``: every engine may use every core (best for one request at a time).
    ``split``: prefill engines on the first half, decode on the second, so the two
    phases never oversubscribe a core with spinning threads (best under load).
    ``auto``: ``resolve_layout``.
    A role with no engines leaves its half to the other: ``--num-prefill 0`` splits
    every core among the decode engines.
    """
    layout = resolve_layout(layout)
    cores = sorted(os.sched_getaffinity(0))
    if layout == "shared" or len(cores) < 2:
        every = ",".join(map(str, cores))
        return [every] * num_prefill, [every] * num_decode
    if num_prefill == 0 or num_decode == 0:
        return _split(cores, num_prefill), _split(cores, num_decode)
    half = len(cores) // 2
    return _split(cores[:half], num_prefill), _split(cores[half:], num_decode)


def _split(group: list[int], n: int) -> list[str]:
    """``n`` slices of ``group``, disjoint while there are enough cores."""
    size = max(1, len(group) // max(n, 1))
    return [",".join(map(str, (group[(i * size) % len(group):] + group)[:size]))
            for i in range(n)]
