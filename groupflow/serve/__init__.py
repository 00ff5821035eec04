"""An OpenAI-compatible HTTP server over the rollout engine that records the tokens it samples.

Design decision: agents written against the OpenAI API (the ``openai`` client, the Agents SDK,
LangGraph …) train by changing their ``base_url``. The server is token-in/token-out underneath:
a request's messages become prompt ids through the chat template, but a conversation that
continues one the server answered reuses the ids it already holds (the prompt and the *sampled*
completion) and tokenizes only the messages added since — so the ids trained are the ids
sampled, and every response carries them (``prompt_token_ids``, and ``token_ids`` /
``token_logprobs`` per choice, vLLM's ``return_token_ids`` names). Concurrent requests share
decode steps through a dynamic batcher (``batcher``). Modules: ``protocol`` (request schemas),
``chat`` (messages → ids, tool calls → ``tool_calls``), ``batcher``, ``scoring`` (prompt
log-probs and top alternatives: ``echo``, ``logprobs``), ``core`` (what the endpoints do:
``ServerCore``, with one mixin per endpoint family, ``chat_endpoint`` and
``completions_endpoint``, over the shared pieces of an answer in ``answers``), ``access``
(the ``Access`` seam between serving and training), ``errors`` (OpenAI-shaped errors), ``app``
(the FastAPI app), ``thread`` (uvicorn in a background thread, for a training run's in-process
server).
"""
