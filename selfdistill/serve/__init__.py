"""`selfdistill serve`: an OpenAI-compatible chat server (plus vLLM-compatible completions and
runtime LoRA loading) that learns from its users' feedback — per tenant, with consent, PII
redaction, a promotion gate and rollback. See docs/serving.md.

Modules: `config` (ServeConfig), `engine` (model + adapters + decoding), `generation` (text,
stop strings, log-prob records), `protocol` (request shapes, errors), `service` (tenants,
routing), `routes_chat`, `routes_vllm`, `admin`, `app` (FastAPI), `feedback` and `lessons`
(feedback → scored lessons), `learner` (background self-distillation rounds), `state` (rows),
`server` (build and run), `cli`.
"""
