"""The OpenAI API surface: request and response schemas, preprocessing (chat template,
tokenization), detokenization, logprobs, tool calls, structured output, and serving one
request on the dispatcher."""
