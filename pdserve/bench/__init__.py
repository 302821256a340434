"""Serving benchmark client (``pdserve bench``), with vLLM's report and definitions.

metrics: the report's numbers from per-request timestamps (pure); datasets:
prompts; multi_turn: conversations whose turns resend the history (pure);
backends: HTTP (SSE) and queue-ingress senders; runner: arrivals and
concurrency; report: the printed block, saved JSON, plot; cli: the command.
"""
