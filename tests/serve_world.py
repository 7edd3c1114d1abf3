"""A real server for tests: a tiny random model (with the real tokenizer) saved to a directory,
`build_service` on it, and uvicorn serving the app on a free loopback port in a thread."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from selfdistill.serve.app import create_app
from selfdistill.serve.config import ServeConfig
from selfdistill.serve.server import build_service

TOKEN = "test-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """uvicorn in a thread; `url` is the API base (…/v1), `service` the live service."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.service = build_service(cfg)
        self.port = free_port()
        config = uvicorn.Config(create_app(self.service), host="127.0.0.1", port=self.port,
                                log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        self.root = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.root}/v1"
        self.http = httpx.Client(base_url=self.root, timeout=120)
        if cfg.learner.enabled:
            self.service.learner.start()

    def client(self):
        """The official openai client on this server."""
        from openai import OpenAI

        return OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=120)

    def stop(self) -> None:
        self.service.learner.stop()
        self.http.close()
        self.server.should_exit = True
        self.thread.join(10)
        self.service.registry.close()


def config(home: Path, model: Path, **kw) -> ServeConfig:
    """A test config: tiny model, admin token, learner off unless asked."""
    learner = {"enabled": False, **kw.pop("learner", {})}
    return ServeConfig.model_validate({"model": str(model), "home": str(home), "admin_token": TOKEN,
                                       "threads": 1, "learner": learner, **kw})


