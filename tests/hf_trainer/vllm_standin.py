"""A stand-in for a vLLM server, to test OUR side of TRL's server protocol on CPU ranks. It is not vLLM and checks
nothing about vLLM: it answers the HTTP endpoints TRL's ``VLLMClient`` calls with a transformers model of its own.

vLLM does not install on a machine without CUDA, and TRL's client needs it in two places: an availability gate
(``is_vllm_available``, checked before a ``VLLMClient`` or a server-mode ``VLLMGeneration`` is made) and the weight
transport (vLLM's NCCL weight-transfer engine, CUDA only). ``use_standin_client`` opens the gate in a rank and makes
``VLLMGeneration`` build an ``HttpWeightsClient``: TRL's ``VLLMClient`` with only those CUDA parts replaced. Its
``init_communicator`` sends TRL's requests without the NCCL rendezvous, and its ``update_named_params`` sends TRL's
``/update_weights`` request with the tensors in the request body instead of over NCCL. Everything else is TRL's own:
``VLLMGeneration.generate`` and ``sync_weights``, the client's ``generate`` (``/v1/completions``),
``reset_prefix_cache``, ``get_server_info``, the health check.

The server (``StandInServer``, a ``ThreadingHTTPServer`` on a thread of the test process; the ranks are forked from
it) decodes greedily whatever the request's sampling parameters, one prompt at a time with no padding (so the answer
does not depend on how a request groups its prompts), and returns vLLM's answer shape: prompt-major choices, the
token ids with the end-of-sequence token included, per-token log-probabilities of the chosen tokens under
``log_softmax(logits / temperature)`` (vLLM's ``processed_logprobs``). A weight update must name every parameter of
its model with the model's shape; an update or request it cannot take is answered 400 with the reason, which TRL's
client raises. ``events`` records what it served: the generation requests (prompt count, ``n``) and the weight
updates (names, a digest of the tensors).
"""
from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

import torch
from trl.generation.vllm_client import VLLMClient

__all__ = ["HttpWeightsClient", "StandInServer", "use_standin_client"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class StandInServer:
    """``model`` served at ``url`` (after ``start``) under the name ``name``; ``eos_token_id`` ends a completion."""

    def __init__(self, model: torch.nn.Module, *, eos_token_id: int, name: str = "stand-in") -> None:
        self.model, self.eos_token_id, self.name = model.eval(), eos_token_id, name
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._http: ThreadingHTTPServer | None = None

    # -- life ------------------------------------------------------------------------------------------------
    def start(self) -> str:
        server = self

        class Handler(_Handler):
            standin = server

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._http.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()

    def take_events(self) -> list[dict[str, Any]]:
        """The events so far, cleared."""
        with self._lock:
            out, self.events = self.events, []
        return out

    # -- endpoints ---------------------------------------------------------------------------------------------
    def answer(self, method: str, path: str, body: dict) -> dict:
        """The JSON answer to ``method path`` with ``body``; ``ValueError`` -> 400."""
        routes = {
            ("GET", "/health"): lambda: {},
            ("GET", "/v1/models"): lambda: {"data": [{"id": self.name}]},
            ("GET", "/server_info"): lambda: {"vllm_config": {
                "model_config": {"logprobs_mode": "processed_logprobs"},
                "weight_transfer_config": {"backend": "http (stand-in)"}}},
            ("GET", "/get_world_size"): lambda: {"world_size": 1},
            ("POST", "/v1/completions"): lambda: self.completions(body),
            ("POST", "/reset_prefix_cache"): lambda: self.record("reset_prefix_cache"),
            ("POST", "/init_weight_transfer_engine"): lambda: self.record("init", world_size=body["init_info"][
                "world_size"]),
            ("POST", "/start_weight_update"): lambda: self.record("start_weight_update"),
            ("POST", "/update_weights"): lambda: self.update_weights(body),
            ("POST", "/finish_weight_update"): lambda: self.record("finish_weight_update"),
        }
        if (method, path) not in routes:
            raise LookupError(f"{method} {path}")
        with self._lock:
            return routes[(method, path)]()

    def record(self, kind: str, **fields: Any) -> dict:
        self.events.append({"kind": kind, **fields})
        return {"success": True}

    def completions(self, body: dict) -> dict:
        prompts, n = body["prompt"], int(body.get("n", 1))
        if not prompts or not all(isinstance(p, list) for p in prompts):
            raise ValueError("the stand-in takes prompts as token-id lists")
        temperature = float(body.get("temperature") or 1.0)
        choices = []
        for prompt in prompts:
            ids, logprobs = self.greedy(prompt, max_tokens=int(body.get("max_tokens", 16)), temperature=temperature)
            logprob_field = None if body.get("logprobs") is None else {
                "tokens": [f"token_id:{t}" for t in ids], "token_logprobs": logprobs,
                "top_logprobs": [{f"token_id:{t}": lp} for t, lp in zip(ids, logprobs)]}
            choices += [{"index": len(choices) + k, "prompt_token_ids": prompt, "token_ids": ids,
                         "logprobs": logprob_field, "text": "", "finish_reason": "stop"} for k in range(n)]
        self.events.append({"kind": "generate", "prompts": len(prompts), "n": n, "max_tokens": body.get("max_tokens")})
        return {"choices": choices}

    @torch.no_grad()
    def greedy(self, prompt: list[int], *, max_tokens: int, temperature: float) -> tuple[list[int], list[float]]:
        """Greedy tokens after ``prompt`` (up to ``max_tokens``, the end-of-sequence token included) and their
        log-probabilities under ``log_softmax(logits / temperature)``."""
        ids, out, logprobs = list(prompt), [], []
        for _ in range(max_tokens):
            logits = self.model(input_ids=torch.tensor([ids])).logits[0, -1].double()
            token = int(logits.argmax())
            out.append(token)
            logprobs.append(float(torch.log_softmax(logits / temperature, dim=-1)[token]))
            ids.append(token)
            if token == self.eos_token_id:
                break
        return out, logprobs

    def update_weights(self, body: dict) -> dict:
        info, blobs = body["update_info"], body.get("tensors")
        names, dtypes, shapes = info["names"], info["dtype_names"], info["shapes"]
        params = dict(self.model.named_parameters())
        if blobs is None or len(blobs) != len(names):
            raise ValueError(f"update_weights: {len(names)} names, {0 if blobs is None else len(blobs)} tensors")
        if sorted(names) != sorted(params):
            raise ValueError(f"update_weights names {sorted(set(names) ^ set(params))[:6]} are not the model's: an "
                             "update must carry every parameter under its checkpoint name")
        digest = []
        for name, dtype, shape, blob in zip(names, dtypes, shapes, blobs):
            raw = bytearray(base64.b64decode(blob))
            tensor = torch.frombuffer(raw, dtype=_DTYPES[dtype]).reshape(shape)
            if tuple(shape) != tuple(params[name].shape):
                raise ValueError(f"update_weights: {name} has shape {shape}, the model's is "
                                 f"{list(params[name].shape)} (a partition, not the whole tensor?)")
            params[name].data.copy_(tensor)
            digest.append(float(tensor.double().sum()))
        self.events.append({"kind": "update_weights", "names": len(names), "digest": digest})
        return {"success": True}


class _Handler(BaseHTTPRequestHandler):
    standin: StandInServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._reply("GET", {})

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        self._reply("POST", json.loads(self.rfile.read(length) or b"{}"))

    def _reply(self, method: str, body: dict) -> None:
        path = self.path.split("?", 1)[0]
        try:
            status, answer = 200, self.standin.answer(method, path, body)
        except LookupError as e:
            status, answer = 404, {"error": f"the stand-in does not serve {e}"}
        except (ValueError, KeyError) as e:
            status, answer = 400, {"error": f"{type(e).__name__}: {e}"}
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:  # quiet
        pass


class HttpWeightsClient(VLLMClient):
    """TRL's ``VLLMClient`` with its two CUDA parts replaced for the stand-in (see the module docstring)."""

    def init_communicator(self, device: Any = 0) -> None:
        if self.get_server_info()["weight_transfer_config"] is None:
            raise RuntimeError("the server has no weight-transfer engine")
        init_info = {"master_address": "127.0.0.1", "master_port": self.group_port, "rank_offset": 1,
                     "world_size": self.get_world_size() + 1}
        self._post(f"{self.base_url}/init_weight_transfer_engine", json={"init_info": init_info})

    def update_named_params(self, metadata: list, named_params: Iterator[tuple[str, torch.Tensor]]) -> None:
        names, dtype_names, shapes = (list(field) for field in zip(*metadata, strict=True))
        # each tensor read while TRL holds it gathered (the other ranks iterate the same gathers meanwhile)
        blobs = [base64.b64encode(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).decode()
                 for _, t in named_params]
        if not self._updating_weights:
            self._start_weight_update()
        self._post(f"{self.base_url}/update_weights", json={
            "update_info": {"names": names, "dtype_names": dtype_names, "shapes": shapes}, "tensors": blobs})
        if not self._updating_weights:
            self._finish_weight_update()


def use_standin_client() -> None:
    """In this process: TRL's vLLM gate open, and server-mode ``VLLMGeneration`` building ``HttpWeightsClient``."""
    import trl.generation.vllm_client as client_module
    import trl.generation.vllm_generation as generation_module

    client_module.is_vllm_available = generation_module.is_vllm_available = lambda *a, **k: True
    generation_module.VLLMClient = HttpWeightsClient
