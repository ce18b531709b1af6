"""The router's HTTP edge: OpenAI request schemas and validation, chat template
and tokenization (once), serving and SSE, responses, logprobs, tools and structured
output, the production edge (keys, limits, request ids, admission, drain) and the admin
API. Its contracts are in ``base.py``; it reaches the workers only through a
``Dispatcher`` (``pdserve.router.dispatch.base``).
"""
