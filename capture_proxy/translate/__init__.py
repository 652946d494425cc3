"""Pure translators between harness APIs and the chat API the proxy captures.

Why a translation layer at the API edge, and not vLLM's own ``/v1/messages`` and
``/v1/responses``: vLLM 0.32 serves both, but neither returns token ids or per-token logprobs,
so neither can be captured exactly. vLLM's Messages server itself converts each request to a
chat request internally; doing the same conversion here, before the capture path, gives every
Messages or Responses generation the chat path's guarantees — ``prompt_token_ids`` from the
engine's own render (its real conditioning), the sampled ids and their logprobs, durable
commit before the harness's last byte, and exact-token continuation (stitch) — without a
second capture path to keep in step with the first.

Each module is pure (JSON in, JSON out; no I/O): ``messages`` (Anthropic Messages) and
``responses`` (OpenAI Responses) hold the request translation and the whole-answer translation;
``messages_stream`` and ``responses_stream`` the stream translators, fed one chat chunk at a
time.
"""
