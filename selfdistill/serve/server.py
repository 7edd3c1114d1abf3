"""Building and running the server: model + registry + engine → `Service` → app, learner thread,
uvicorn on a socket bound here (so port 0 works and the address is known)."""

from __future__ import annotations

import logging
import socket
import sys
from typing import Any

from selfdistill.serve.config import ServeConfig


def build_service(cfg: ServeConfig, *, progress: bool = False) -> Any:
    """Load the model and open the registry (its database also holds the server's tables)."""
    import torch

    from selfdistill.models import load_model
    from selfdistill.registry import Registry
    from selfdistill.serve.engine import Engine
    from selfdistill.serve.learner import Learner
    from selfdistill.serve.service import Service

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    home = cfg.home_dir()
    registry = Registry(cfg.registry or home / "registry.db",
                        weights_dir=None if cfg.registry else home / "adapters")
    lm = load_model(cfg.model, progress=progress)
    name = cfg.served_model_name or (
        lm.name if lm.name != "default" else "SmolLM2-135M-Instruct")
    engine = Engine(lm.model, lm.tokenizer, name=name, path=lm.path)
    service = Service(cfg, engine, registry)
    service.learner = Learner(service)
    return service


def serve(cfg: ServeConfig, *, ready: Any = None) -> None:
    """Run until interrupted. `ready(host, port)` is called once the socket is bound."""
    import uvicorn

    from selfdistill.serve.app import create_app

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("selfdistill").setLevel(logging.INFO)
    service = build_service(cfg)
    app = create_app(service)
    sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((cfg.host, cfg.port))
    host, port = sock.getsockname()[:2]
    (ready or _announce)(host, port)
    if cfg.learner.enabled:
        service.learner.start()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=30))
    try:
        server.run(sockets=[sock])
    finally:
        service.learner.stop()
        service.registry.close()


def _announce(host: str, port: int) -> None:
    print(f"selfdistill serve: listening on http://{host}:{port}/v1", file=sys.stderr, flush=True)
