"""How an engine call says it continues a request.

A decode call's prompt may end with output the request already produced (prefill's first
token; tokens sent before a migration). The call names those tokens in
``SamplingParams.extra_args[OUTPUT_IN_PROMPT]`` (a list of token ids), and the engine's
hooks count them as output: the connector's scheduler side advances the request's
structured-output grammar past them (``scheduler_side.py``), and pdserve's logits
processor adds the penalties they carry (``pdserve/worker/output_in_prompt.py``).
"""

OUTPUT_IN_PROMPT = "pdserve_output_in_prompt"
