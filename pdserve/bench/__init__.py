"""``pdserve bench``: a load generator for any OpenAI-compatible endpoint.

``run`` drives one endpoint with a seeded workload (open loop: Poisson or gamma arrivals;
closed loop: a concurrency cap) and writes one JSON result; ``sweep`` repeats it over
rates or concurrencies and finds the highest one that meets the SLO; ``compare`` starts
aggregated vLLM, optionally vLLM's own P/D, and pdserve configurations one after another
on the same cores, runs the same workload and rates against each and writes one report.

What comes from vLLM's ``vllm.benchmarks`` and what does not
--------------------------------------------------------------
The metric definitions (TTFT, TPOT excluding the first token, ITL between streamed
chunks, E2E to the last token chunk, goodput with every SLO inclusive, percentiles by
``numpy.percentile``), the arrival process (gamma intervals of shape ``burstiness`` and
scale ``1 / (rate * burstiness)``, rescaled so ``n`` requests span ``n / rate`` seconds)
and the streamed-response parsing are ``vllm bench serve``'s (``serve.py``:
``calculate_metrics``, ``get_request``; ``lib/endpoint_request_func.py``).
``tests/unit/test_bench_vllm_conformance.py`` runs vLLM's own functions on the same inputs
and checks that the numbers are equal. The code is written again here, not imported,
because:

- importing any ``vllm.benchmarks`` module imports torch and vLLM (15-20 s and several
  hundred MB on this machine) into a load generator that shares its cores with the
  engines it measures; ``calculate_metrics`` also prints to stdout;
- ``get_request`` draws from numpy's global random state and sleeps while it yields, so
  its arrival times can neither be computed ahead (reproducibility checks, duration mode)
  nor tested without running the clock;
- its request functions use aiohttp with a 6-hour timeout and no per-request deadline,
  turn every failure into a traceback string (no error kinds), read no
  ``usage.prompt_tokens_details.cached_tokens`` and take the API key only from
  ``OPENAI_API_KEY``;
- its ShareGPT loader reads JSON only (no JSONL), raises on a malformed entry instead of
  skipping and counting it, and drops prompts over 1,024 tokens whatever the context;
  its random dataset draws from the global random state.
The workloads a P/D system needs to control (chat mixes of short and long prompts with
exact token counts through the endpoint's chat template, shared-prefix multi-turn
conversations for placement) are pdserve's own.
"""
