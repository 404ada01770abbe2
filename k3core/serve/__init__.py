"""Serve: k3 in a conversation and over HTTP, on the run pipeline's engine and sessions.

``chat_format`` renders a conversation to token ids (the Kimi K3 XTML format, or a plain
text format for tokenizers without its control tokens) and reads a reply back;
``conversation`` carries one conversation's state across turns; ``worker`` runs each
request in a session of its own on one engine, their passes batched (docs/scheduler.md),
and keeps prompt-prefix states for the requests that continue them; ``protocol`` holds the OpenAI-compatible request and response
models and error bodies; ``app`` is the ASGI application (Starlette, served by uvicorn; the
``serve`` extra installs both).

May import: every room below it (``api``, ``plugins``, ``model``, ``tokenizer``,
``checkpoint``, ``trunk``, ``experts``, ``run``).
"""
